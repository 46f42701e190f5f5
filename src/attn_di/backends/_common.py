"""Shared machinery of attn_di's torch backends: input checks, cache writes, batch layout.

Every backend here follows the same plan for a batch of B sequences: check the inputs,
write the new keys/values into the paged cache at ``slot_mapping``, then attend over
groups of sequences padded to a common query length Lq and key length Lk. This module
builds the padded index tensors and masks; the backends differ only in the attention math.

The cache is taken to be dirty: a server allocates it uninitialised and reuses blocks, so a
slot a sequence does not cover may hold NaN or Inf. A mask is not enough against that
(``0 * NaN`` is NaN in ``weights @ V``), so the padded key indices never name such a slot
(see :class:`SeqGroup`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attn_di.backend._backend import dtype_name
from attn_di.backend._types import AttentionType
from attn_di.backends._memory import check_apart, may_share_memory, non_overlapping
from attn_di.exceptions import InvalidInputError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attn_di.backend._impl import AttentionImpl
    from attn_di.backend._metadata import AttentionMetadata

__all__ = [
    "SCORE_BUDGET",
    "BatchPlan",
    "CacheRows",
    "SeqGroup",
    "alibi_bias",
    "cache_rows",
    "check_inputs",
    "materialized",
    "may_share_memory",
    "metadata_checked",
    "new_output",
    "non_overlapping",
    "uses_cache",
    "write_kv_cache",
]

# Largest number of attention scores (group rows x keys x heads) materialised at once.
SCORE_BUDGET = 1 << 24


def uses_cache(impl: AttentionImpl) -> bool:
    """Whether the impl's attention type reads and writes the paged KV cache."""
    return impl.attn_type == AttentionType.DECODER


def check_inputs(
    impl: AttentionImpl,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    output: torch.Tensor | None,
) -> None:
    """Check types, shapes, dtypes, devices and indices of one ``forward`` call.

    Everything is checked before ``forward`` writes the cache, so a refused call leaves
    ``kv_cache`` untouched. The layers of a model step call this with inputs of one shape
    and one metadata object: a call whose tensors have the properties of one already checked
    for this impl (shapes, dtypes, devices, the cache's strides, autograd state; see
    :func:`_signature`) and whose metadata is unchanged since its check (:func:`_metadata_stamp`)
    costs a few attribute reads, not the checks again.

    Raises:
        InvalidInputError: naming the first offending input and its type, shape, dtype or
            device (every tensor, the metadata's included, must be on the query's device),
            or a ``kv_cache`` autograd would refuse to write in place (a leaf that requires
            grad, or a view of one, in grad mode).
    """
    signature = _signature(query, key, value, kv_cache, output)
    if signature is not None and signature in _checked_signatures(impl):
        num_tokens = signature[0]
        try:
            stamp = _metadata_stamp(impl, kv_cache, metadata, num_tokens, query.device)
        except AttributeError:  # not AttentionMetadata-shaped: the full checks say why
            stamp = None
        if stamp is not None and _same_stamp(_remembered(metadata), stamp):
            # addresses are not in the signature: checked on every call
            check_apart(
                impl, query, key, value, kv_cache, metadata, output, writes_cache=uses_cache(impl)
            )
            return
    _check_all(impl, query, key, value, kv_cache, metadata, output)
    if signature is not None:
        checked = _checked_signatures(impl)
        if len(checked) >= _SIGNATURES_KEPT:
            checked.clear()
        checked.add(signature)


# Signatures of inputs an impl's checks passed (per impl, a few: one per shape of step).
_SIGNATURES_KEPT = 16
_Signature = tuple[int, tuple[object, ...]]
_SIGNATURES: weakref.WeakKeyDictionary[object, set[_Signature]] = weakref.WeakKeyDictionary()


def _checked_signatures(impl: AttentionImpl) -> set[_Signature]:
    """The signatures of inputs ``impl``'s checks passed."""
    checked = _SIGNATURES.get(impl)
    if checked is None:
        checked = _SIGNATURES[impl] = set()
    return checked


