"""A hypothesis state machine: register / clear / override enter / exit / resolve vs a model."""

from __future__ import annotations

import collections
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    BackendNotRegisteredError,
    BackendOverride,
)
from attn_di._enum import remove_runtime_member

CLASSES = [collections.OrderedDict, collections.Counter, collections.deque, dict, list]
DEFAULT = collections.defaultdict


class RegistryMachine(RuleBasedStateMachine):
    """The container must agree with a plain model after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.container = BackendContainer()
        self.runtime = AttentionBackendEnum.register(
            f"STATE_MACHINE_{id(self)}", "collections.defaultdict"
        )
        self.members = [AttentionBackendEnum.CUSTOM, self.runtime]
        self.registered: dict[AttentionBackendEnum, type] = {}
        self.layers: list[tuple[BackendOverride, dict[AttentionBackendEnum, type]]] = []

    def teardown(self) -> None:
        for handle, _ in self.layers:
            handle.restore()
        remove_runtime_member(self.runtime)

    def expected(self, member: AttentionBackendEnum) -> type | None:
        for _, impls in reversed(self.layers):
            if member in impls:
                return impls[member]
        if member in self.registered:
            return self.registered[member]
        return DEFAULT if member is self.runtime else None

    @rule(index=st.integers(0, 1), cls=st.sampled_from(CLASSES), by_path=st.booleans())
    def register(self, index: int, cls: type, by_path: bool) -> None:
        member = self.members[index]
        impl: Any = f"{cls.__module__}.{cls.__qualname__}" if by_path else cls
        self.container.register(member, impl)
        self.registered[member] = cls

    @rule(index=st.integers(0, 1))
    def clear(self, index: int) -> None:
        member = self.members[index]
        self.container.clear_override(member)
        self.registered.pop(member, None)

    @rule(
        which=st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True),
        cls=st.sampled_from(CLASSES),
    )
    def enter(self, which: list[int], cls: type) -> None:
        impls = {self.members[i]: cls for i in which}
        handle = self.container.override(impls)
        self.layers.append((handle, impls))

    @precondition(lambda self: self.layers)
    @rule(data=st.data())
    def exit(self, data: st.DataObject) -> None:
        position = data.draw(st.integers(0, len(self.layers) - 1))
        handle, _ = self.layers.pop(position)
        handle.__exit__(None, None, None)

    @invariant()
    def resolution_matches_the_model(self) -> None:
        for member in self.members:
            expected = self.expected(member)
            if expected is None:
                try:
                    self.container.backend(member)
                except BackendNotRegisteredError:
                    pass
                else:
                    raise AssertionError(f"{member.name} resolved without a path")
                assert not self.container.is_overridden(member)
            else:
                assert self.container.backend(member) is expected
                assert self.container.provider(member)() is expected
                overridden = (
                    expected is not DEFAULT
                    or member in self.registered
                    or any(member in impls for _, impls in self.layers)
                )
                assert self.container.is_overridden(member) == overridden


RegistryMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestRegistryMachine = RegistryMachine.TestCase
