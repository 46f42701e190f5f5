"""``register()``: attn_di's names in transformers' attention and mask registries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from attn_di._enum import AttentionBackendEnum, parse_backend_name
from attn_di.exceptions import UnsupportedFeatureError
from attn_di.integrations.transformers._attention import AttentionFunction
from attn_di.integrations.transformers._masks import (
    MaskTag,
    left_padding,
    mask_patterns,
    tag_mask,
)
from attn_di.integrations.transformers._paged_cache import transformers_name

__all__ = [
    "ATTENTION_NAME",
    "attention_settings",
    "implementation_name",
    "padding_mask",
    "register",
]

ATTENTION_NAME = "attn_di"
"""The transformers attention implementation that lets attn_di select the backend."""

_FUNCTIONS: dict[AttentionBackendEnum | None, AttentionFunction] = {}


def implementation_name(member: AttentionBackendEnum | str | None = None) -> str:
    """The transformers ``attn_implementation`` name for a backend.

    Args:
        member: a member or its name (case-insensitive); None or ``"auto"`` for attn_di's
            selection.

    Returns:
        ``"attn_di"``, or ``"attn_di:<MEMBER>"`` (e.g. ``"attn_di:CPU_ATTN"``): the name that
        runs that very member, case kept: ``MY_X`` and ``my_x`` get names of their own
        (a lowercase ``flash``, ``sdpa`` or ``flex_attention`` in a name gets a ``.`` after
        its first letter, which transformers would otherwise read as its own kinds).

    Raises:
        UnknownBackendError: an unknown name, with the closest suggestion.
    """
    parsed = parse_backend_name(member)
    return ATTENTION_NAME if parsed is None else transformers_name(parsed.name)


def register() -> list[str]:
    """Register ``"attn_di"`` and ``"attn_di:<MEMBER>"`` for every member with transformers.

    Each name goes into ``transformers.AttentionInterface`` (the attention function) and
    ``AttentionMaskInterface`` (:func:`padding_mask`, so padded batches keep their padding).
    Idempotent: calling it again registers the same functions, plus any member added since
    (``AttentionBackendEnum.register``). Each member has its own name, case kept; no name
    holds a lowercase ``flash``, ``sdpa`` or ``flex_attention``, which would trigger
    transformers' own checks for those kinds.

    Returns:
        The registered names, ``"attn_di"`` first.
    """
    names = []
    for member in (None, *AttentionBackendEnum):
        function = _FUNCTIONS.get(member)
        if function is None:
            function = _FUNCTIONS.setdefault(member, AttentionFunction(member))
        name = implementation_name(member)
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, padding_mask)
        names.append(name)
    return names


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """attn_di's mask function: the ``[B, kv_length]`` bool padding mask.

    transformers calls it (through ``AttentionMaskInterface``) once per forward and mask
    kind. The causal, sliding-window, chunked and bidirectional patterns are the impls'
    business (from each layer's settings), so only padding is passed on; but first the
    pattern transformers asks for (``mask_function``) is checked to be one of those over the
    real tokens, and what was found is kept on the returned tensor for the attention function
    to check against each layer (see ``attn_di.integrations.transformers._masks``).

    Args:
        batch_size: B.
        q_length, q_offset: the query columns, from ``q_offset``.
        kv_length: keys the layer will see.
        kv_offset: the first key's column in the 2-D mask (transformers' sliding caches).
        mask_function: transformers' index-based pattern ``(b, h, q, kv) -> bool``.
        attention_mask: ``[B, columns]`` 1 for tokens, 0 for padding, or None.
        use_vmap: True when the model adds its own mask functions (refused).
        kwargs: ``local_size`` (the window or chunk) and ``config`` are read; the rest is
            ignored.

    Returns:
        ``attention_mask[:, kv_offset:kv_offset + kv_length]`` as bool (False past its end;
        all True without a mask).

    Raises:
        UnsupportedFeatureError: the model combines extra mask functions
            (``or_mask_function``/``and_mask_function``, e.g. bidirectional image blocks), or
            the pattern is none of causal, sliding window, chunked and bidirectional (packed
            sequences, ``block_sequence_ids``).
    """
    if use_vmap:
        error = UnsupportedFeatureError("attn_di", "custom mask functions of the model")
        error.hint = (
            "attn_di's transformers integration handles causal, sliding-window, chunked, "
            "bidirectional and padding masks; use another attn_implementation for this model"
        )
        raise error
    config = kwargs.get("config")
    sizes = tuple(
        size
        for size in (
            kwargs.get("local_size"),
            getattr(config, "sliding_window", None),
            getattr(config, "attention_chunk_size", None),
        )
        if isinstance(size, int) and not isinstance(size, bool)
    )
    patterns = mask_patterns(
        mask_function,
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=int(q_offset),
        kv_offset=int(kv_offset),
        attention_mask=attention_mask,
        sizes=sizes,
    )
    end = kv_offset + kv_length
    if attention_mask is None:
        mask = torch.ones((batch_size, kv_length), dtype=torch.bool, device=kwargs.get("device"))
    else:
        mask = attention_mask.to(torch.bool)
        if mask.shape[-1] < end:
            mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]), value=False)
        mask = mask[:, kv_offset:end]
    tag = MaskTag(patterns, int(kv_offset), left_padding(attention_mask, batch_size))
    return tag_mask(mask, tag)


def attention_settings(model: torch.nn.Module, *, block_size: int | None = None) -> dict[str, Any]:
    """The selection inputs of a loaded model, for ``container.attention.from_dict(...)``.

    With them, ``Provide[BackendContainer.selected]`` injects the backend class attn_di selects
    for the model's attention layers (under the same overrides, ``force_backend`` and
    ``ATTN_DI_BACKEND``), so an engine built around the model can be handed that backend.

    Args:
        model: a transformers model (``PreTrainedModel``).
        block_size: the KV-cache block size in tokens (a :class:`PagedCache`'s), or None.

    Returns:
        ``{"head_size", "dtype", "block_size", "has_sink", "attn_type", "device"}``.
    """
    config = model.config.get_text_config(decoder=True)  # type: ignore[operator, union-attr]
    heads = int(config.num_attention_heads)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameter = next(model.parameters())
    has_sink = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
    flags = [
        m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    causal = all(flags) if flags else True
    return {
        "head_size": int(head_size),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "block_size": block_size,
        "has_sink": has_sink,
        "attn_type": "decoder" if causal else "encoder_only",
        "device": parameter.device.type,
    }
