"""The attention impl interface: constructor options, feature checks and ``forward``."""

from __future__ import annotations

import abc
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from attn_di.backend._types import AttentionType
from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError

if TYPE_CHECKING:
    import torch

    from attn_di.backend._backend import AttentionBackend
    from attn_di.backend._metadata import AttentionMetadata

__all__ = ["AttentionImpl"]

# Which of attn_di's backends implement each optional feature (used in hints only).
_FEATURE_PROVIDERS: dict[str, tuple[str, ...]] = {
    "alibi_slopes": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
    "sliding_window": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
    "logits_soft_cap": ("CPU_ATTN", "FLEX_ATTENTION"),
    "sinks": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
}


def _is_bool(value: object) -> bool:
    """True for Python, numpy and torch booleans (which ``operator.index`` may accept)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in {"bool", "torch.bool"}


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


# Sizes and lengths reach torch's operators as int64.
_INT64_MAX = 2**63 - 1
# float32's range: a soft cap is applied in float32.
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal
_FLOAT32_MAX = 3.4028234663852886e38


def _positive_int(argument: str, value: object, example: str) -> int:
    """``value`` as a positive int64: ints and ``operator.index``-able values, not bool."""
    if _is_bool(value):
        index = None
    else:
        try:
            index = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            index = None
    if index is None:
        raise InvalidInputError(
            argument, f"must be a positive int, got {_describe(value)}", hint=f"e.g. {example}"
        )
    if index <= 0:
        raise InvalidInputError(argument, f"must be positive, got {index}", hint=f"e.g. {example}")
    if index > _INT64_MAX:
        raise InvalidInputError(
            argument, f"must be at most 2**63 - 1 (an int64), got {index}", hint=f"e.g. {example}"
        )
    return index


def _finite_real(argument: str, value: object, example: str) -> float:
    """``value`` as a finite float: real numbers only, not bool, str or None."""
    number = None
    if not _is_bool(value) and not isinstance(value, (str, bytes, bytearray)):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            number = None
    if number is None:
        raise InvalidInputError(
            argument, f"must be a real number, got {_describe(value)}", hint=f"e.g. {example}"
        )
    if not math.isfinite(number):
        raise InvalidInputError(argument, f"must be finite, got {number}", hint=f"e.g. {example}")
    if abs(number) > _FLOAT32_MAX:
        raise InvalidInputError(
            argument,
            f"{number} is beyond float32's range (±{_FLOAT32_MAX:.8g}), in which it is applied",
            hint=f"e.g. {example}",
        )
    return number


def _soft_cap(value: object) -> float | None:
    """The soft cap c, or None when off (None, 0, or beyond float32's range up to +inf:
    ``c * tanh(s / c) -> s``); a positive c below float32's smallest normal is refused."""
    if value is None:
        return None
    hint = "e.g. logits_soft_cap=50.0 (Gemma 2); None or 0 turns it off"
    if _is_bool(value) or isinstance(value, (str, bytes, bytearray)):
        number = None
    else:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            number = None
    if number is None:
        raise InvalidInputError(
            "logits_soft_cap", f"must be a real number or None, got {_describe(value)}", hint=hint
        )
    if math.isnan(number) or number < 0:
        raise InvalidInputError("logits_soft_cap", f"must be >= 0, got {number}", hint=hint)
    if 0.0 < number < _FLOAT32_TINY:
        raise InvalidInputError(
            "logits_soft_cap",
            f"{number} is below float32's smallest normal number ({_FLOAT32_TINY:.8g}), in "
            "which the cap is applied",
            hint=hint,
        )
    return None if number == 0.0 or number > _FLOAT32_MAX else number