def _signature(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor | None,
) -> tuple[int, tuple[object, ...]] | None:
    """``(num_tokens, what the tensor checks' verdict depends on)``: each tensor's shape,
    dtype and device, the cache's strides, whether autograd would record (grad mode), and
    the output buffer's shape, strides, dtype and device (or None); None where the inputs
    are not all plain tensors, or the cache requires grad (its autograd check looks at the
    graph: checked on every call)."""
    tensors = (query, key, value, kv_cache)
    if any(type(t) is not torch.Tensor for t in tensors):
        return None
    if (output is not None and type(output) is not torch.Tensor) or kv_cache.requires_grad:
        return None
    shapes = tuple(tuple(t.shape) for t in tensors)
    kinds = tuple((t.dtype, t.device) for t in tensors)
    out = (
        None
        if output is None
        else (tuple(output.shape), output.stride(), output.dtype, output.device)
    )
    facts = (shapes, kinds, kv_cache.stride(), out, torch.is_grad_enabled())
    return (int(query.shape[0]) if query.dim() else 0), facts


def _check_all(
    impl: AttentionImpl,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    output: torch.Tensor | None,
) -> None:
    """Every check of :func:`check_inputs`, in order."""
    heads, kv_heads, size = impl.num_heads, impl.num_kv_heads, impl.head_size
    tensors = (("query", query), ("key", key), ("value", value), ("kv_cache", kv_cache))
    for argument, tensor in (*tensors, ("output", output)):
        if not isinstance(tensor, torch.Tensor) and (argument != "output" or tensor is not None):
            raise InvalidInputError(
                argument,
                f"must be a torch.Tensor, got {type(tensor).__name__}",
                hint=f"pass a tensor, e.g. torch.as_tensor({argument})"
                + (" or None" if argument == "output" else ""),
            )
    _check_metadata_types(metadata)
    if query.dim() != 3 or tuple(query.shape[1:]) != (heads, size):
        raise InvalidInputError(
            "query",
            f"shape {tuple(query.shape)} should be [num_tokens, {heads}, {size}] "
            "(num_heads, head_size)",
            hint="query must be [num_tokens, num_heads, head_size]",
        )
    supported = impl.backend.supported_dtypes
    if query.dtype not in supported and dtype_name(query.dtype) not in {
        dtype_name(d) for d in supported
    }:
        raise InvalidInputError(
            "query",
            f"dtype {query.dtype} is not supported by {impl.backend.get_name()}",
            hint="use one of " + ", ".join(dtype_name(d) for d in impl.backend.supported_dtypes),
        )
    num_tokens = int(query.shape[0])
    for argument, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != (num_tokens, kv_heads, size):
            raise InvalidInputError(
                argument,
                f"shape {tuple(tensor.shape)} should be [{num_tokens}, {kv_heads}, {size}] "
                "(num_tokens, num_kv_heads, head_size)",
                hint=f"{argument} must be [num_tokens, num_kv_heads, head_size], with as many "
                "tokens as query",
            )
    for argument, tensor in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        if tensor.dtype != query.dtype and (argument != "kv_cache" or uses_cache(impl)):
            raise InvalidInputError(
                argument,
                f"dtype {tensor.dtype} differs from query's dtype {query.dtype}",
                hint=f"give query, key, value and kv_cache one dtype, e.g. "
                f"{argument}.to({query.dtype})",
            )
        if tensor.device != query.device and (argument != "kv_cache" or uses_cache(impl)):
            raise InvalidInputError(
                argument,
                f"is on {tensor.device} but query is on {query.device}",
                hint=f"put every tensor on one device, e.g. {argument}.to(query.device)",
            )
    if output is not None and (
        tuple(output.shape) != (num_tokens, heads * size) or output.dtype != query.dtype
    ):
        raise InvalidInputError(
            "output",
            f"shape {tuple(output.shape)} dtype {output.dtype} should be "
            f"[{num_tokens}, {heads * size}] {query.dtype}",
            hint="output must be [num_tokens, num_heads * head_size] in query's dtype, or None",
        )
    if output is not None and output.device != query.device:
        raise InvalidInputError(
            "output",
            f"is on {output.device} but query is on {query.device}",
            hint="allocate output on the query's device, e.g. torch.empty_like(...) of query's",
        )
    if output is not None and not non_overlapping(output):
        raise InvalidInputError(
            "output",
            f"strides {output.stride()} of shape {tuple(output.shape)}: its elements may share "
            "memory (an expanded or overlapping view)",
            hint="pass a tensor of its own, e.g. torch.empty(num_tokens, num_heads * head_size)",
        )
    if uses_cache(impl):
        _check_cache_autograd(kv_cache)
    _check_metadata_devices(metadata, query.device)
    check_apart(impl, query, key, value, kv_cache, metadata, output, writes_cache=uses_cache(impl))
    stamp = _metadata_stamp(impl, kv_cache, metadata, num_tokens, query.device)
    if stamp is None or not _same_stamp(_remembered(metadata), stamp):
        _check_metadata(impl, kv_cache, metadata, num_tokens)
        if stamp is not None:
            _remember(metadata, stamp)


