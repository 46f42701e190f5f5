"""``_Backend``: vLLM's deprecated name for the enum, kept as an alias that warns on use."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from attn_di._enum import AttentionBackendEnum
from attn_di.exceptions import AttnDIDeprecationWarning

__all__ = ["DeprecatedBackendAlias"]


class _AliasMeta(type):
    """Forwards class-level use (attributes, items, iteration, calls, isinstance) to the enum."""

    def __getattr__(cls, name: str) -> Any:
        _warn()
        return getattr(AttentionBackendEnum, name)

    def __getitem__(cls, name: str) -> AttentionBackendEnum:
        _warn()
        return AttentionBackendEnum[name]

    def __iter__(cls) -> Iterator[AttentionBackendEnum]:
        _warn()
        return iter(AttentionBackendEnum)

    def __len__(cls) -> int:
        _warn()
        return len(AttentionBackendEnum)

    def __contains__(cls, member: object) -> bool:
        _warn()
        return isinstance(member, AttentionBackendEnum) and member in AttentionBackendEnum

    def __call__(cls, value: object) -> AttentionBackendEnum:
        _warn()
        return AttentionBackendEnum(value)

    def __instancecheck__(cls, instance: object) -> bool:
        _warn()
        return isinstance(instance, AttentionBackendEnum)

    def __repr__(cls) -> str:
        return "<deprecated alias _Backend of attn_di.AttentionBackendEnum>"


class DeprecatedBackendAlias(metaclass=_AliasMeta):
    """``attn_di._Backend``: every use forwards to :class:`AttentionBackendEnum` and warns with
    :class:`AttnDIDeprecationWarning` (a DeprecationWarning) at the caller's line."""


def _warn() -> None:
    # stacklevel 3: _warn <- the alias's method <- the caller's line.
    warnings.warn(
        "_Backend is deprecated; use attn_di.AttentionBackendEnum",
        AttnDIDeprecationWarning,
        stacklevel=3,
    )
