"""The attention function transformers calls for ``attn_di`` and ``attn_di:<MEMBER>``.

Per call: read the layer's settings from the call (heads, head size, scale, sliding window,
soft cap, sinks, causality), resolve the backend through the container (:func:`select_backend`,
so overrides, ``force_backend`` and ``ATTN_DI_BACKEND`` act on a loaded model), take the
layer's impl from a cache keyed by (backend class, settings), then run one of three paths:

* a :class:`PagedCache` step: the impl writes the new keys/values through the step's
  ``slot_mapping`` and reads the history through its ``block_table``;
* causal attention over transformers' own keys (no cache, or ``DynamicCache``): the keys
  are packed into a one-block-per-row scratch cache in attn_di's layout;
* non-causal self-attention (encoders such as BERT): attn_di's ``encoder_only`` mode.

A chunked layer (``chunked_attention``) whose tokens reach past the first chunk runs each
(row, chunk) of its queries as a sequence of its own, over that chunk's keys (a scratch cache
of one block per chunk, or the chunk's blocks of a :class:`PagedCache`). Before any path, the
layer's type and its mask are checked (``_masks.check_layer``): refused types and masks fail.

Padding tokens (0 in the 2-D ``attention_mask``) are dropped before the impl sees the batch
(vLLM's packed layout, ``query_start_loc``) and get zeros in the output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from attn_di._default import get_container
from attn_di._device import Device, parse_device
from attn_di._enum import AttentionBackendEnum, parse_backend_name
from attn_di._selection import AttentionSelectorConfig, Selection, select_backend, shared_selection
from attn_di.backend import AttentionType
from attn_di.exceptions import (
    BackendRejectedError,
    InvalidInputError,
    NoValidBackendError,
    UnsupportedFeatureError,
)
from attn_di.integrations.transformers._masks import check_layer, mask_tag
from attn_di.integrations.transformers._paged_cache import PENDING, PagedCache, StepBatch
from attn_di.integrations.transformers._paged_cache import transformers_name as _transformers_name

if TYPE_CHECKING:
    from attn_di.backend import AttentionImpl, AttentionMetadata

__all__ = ["AttentionFunction", "LayerSettings"]


@dataclass(frozen=True)
class LayerSettings:
    """What an attention layer asks of its impl (hashable: a key of the impl cache).

    Attributes:
        num_heads: query heads H.
        head_size: D.
        num_kv_heads: key/value heads (GQA when fewer than H).
        scale: the factor on ``q @ k^T``.
        sliding_window: w, or None.
        logits_soft_cap: c, or None.
        sinks_id: ``id`` of the layer's sink tensor (gpt-oss ``s_aux``), or None.
        attn_type: ``"decoder"`` (causal) or ``"encoder_only"`` (bidirectional, no cache).
    """

    num_heads: int
    head_size: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    sinks_id: int | None
    attn_type: str


# Per model layer (the transformers module): {(chosen backend class, settings): (class, impl)}.
_IMPLS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, LayerSettings], tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)
_CPU = Device("cpu")


class AttentionFunction:
    """A transformers attention function that runs an attn_di backend.

    ``AttentionFunction(None)`` is ``"attn_di"`` (attn_di selects the backend);
    ``AttentionFunction(AttentionBackendEnum.CPU_ATTN)`` is ``"attn_di:CPU_ATTN"``.

    Args:
        member: the backend asked for, or None for attn_di's selection.
    """

    def __init__(self, member: AttentionBackendEnum | None) -> None:
        self.member = member
        self.__name__ = "attn_di_attention" if member is None else f"attn_di_{member.name}"

    def __repr__(self) -> str:
        return f"AttentionFunction({'auto' if self.member is None else self.member.name})"

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Attend as transformers' attention functions do.

        Args:
            module: the calling attention layer (its ``layer_idx``, ``is_causal``).
            query: ``[B, H, q, D]``.
            key: ``[B, H_kv, k, D]`` (with a :class:`PagedCache`: only the step's new keys).
            value: ``[B, H_kv, k, D]``.
            attention_mask: ``[B, k]`` bool, True for real tokens (attn_di's mask function
                makes it), or None when there is no padding.
            scaling: the factor on ``q @ k^T``; None: ``D ** -0.5``.
            dropout: must be 0 (attn_di's backends have no attention dropout).
            kwargs: ``sliding_window``, ``softcap``, ``s_aux`` (sinks), ``is_causal``; the
                rest is ignored.

        Returns:
            ``([B, q, H, D] output in the query's dtype, None)``; padding rows are zeros.

        Raises:
            UnsupportedFeatureError: dropout, cross-attention, a feature the asked-for
                backend lacks, a layer type attn_di refuses, or a mask that is not the
                layer's pattern (see ``_masks.check_layer``).
            BackendRejectedError: a forced or named backend refuses the layer.
            NoValidBackendError: no candidate backend accepts the layer.
            InvalidInputError: a 4-D or otherwise foreign ``attention_mask``.
        """
        if dropout:
            error = UnsupportedFeatureError("attn_di", f"attention dropout (p={dropout})")
            error.hint = "attn_di's backends run inference attention: call model.eval()"
            raise error
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        pending = PENDING.get()
        cache: PagedCache | None = None
        if pending is not None:
            PENDING.set(None)
            if pending[1] == getattr(module, "layer_idx", None):
                cache = pending[0]
        try:
            return self._attend(
                module, query, key, value, attention_mask, scaling, cache, causal, kwargs
            )
        except BaseException:
            if cache is not None:
                cache.abandon_step()
            raise

    def _attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        cache: PagedCache | None,
        causal: bool,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        if cache is None:
            valid = _padding_mask(attention_mask, key)
        else:  # the layers of a step share one mask: read it once per step
            memo = cache.step_memo.get("padding_mask")
            if memo is not None and memo[0] is attention_mask:
                valid = memo[1]
            else:
                valid = _padding_mask(attention_mask, key)
                cache.step_memo["padding_mask"] = (attention_mask, valid)
        sinks = kwargs.get("s_aux")
        window = kwargs.get("sliding_window")
        soft_cap = kwargs.get("softcap")
        for packed in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if kwargs.get(packed) is not None:
                raise _unsupported_call(f"packed sequences ({packed}) in one row")
        tag = mask_tag(attention_mask)
        pattern = check_layer(
            module, causal=causal, window=int(window) if window else None, tag=tag
        )
        settings = LayerSettings(
            num_heads=int(query.shape[1]),
            head_size=int(query.shape[3]),
            num_kv_heads=int(key.shape[1]),
            scale=float(scaling) if scaling is not None else float(query.shape[3]) ** -0.5,
            sliding_window=int(window) if window else None,
            logits_soft_cap=float(soft_cap) if soft_cap else None,
            sinks_id=None if sinks is None else id(sinks),
            attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY,
        )
        block_size = cache.block_size if cache is not None else None
        backend_cls, impl = self.resolve(module, settings, query, block_size, sinks)
        if not causal:
            if cache is not None:
                raise _unsupported(backend_cls, "non-causal attention over a PagedCache")
            return _encoder_only(impl, backend_cls, query, key, value, valid), None
        if pattern.kind == "chunked":
            assert tag is not None  # check_layer refuses a chunked layer without a tag
            assert pattern.size is not None
            width = int(attention_mask.shape[1])  # type: ignore[union-attr]
            chunk = pattern.size
            if cache is not None:
                positions = tag.positions(int(query.shape[2]), width)
                return _paged(impl, backend_cls, cache, module, query, key, value, valid,
                              chunked=(chunk, positions)), None  # fmt: skip
            positions = tag.positions(int(key.shape[2]), width)
            if _beyond_first_chunk(positions, valid, chunk):
                return _chunked(impl, backend_cls, query, key, value, valid, positions, chunk), None
        if cache is not None:
            return _paged(impl, backend_cls, cache, module, query, key, value, valid), None
        return _contiguous(impl, backend_cls, query, key, value, valid), None

    def resolve(
        self,
        module: torch.nn.Module,
        settings: LayerSettings,
        query: torch.Tensor,
        block_size: int | None,
        sinks: torch.Tensor | None,
    ) -> tuple[Any, AttentionImpl]:
        """The backend class and impl for this layer now (selection, then the impl cache).

        Raises:
            BackendRejectedError, NoValidBackendError, UnknownBackendError: see ``__call__``.
        """
        config = _selector_config(
            settings.head_size, query.dtype, block_size, sinks is not None, settings.attn_type
        )
        device = _CPU if query.device.type == "cpu" else parse_device(query.device.type)
        try:
            selection = shared_selection(config, device=device, backend=self.member)
        except BackendRejectedError as exc:
            exc.hint = _rejected_hint(exc.origin, ())
            raise
        impls = _IMPLS.get(module)
        if impls is None:
            impls = _IMPLS.setdefault(module, {})
        found = impls.get((selection.backend_cls, settings))
        if found is None:
            found = _choose(selection, settings, sinks, device)
            impls[(selection.backend_cls, settings)] = found
        return found


