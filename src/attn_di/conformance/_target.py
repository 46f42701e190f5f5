"""From what a user names (a class, a member, a member name, a class path) to a driver."""

from __future__ import annotations

from typing import Any

from attn_di.conformance._driver import Driver, driver_classes
from attn_di.exceptions import (
    BackendImportError,
    InvalidBackendTypeError,
    InvalidInputError,
    UnknownBackendError,
)

__all__ = ["resolve_driver", "resolve_target", "subprocess_spec"]


def resolve_target(target: object) -> tuple[Any, str]:
    """``(backend_cls, name)``: the class and how commands name it.

    Args:
        target: a backend class; an ``AttentionBackendEnum`` member (its class comes from
            the default container, overrides included); a member name (``"CPU_ATTN"``, a
            runtime member's); or a class path (``"pkg.mod:Cls"`` or ``"pkg.mod.Cls"``).

    Raises:
        UnknownBackendError: a name that is neither a member nor a class path.
        InvalidInputError: ``"auto"`` or an empty name (conform checks one backend).
        BackendImportError: a class path that does not import.
        InvalidBackendTypeError: anything else.
    """
    from attn_di import AttentionBackendEnum, parse_backend_name
    from attn_di._paths import check_class_path, import_class_path

    if isinstance(target, type) and not isinstance(target, type(AttentionBackendEnum)):
        return target, _class_path(target)
    if isinstance(target, AttentionBackendEnum):
        return target.get_class(), target.name
    if isinstance(target, str):
        text = target.strip()
        if ":" in text or "." in text:
            check_class_path(text)
            try:
                return import_class_path(text, text), text
            except BackendImportError as error:  # a target, not a registration: its own fix
                if error.reason == error.MODULE_NOT_FOUND and (error.hint or "").startswith(
                    "install"
                ):
                    error.hint = (
                        "check the path: its module must import from here (the current "
                        "directory, PYTHONPATH or an installed package)"
                    )
                raise
        try:
            member = parse_backend_name(text)
        except UnknownBackendError as error:
            raise _one_backend(error) from None
        if member is None:  # "auto", or nothing
            problem = (
                f"{target!r} asks for automatic selection, and conform checks one backend"
                if text
                else "an empty name names no backend"
            )
            raise InvalidInputError(
                "target",
                problem,
                hint="name one backend: a member name (see `attn-di list`; `attn-di select` "
                "shows which one auto picks), a class or a class path (pkg.module:Class)",
            )
        return member.get_class(), member.name
    raise InvalidBackendTypeError(
        "target",
        target,
        "a backend class, an AttentionBackendEnum member, its name or a class path",
    )


def _one_backend(error: UnknownBackendError) -> UnknownBackendError:
    """The enum's error for an unknown target name, without ``auto``: a target is one backend,
    so automatic selection is not among its valid choices nor its suggestion."""
    choices = [choice for choice in error.choices if choice != "auto"]
    narrowed = UnknownBackendError(error.name, choices, error.looked_up, error.enum, error.phrase)
    if not narrowed.suggestion and "`all`" not in (narrowed.hint or ""):  # keep `all`'s hint
        narrowed.hint = "give a member name (see `attn-di list`) or a class path (pkg.module:Class)"
    return narrowed


def resolve_driver(target: object) -> Driver:
    """The driver of the first registered contract that accepts the target's class.

    Raises:
        InvalidBackendTypeError: no driver accepts the class (it lacks the interface's
            class methods).
        and what :func:`resolve_target` raises.
    """
    backend_cls, name = resolve_target(target)
    for driver_cls in driver_classes(backend_cls):
        if driver_cls.accepts(backend_cls):
            return driver_cls(backend_cls, name)
    raise InvalidBackendTypeError(
        "target", backend_cls, "a class with attn_di's (vLLM's) AttentionBackend class methods"
    )


def subprocess_spec(driver: Driver) -> str | None:
    """A class path a fresh interpreter imports to the same class, or None if there is none
    (a class defined inside a function)."""
    from attn_di._paths import import_class_path

    path = _class_path(driver.backend_cls)
    if "<locals>" in path:
        return None
    try:
        return path if import_class_path(path, path) is driver.backend_cls else None
    except Exception:
        return None


def _class_path(backend_cls: type) -> str:
    return f"{backend_cls.__module__}:{backend_cls.__qualname__}"
