"""What attn_di runs of transformers' layer types and masks, and the check that it runs them.

transformers builds one mask per layer type (``config.layer_types``; its mask registry maps
each type to a ``create_*_mask`` function), through the mask function registered for the
attention implementation: attn_di's is :func:`~attn_di.integrations.transformers.padding_mask`.
That function receives the pattern (transformers' index-based ``mask_function``) but passes
only padding on: the impls apply causality, the sliding window and (here) chunks themselves.
Two checks keep a pattern attn_di does not compute from turning into numbers:

* :func:`mask_patterns` (in the mask function) evaluates transformers' pattern over the
  real tokens and names the patterns attn_di computes that equal it; none: refused there;
* :func:`check_layer` (in the attention function) refuses a layer whose type
  :data:`LAYER_TYPES` refuses, and a layer whose own pattern (causality, window, chunk from
  its settings) is not among those its mask was found equal to.

Chunked attention (Llama 4's ``chunked_attention``, ``attention_chunk_size`` C): query ``i``
sees key ``j`` when ``j <= i`` and ``(j - L) // C == (i - L) // C``, positions counted from
the row's first real token (``L`` left-padding columns), as transformers' ``chunked_overlay``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from attn_di.exceptions import UnsupportedFeatureError, closest_name

__all__ = [
    "BIDIRECTIONAL",
    "CAUSAL",
    "LAYER_TYPES",
    "MASK_FUNCTIONS",
    "MaskPattern",
    "MaskTag",
    "Support",
    "check_layer",
    "layer_type",
    "left_padding",
    "mask_patterns",
    "mask_tag",
    "tag_mask",
]


@dataclass(frozen=True)
class Support:
    """How attn_di treats one of transformers' layer types or mask functions.

    Attributes:
        kind: for a layer type: ``"full"`` (causal, or bidirectional where the layer is
            not causal; a window when the layer passes ``sliding_window``), ``"sliding"``
            (a causal sliding window), ``"chunked"`` (causal within chunks of
            ``attention_chunk_size``),
            ``"not_attention"`` (a recurrent, convolution or MLP layer: transformers calls no
            attention function for it) or ``"refused"``; for a mask function:
            ``"computed"``, ``"refused"``, ``"not_attention"`` or ``"dispatch"`` (it calls
            the others, per layer type).
        reason: what the layer type does, and for ``"refused"`` why attn_di cannot run it.
    """

    kind: str
    reason: str


def _table() -> Mapping[str, Support]:
    full = "causal attention over every earlier token (bidirectional where is_causal=False)"
    sliding = "causal attention over the last sliding_window tokens"
    recurrent = "a recurrent or convolution layer: no attention function call"
    sparse = (
        "keys picked per query by the model (an indexer or compressed keys): a sparse "
        "pattern attn_di's backends do not compute"
    )
    table = {
        "full_attention": Support("full", full),
        "attention": Support("full", full + " (transformers' old name)"),
        "hybrid": Support("full", full + ", beside the layer's recurrent state"),
        "window_attention": Support(
            "full",
            "non-overlapping windows that the model cuts before calling attention "
            "(bidirectional within each call)",
        ),
        "sliding_attention": Support("sliding", sliding),
        "hybrid_sliding": Support("sliding", sliding + ", beside a recurrent state"),
        "chunked_attention": Support(
            "chunked", "causal attention within chunks of attention_chunk_size tokens"
        ),
        "linear_attention": Support("not_attention", recurrent),
        "mamba": Support("not_attention", recurrent + " (transformers' old name)"),
        "conv": Support("not_attention", recurrent),
        "moe": Support("not_attention", "a mixture-of-experts block without attention"),
        "sparse": Support("not_attention", "an MLP layer type (mlp_layer_types)"),
        "dense": Support("not_attention", "an MLP layer type (mlp_layer_types)"),
        "indexed_attention": Support("refused", sparse),
        "deepseek_sparse_attention": Support("refused", sparse),
        "qwen_sparse_attention": Support("refused", sparse),
        "compressed_sparse_attention": Support("refused", sparse),
        "heavily_compressed_attention": Support("refused", sparse),
        "minimax_m3_sparse": Support("refused", sparse),
        "reference_sliding_attention": Support(
            "refused",
            "full attention over the prompt and a ring-buffered window over generated "
            "tokens: a pattern attn_di's backends do not compute",
        ),
    }
    return MappingProxyType(dict(sorted(table.items())))


LAYER_TYPES: Mapping[str, Support] = _table()
"""Every layer type of transformers 5.24 (``ALLOWED_LAYER_TYPES``, the mask registry's keys
and the old names it remaps), classified. A type not listed is refused."""


def _mask_table() -> Mapping[str, Support]:
    computed, refused = "computed", "refused"
    packed = "several sequences packed in one row (position_ids restarting, no attention_mask)"
    table = {
        "causal_mask_function": Support(computed, "causal"),
        "bidirectional_mask_function": Support(computed, "bidirectional (encoder-only)"),
        "padding_mask_function": Support(computed, "padding: attn_di drops padding tokens"),
        "add_offsets_to_mask_function": Support(
            computed, "the cache's offsets: patterns are read at absolute positions"
        ),
        "sliding_window_overlay": Support(computed, "the causal sliding window"),
        "sliding_window_causal_mask_function": Support(computed, "the causal sliding window"),
        "chunked_overlay": Support(computed, "chunks of attention_chunk_size"),
        "chunked_causal_mask_function": Support(computed, "causal within chunks"),
        "sliding_window_bidirectional_overlay": Support(refused, "a bidirectional window"),
        "sliding_window_bidirectional_mask_function": Support(refused, "a bidirectional window"),
        "blockwise_overlay": Support(
            refused, "bidirectional blocks inside a causal mask (block_sequence_ids)"
        ),
        "packed_sequence_mask_function": Support(refused, packed),
        "create_causal_mask": Support(
            computed,
            "causal (bidirectional for is_causal=False configs); refused with "
            "or_mask_function/and_mask_function, block_sequence_ids or packed sequences",
        ),
        "create_bidirectional_mask": Support(
            computed, "bidirectional; refused with or_mask_function/and_mask_function"
        ),
        "create_sliding_window_causal_mask": Support(
            computed, "the causal sliding window; refused as create_causal_mask is"
        ),
        "create_chunked_causal_mask": Support(
            computed, "causal within chunks; refused as create_causal_mask is"
        ),
        "create_bidirectional_sliding_window_mask": Support(
            refused, "a bidirectional window (accepted only where it equals bidirectional)"
        ),
        "create_recurrent_attention_mask": Support(
            "not_attention", "the padding of recurrent layers: no attention function call"
        ),
        "create_masks_for_generate": Support("dispatch", "one of the above per layer type"),
    }
    return MappingProxyType(dict(sorted(table.items())))


MASK_FUNCTIONS: Mapping[str, Support] = _mask_table()
"""transformers 5.24's mask functions and mask makers (``transformers.masking_utils``: the
``*_mask_function``, ``*_overlay`` and ``create_*`` functions), classified."""


@dataclass(frozen=True)
class MaskPattern:
    """An attention pattern attn_di computes.

    Attributes:
        kind: ``"causal"``, ``"sliding"`` (the last ``size`` tokens, the query's own
            included), ``"chunked"`` (causal within chunks of ``size``) or ``"bidirectional"``.
        size: the window or chunk in tokens; None for causal and bidirectional.
    """

    kind: str
    size: int | None = None

    def __str__(self) -> str:
        return self.kind if self.size is None else f"{self.kind}({self.size})"


CAUSAL = MaskPattern("causal")
BIDIRECTIONAL = MaskPattern("bidirectional")


@dataclass(frozen=True)
class MaskTag:
    """What attn_di's mask function found of the mask it made (kept on the returned tensor).

    Attributes:
        patterns: the patterns attn_di computes that equal transformers' over the real tokens.
        first_column: the absolute column of the mask's first column (transformers'
            ``kv_offset``).
        left_padding: ``[B]`` int64 padding columns before each row's first real token.
    """

    patterns: frozenset[MaskPattern]
    first_column: int
    left_padding: torch.Tensor

    def positions(self, columns: int, last: int) -> torch.Tensor:
        """``[B, columns]`` int64 positions (from each row's first real token) of the mask's
        ``columns`` columns ending at mask column ``last`` (exclusive)."""
        start = self.first_column + last - columns
        absolute = torch.arange(start, start + columns, dtype=torch.int64)
        return absolute[None, :] - self.left_padding[:, None]


_TAG = "_attn_di_mask_tag"


def tag_mask(mask: torch.Tensor, tag: MaskTag) -> torch.Tensor:
    """Attach ``tag`` to the tensor ``mask`` (an attribute: the tensor is passed unchanged)."""
    setattr(mask, _TAG, tag)
    return mask


def mask_tag(mask: object) -> MaskTag | None:
    """The tag :func:`tag_mask` attached, or None (a mask attn_di's mask function did not make)."""
    tag = getattr(mask, _TAG, None)
    return tag if isinstance(tag, MaskTag) else None


def left_padding(attention_mask: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """``[B]`` int64: padding columns before each row's first token (0 without a mask)."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.int64)
    real = attention_mask.to(torch.bool)
    return (real.to(torch.int64).cumsum(dim=-1) == 0).sum(dim=-1).to(torch.int64).cpu()


def mask_patterns(
    mask_function: Callable[..., Any] | None,
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    sizes: tuple[int, ...],
) -> frozenset[MaskPattern]:
    """The patterns attn_di computes that equal transformers' ``mask_function`` here.

    ``mask_function(b, h, q, kv)`` is transformers' index-based pattern (without padding);
    it is evaluated over the ``[B, q_length, kv_length]`` grid (absolute positions
    ``q_offset + i``, ``kv_offset + j``) and compared where the key column and the query
    column are real tokens of ``attention_mask``. Candidates: causal, bidirectional, and a
    sliding window and chunks of each of ``sizes`` (transformers' ``local_size``, the config's
    ``sliding_window`` and ``attention_chunk_size``).

    Returns:
        The matching patterns (several when they coincide on these tokens, e.g. a prompt
        shorter than the window).

    Raises:
        UnsupportedFeatureError: no candidate matches (packed sequences, bidirectional image
            blocks, a bidirectional window, ...), naming the fix.
    """
    from transformers import masking_utils

    if mask_function is masking_utils.causal_mask_function:
        return frozenset({CAUSAL})
    if mask_function is masking_utils.bidirectional_mask_function:
        return frozenset({BIDIRECTIONAL})
    if mask_function is None:
        raise _foreign("a mask call without a mask function")
    q_pos = torch.arange(q_length, dtype=torch.int64) + int(q_offset)
    kv_pos = torch.arange(kv_length, dtype=torch.int64) + int(kv_offset)
    rows = torch.arange(batch_size, dtype=torch.int64)
    heads = torch.zeros(1, dtype=torch.int64)
    try:
        allowed = mask_function(
            rows[:, None, None, None], heads[None, :, None, None],
            q_pos[None, None, :, None], kv_pos[None, None, None, :],
        )  # fmt: skip
    except Exception as exc:  # an unusual mask function: refuse, do not guess
        raise _foreign(f"a mask function attn_di cannot evaluate ({exc})") from exc
    allowed = torch.as_tensor(allowed, dtype=torch.bool).cpu()
    allowed = allowed.expand(batch_size, 1, q_length, kv_length)[:, 0]
    relevant = _real(attention_mask, batch_size, q_pos, kv_pos)
    pads = left_padding(attention_mask, batch_size)[:, None, None]
    q_idx, kv_idx = q_pos[None, :, None], kv_pos[None, None, :]
    causal = kv_idx <= q_idx

    def expected(pattern: MaskPattern) -> torch.Tensor:  # one candidate at a time: memory
        if pattern == CAUSAL:
            return causal
        if pattern == BIDIRECTIONAL:
            return torch.ones_like(causal)
        size = int(pattern.size or 1)
        if pattern.kind == "sliding":
            return causal & (kv_idx > q_idx - size)
        kv_chunk = (kv_idx - pads).div(size, rounding_mode="floor")
        return causal & (kv_chunk == (q_idx - pads).div(size, rounding_mode="floor"))

    candidates = [CAUSAL, BIDIRECTIONAL]
    for size in sorted({int(s) for s in sizes if s and int(s) > 0}):
        candidates += [MaskPattern("sliding", size), MaskPattern("chunked", size)]
    found = frozenset(
        pattern
        for pattern in candidates
        if not bool(((allowed ^ expected(pattern)) & relevant).any())
    )
    if not found:
        raise _foreign(
            "a mask pattern that is none of causal, sliding window, chunked, bidirectional"
        )
    return found


def _real(
    attention_mask: torch.Tensor | None,
    batch_size: int,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
) -> torch.Tensor:
    """``[B, q, kv]`` bool: both the query column and the key column are real tokens (columns
    past the 2-D mask's end are padding, as transformers pads the mask with zeros)."""
    if attention_mask is None:
        return torch.ones((batch_size, len(q_pos), len(kv_pos)), dtype=torch.bool)
    real = attention_mask.to(torch.bool).cpu()
    width = int(real.shape[-1])

    def columns(positions: torch.Tensor) -> torch.Tensor:
        if not width:
            return torch.zeros((batch_size, len(positions)), dtype=torch.bool)
        inside = (positions >= 0) & (positions < width)
        return real[:, positions.clamp(0, width - 1)] & inside[None, :]

    return columns(q_pos)[:, :, None] & columns(kv_pos)[:, None, :]


def _foreign(what: str) -> UnsupportedFeatureError:
    error = UnsupportedFeatureError("attn_di", f"{what} in the model's attention mask")
    error.hint = (
        "attn_di computes causal, sliding-window, chunked and bidirectional masks with padding; "
        "packed sequences (position_ids restarting without an attention_mask) and per-token "
        "blocks (block_sequence_ids, image tokens) are not: pass a 2-D attention_mask with one "
        "sequence per row, or use another attn_implementation for this model"
    )
    return error


def layer_type(module: torch.nn.Module) -> str | None:
    """The layer type of an attention module (``config.layer_types[module.layer_idx]``), or
    ``"chunked_attention"`` for a config with ``attention_chunk_size`` and no ``layer_types``
    nor ``sliding_window`` (transformers then makes every layer chunked), or None."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types:
        if isinstance(index, int) and 0 <= index < len(types):
            return str(types[index])
        return None
    no_window = getattr(config, "sliding_window", None) is None
    if no_window and getattr(config, "attention_chunk_size", None) is not None:
        return "chunked_attention"
    return None


def check_layer(
    module: torch.nn.Module,
    *,
    causal: bool,
    window: int | None,
    tag: MaskTag | None,
) -> MaskPattern:
    """The pattern attn_di computes for this layer, after checking that it is the layer's.

    Args:
        module: the attention layer (``config``, ``layer_idx``).
        causal: the layer's ``is_causal``.
        window: the ``sliding_window`` the layer passed, or None.
        tag: what attn_di's mask function found of the layer's mask, or None.

    Returns:
        ``CAUSAL``, ``BIDIRECTIONAL``, ``sliding(w)`` or ``chunked(C)``.

    Raises:
        UnsupportedFeatureError: a layer type :data:`LAYER_TYPES` refuses or does not list,
            a chunked layer without ``attention_chunk_size`` or with a window too, a
            bidirectional window, or a mask that differs from the layer's pattern; each names
            the layer, its type and the fix.
    """
    kind = layer_type(module)
    support = LAYER_TYPES.get(kind) if kind is not None else Support("full", "")
    where = _where(module, kind)
    if support is None:
        known = [name for name, known in LAYER_TYPES.items() if known.kind != "refused"]
        close = closest_name(str(kind), known)
        raise _layer_error(
            where,
            "a layer type attn_di does not know",
            (f"did you mean {close!r}? " if close else "")
            + f"the layer types attn_di runs: {', '.join(known)}; or use another "
            "attn_implementation for this model",
        )
    if support.kind in ("refused", "not_attention"):
        raise _layer_error(where, support.reason, "use another attn_implementation for this model")
    if support.kind == "chunked":
        size = getattr(getattr(module, "config", None), "attention_chunk_size", None)
        if not size or window:
            raise _layer_error(
                where,
                f"chunked attention with attention_chunk_size={size!r} and "
                f"sliding_window={window!r}",
                "give the config a positive attention_chunk_size and no window on chunked layers",
            )
        pattern = MaskPattern("chunked", int(size))
    elif window:
        if not causal:
            raise _layer_error(
                where,
                f"a bidirectional sliding window (sliding_window={window})",
                "use another attn_implementation for this model",
            )
        pattern = MaskPattern("sliding", int(window))
    else:
        pattern = CAUSAL if causal else BIDIRECTIONAL
    if tag is not None and pattern not in tag.patterns:
        found = ", ".join(sorted(str(p) for p in tag.patterns))
        raise _layer_error(
            where,
            f"its mask is {found}, but the layer would run {pattern}",
            "use another attn_implementation for this model, or report the model to attn_di",
        )
    if tag is None and pattern.kind == "chunked":
        raise _layer_error(
            where,
            f"chunked attention (attention_chunk_size={pattern.size}) without attn_di's mask",
            "let transformers build the mask (pass a 2-D attention_mask, not a 4-D one) on an "
            "attn_implementation registered by attn_di.integrations.transformers.register()",
        )
    return pattern


def _where(module: torch.nn.Module, kind: str | None) -> str:
    index = getattr(module, "layer_idx", None)
    name = type(module).__name__
    return f"layer {index} ({name}, layer type {kind!r})" if kind else f"layer {index} ({name})"


def _layer_error(where: str, what: str, fix: str) -> UnsupportedFeatureError:
    error = UnsupportedFeatureError("attn_di", f"{what} at {where}")
    error.hint = fix
    return error
