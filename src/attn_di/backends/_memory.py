"""Which tensors of one ``forward`` call may share memory, and the check that refuses it.

A call writes two tensors (the paged cache, at ``slot_mapping``; then ``output=``) while it
reads the others (query, key, value, the metadata's index tensors, the impl's sinks). If a
tensor it writes shares memory with one it reads, or with the other one it writes, the
result depends on the order in which the kernels touch rows: the compiled prefill kernel,
for instance, writes output tiles while other tiles are still reading their query rows, so an
``output=`` that is the query's buffer shifted by one row silently gets wrong rows. Such a
call is refused before anything is written (:func:`check_apart`); tensors that are only read
may share memory freely (vLLM's query, key and value are views of one ``qkv`` buffer).

"Share memory" is decided on the bytes the elements occupy (:func:`shares_memory`), exactly
for tensors that do not overlap themselves: interleaved views of one buffer that share no
element (``kv_cache[:, 0]`` and ``kv_cache[:, 1]`` of vLLM's blocks-outermost cache, the
query and output columns of one row buffer) pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attn_di.exceptions import InvalidInputError

if TYPE_CHECKING:
    from attn_di.backend._impl import AttentionImpl
    from attn_di.backend._metadata import AttentionMetadata

__all__ = [
    "address_range",
    "check_apart",
    "may_share_memory",
    "non_overlapping",
    "shares_memory",
]


def non_overlapping(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` can share memory: with its axes of size > 1
    sorted by stride, each stride is at least the span of the smaller ones (true of every
    permuted or sliced view of a dense buffer, and of an empty tensor; a stride of 0 or
    interleaved axes fail)."""
    if tensor.numel() == 0:
        return True
    pairs = zip(tensor.stride(), tensor.shape, strict=True)
    axes = sorted((stride, size) for stride, size in pairs if size > 1)
    span = 1  # elements covered by the axes so far
    for stride, size in axes:
        if stride < span:
            return False
        span += stride * (size - 1)
    return True


def address_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory ``tensor``'s elements lie in (empty for none).

    Strides are taken as non-negative (torch has no negative strides).
    """
    first = tensor.data_ptr()
    if tensor.is_contiguous():
        return first, first + tensor.nbytes
    if tensor.numel() == 0:
        return first, first
    span = 0
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        span += (size - 1) * stride
    return first, first + (span + 1) * tensor.element_size()


def may_share_memory(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether the memory ranges of two tensors' elements intersect (a conservative test:
    interleaved views of one buffer count as sharing)."""
    a0, a1 = address_range(first)
    b0, b1 = address_range(second)
    return a0 < b1 and b0 < a1


