"""Small value types shared by backends: attention types, device capability, block-size rules."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AttentionType", "DeviceCapability", "MultipleOf"]


class AttentionType(enum.StrEnum):
    """Which tokens attend to which, as vLLM names it (``vllm.attention.AttentionType``).

    Members are ``str`` and compare equal to their value, so ``"decoder"`` and
    ``AttentionType.DECODER`` are interchangeable; ``AttentionType("encoder_only")``
    parses a string.
    """

    DECODER = "decoder"
    """Causal self-attention over the paged KV cache."""
    ENCODER = "encoder"
    """Bidirectional self-attention of an encoder-decoder model's encoder."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention over the given tokens, no KV cache (BERT-like)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention from decoder queries to encoder keys/values."""


@dataclass(frozen=True, order=True)
class DeviceCapability:
    """A device's compute capability, e.g. ``DeviceCapability(9, 0)`` for an H100.

    Attributes:
        major: the major version.
        minor: the minor version.
    """

    major: int
    minor: int

    def as_version_str(self) -> str:
        """``"9.0"`` for ``DeviceCapability(9, 0)``."""
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """``90`` for ``DeviceCapability(9, 0)`` (vLLM's integer form: ``major * 10 + minor``)."""
        return self.major * 10 + self.minor


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block-size rule: any block size that is a multiple of ``base``.

    Attributes:
        base: the divisor, a positive int.
    """

    base: int

    def accepts(self, block_size: int) -> bool:
        """Whether ``block_size`` is a positive multiple of :attr:`base`."""
        return block_size > 0 and block_size % self.base == 0
