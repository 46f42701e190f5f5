"""CPU_ATTN's one-call decoder step: a model step's layers after the first write the cache and
attend in one compiled call (``write_and_attend``) once the step's metadata passed the full
checks. Its results are the checked path's bit for bit, a bad input still raises the typed
error that names it with the cache untouched, and changed metadata is checked again.

Each "layer" is an impl of its own with a cache of its own, as in a model; every cache holds
NaN keys and Inf values in the slots no sequence covers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from pytest_mock import MockerFixture

from attn_di.backend import AttentionMetadata
from attn_di.backends import cpu_attn
from attn_di.exceptions import InvalidInputError
from tests.backends.reference import Batch, Options, make_batch, reference_attention
from tests.backends.test_cpu_kernel import assert_matches, poison_unused_slots, requires_kernel

pytestmark = requires_kernel

BLOCK = 16
OPTIONS = Options(8, 2, 64, sliding_window=50, logits_soft_cap=30.0, sinks=torch.randn(8))
# decode, chunked decode (3 tokens) and a one-token sequence, a padding token after them
QUERY_LENS, SEQ_LENS = [1, 3, 1], [40, 70, 17]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _batch(dtype: torch.dtype) -> Batch:
    return make_batch(OPTIONS, QUERY_LENS, SEQ_LENS, BLOCK, dtype, pad_tokens=1)


def _layer_cache(batch: Batch) -> torch.Tensor:
    cache = batch.kv_cache.clone()
    poison_unused_slots(batch.metadata, cache, BLOCK)
    return cache


def _output(batch: Batch) -> torch.Tensor:
    """A fresh ``[N, H * D]`` output buffer, NaN where nothing is written."""
    rows = batch.query.shape[0]
    return torch.full(
        (rows, OPTIONS.num_heads * OPTIONS.head_size), float("nan"), dtype=batch.query.dtype
    )


def _step(
    batch: Batch, layers: int, spy: object
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """``layers`` layers of one step: their outputs, their caches, and per layer whether its
    call was the one-call kind (``_run_kernel`` with ``write``)."""
    outputs, caches, one_call = [], [], []
    for _ in range(layers):
        impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())
        cache, out = _layer_cache(batch), _output(batch)
        before = spy.call_count  # type: ignore[attr-defined]
        result = impl.forward(None, batch.query, batch.key, batch.value, cache, batch.metadata, out)
        assert result is out
        calls = spy.call_args_list[before:]  # type: ignore[attr-defined]
        assert len(calls) == 1  # the compiled kernels ran this layer, once
        one_call.append(calls[0].kwargs.get("write") is not None)
        outputs.append(out)
        caches.append(cache)
    return outputs, caches, one_call


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_later_layers_take_one_call_with_the_checked_paths_result(
    dtype: torch.dtype, mocker: MockerFixture
) -> None:
    batch = _batch(dtype)
    spy = mocker.spy(cpu_attn.CPUAttentionImpl, "_run_kernel")
    outputs, caches, one_call = _step(batch, 3, spy)

    assert one_call == [False, True, True]  # the first layer's call checks the metadata
    for out, cache in zip(outputs[1:], caches[1:], strict=True):
        assert _same_bits(out, outputs[0])
        assert _same_bits(cache, caches[0])
    real = batch.metadata.num_actual_tokens
    assert_matches(outputs[0][:real], reference_attention(OPTIONS, batch).flatten(1), dtype)
    assert bool(outputs[0][real:].isnan().all())  # the padding row is left alone


def _output_in_the_cache(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, width = _output(batch).shape
    return {"output": cache[0].view(-1)[: rows * width].view(rows, width)}


def _output_over_the_key(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    # key and output in one buffer, overlapping
    width = OPTIONS.num_heads * OPTIONS.head_size
    buffer = torch.zeros(batch.query.shape[0] * width * 2, dtype=batch.query.dtype)
    key = buffer[: batch.key.numel()].view(batch.key.shape)
    key.copy_(batch.key)
    return {"key": key, "output": buffer[: batch.query.shape[0] * width].view(-1, width)}


def _key_padding_row_in_the_cache(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    # the key's last row (a padding token, never written) is the cache's first row
    row = OPTIONS.num_kv_heads * OPTIONS.head_size
    before = batch.key.numel() - row
    buffer = torch.empty(before + cache.numel(), dtype=cache.dtype)
    in_buffer = buffer[before:].view(cache.shape)
    in_buffer.copy_(cache)
    key = buffer[: batch.key.numel()].view(batch.key.shape)
    key[:-1].copy_(batch.key[:-1])
    return {"key": key, "kv_cache": in_buffer}


def _query_of_other_heads(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"query": batch.query[:, :6].contiguous()}


def _key_of_other_dtype(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"key": batch.key.double()}


def _zero_tensor_output(batch: Batch, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    # a zero tensor has no memory to write: the op refuses it, then the checked path names it
    return {"output": torch._efficientzerotensor(_output(batch).shape)}


@pytest.mark.parametrize(
    ("bad", "argument"),
    [
        (_output_in_the_cache, "output"),
        (_output_over_the_key, "output"),
        (_key_padding_row_in_the_cache, "key"),
        (_query_of_other_heads, "query"),
        (_key_of_other_dtype, "key"),
        (_zero_tensor_output, "output"),
    ],
    ids=[
        "output-in-the-cache",
        "output-over-the-key",
        "key-padding-row",
        "query-heads",
        "key-dtype",
        "zero-tensor-output",
    ],
)
def test_a_bad_input_on_a_later_layer_is_named_and_changes_nothing(
    bad: Callable[[Batch, torch.Tensor], dict[str, torch.Tensor]],
    argument: str,
    mocker: MockerFixture,
) -> None:
    batch = _batch(torch.float32)
    spy = mocker.spy(cpu_attn.CPUAttentionImpl, "_run_kernel")
    _step(batch, 1, spy)  # the step's first layer: its metadata checked
    cache = _layer_cache(batch)
    inputs = {"query": batch.query, "key": batch.key, "value": batch.value, "kv_cache": cache}
    inputs |= {"output": _output(batch), **bad(batch, cache)}
    cache = inputs["kv_cache"]
    before = cache.clone()
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())

    with pytest.raises(InvalidInputError) as caught:
        impl.forward(
            None, inputs["query"], inputs["key"], inputs["value"], cache, batch.metadata,
            inputs["output"],
        )  # fmt: skip

    assert caught.value.argument == argument
    assert _same_bits(cache, before)


def _negative_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a negative view (``.conj().imag`` of a complex tensor)."""
    view = torch.complex(torch.zeros_like(tensor), -tensor).conj().imag
    assert view.is_neg()
    assert _same_bits(view.resolve_neg(), tensor)
    return view


