"""A call's tensors may not share memory with a tensor it writes (the cache, ``output=``).

Each case is refused with an InvalidInputError naming both tensors before the cache is written,
on every backend path (CPU_ATTN's compiled kernel and its pure-torch path, TORCH_SDPA,
FLEX_ATTENTION), also on a call whose shapes were checked before (the fast path). Tensors
that are only read may share memory (vLLM's query/key/value are views of one qkv buffer), and
disjoint views of one buffer pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_di.backend import AttentionBackend
from attn_di.backends._memory import shares_memory
from attn_di.exceptions import InvalidInputError
from tests.backends.reference import Batch, Options, differs, make_batch, reference_attention

HEADS, KV_HEADS, SIZE = 4, 2, 64
ROW = HEADS * SIZE  # one output row


@pytest.fixture(name="opts")
def _opts() -> Options:
    """Four query heads over two KV heads of size 64."""
    return Options(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=SIZE)


@pytest.fixture(name="batch")
def _batch(opts: Options) -> Batch:
    """A 200-token prefill (several prefill-kernel tiles) and a decode in one batch."""
    return make_batch(opts, [200, 1], [200, 40], 16, torch.float32)


def _refused(
    backend_cls: type[AttentionBackend],
    opts: Options,
    batch: Batch,
    match: str,
    *,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    metadata: object = None,
    sinks: torch.Tensor | None = None,
) -> InvalidInputError:
    """Run one forward with the given replacements; assert it is refused with ``match`` and
    leaves the cache as it was; return the error."""
    impl = backend_cls.get_impl_cls()(**{**opts.impl_kwargs(), "sinks": sinks})
    before = batch.kv_cache.clone()
    with pytest.raises(InvalidInputError, match=match) as info:
        impl.forward(
            None,
            batch.query if query is None else query,
            batch.key if key is None else key,
            batch.value if value is None else value,
            batch.kv_cache,
            batch.metadata if metadata is None else metadata,  # type: ignore[arg-type]
            output=output,
        )
    assert not differs(batch.kv_cache, before).any()
    assert info.value.hint
    return info.value


@pytest.mark.parametrize("shift", [1, -1], ids=["output-first", "query-first"])
def test_an_output_over_the_query_shifted_by_a_row_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, shift: int
) -> None:
    """``output=`` the query's own buffer shifted by one row: the compiled prefill wrote
    output tiles over query rows other tiles had not read yet (a silently wrong answer)."""
    rows = int(batch.query.shape[0])
    buffer = torch.zeros(rows + 1, ROW)
    query_rows, output_rows = (buffer[1:], buffer[:rows]) if shift == 1 else (
        buffer[:rows], buffer[1:]
    )  # fmt: skip
    query_rows.copy_(batch.query.reshape(rows, ROW))
    kept = buffer.clone()

    error = _refused(
        backend_cls,
        opts,
        batch,
        r"output: shares memory with query",
        query=query_rows.view(rows, HEADS, SIZE),
        output=output_rows,
    )

    assert error.argument == "output"
    assert torch.equal(buffer, kept)  # nothing written either


@pytest.mark.parametrize("name", ["key", "value"])
def test_an_output_over_the_keys_or_values_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, name: str
) -> None:
    """``output=`` a buffer whose first rows are the call's keys (or values)."""
    rows = int(batch.query.shape[0])
    buffer = torch.empty(rows * ROW)
    source = getattr(batch, name)
    inside = buffer[: source.numel()].view_as(source)
    inside.copy_(source)

    _refused(
        backend_cls,
        opts,
        batch,
        rf"output: shares memory with {name}",
        output=buffer.view(rows, ROW),
        **{name: inside},
    )


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_an_input_inside_the_cache_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, name: str
) -> None:
    """A query, key or value that is a view of the cache the call writes (the write lands on
    rows it has not read yet)."""
    source = getattr(batch, name)
    inside = batch.kv_cache.view(-1)[: source.numel()].view_as(source)
    inside.copy_(source)

    error = _refused(
        backend_cls, opts, batch, rf"{name}: lies in the memory of kv_cache", **{name: inside}
    )

    assert error.argument == name


def test_a_slot_mapping_inside_the_cache_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """Metadata the call reads may not live in the cache it writes (slots change as it writes)."""
    slots = batch.metadata.slot_mapping
    inside = batch.kv_cache.view(-1).view(torch.int64)[: slots.numel()]
    inside.copy_(slots)
    metadata = dataclasses.replace(batch.metadata, slot_mapping=inside)

    _refused(
        backend_cls, opts, batch, r"slot_mapping: lies in the memory of kv_cache", metadata=metadata
    )


def test_a_block_table_inside_the_output_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """The block table lying in ``output=``'s buffer: rows written early change block numbers."""
    rows = int(batch.query.shape[0])
    output = torch.zeros(rows, ROW)
    table = batch.metadata.block_table
    inside = output.view(-1).view(torch.int32)[: table.numel()].view_as(table)
    inside.copy_(table)
    metadata = dataclasses.replace(batch.metadata, block_table=inside)

    _refused(
        backend_cls,
        opts,
        batch,
        r"output: shares memory with block_table",
        output=output,
        metadata=metadata,
    )


def test_sinks_inside_the_output_are_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """The impl's sinks (read for every row) lying in ``output=``'s buffer."""
    rows = int(batch.query.shape[0])
    output = torch.zeros(rows, ROW)
    output.view(-1)[:HEADS] = torch.randn(HEADS)

    _refused(
        backend_cls,
        opts,
        batch,
        r"output: shares memory with sinks",
        output=output,
        sinks=output.view(-1)[:HEADS],
    )


