"""Devices for backend selection: ``"cpu"``, ``"cuda"``, ``"cuda:9.0"``, ``"rocm"``, or detected."""

from __future__ import annotations

import re
from dataclasses import dataclass

from attn_di.exceptions import InvalidInputError

__all__ = ["Device", "detect_device", "parse_device"]

_CAPABILITY_RE = re.compile(r"^(cuda|rocm):(\d+)\.(\d+)$")
KINDS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True)
class Device:
    """A platform and, for GPUs, its compute capability.

    Attributes:
        kind: "cpu", "cuda" or "rocm".
        capability: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper; None on the CPU.
    """

    kind: str
    capability: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.capability is None:
            return self.kind
        return f"{self.kind}:{self.capability[0]}.{self.capability[1]}"


def parse_device(device: str | Device | None) -> Device:
    """Parse a device string; None detects it (through torch, imported only then).

    Accepted: ``"cpu"``, ``"cuda"`` (capability detected), ``"cuda:9.0"`` (capability given),
    ``"rocm"``, ``"rocm:9.4"``; case-insensitive, surrounding spaces ignored.

    Raises:
        InvalidInputError: anything else (a ValueError), listing the accepted forms.
    """
    if isinstance(device, Device):
        return device
    if device is None:
        return detect_device()
    if not isinstance(device, str):
        if type(device).__name__ == "device" and hasattr(device, "type"):  # a torch.device
            device = str(device.type)
        else:
            raise InvalidInputError(
                "device",
                f"expected a string such as 'cpu', got {device!r}",
                hint="'cpu' or 'cuda:9.0'",
            )
    text = device.strip().lower()
    if text == "cpu":
        return Device("cpu")
    if text in ("cuda", "rocm"):
        detected = detect_device()
        if detected.kind != text:
            raise InvalidInputError(
                "device",
                f"{text!r} was asked for but this machine has {detected}",
                hint=f"give the capability explicitly, e.g. '{text}:9.0'",
            )
        return detected
    match = _CAPABILITY_RE.match(text)
    if match:
        return Device(match.group(1), (int(match.group(2)), int(match.group(3))))
    if re.fullmatch(r"(cuda|rocm):\d+", text):
        raise InvalidInputError(
            "device",
            f"{device!r} looks like a torch device index; attn_di wants the platform and its "
            "compute capability",
            hint=f"'{text.split(':')[0]}' (detected) or e.g. '{text.split(':')[0]}:9.0'",
        )
    raise InvalidInputError(
        "device",
        f"unknown device {device!r}; valid forms: cpu, cuda, cuda:MAJOR.MINOR, rocm, "
        "rocm:MAJOR.MINOR",
        hint="e.g. 'cuda:9.0' for an H100/H200, 'cuda:10.0' for a B200",
    )


def detect_device() -> Device:
    """The device torch sees: CUDA (with capability), ROCm, else the CPU (also without torch)."""
    try:
        import torch
    except ImportError:
        return Device("cpu")
    if not torch.cuda.is_available():
        return Device("cpu")
    major, minor = torch.cuda.get_device_capability()
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return Device(kind, (int(major), int(minor)))