MATH_BITS: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "negative output": lambda t: t.update(output=_negative_view(t["output"])),
    "zero query": lambda t: t.update(query=torch._efficientzerotensor(t["query"].shape)),
    "negative key": lambda t: t.update(key=_negative_view(t["key"])),
}


@pytest.mark.parametrize("math_bit", list(MATH_BITS))
def test_a_tensor_with_a_math_bit_takes_the_checked_path(
    mocker: MockerFixture, math_bit: str
) -> None:
    """``write_and_attend`` sees a negative view or a zero tensor as the caller holds it (not as
    the resolved copy an operator gets, whose memory checks would not see the caller's
    memory) and refuses it: such a call takes the checked path, and gets its result."""
    batch = _batch(torch.float32)
    spy = mocker.spy(cpu_attn.CPUAttentionImpl, "_run_kernel")
    _step(batch, 1, spy)  # the step's first layer: its metadata checked
    tensors = {"query": batch.query, "key": batch.key, "output": _output(batch)}
    MATH_BITS[math_bit](tensors)
    query, key, out = tensors["query"], tensors["key"], tensors["output"]
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())

    impl.forward(None, query, key, batch.value, _layer_cache(batch), batch.metadata, out)

    # the one-call op was asked and refused it; then the checked path ran
    assert [call.kwargs.get("write") is not None for call in spy.call_args_list[1:]] == [
        True,
        False,
    ]
    # the same values without math bits, through the checked path (metadata never checked)
    resolved = {
        name: torch.zeros(t.shape, dtype=t.dtype) if t._is_zerotensor() else t.resolve_neg()
        for name, t in tensors.items()
    }
    fresh = dataclasses.replace(batch.metadata)
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())
    expected = impl.forward(
        None, resolved["query"], resolved["key"], batch.value, _layer_cache(batch), fresh,
        _output(batch),
    )  # fmt: skip
    real = batch.metadata.num_actual_tokens
    assert torch.equal(out[:real].clone(), expected[:real])