@lru_cache(maxsize=256)
def _selector_config(
    head_size: int, dtype: torch.dtype, block_size: int | None, has_sink: bool, attn_type: str
) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        has_sink=has_sink,
        attn_type=attn_type,
    )


def _choose(
    selection: Selection, settings: LayerSettings, sinks: torch.Tensor | None, device: Device
) -> tuple[Any, AttentionImpl]:
    """Build the selected backend's impl; when attn_di chose (no backend asked for) and the
    impl refuses a feature the selector does not know (soft cap, window), go on down the
    candidate list. A backend asked for is never replaced: it fails with the reason."""
    try:
        return selection.backend_cls, _build_impl(selection.backend_cls, settings, sinks)
    except UnsupportedFeatureError as exc:
        if selection.origin != "auto":
            rejected = BackendRejectedError(
                selection.backend.name,
                [exc.message()],
                selection.origin,
                _describe(selection.config, settings),
                str(device),
            )
            rejected.hint = _rejected_hint(selection.origin, exc.supported_by)
            raise rejected from exc
        refusal = exc.message()
    rejected_by: dict[str, list[str]] = {
        member.name: list(reasons) for member, reasons in selection.rejected.items()
    }
    rejected_by[selection.backend.name] = [refusal]
    config = selection.config
    assert config is not None
    candidates = [parse_backend_name(c) for c in get_container().candidates(device, config)]
    position = candidates.index(selection.backend) if selection.backend in candidates else -1
    for member in candidates[position + 1 :]:
        if member is None:
            continue
        try:
            backend_cls = select_backend(config, device=device, backend=member).backend_cls
            return backend_cls, _build_impl(backend_cls, settings, sinks)
        except BackendRejectedError as exc:
            rejected_by[member.name] = list(exc.reasons)
        except UnsupportedFeatureError as exc:
            rejected_by[member.name] = [exc.message()]
    raise NoValidBackendError(_describe(config, settings), str(device), rejected_by)


