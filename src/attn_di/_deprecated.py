"""``_Backend``: vLLM's deprecated name for the enum, kept as a warning alias."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from attn_di._enum import AttentionBackendEnum
from attn_di.exceptions import AttnDIDeprecationWarning

__all__ = ["DeprecatedBackendAlias"]


class DeprecatedBackendAlias:
    """Forwards attribute access, item access and iteration to :class:`AttentionBackendEnum`,
    warning with :class:`AttnDIDeprecationWarning` (a DeprecationWarning) at the caller."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _warn()
        return getattr(AttentionBackendEnum, name)

    def __getitem__(self, name: str) -> AttentionBackendEnum:
        _warn()
        return AttentionBackendEnum[name]

    def __iter__(self) -> Iterator[AttentionBackendEnum]:
        _warn()
        return iter(AttentionBackendEnum)

    def __len__(self) -> int:
        _warn()
        return len(AttentionBackendEnum)

    def __repr__(self) -> str:
        return "<deprecated alias _Backend of attn_di.AttentionBackendEnum>"


def _warn() -> None:
    # stacklevel 3: _warn <- the alias's dunder <- the caller's line.
    warnings.warn(
        "_Backend is deprecated; use attn_di.AttentionBackendEnum",
        AttnDIDeprecationWarning,
        stacklevel=3,
    )