def test_write_and_attend_refuses_a_math_bit_before_writing() -> None:
    """The op itself refuses a negative view (an argument it would otherwise read or write
    through memory that is not the caller's): a RuntimeError naming it, the cache unchanged."""
    batch = _batch(torch.float32)
    cache, out = _layer_cache(batch), _output(batch)
    before = cache.clone()
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())
    options = (impl.scale, OPTIONS.sliding_window, OPTIONS.logits_soft_cap, None, OPTIONS.sinks)
    m = batch.metadata

    with pytest.raises(RuntimeError, match="output is a negative or conjugate view"):
        torch.ops.attn_di.write_and_attend(
            batch.query, batch.key, batch.value, cache, m.slot_mapping, m.num_actual_tokens,
            m.block_table, m.seq_lens, m.query_start_loc, _negative_view(out), *options, True,
            OPTIONS.num_heads, OPTIONS.num_kv_heads, OPTIONS.head_size,
        )  # fmt: skip

    assert _same_bits(cache, before)


def test_metadata_changed_in_place_is_checked_again(mocker: MockerFixture) -> None:
    """A write into the step's metadata between layers (its version moves) sends the next
    call through the full checks: a sequence length past the block table is refused, and the
    cache is left as it was."""
    batch = _batch(torch.float32)
    spy = mocker.spy(cpu_attn.CPUAttentionImpl, "_run_kernel")
    _step(batch, 1, spy)
    cache = _layer_cache(batch)
    before = cache.clone()
    batch.metadata.seq_lens[0] = 10_000  # in place: the stamp's version changes
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())

    with pytest.raises(InvalidInputError) as caught:
        impl.forward(
            None, batch.query, batch.key, batch.value, cache, batch.metadata, _output(batch)
        )  # fmt: skip

    assert caught.value.argument in {"seq_lens", "max_seq_len", "block_table"}
    assert _same_bits(cache, before)
    assert spy.call_count == 1  # only the first layer's


def _float_token_count(metadata: AttentionMetadata) -> None:
    metadata.num_actual_tokens = float(metadata.num_actual_tokens)  # type: ignore[assignment]


def _int_causal(metadata: AttentionMetadata) -> None:
    metadata.causal = 1  # type: ignore[assignment]


def _equal_copy_of_seq_lens(metadata: AttentionMetadata) -> None:
    metadata.seq_lens = metadata.seq_lens.clone()


def _larger_max_seq_len(metadata: AttentionMetadata) -> None:
    metadata.max_seq_len += 1


def _written_block_table(metadata: AttentionMetadata) -> None:
    metadata.block_table.add_(0)  # same values, a new version


@pytest.mark.parametrize(
    ("edit", "refused"),
    [
        (_float_token_count, "num_actual_tokens"),
        (_int_causal, "causal"),
        (_equal_copy_of_seq_lens, None),
        (_larger_max_seq_len, None),
        (_written_block_table, None),
    ],
    ids=["float-token-count", "int-causal", "seq-lens-copy", "larger-max-seq-len", "table-written"],
)
def test_metadata_edited_between_layers_takes_the_checked_path(
    edit: Callable[[AttentionMetadata], None], refused: str | None, mocker: MockerFixture
) -> None:
    """Each field the first layer's checks passed is compared again on every later layer, by
    identity and version for tensors and by value and type for the rest: an edit that keeps
    values equal (4.0 for 4, 1 for True, an equal copy, an in-place write) still sends the
    next call through the full checks, which refuse it or run the checked path."""
    batch = _batch(torch.float32)
    spy = mocker.spy(cpu_attn.CPUAttentionImpl, "_run_kernel")
    outputs, _, one_call = _step(batch, 2, spy)
    assert one_call == [False, True]
    edit(batch.metadata)
    cache = _layer_cache(batch)
    before = cache.clone()
    impl = cpu_attn.CPUAttentionImpl(**OPTIONS.impl_kwargs())
    out = _output(batch)
    calls = spy.call_count

    if refused is not None:
        with pytest.raises(InvalidInputError) as caught:
            impl.forward(None, batch.query, batch.key, batch.value, cache, batch.metadata, out)
        assert caught.value.argument == refused
        assert _same_bits(cache, before)
        assert spy.call_count == calls
        return
    impl.forward(None, batch.query, batch.key, batch.value, cache, batch.metadata, out)
    assert spy.call_args_list[calls].kwargs.get("write") is None  # the checked path ran
    assert _same_bits(out, outputs[0])
    _, _, again = _step(batch, 1, spy)
    assert again == [True]  # checked once more, the step's later layers are one call again