_Stamp = tuple[tuple[torch.Tensor, ...], tuple[object, ...]]
# id(metadata) -> (weak reference to it, the stamp of its last passed check). Kept beside the
# metadata rather than on it, so vars(metadata), pickles and copies never carry it.
_STAMPS: dict[int, tuple[weakref.ref[object], _Stamp]] = {}


def _metadata_stamp(
    impl: AttentionImpl,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    num_tokens: int,
    device: torch.device,
) -> _Stamp | None:
    """What :func:`_check_metadata`'s verdict depends on, or None where that cannot be known.

    A model's layers share one metadata object per step (vLLM builds it once per batch), so
    the index checks (a dozen small tensor ops, which cost more than a decode step's attention
    at short lengths) run once per step, not once per layer. The stamp holds the metadata's
    tensors themselves (compared by identity) and their version counters, so an in-place
    write torch sees, or a replaced tensor, checks again. Inference tensors have no version
    counter: metadata holding one is checked on every call (``AttentionMetadataBuilder``
    makes ordinary tensors even under ``torch.inference_mode()``). Writes torch does not see
    (through ``.numpy()``, ``.data`` or the storage) are not noticed, as autograd does not
    notice them either. The query's device is part of it (the metadata's tensors, whose
    types, ranks and devices were checked with it, must be on that device).
    """
    tensors = (
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table, metadata.slot_mapping
    )  # fmt: skip
    if any(t.is_inference() for t in tensors):
        return None
    return tensors, (
        tuple(t._version for t in tensors),
        metadata.num_actual_tokens,
        metadata.max_query_len,
        metadata.max_seq_len,
        metadata.causal,
        # their types too: 4.0 == 4 and 1 == True, but only ints and a bool pass the checks
        tuple(
            map(
                type,
                (
                    metadata.num_actual_tokens,
                    metadata.max_query_len,
                    metadata.max_seq_len,
                    metadata.causal,
                ),
            )
        ),
        _call_facts(impl, kv_cache, num_tokens, device),
    )


def _call_facts(
    impl: AttentionImpl, kv_cache: torch.Tensor, num_tokens: int, device: torch.device
) -> tuple[object, ...]:
    """The call's part of a metadata stamp: what the index checks' verdict also depends on."""
    return (
        num_tokens,
        uses_cache(impl),
        impl.num_kv_heads,
        impl.head_size,
        tuple(kv_cache.shape),
        kv_cache.stride(),
        device,
    )


def metadata_checked(
    impl: AttentionImpl, kv_cache: torch.Tensor, metadata: AttentionMetadata, query: torch.Tensor
) -> bool:
    """Whether :func:`check_inputs`' full checks passed ``metadata`` (unchanged since: its
    tensors the same objects at the same versions, its fields the same) for a call of
    ``impl`` with this cache's shape and strides and ``query``'s token count and device: a
    model step's later layers, whose metadata the first layer's call checked. False where
    that cannot be known (see :func:`_metadata_stamp`).

    ``_same_stamp(_remembered(metadata), _metadata_stamp(...))``, compared field by field as
    it is read, without building the stamp: the later layers of a model step ask this once
    per call, where each Python call costs (docs/benchmarks.md)."""
    stored = _remembered(metadata)
    if stored is None:
        return False
    tensors, facts = stored
    qsl, seq_lens, table, slots = tensors
    try:
        if (
            metadata.query_start_loc is not qsl
            or metadata.seq_lens is not seq_lens
            or metadata.block_table is not table
            or metadata.slot_mapping is not slots
        ):
            return False
        versions, actual, max_query, max_seq, causal, types, call = facts
        if (qsl._version, seq_lens._version, table._version, slots._version) != versions:
            return False
        fields = (metadata.num_actual_tokens, metadata.max_query_len, metadata.max_seq_len)
        # types first: a value of another type (an array, a tensor) is never compared
        if (*map(type, fields), type(metadata.causal)) != types:
            return False
        if fields != (actual, max_query, max_seq) or metadata.causal is not causal:
            return False
        return call == _call_facts(impl, kv_cache, int(query.shape[0]), query.device)
    except (AttributeError, IndexError):  # no longer AttentionMetadata-shaped, or a 0-d query
        return False


