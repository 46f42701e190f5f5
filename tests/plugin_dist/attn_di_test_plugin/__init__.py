"""A tiny attn_di plugin: zero-argument callables registering stand-in backends.

``CALLS`` counts how often each plugin ran in this process (tests check idempotence).
"""

from __future__ import annotations

import collections

from attn_di import register_backend

CALLS: collections.Counter[str] = collections.Counter()


class TinyBackend:
    """A stand-in attention backend (the registry never calls into it)."""

    @staticmethod
    def get_name() -> str:
        return "TINY_ATTN"


class ExtraBackend:
    """Another stand-in attention backend."""

    @staticmethod
    def get_name() -> str:
        return "EXTRA"


def register_tiny() -> None:
    """Plugin ``tiny``: adds the runtime member TINY_ATTN (idempotent via register_backend)."""
    CALLS["tiny"] += 1
    register_backend("TINY_ATTN", "attn_di_test_plugin:TinyBackend")


def register_extra() -> None:
    """Plugin ``extra``: registers ExtraBackend for the built-in CUSTOM member."""
    CALLS["extra"] += 1
    register_backend("CUSTOM", "attn_di_test_plugin.ExtraBackend")


def broken() -> None:
    """Plugin ``broken``: registers two backends, then raises."""
    CALLS["broken"] += 1
    register_backend("BROKEN_ATTN", "attn_di_test_plugin:TinyBackend")
    register_backend("FLASH_ATTN", "attn_di_test_plugin:TinyBackend")
    raise RuntimeError("the broken test plugin fails on purpose")