def shares_memory(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether a byte of one tensor's elements may be a byte of the other's.

    Exact for tensors that do not overlap themselves (every permuted or sliced view of a
    dense buffer): the byte at ``first_ptr + sum(i_k * a_k)`` is the one at ``second_ptr +
    sum(j_k * b_k)`` for some indices within the sizes exactly when the offset between the two
    is a sum of such terms, which a short search over the axes (largest stride first, each
    bounded by what the smaller ones can still add) decides. Where a tensor may overlap
    itself, or the search would be long (strides of both tensors interleaving closely), the
    answer is True whenever the byte ranges meet.
    """
    a0, a1 = address_range(first)
    b0, b1 = address_range(second)
    if not (a0 < b1 and b0 < a1):
        return False
    if not (non_overlapping(first) and non_overlapping(second)):
        return True
    # first's byte at a0 + sum(i * stride) against second's at b0 + sum(j * stride): is
    # b0 - a0 = sum(i * stride) - sum(j * stride) for indices within the sizes?
    terms: dict[int, tuple[int, int]] = {}
    for sign, tensor in ((1, first), (-1, second)):
        for stride, size in _byte_axes(tensor):
            low, high = terms.get(stride, (0, 0))
            span = (0, size - 1) if sign > 0 else (-(size - 1), 0)
            terms[stride] = (low + span[0], high + span[1])
    axes = sorted(((stride, low, high) for stride, (low, high) in terms.items()), reverse=True)
    budget = [_SEARCH_BUDGET]
    return _solvable(b0 - a0, axes, budget) or budget[0] <= 0


# Most nodes the search of shares_memory visits before it answers "may share".
_SEARCH_BUDGET = 4096


def _byte_axes(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``[(byte stride, size)]`` of ``tensor``'s axes of size > 1, the element's own bytes as
    an axis of stride 1, adjacent axes merged where one continues the other."""
    item = tensor.element_size()
    pairs = [
        (stride * item, size)
        for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
        if size > 1
    ]
    pairs.sort(reverse=True)
    pairs.append((1, item))
    merged: list[tuple[int, int]] = []
    for stride, size in pairs:
        if merged and merged[-1][0] == stride * size:  # the outer axis continues this one
            merged[-1] = (stride, size * merged[-1][1])
        else:
            merged.append((stride, size))
    return [(stride, size) for stride, size in merged if size > 1]


def _solvable(offset: int, axes: list[tuple[int, int, int]], budget: list[int]) -> bool:
    """Whether ``offset = sum(c_k * stride_k)`` with ``low_k <= c_k <= high_k`` (``axes``:
    ``(stride, low, high)``, largest stride first); ``budget[0]`` counts down the nodes
    visited (the search gives up, False, when it runs out)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if not axes:
        return offset == 0
    (stride, low, high), rest = axes[0], axes[1:]
    rest_low = sum(s * lo for s, lo, _ in rest)
    rest_high = sum(s * hi for s, _, hi in rest)
    # offset - c * stride must lie in [rest_low, rest_high]
    first = max(low, -((rest_high - offset) // stride))  # ceil((offset - rest_high) / stride)
    last = min(high, (offset - rest_low) // stride)
    return any(_solvable(offset - c * stride, rest, budget) for c in range(first, last + 1))


def check_apart(
    impl: AttentionImpl,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    output: torch.Tensor | None,
    *,
    writes_cache: bool,
) -> None:
    """Refuse a call in which a tensor it writes shares memory with another of its tensors.

    Written: ``kv_cache`` (when ``writes_cache``) and ``output``; read: ``query``, ``key``,
    ``value``, the metadata's ``query_start_loc``, ``seq_lens``, ``block_table`` and
    ``slot_mapping``, and the impl's ``sinks``. Reads may share memory with one another. The
    inputs' types and devices are checked already. Cheap where nothing is shared (a few
    hundred nanoseconds a tensor): tensors whose storages lie apart are not looked at further.

    Raises:
        InvalidInputError: naming the tensor and the one it shares memory with, or a written
            tensor that is a zero tensor (it has no memory).
    """
    if (output is None and not writes_cache) or query.device.type == "meta":
        return  # nothing written, or no memory (meta tensors)
    written: list[tuple[str, torch.Tensor, tuple[int, int]]] = []
    for name, buffer in (("kv_cache", kv_cache if writes_cache else None), ("output", output)):
        if buffer is None:
            continue
        if buffer._is_zerotensor():
            raise InvalidInputError(
                name,
                "is a zero tensor (torch._efficientzerotensor): it has no memory to write",
                hint=f"pass a buffer of its own, e.g. torch.zeros({tuple(buffer.shape)})",
            )
        written.append((name, buffer, _storage_range(buffer)))
    if len(written) == 2:
        _refuse_if_shared(written[1], written[0])
    sinks = getattr(impl, "sinks", None)
    reads = (
        ("query", query),
        ("key", key),
        ("value", value),
        ("query_start_loc", metadata.query_start_loc),
        ("seq_lens", metadata.seq_lens),
        ("block_table", metadata.block_table),
        ("slot_mapping", metadata.slot_mapping),
        ("sinks", sinks if isinstance(sinks, torch.Tensor) else None),
    )
    for name, tensor in reads:
        if tensor is None or tensor._is_zerotensor():
            continue  # no memory (a zero tensor has none): nothing to share
        storage = tensor.untyped_storage()
        a0 = storage.data_ptr()
        a1 = a0 + storage.nbytes()
        for target in written:
            b0, b1 = target[2]
            if a0 < b1 and b0 < a1:  # one storage (or overlapping ones): look closer
                _refuse_if_shared((name, tensor, (a0, a1)), target)


def _storage_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of ``tensor``'s storage: every element lies in it."""
    storage = tensor.untyped_storage()
    first = storage.data_ptr()
    return first, first + storage.nbytes()


def _refuse_if_shared(
    other: tuple[str, torch.Tensor, tuple[int, int]],
    target: tuple[str, torch.Tensor, tuple[int, int]],
) -> None:
    """Raise if ``other`` shares memory with ``target``, a tensor the call writes (the cache,
    or ``output``)."""
    name, tensor, (a0, a1) = other
    target_name, target_tensor, (b0, b1) = target
    if not (a0 < b1 and b0 < a1) or not shares_memory(tensor, target_tensor):
        return  # storages apart, or elements apart within one storage
    (a0, a1), (b0, b1) = address_range(tensor), address_range(target_tensor)
    own_buffer = "pass a buffer of its own, e.g. torch.empty(num_tokens, num_heads * head_size)"
    if name == "output":  # and the cache: both are written
        raise InvalidInputError(
            "output", "lies in the memory of kv_cache, which the call writes too", hint=own_buffer
        )
    if target_name == "kv_cache":
        raise InvalidInputError(
            name,
            f"lies in the memory of kv_cache, which the call writes (at slot_mapping) before "
            f"it is done reading {name}",
            hint=f"pass {name} in memory of its own, e.g. {name}.clone()",
        )
    raise InvalidInputError(
        "output",
        f"shares memory with {name} (bytes [{b0:#x}, {b1:#x}) and [{a0:#x}, {a1:#x})), which "
        f"the call reads while it writes output: rows written early would be read as {name}",
        hint=own_buffer,
    )