def _remembered(metadata: object) -> _Stamp | None:
    """The stamp of ``metadata``'s last passed check, if it is still alive and recorded."""
    entry = _STAMPS.get(id(metadata))
    if entry is None or entry[0]() is not metadata:
        return None
    return entry[1]


def _remember(metadata: object, stamp: _Stamp) -> None:
    """Record ``stamp`` for ``metadata`` until it is garbage (not for objects without weak
    references, which are then checked on every call)."""
    key = id(metadata)
    try:
        ref = weakref.ref(metadata, lambda _, key=key: _STAMPS.pop(key, None))  # type: ignore[misc]
    except TypeError:
        return
    _STAMPS[key] = (ref, stamp)


def _same_stamp(stored: _Stamp | None, stamp: _Stamp) -> bool:
    """Whether ``stored`` is ``stamp``: the same tensor objects (by identity) and facts."""
    if stored is None:
        return False
    tensors, facts = stored
    return all(a is b for a, b in zip(tensors, stamp[0], strict=True)) and facts == stamp[1]


def _check_cache_autograd(kv_cache: torch.Tensor) -> None:
    """Refuse a cache that autograd forbids writing in place: a leaf (or a view of one) that
    requires grad, while grad mode is on. A cache that is already part of a graph (written
    by an earlier forward whose keys required grad) is not a leaf and is accepted."""
    if not (kv_cache.requires_grad and torch.is_grad_enabled()):
        return
    base = kv_cache._base  # the tensor a view was taken from, or None
    if kv_cache.is_leaf or (base is not None and base.is_leaf):
        raise InvalidInputError(
            "kv_cache",
            "requires grad and is a leaf tensor (or a view of one), but forward writes the "
            "new keys/values into it in place",
            hint="allocate the cache without requires_grad (gradients still reach key and "
            "value through the cache writes), or pass kv_cache.detach()",
        )


def _check_metadata_devices(metadata: AttentionMetadata, device: torch.device) -> None:
    """Refuse metadata tensors on another device than the query (indices must sit with the data)."""
    for name, _, _ in _METADATA_TENSORS:
        tensor: torch.Tensor = getattr(metadata, name)
        if tensor.device != device:
            raise InvalidInputError(
                name,
                f"is on {tensor.device} but query is on {device}",
                hint=f"build the metadata on the query's device: "
                f"AttentionMetadataBuilder(block_size, device={str(device)!r})",
            )


_BUILD_HINT = "build the metadata with AttentionMetadataBuilder(block_size).build(...)"
# The metadata's tensors and their ranks, as documented on AttentionMetadata.
_METADATA_TENSORS = (
    ("query_start_loc", 1, "[B + 1]"),
    ("seq_lens", 1, "[B]"),
    ("block_table", 2, "[B, max_blocks]"),
    ("slot_mapping", 1, "[num_tokens]"),
)
# The metadata's ints besides its tensors, and what each one is.
_METADATA_INTS = (
    ("num_actual_tokens", "the number of real (unpadded) query tokens"),
    ("max_query_len", "the longest query length in the batch"),
    ("max_seq_len", "the longest sequence length in the batch"),
)
_INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _check_metadata_types(metadata: object) -> None:
    """Refuse metadata that is not :class:`AttentionMetadata`-shaped: wrong object, types, ranks."""
    fields = (
        *(name for name, _ in _METADATA_INTS),
        *(name for name, _, _ in _METADATA_TENSORS),
        "causal",
    )
    missing = [name for name in fields if not hasattr(metadata, name)]
    if missing:
        raise InvalidInputError(
            "attn_metadata",
            f"{type(metadata).__name__} is not AttentionMetadata (lacks {', '.join(missing)})",
            hint=_BUILD_HINT,
        )
    for name, meaning in _METADATA_INTS:
        number = getattr(metadata, name)
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise InvalidInputError(
                name,
                f"must be a non-negative int, got {number!r} ({type(number).__name__})",
                hint=f"attn_metadata.{name} is {meaning}; {_BUILD_HINT}",
            )
    causal = getattr(metadata, "causal")  # noqa: B009
    if not isinstance(causal, bool):
        raise InvalidInputError(
            "causal",
            f"must be True or False, got {causal!r} ({type(causal).__name__})",
            hint="attn_metadata.causal is False for bidirectional (encoder) attention",
        )
    for name, rank, layout in _METADATA_TENSORS:
        tensor = getattr(metadata, name)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(
                name,
                f"must be a torch.Tensor, got {type(tensor).__name__}",
                hint=f"{name} is a {layout} integer tensor; {_BUILD_HINT}",
            )
        if tensor.dtype not in _INTEGER_DTYPES:
            raise InvalidInputError(
                name,
                f"dtype {tensor.dtype} is not an integer dtype",
                hint=f"{name} is a {layout} integer tensor (torch.int32 or torch.int64)",
            )
        if tensor._is_zerotensor():  # no memory: its values cannot even be shown in an error
            raise InvalidInputError(
                name,
                "is a zero tensor (torch._efficientzerotensor), which holds no values",
                hint=f"{name} is a {layout} integer tensor; pass a real one, e.g. torch.zeros(...)",
            )
        if tensor.dim() != rank:
            raise InvalidInputError(
                name,
                f"shape {tuple(tensor.shape)} should be {layout} ({rank}-D)",
                hint=f"{name} is a {layout} integer tensor; {_BUILD_HINT}",
            )


