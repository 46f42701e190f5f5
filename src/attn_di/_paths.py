"""Dotted class paths: validate them, import them, and compute them from classes.

A class path is ``pkg.module.Class`` (the module is everything before the last dot, as
in vLLM) or ``pkg.module:Outer.Inner`` (entry-point style, for nested classes). A dotted
path whose last-dot split names no module is retried with the split moved left, so
``pkg.module.Outer.Inner`` works too.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

from attn_di.exceptions import BackendImportError, InvalidClassPathError, closest_name

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_PATH_RE = re.compile(rf"^{_DOTTED}(?::{_DOTTED})?$")


def check_class_path(class_path: str) -> str:
    """Return ``class_path`` unchanged if well formed.

    Raises:
        InvalidClassPathError: empty, spaces, a leading/trailing dot, a part that is not an
            identifier, or a single name with no module.
    """
    if not class_path:
        raise InvalidClassPathError(class_path, "the path is empty")
    if class_path != class_path.strip():
        raise InvalidClassPathError(class_path, "the path has surrounding whitespace")
    if not _PATH_RE.match(class_path):
        raise InvalidClassPathError(
            class_path, "every part must be a Python identifier, separated by '.' (or one ':')"
        )
    if "." not in class_path and ":" not in class_path:
        raise InvalidClassPathError(class_path, "a class path needs a module and a class name")
    return class_path


def module_part(class_path: str) -> str:
    """The module part of a class path: before ``:`` if present, else before the last dot."""
    if ":" in class_path:
        return class_path.partition(":")[0]
    return class_path.rpartition(".")[0]


def path_of(backend_cls: object) -> str:
    """``module.qualname`` of a class (what a decorator registration records)."""
    module = getattr(backend_cls, "__module__", None) or type(backend_cls).__module__
    qualname = getattr(backend_cls, "__qualname__", None) or type(backend_cls).__qualname__
    return f"{module}.{qualname}"


def import_class_path(class_path: str, member: str) -> Any:
    """Import the object a class path names.

    Args:
        class_path: a path accepted by :func:`check_class_path`.
        member: the member's name, for the error message.

    Raises:
        BackendImportError: with ``reason`` "module not found" (the module itself is
            missing), "module failed to import" (it exists but raised, including a missing
            dependency of it), or "attribute not found" (the module lacks the name; the
            closest name it has is suggested). The original exception is chained.
    """
    if ":" in class_path:
        module_name, _, attr_path = class_path.partition(":")
        splits = [(module_name, attr_path.split("."))]
    else:
        parts = class_path.split(".")
        splits = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    first_missing: ModuleNotFoundError | None = None
    for module_name, attrs in splits:
        try:
            module = _import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                if exc.name is not None and module_name.startswith(exc.name + "."):
                    # A parent package is missing: shorter splits cannot succeed either.
                    first_missing = first_missing or exc
                    break
                raise BackendImportError(
                    member, class_path, BackendImportError.MODULE_FAILED, f"{exc}",
                    missing_module=exc.name,
                ) from exc  # fmt: skip
            first_missing = first_missing or exc
            continue
        except KeyboardInterrupt:  # the user asked to stop
            raise
        except BaseException as exc:  # SystemExit too: importing a backend never ends the host
            raise BackendImportError(
                member, class_path, BackendImportError.MODULE_FAILED, f"{type(exc).__name__}: {exc}"
            ) from exc
        if first_missing is not None and not hasattr(module, attrs[0]):
            # A shorter split (tried for nested classes) lacks the would-be module too: the
            # truthful report is the module that was not found.
            break
        return _getattr_chain(module, attrs, class_path, member)
    assert first_missing is not None
    raise BackendImportError(
        member,
        class_path,
        BackendImportError.MODULE_NOT_FOUND,
        str(first_missing),
        missing_module=first_missing.name,
    ) from first_missing


def resolves_to(class_path: str, backend_cls: object) -> bool:
    """True if importing ``class_path`` in a fresh process would give ``backend_cls``.

    Checked in this process: the path must import (without ``<locals>``) to the same object.
    """
    if "<" in class_path:
        return False
    try:
        return import_class_path(class_path, "?") is backend_cls
    except BackendImportError:
        return False


def _import_module(module_name: str) -> Any:
    """The module, imported if needed. A module another thread is still importing (in
    ``sys.modules`` with its spec ``_initializing``) goes through ``importlib``, which waits
    for that import to finish, rather than being returned half made."""
    module = sys.modules.get(module_name)
    if module is not None and not getattr(
        getattr(module, "__spec__", None), "_initializing", False
    ):
        return module
    return importlib.import_module(module_name)


def _getattr_chain(module: Any, attrs: list[str], class_path: str, member: str) -> Any:
    target = module
    for attr in attrs:
        try:
            target = getattr(target, attr)
        except AttributeError as exc:
            names = [name for name in dir(target) if not name.startswith("_")]
            raise BackendImportError(
                member,
                class_path,
                BackendImportError.ATTRIBUTE_NOT_FOUND,
                f"{getattr(target, '__name__', target)!s} has no attribute {attr!r}",
                closest_name(attr, names),
            ) from exc
    return target
