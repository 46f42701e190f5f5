"""On/off environment switches: the one parser every ``ATTN_DI_*`` switch is read with.

A switch is on for ``1``, ``true``, ``yes`` or ``on`` and off for ``0``, ``false``, ``no`` or
``off``, in any case and with spaces around it ignored; unset or empty, it has its default.
Anything else is refused by name (:class:`~attn_di.exceptions.EnvSwitchError`, a
``ValueError``), never read as on or off: ``"disable"`` is not on, ``"true"`` is not off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from attn_di.exceptions import EnvSwitchError

__all__ = ["Switch"]


@dataclass(frozen=True)
class Switch:
    """One on/off environment variable.

    Attributes:
        name: the variable, e.g. ``"ATTN_DI_CPU_KERNEL"``.
        default: its value when unset or empty.
        on: what on means (for the error's hint), e.g. ``"use the compiled kernel"``.
        off: what off means.
    """

    name: str
    default: bool
    on: str
    off: str

    def read(self, environ: Mapping[str, str] | None = None) -> bool:
        """The switch's value in ``environ`` (``os.environ`` by default).

        Raises:
            EnvSwitchError: the variable is set to something that is neither on nor off.
        """
        spelled = self.spelling(environ)
        if spelled is None:
            return self.default
        if spelled in EnvSwitchError.ON_SPELLINGS:
            return True
        if spelled in EnvSwitchError.OFF_SPELLINGS:
            return False
        raise EnvSwitchError(
            self.name, (os.environ if environ is None else environ)[self.name], self.on, self.off
        )

    def spelling(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value as the switch reads it (stripped, lower case), or None when it
        is unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return None
        return raw.strip().lower()