def _head_vector(argument: str, value: object, num_heads: int, *, finite: bool) -> torch.Tensor:
    """``value`` (a tensor or a sequence of numbers) as a ``[num_heads]`` real tensor.

    A tensor is returned as given (its dtype, device and autograd history kept); anything
    else becomes a float32 tensor. With ``finite`` every entry must be finite, otherwise only
    NaN and +inf are refused (-inf is a valid "no sink" logit).
    """
    import torch

    hint = f"a tensor or list of {num_heads} numbers, one per query head ([num_heads])"
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        converted = None
        if not isinstance(value, (str, bytes, bytearray, dict)):
            try:
                converted = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                converted = None
        if converted is None:
            raise InvalidInputError(
                argument,
                f"must be a tensor or a sequence of numbers, got {_describe(value)}",
                hint=hint,
            )
        tensor = converted
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise InvalidInputError(
            argument, f"dtype {tensor.dtype} is not a real number type", hint=hint
        )
    if tuple(tensor.shape) != (num_heads,):
        raise InvalidInputError(
            argument, f"shape {tuple(tensor.shape)} should be [num_heads]=[{num_heads}]", hint=hint
        )
    if not isinstance(value, torch.Tensor):
        tensor = tensor.to(torch.float32)
    values = tensor.detach().double()
    applied = values.to(torch.float32)  # the backends apply them in float32
    bad = ~torch.isfinite(applied) if finite else torch.isnan(applied) | (applied == math.inf)
    if bool(bad.any()):
        raise InvalidInputError(
            argument,
            f"holds {'non-finite' if finite else 'NaN or +inf'} values in float32 (in which "
            f"they are applied): {values.tolist()}",
            hint=hint,
        )
    return tensor