def test_a_call_of_a_checked_shape_is_checked_for_sharing_too(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A call whose shapes, strides and metadata passed the checks before (the fast path)
    with an ``output=`` over the query is refused all the same."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    rows = int(batch.query.shape[0])
    args = (batch.key, batch.value, batch.kv_cache, batch.metadata)
    buffer = torch.empty(rows + 1, ROW)
    query = buffer[1:].view(rows, HEADS, SIZE)
    query.copy_(batch.query)
    impl.forward(None, query, *args, output=torch.empty(rows, ROW))  # checked: passes
    before = batch.kv_cache.clone()

    with pytest.raises(InvalidInputError, match=r"output: shares memory with query"):
        impl.forward(None, query, *args, output=buffer[:rows])
    assert not differs(batch.kv_cache, before).any()


def test_reads_may_share_memory_and_disjoint_views_of_one_buffer_pass(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """query, key and value as views of one qkv buffer (as vLLM hands them), and an
    ``output=`` interleaved with the query rows in one buffer (no element shared): computed,
    and right."""
    rows = int(batch.query.shape[0])
    width = (HEADS + 2 * KV_HEADS) * SIZE
    qkv = torch.empty(rows, 2, width)  # [:, 0]: q|k|v of a token; [:, 1]: its output row
    query = qkv[:, 0, :ROW].view(rows, HEADS, SIZE)
    key = qkv[:, 0, ROW : ROW + KV_HEADS * SIZE].view(rows, KV_HEADS, SIZE)
    value = qkv[:, 0, ROW + KV_HEADS * SIZE :].view(rows, KV_HEADS, SIZE)
    query.copy_(batch.query)
    key.copy_(batch.key)
    value.copy_(batch.value)
    output = qkv[:, 1, :ROW]
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    result = impl.forward(None, query, key, value, batch.kv_cache, batch.metadata, output=output)

    assert result.data_ptr() == output.data_ptr()
    torch.testing.assert_close(
        output.double(), reference_attention(opts, batch), atol=2e-4, rtol=2e-4
    )


# -- shares_memory, against the elements themselves ---------------------------------------
def _view(buffer: torch.Tensor, offset: int, sizes: list[int], order: list[int]) -> torch.Tensor:
    """A non-overlapping strided view of ``buffer``: ``sizes`` laid out densely in the axis
    ``order`` given (a permuted slice of a dense block), starting at ``offset``."""
    strides = [0] * len(sizes)
    stride = 1
    for axis in reversed(order):
        strides[axis] = stride
        stride *= sizes[axis]
    return buffer.as_strided(sizes, strides, offset)


def _elements(tensor: torch.Tensor, base: int) -> set[int]:
    """The element offsets (in elements of the buffer starting at ``base``) ``tensor`` covers."""
    if not tensor.numel():
        return set()
    first = (tensor.data_ptr() - base) // tensor.element_size()
    offsets = torch.zeros(tensor.shape, dtype=torch.int64) + first
    for axis, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
        shape = [1] * tensor.dim()
        shape[axis] = size
        offsets = offsets + torch.arange(size).view(shape) * stride
    return set(offsets.flatten().tolist())


LAYOUT = st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
    lambda sizes: st.tuples(st.just(sizes), st.permutations(list(range(len(sizes)))))
)


@settings(max_examples=300, deadline=None)
@given(
    first=LAYOUT,
    second=LAYOUT,
    offsets=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    same_layout=st.booleans(),
)
def test_shares_memory_says_whether_an_element_is_shared(
    first: tuple[list[int], list[int]],
    second: tuple[list[int], list[int]],
    offsets: tuple[int, int],
    same_layout: bool,
) -> None:
    """For views that do not overlap themselves (any two permuted slices of one buffer, of one
    layout or two), exactly whether an element is shared."""
    buffer = torch.zeros(200)
    base = buffer.data_ptr()
    sizes, order = first
    a = _view(buffer, offsets[0], sizes, order)
    if same_layout:
        b = buffer.as_strided(a.shape, a.stride(), offsets[1])
    else:
        b = _view(buffer, offsets[1], *second)
    shared = bool(_elements(a, base) & _elements(b, base))

    assert shares_memory(a, b) == shared


def test_interleaved_planes_of_one_cache_do_not_share() -> None:
    """vLLM's blocks-outermost cache: its key and value planes interleave block by block,
    and no element is shared; an overlap of one element is seen."""
    cache = torch.zeros(4, 2, 16, 2, 8)
    assert not shares_memory(cache[:, 0], cache[:, 1])
    flat = cache.view(-1)
    assert shares_memory(flat[:10], flat[9:20])
    assert not shares_memory(flat[:10], flat[10:20])
    assert not shares_memory(torch.zeros(0), flat)


@pytest.mark.parametrize(
    "make",
    [
        lambda buffer: (buffer[0::2], buffer[1::2]),
        lambda buffer: (buffer.view(4, 4)[:, :2], buffer.view(4, 4)[:, 2:]),
    ],
    ids=["even-odd", "column-halves"],
)
def test_disjoint_interleaved_views_are_told_apart(
    make: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Two views of one layout whose elements alternate share nothing."""
    a, b = make(torch.zeros(16))
    assert not shares_memory(a, b)
    assert shares_memory(a, a)