def _rejected_hint(origin: str, supported_by: tuple[str, ...]) -> str:
    """The hint of a refused backend in transformers' terms (the core's names ``backend=``)."""
    if origin == "force_backend()":
        choose, alternative = "leave force_backend() off to let attn_di choose", "force {}"
        names = " or ".join(supported_by)
    elif origin == "ATTN_DI_BACKEND":
        choose, alternative = "unset ATTN_DI_BACKEND to let attn_di choose", "set it to {}"
        names = " or ".join(supported_by)
    else:
        choose = (
            'load the model with attn_implementation="attn_di" (or call '
            'model.set_attn_implementation("attn_di")) to let attn_di choose'
        )
        alternative = "name {}"
        names = " or ".join(f'"{_transformers_name(name)}"' for name in supported_by)
    return f"{choose}, or {alternative.format(names)}" if names else choose


def _build_impl(backend_cls: Any, settings: LayerSettings, sinks: torch.Tensor | None) -> Any:
    options: dict[str, Any] = {
        "num_heads": settings.num_heads,
        "head_size": settings.head_size,
        "scale": settings.scale,
        "num_kv_heads": settings.num_kv_heads,
        "attn_type": settings.attn_type,
    }
    if settings.sliding_window is not None:
        options["sliding_window"] = settings.sliding_window
    if settings.logits_soft_cap is not None:
        options["logits_soft_cap"] = settings.logits_soft_cap
    if sinks is not None:
        options["sinks"] = sinks
    return backend_cls.get_impl_cls()(**options)