class AttentionImpl(abc.ABC):
    """One attention layer's computation for a backend (vLLM's ``AttentionImpl``).

    The constructor checks the options against what the backend declares and refuses any
    feature it cannot honour with :class:`~attn_di.exceptions.UnsupportedFeatureError`
    (a ``NotImplementedError`` naming the feature), as vLLM's impls do.

    Args:
        num_heads: query heads H, a positive int (``operator.index``-able, not bool).
        head_size: D, features per head, a positive int.
        scale: the factor applied to ``q @ k^T`` (usually ``D ** -0.5``), a finite number.
        num_kv_heads: key/value heads; defaults to H; must divide H (GQA/MQA).
        alibi_slopes: ``[H]`` ALiBi slopes m_h (a tensor or a sequence of finite numbers);
            the score of query position i and key position j gets ``m_h * (j - i)`` added
            (Press et al. 2022, "Train Short, Test Long").
        sliding_window: w, a positive int; position p sees keys k with ``p - w < k <= p``.
        kv_cache_dtype: the cache dtype string; only ``"auto"`` (the model dtype).
        logits_soft_cap: c; scores s become ``c * tanh(s / c)`` (Gemma 2). None, 0 or
            ``+inf`` (the limit ``c -> inf`` is the identity): off; NaN or negative is refused.
        attn_type: an :class:`AttentionType` or its string.
        sinks: ``[H]`` per-head logits (a tensor, kept as given, or a sequence of numbers,
            made a float32 tensor; ``-inf`` means no sink) that join the softmax
            denominator and carry no value (gpt-oss attention sinks).
        kv_sharing_target_layer_name: another layer whose cache this one reads; not
            supported (keyword only, as vLLM passes it).

    Raises:
        InvalidInputError: a size that is not a positive int, num_kv_heads not dividing
            num_heads, a scale that is not a finite number, a bad sliding_window or
            logits_soft_cap, or alibi_slopes/sinks that are not ``[num_heads]`` numbers.
        UnsupportedFeatureError: a feature or attention type the backend does not implement.
    """

    backend: ClassVar[type[AttentionBackend]]
    supports_alibi: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: Sequence[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        sinks: Sequence[float] | torch.Tensor | None = None,
        *,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        name = self.backend.get_name()
        num_heads = _positive_int("num_heads", num_heads, "num_heads=32")
        head_size = _positive_int("head_size", head_size, "head_size=128")
        num_kv_heads = (
            num_heads
            if num_kv_heads is None
            else _positive_int("num_kv_heads", num_kv_heads, "num_kv_heads=8")
        )
        if num_heads % num_kv_heads:
            raise InvalidInputError(
                "num_kv_heads",
                f"{num_kv_heads} does not divide num_heads {num_heads}",
                hint="GQA/MQA needs num_heads to be a multiple of num_kv_heads",
            )
        scale = _finite_real("scale", scale, f"scale={head_size**-0.5:.4g} (head_size ** -0.5)")
        try:
            attn_type = AttentionType(attn_type)
        except ValueError:
            raise InvalidInputError(
                "attn_type",
                f"unknown attention type {attn_type!r}",
                hint=f"one of {', '.join(t.value for t in AttentionType)}",
            ) from None
        if not self.backend.supports_attn_type(attn_type):
            supported = ", ".join(
                str(AttentionType(t).value) for t in self.backend.supported_attn_types
            )
            error = UnsupportedFeatureError(name, f"attention type {attn_type.value}")
            error.hint = (
                f"{name} runs attn_type {supported}; no attn_di backend runs "
                f"{attn_type.value} (cross-attention needs a custom backend)"
                if attn_type == AttentionType.ENCODER_DECODER
                else f"{name} runs attn_type {supported}"
            )
            raise error
        if kv_cache_dtype not in self.backend.supported_kv_cache_dtypes:
            error = UnsupportedFeatureError(name, f"kv_cache_dtype {kv_cache_dtype!r}")
            choices = ", ".join(repr(d) for d in self.backend.supported_kv_cache_dtypes)
            error.hint = f"use kv_cache_dtype='auto' (the model dtype); {name} supports {choices}"
            raise error
        if kv_sharing_target_layer_name is not None:
            error = UnsupportedFeatureError(name, "kv_sharing_target_layer_name")
            error.hint = (
                "no attn_di backend shares a KV cache between layers; give each layer its "
                "own cache and pass kv_sharing_target_layer_name=None"
            )
            raise error
        if sliding_window is not None:
            sliding_window = _positive_int("sliding_window", sliding_window, "sliding_window=4096")
        logits_soft_cap = _soft_cap(logits_soft_cap)
        self._require(alibi_slopes is not None, self.supports_alibi, "alibi_slopes")
        self._require(sliding_window is not None, self.supports_sliding_window, "sliding_window")
        self._require(logits_soft_cap is not None, self.supports_logits_soft_cap, "logits_soft_cap")
        self._require(sinks is not None, self.backend.supports_sink(), "sinks")
        slopes = None
        if alibi_slopes is not None:
            slopes = [
                float(m)
                for m in _head_vector("alibi_slopes", alibi_slopes, num_heads, finite=True).tolist()
            ]
        if sinks is not None:
            sinks = _head_vector("sinks", sinks, num_heads, finite=False)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.alibi_slopes = slopes
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.sinks = sinks

    def _require(self, requested: bool, supported: bool, feature: str) -> None:
        if requested and not supported:
            raise UnsupportedFeatureError(
                self.backend.get_name(), feature, _FEATURE_PROVIDERS.get(feature, ())
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, head_size={self.head_size}, "
            f"num_kv_heads={self.num_kv_heads}, attn_type={self.attn_type.value!r})"
        )

    @abc.abstractmethod
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new keys/values into the cache, then attend.

        Args:
            layer: the calling layer (unused by attn_di's backends; may be None).
            query: ``[N, H, D]``.
            key: ``[N, H_kv, D]``, same dtype as query.
            value: ``[N, H_kv, D]``, same dtype as query.
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` (see
                :meth:`AttentionBackend.get_kv_cache_shape`), in any memory layout whose last
                axis is contiguous and whose slots do not share memory: attn_di's backends
                read and write it in place through its strides (e.g. the blocks-outermost
                buffer vLLM hands each layer, or a head-major block interior); may be empty
                for ``encoder_only``.
            attn_metadata: the batch's :class:`AttentionMetadata`. attn_di's backends check
                its indices against the cache once per metadata object, cache shape and
                token count (the layers of one step share it, as in vLLM), and again after
                an in-place write torch counts (its version counters). Metadata holding an
                inference tensor (no version counter) is checked on every call; writes torch
                does not count (through ``.numpy()``, ``.data``) go unnoticed: build new
                metadata rather than editing one after use.
            output: optional ``[N, H * D]`` buffer to write into.

        Returns:
            ``[N, H * D]`` in the query's dtype (``output`` itself when given).

        Raises:
            InvalidInputError: a tensor of the wrong shape, dtype or device (the metadata's
                tensors included), a ``kv_cache`` that is a leaf requiring grad (forward
                writes it in place), or a slot or block number outside the cache.
        """