def _check_metadata(
    impl: AttentionImpl, kv_cache: torch.Tensor, metadata: AttentionMetadata, num_tokens: int
) -> None:
    qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
    num_seqs = int(seq_lens.shape[0])
    if int(qsl.shape[0]) != num_seqs + 1:
        raise InvalidInputError(
            "query_start_loc",
            f"shape {tuple(qsl.shape)} should be [{num_seqs + 1}] (B + 1)",
            hint="query_start_loc is [B + 1], one more entry than seq_lens",
        )
    q_lens = qsl[1:].long() - qsl[:-1].long()
    if int(qsl[0]) != 0 or bool((q_lens < 0).any()):
        raise InvalidInputError(
            "query_start_loc",
            f"{qsl.tolist()} must rise from 0",
            hint="query_start_loc holds cumulative query lengths, e.g. [0, 3, 4]",
        )
    actual = int(qsl[-1])
    if actual != metadata.num_actual_tokens or actual > num_tokens:
        raise InvalidInputError(
            "query_start_loc",
            f"ends at {actual}, but num_actual_tokens={metadata.num_actual_tokens} and "
            f"query has {num_tokens} tokens",
            hint="query_start_loc[-1] must equal num_actual_tokens, at most query.shape[0]",
        )
    _check_longest(metadata, "max_query_len", q_lens)
    if uses_cache(impl) and bool((seq_lens.long() < q_lens).any()):
        raise InvalidInputError(
            "seq_lens",
            f"{seq_lens.tolist()} shorter than query lengths {q_lens.tolist()}",
            hint="seq_lens count the cached prefix plus the query tokens of each sequence",
        )
    _check_longest(metadata, "max_seq_len", seq_lens)
    if not uses_cache(impl):
        return
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != (impl.num_kv_heads, impl.head_size)
    ):
        raise InvalidInputError(
            "kv_cache",
            f"shape {tuple(kv_cache.shape)} should be [2, num_blocks, block_size, "
            f"{impl.num_kv_heads}, {impl.head_size}]",
            hint="allocate it with backend.get_kv_cache_shape(num_blocks, block_size, "
            "num_kv_heads, head_size)",
        )
    num_blocks, block_size = int(kv_cache.shape[1]), int(kv_cache.shape[2])
    if block_size <= 0:
        raise InvalidInputError(
            "kv_cache",
            f"shape {tuple(kv_cache.shape)} has block size {block_size} (axis 2); it must be > 0",
            hint="allocate it with backend.get_kv_cache_shape(num_blocks, block_size, "
            "num_kv_heads, head_size) and a block_size >= 1",
        )
    strides = kv_cache.stride()
    if strides[4] != 1 or not non_overlapping(kv_cache):
        raise InvalidInputError(
            "kv_cache",
            f"strides {strides} of shape {tuple(kv_cache.shape)}: each head's row of "
            "head_size values must be contiguous (last stride 1) and no two slots may share "
            "memory (no stride 0, no overlapping slots)",
            hint="any layout of the cache's axes is fine (a permuted or sliced buffer, e.g. "
            "vLLM's blocks-outermost view), but not an expanded one or a transposed last axis",
        )
    slot_mapping = metadata.slot_mapping
    if int(slot_mapping.shape[0]) < actual:
        raise InvalidInputError(
            "slot_mapping",
            f"shape {tuple(slot_mapping.shape)} has fewer than {actual} entries",
            hint="slot_mapping is [num_tokens], one cache slot per query token (-1: padding)",
        )
    slots = slot_mapping[:actual]
    if actual and int(slots.max()) >= num_blocks * block_size:
        raise InvalidInputError(
            "slot_mapping",
            f"slot {int(slots.max())} is outside the cache of shape {tuple(kv_cache.shape)} "
            f"({num_blocks * block_size} slots)",
            hint="a slot is block_number * block_size + offset, below num_blocks * block_size",
        )
    table = metadata.block_table
    needed = (seq_lens.long() + block_size - 1) // block_size
    if int(table.shape[0]) != num_seqs:
        raise InvalidInputError(
            "block_table",
            f"shape {tuple(table.shape)} should be [{num_seqs}, max_blocks]",
            hint="block_table has one row per sequence (as many as seq_lens)",
        )
    if num_seqs and int(needed.max()) > int(table.shape[1]):
        raise InvalidInputError(
            "block_table",
            f"shape {tuple(table.shape)} is too short for seq_lens {seq_lens.tolist()} "
            f"with block_size {block_size} (needs {int(needed.max())} columns)",
            hint="each row needs ceil(seq_len / block_size) block numbers",
        )
    if num_seqs and table.shape[1]:
        used = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
        used_blocks = table[used]
        if used_blocks.numel() and (
            int(used_blocks.min()) < 0 or int(used_blocks.max()) >= num_blocks
        ):
            raise InvalidInputError(
                "block_table",
                f"holds block numbers outside [0, {num_blocks}) of kv_cache shape "
                f"{tuple(kv_cache.shape)}",
                hint=f"block numbers index the cache's axis 1: 0 <= block < {num_blocks}",
            )