def _describe(config: AttentionSelectorConfig | None, settings: LayerSettings) -> str:
    extras = [
        f"{name}={value}"
        for name, value in (
            ("sliding_window", settings.sliding_window),
            ("logits_soft_cap", settings.logits_soft_cap),
        )
        if value is not None
    ]
    return f"{config!r}" + (f" with {', '.join(extras)}" if extras else "")


def _unsupported(backend_cls: Any, feature: str) -> UnsupportedFeatureError:
    error = UnsupportedFeatureError(str(backend_cls.get_name()), feature)
    error.hint = "attn_di's transformers integration runs decoder self-attention and encoders"
    return error


def _unsupported_call(feature: str) -> UnsupportedFeatureError:
    error = UnsupportedFeatureError("attn_di", feature)
    error.hint = "use another attn_implementation for this model"
    return error


def _padding_mask(attention_mask: object, key: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, k]`` bool mask of real tokens, None when every token is real.

    Raises:
        InvalidInputError: a mask attn_di's mask function did not make (4-D, BlockMask).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = getattr(attention_mask, "shape", None)
        raise InvalidInputError(
            "attention_mask",
            f"attn_di takes a 2-D padding mask [batch, kv_len], got {type(attention_mask).__name__}"
            + (f" of shape {tuple(shape)}" if shape is not None else ""),
            hint="pass a 2-D attention_mask (1 = token, 0 = padding); custom 4-D masks and "
            "mask functions are not supported",
        )
    if attention_mask.shape[0] != key.shape[0] or attention_mask.shape[1] < key.shape[2]:
        raise InvalidInputError(
            "attention_mask",
            f"shape {tuple(attention_mask.shape)} does not cover keys of shape {tuple(key.shape)}",
            hint="the 2-D mask needs one row per sequence and one column per key",
        )
    mask = attention_mask.to(torch.bool)
    if bool(mask.all()):
        return None
    return mask


