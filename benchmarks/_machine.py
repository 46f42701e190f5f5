"""What every benchmark prints about the machine: the CPU model and its vector ISA."""

from __future__ import annotations

import platform

__all__ = ["cpu_flags", "cpu_model"]

_WANTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile")


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_flags() -> str:
    """The vector extensions this CPU reports (avx2, avx512f, ...), or "?"."""
    flags = (_cpuinfo_field("flags") or "").split()
    return " ".join(flag for flag in flags if flag in _WANTED_FLAGS) or "?"


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