def _check_longest(metadata: AttentionMetadata, name: str, lengths: torch.Tensor) -> None:
    """Refuse ``max_query_len`` / ``max_seq_len`` below the longest of ``lengths`` (the checked
    indices). Backends choose their path by it (CPU_ATTN's kernel is causal; a single-token
    batch takes it even when not causal), so a stale, smaller value would compute a silently
    wrong answer; a larger one is a bound, as flash-attention's ``max_seqlen`` is, and only
    keeps a batch off a path meant for shorter queries."""
    longest = int(lengths.max()) if lengths.numel() else 0
    value = getattr(metadata, name)
    if value < longest:
        kind = "query" if name == "max_query_len" else "sequence"
        raise InvalidInputError(
            name,
            f"{value} is less than the longest {kind} length {longest} "
            f"(lengths {lengths.tolist()})",
            hint=f"set {name} from the lengths (AttentionMetadataBuilder does), or build new "
            "metadata rather than editing one",
        )


def materialized(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or where it is a zero tensor (``torch._efficientzerotensor``: no
    memory) its zeros as a real tensor. torch 2.13's CPU flash attention op reads a zero-tensor
    query as uninitialised memory (a wrong result, silently), and attn_di's compiled ops refuse
    one: the checked path hands every op real tensors."""
    if tensor._is_zerotensor():
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor


def new_output(query: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
    """The ``[N, H * D]`` result buffer: ``output`` or a new zeroed tensor."""
    if output is not None:
        return output
    return query.new_zeros((query.shape[0], query.shape[1] * query.shape[2]))


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's key/value into its cache slot; negative slots are skipped.

    Args:
        key: ``[N, H_kv, D]``.
        value: ``[N, H_kv, D]``.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, any strides with a contiguous last
            axis (see :func:`cache_rows`), written in place.
        slot_mapping: ``[>= N]`` int64, ``block_number * block_size + offset`` (vLLM layout).
    """
    num_tokens = int(key.shape[0])
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if _slot_major(kv_cache):
        flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)
        return
    block_size = int(kv_cache.shape[2])
    where = (slots // block_size, slots % block_size)
    kv_cache[0].index_put_(where, key)
    kv_cache[1].index_put_(where, value)


def _slot_major(kv_cache: torch.Tensor) -> bool:
    """Whether each plane of the cache is one contiguous ``[slots, H_kv, D]`` array
    (attn_di's own layout): then slots index a flat view directly."""
    return kv_cache[0].is_contiguous() and kv_cache[1].is_contiguous()


@dataclass(frozen=True)
class CacheRows:
    """A paged cache's key and value planes as row tables the torch paths gather from.

    A cache of any strides (attn_di's own contiguous layout, vLLM's blocks-outermost buffer
    ``[num_blocks, 2, block_size, H_kv, D]``, a head-major block interior ...) is read in
    place: with ``u`` the greatest common divisor of the block and token strides, every token
    row of a plane starts at a multiple of ``u`` elements, so the plane is a strided view
    ``[R, H_kv, D]`` of rows ``u`` elements apart, and slot ``s`` of the paged layout is row
    ``(s // block_size) * block_step + (s % block_size) * token_step``. Rows may overlap in
    memory (they are only read); for attn_di's own layout the map is the identity.

    Attributes:
        keys: ``[R, H_kv, D]`` view of the key plane.
        values: ``[R, H_kv, D]`` view of the value plane.
        block_size: tokens per block.
        block_step: rows from one block to the next (``block_stride / u``).
        token_step: rows from one slot of a block to the next (``token_stride / u``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    block_size: int
    block_step: int
    token_step: int

    @property
    def identity(self) -> bool:
        """Whether slot ``s`` is row ``s`` (attn_di's own contiguous layout)."""
        return self.token_step == 1 and self.block_step == self.block_size

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of cache slots (``block * block_size + offset``), same shape, int64."""
        if self.identity:
            return slots
        return (slots // self.block_size) * self.block_step + (
            slots % self.block_size
        ) * self.token_step

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., block_size]`` rows of every slot of ``blocks`` (block numbers), in order."""
        offsets = torch.arange(self.block_size, device=blocks.device) * self.token_step
        return blocks[..., None] * self.block_step + offsets


def cache_rows(kv_cache: torch.Tensor) -> CacheRows:
    """The :class:`CacheRows` of a checked ``[2, num_blocks, block_size, H_kv, D]`` cache.

    The view covers exactly the memory of each plane (no element past it), so it is valid for
    any tensor torch accepts.
    """
    _, num_blocks, block_size, kv_heads, size = (int(n) for n in kv_cache.shape)
    if _slot_major(kv_cache):
        flat = kv_cache.view(2, -1, kv_heads, size)
        return CacheRows(flat[0], flat[1], block_size, block_size, 1)
    _, block_stride, token_stride, head_stride, _ = kv_cache.stride()
    unit = math.gcd(block_stride if num_blocks > 1 else 0, token_stride if block_size > 1 else 0)
    unit = unit or 1
    block_step = block_stride // unit if num_blocks > 1 else 0
    token_step = token_stride // unit if block_size > 1 else 0
    count = (num_blocks - 1) * block_step + (block_size - 1) * token_step + 1 if num_blocks else 0
    planes = []
    for plane in (kv_cache[0], kv_cache[1]):
        planes.append(
            plane.as_strided(
                (count, kv_heads, size), (unit, head_stride, 1), plane.storage_offset()
            )
        )
    return CacheRows(planes[0], planes[1], block_size, block_step, token_step)


@dataclass
class SeqGroup:
    """b sequences (or a query slice of them) padded to Lq queries and Lk keys.

    Attributes:
        query_index: ``[b, Lq]`` int64 token rows of ``query`` (0 where padding).
        query_valid: ``[b, Lq]`` bool, real query tokens.
        query_pos: ``[b, Lq]`` int64 absolute positions of the queries.
        kv_index: ``[b, Lk]`` int64 rows of the key/value source (the cache's rows, see
            :class:`CacheRows`, or the batch's tokens).
            Past a sequence's length (masked out by ``allowed``) it repeats the sequence's
            first row, so it only names rows that were written, never a slot the sequence
            does not cover, which may hold anything (stale values, NaN, Inf).
        allowed: ``[b, Lq, Lk]`` bool, which key each query may see.
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor
    query_pos: torch.Tensor
    kv_index: torch.Tensor
    allowed: torch.Tensor

    def key_pos(self) -> torch.Tensor:
        """``[Lk]`` int64 absolute key positions."""
        return torch.arange(self.kv_index.shape[1], device=self.kv_index.device)


class BatchPlan:
    """Splits a batch into :class:`SeqGroup` s whose scores fit :data:`SCORE_BUDGET`.

    Args:
        impl: the impl (for heads, window and attention type).
        metadata: the batch.
        cache: the cache's rows (:func:`cache_rows`): ``kv_index`` then names their rows;
            None without a cache (``kv_index`` names the batch's own key/value tokens).
    """

    def __init__(
        self, impl: AttentionImpl, metadata: AttentionMetadata, cache: CacheRows | None
    ) -> None:
        self.impl = impl
        self.cache = cache
        self.cached = uses_cache(impl)
        qsl = metadata.query_start_loc.long()
        self.q_start = qsl[:-1]
        self.q_lens = qsl[1:] - qsl[:-1]
        self.seq_lens = metadata.seq_lens.long() if self.cached else self.q_lens
        self.causal = metadata.causal if self.cached else False
        self.block_table = metadata.block_table.long()
        self._q_lens = self.q_lens.tolist()
        self._seq_lens = self.seq_lens.tolist()

    def groups(self) -> Iterator[SeqGroup]:
        """Yield groups of consecutive sequences, and query slices of long ones."""
        start, num_seqs = 0, len(self._q_lens)
        heads = self.impl.num_heads
        while start < num_seqs:
            stop, max_q, max_k = start, 0, 0
            while stop < num_seqs:
                new_q = max(max_q, self._q_lens[stop])
                new_k = max(max_k, self._seq_lens[stop])
                if stop > start and (stop + 1 - start) * new_q * new_k * heads > SCORE_BUDGET:
                    break
                max_q, max_k, stop = new_q, new_k, stop + 1
            if max_q:
                q_chunk = max(1, SCORE_BUDGET // max(1, (stop - start) * max_k * heads))
                for q_from in range(0, max_q, q_chunk):
                    yield self._group(start, stop, q_from, min(max_q, q_from + q_chunk), max_k)
            start = stop

    def _group(self, start: int, stop: int, q_from: int, q_to: int, max_k: int) -> SeqGroup:
        device = self.q_lens.device
        q_lens, seq_lens = self.q_lens[start:stop], self.seq_lens[start:stop]
        j = torch.arange(q_from, q_to, device=device)[None, :]
        query_valid = j < q_lens[:, None]
        query_index = torch.where(query_valid, self.q_start[start:stop, None] + j, 0)
        query_pos = (seq_lens - q_lens)[:, None] + j
        k = torch.arange(max_k, device=device)
        kv_valid = k[None, :] < seq_lens[:, None]
        if self.cached and self.cache is not None:
            blocks = self.block_table[start:stop, : math.ceil(max_k / self.cache.block_size)]
            kv_index = self.cache.block_rows(blocks).reshape(stop - start, -1)[:, :max_k]
        else:
            kv_index = self.q_start[start:stop, None] + k[None, :]
        # A key past a sequence's length reads the sequence's own first key (position 0,
        # written) rather than a slot the sequence does not cover: such a slot may hold NaN or
        # Inf, and a masked key still enters weights @ V (0 * NaN = NaN). An empty sequence
        # (no key, no query) reads the first key of the group's longest one (max_k > 0 here).
        longest = int(seq_lens.argmax())
        own_first = torch.where(seq_lens[:, None] > 0, kv_index[:, :1], kv_index[longest, 0])
        kv_index = torch.where(kv_valid, kv_index, own_first)
        allowed = kv_valid[:, None, :] & query_valid[:, :, None]
        delta = query_pos[:, :, None] - k[None, None, :]
        if self.causal:
            allowed &= delta >= 0
        window = self.impl.sliding_window
        if window is not None:
            allowed &= (delta < window) if self.causal else (delta.abs() < window)
        return SeqGroup(query_index, query_valid, query_pos, kv_index, allowed)


def alibi_bias(slopes: list[float], group: SeqGroup) -> torch.Tensor:
    """``[b, H, Lq, Lk]`` float32 ALiBi bias ``m_h * (k - q)`` (Press et al. 2022)."""
    slope = torch.tensor(slopes, dtype=torch.float32, device=group.kv_index.device)
    delta = (group.key_pos()[None, None, :] - group.query_pos[:, :, None]).float()
    return slope[None, :, None, None] * delta[:, None, :, :]