def _rows(tensor: torch.Tensor, index: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """``[B, h, q, D]`` -> ``[N, h, D]``: the real tokens (all B * q when ``index`` is None)."""
    by_token = tensor.transpose(1, 2)
    if index is None:
        return by_token.reshape(-1, tensor.shape[1], tensor.shape[3])
    return by_token[index]


def _forward_rows(
    impl: AttentionImpl,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    index: tuple[torch.Tensor, ...] | None,
) -> torch.Tensor:
    """``impl.forward`` on the real tokens (``index``; all when None) of ``[B, h, q, D]``
    query/key/value; the output back as ``[B, q, H, D]``, zeros at padding."""
    batch, heads, q_len, size = (int(n) for n in query.shape)
    out = impl.forward(
        None, _rows(query, index), _rows(key, index), _rows(value, index), kv_cache, metadata
    )
    if index is None:
        return out.view(batch, q_len, heads, size)
    result = out.new_zeros((batch, q_len, heads, size))
    result[index] = out.view(-1, heads, size)
    return result


def _paged(
    impl: AttentionImpl,
    backend_cls: Any,
    cache: PagedCache,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    chunked: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One :class:`PagedCache` step; ``chunked``: ``(C, [B, q] positions of the query
    columns)`` for a chunked layer."""
    batch, q_len = int(query.shape[0]), int(query.shape[2])
    valid_q = None if valid is None else valid[:, -q_len:]
    step = cache.step_batch(valid_q, batch, q_len)
    metadata = step.metadata_for(backend_cls, cache.block_size)
    if chunked is not None:
        metadata = _paged_chunks(step, backend_cls, cache, valid_q, *chunked) or metadata
    layer_idx = int(getattr(module, "layer_idx", 0))
    kv_cache = cache.kv_cache(layer_idx, backend_cls, key.dtype, key.device)
    index = None
    if step.batch_index is not None and step.column_index is not None:
        index = (step.batch_index, step.column_index)
    return _forward_rows(impl, query, key, value, kv_cache, metadata, index)


def _paged_chunks(
    step: StepBatch,
    backend_cls: Any,
    cache: PagedCache,
    valid_q: torch.Tensor | None,
    chunk: int,
    positions: torch.Tensor,
) -> AttentionMetadata | None:
    """The step's metadata for a chunked layer: one sequence per (row, chunk) of its queries,
    reading the row's blocks from the chunk's first (None: every token is in the first chunk,
    the ordinary metadata is right).

    Raises:
        UnsupportedFeatureError: padding inside a sequence (positions that are not the
            cache's), or a chunk that is not a whole number of blocks.
    """
    memo_key = f"chunked:{chunk}:{backend_cls.get_builder_cls().__qualname__}"
    memo = cache.step_memo.get(memo_key)
    if memo is not None and memo[0] is step:
        return memo[1]  # type: ignore[no-any-return]
    rows: list[list[int]] = []
    for row in range(step.batch_size):
        mine = positions[row] if valid_q is None else positions[row][valid_q[row].cpu()]
        first = step.seq_lens[row] - step.query_lens[row]
        if mine.tolist() != list(range(first, step.seq_lens[row])):
            error = _unsupported_call(
                "chunked attention over a PagedCache with padding inside a sequence"
            )
            error.hint = "pad only on the left (tokenizer padding_side='left')"
            raise error
        rows.append(mine.tolist())
    metadata: AttentionMetadata | None = None
    if max(step.seq_lens, default=0) > chunk:
        block_size = cache.block_size
        if chunk % block_size:  # PagedCache refuses such a block_size when it is made
            raise _unsupported_call(
                f"chunked attention (attention_chunk_size={chunk}) over a PagedCache of "
                f"block_size={block_size}, which does not divide it"
            )
        query_lens, seq_lens, tables = [], [], []
        for row, row_positions in enumerate(rows):
            table = step.block_table[row].tolist()
            for index in sorted({p // chunk for p in row_positions}):
                in_chunk = [p for p in row_positions if p // chunk == index]
                query_lens.append(len(in_chunk))
                seq_lens.append(in_chunk[-1] + 1 - index * chunk)
                tables.append(table[index * chunk // block_size :])
        width = max(len(table) for table in tables)
        block_table = torch.tensor(
            [t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32
        )
        builder = backend_cls.get_builder_cls()(block_size)
        metadata = builder.build(query_lens, seq_lens, block_table)
    cache.step_memo[memo_key] = (step, metadata)
    return metadata


def _check_scratch_layout(backend_cls: Any, expected: tuple[int, int, int, int, int]) -> None:
    """Refuse a backend whose KV cache is not attn_di's ``[2, num_blocks, block_size, H_kv,
    D]`` layout, which the scratch caches over transformers' own keys are written in.

    Raises:
        UnsupportedFeatureError: another layout, naming it.
    """
    _, blocks, block_size, kv_heads, size = expected
    shape = tuple(backend_cls.get_kv_cache_shape(blocks, block_size, kv_heads, size))
    if shape != expected:
        error = _unsupported(backend_cls, f"transformers' own caches (its KV layout is {shape})")
        error.hint = "use attn_di.integrations.transformers.PagedCache with this backend"
        raise error


def _contiguous(
    impl: AttentionImpl,
    backend_cls: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention over keys transformers keeps itself (``[B, H_kv, k, D]``, padded).

    Each row's real keys are moved to the front of one cache block of ``k`` slots (a scratch
    cache in attn_di's ``[2, B, k, H_kv, D]`` layout); the query tokens are the last ``q``
    columns, so the real ones are the last of each row's real keys.
    """
    batch, q_len, size = int(query.shape[0]), int(query.shape[2]), int(query.shape[3])
    kv_heads, k_len = int(key.shape[1]), int(key.shape[2])
    expected = (2, batch, k_len, kv_heads, size)
    _check_scratch_layout(backend_cls, expected)
    valid = None if valid is None else valid[:, -k_len:]
    if valid is None:
        keys, values = key, value
        kv_lens = torch.full((batch,), k_len, dtype=torch.int64)
        q_lens = torch.full((batch,), q_len, dtype=torch.int64)
        index = None
    else:
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        gather = order[:, None, :, None].expand(batch, kv_heads, k_len, size)
        keys, values = key.gather(2, gather), value.gather(2, gather)
        kv_lens = valid.sum(dim=1)
        valid_q = valid[:, k_len - q_len :]
        q_lens = valid_q.sum(dim=1)
        index = valid_q.nonzero(as_tuple=True)
    scratch = torch.empty(expected, dtype=key.dtype, device=key.device)
    scratch[0].copy_(keys.transpose(1, 2))
    scratch[1].copy_(values.transpose(1, 2))
    block_table = torch.arange(batch, dtype=torch.int32)[:, None]
    metadata: AttentionMetadata = backend_cls.get_builder_cls()(k_len).build(
        q_lens, kv_lens, block_table
    )
    new_keys = key[:, :, k_len - q_len :]
    new_values = value[:, :, k_len - q_len :]
    return _forward_rows(impl, query, new_keys, new_values, scratch, metadata, index)


def _beyond_first_chunk(positions: torch.Tensor, valid: torch.Tensor | None, chunk: int) -> bool:
    """Whether a real key lies past the first chunk (else chunked attention is causal)."""
    beyond = positions >= chunk
    if valid is not None:
        beyond &= valid[:, -positions.shape[1] :].cpu()
    return bool(beyond.any())


def _chunked(
    impl: AttentionImpl,
    backend_cls: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Chunked causal attention over keys transformers keeps itself: causal attention of each
    (row, chunk) of the query tokens over that chunk's real keys.

    Args:
        positions: ``[B, k]`` int64 position of each key column from its row's first real
            token (transformers' chunk boundaries are multiples of ``chunk`` in it).
        chunk: C, ``attention_chunk_size``.

    Each (row, chunk) becomes one sequence of a scratch cache of one block per sequence
    (``[2, G, width, H_kv, D]``); its query tokens are the last of its keys, as the query
    columns are the last key columns.
    """
    batch, q_len, size = int(query.shape[0]), int(query.shape[2]), int(query.shape[3])
    kv_heads, k_len = int(key.shape[1]), int(key.shape[2])
    real = (
        torch.ones((batch, k_len), dtype=torch.bool) if valid is None else valid[:, -k_len:].cpu()
    )
    chunk_of = positions.div(chunk, rounding_mode="floor")
    groups: list[tuple[int, torch.Tensor]] = []
    query_lens: list[int] = []
    for row in range(batch):
        real_q = real[row, k_len - q_len :]
        query_chunks = chunk_of[row, k_len - q_len :]
        for index in torch.unique(query_chunks[real_q]).tolist():
            columns = (real[row] & (chunk_of[row] == index)).nonzero().flatten()
            groups.append((row, columns.to(key.device)))
            query_lens.append(int((real_q & (query_chunks == index)).sum()))
    kv_lens = [len(columns) for _, columns in groups]
    width = max(kv_lens)
    expected = (2, len(groups), width, kv_heads, size)
    _check_scratch_layout(backend_cls, expected)
    scratch = torch.empty(expected, dtype=key.dtype, device=key.device)
    for group, (row, columns) in enumerate(groups):
        scratch[0, group, : len(columns)].copy_(key[row][:, columns].transpose(0, 1))
        scratch[1, group, : len(columns)].copy_(value[row][:, columns].transpose(0, 1))
    block_table = torch.arange(len(groups), dtype=torch.int32)[:, None]
    metadata: AttentionMetadata = backend_cls.get_builder_cls()(width).build(
        query_lens, kv_lens, block_table
    )
    index = None
    if valid is not None:
        index = real[:, k_len - q_len :].to(query.device).nonzero(as_tuple=True)
    new_keys = key[:, :, k_len - q_len :]
    new_values = value[:, :, k_len - q_len :]
    return _forward_rows(impl, query, new_keys, new_values, scratch, metadata, index)


def _encoder_only(
    impl: AttentionImpl,
    backend_cls: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """Bidirectional self-attention of each row's real tokens (attn_di's ``encoder_only``)."""
    batch, q_len = int(query.shape[0]), int(query.shape[2])
    if int(key.shape[2]) != q_len:
        raise _unsupported(backend_cls, "cross-attention (keys from another sequence)")
    if valid is None:
        lens = torch.full((batch,), q_len, dtype=torch.int64)
        index = None
    else:
        valid = valid[:, -q_len:]
        lens = valid.sum(dim=1)
        index = valid.nonzero(as_tuple=True)
    metadata = backend_cls.get_builder_cls()(1).build(lens, lens, None, causal=False)
    return _forward_rows(impl, query, key, value, query.new_empty(0), metadata, index)
