"""Bad inputs are refused with an InvalidInputError naming the tensor and its shape."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from pytest_mock import MockerFixture

from attn_di.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from attn_di.backends.cpu_attn import CPUAttentionImpl
from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError
from tests.backends.reference import Batch, Options, differs, make_batch, reference_attention


@pytest.fixture(name="opts")
def _opts() -> Options:
    """Four query heads over two KV heads of size 64."""
    return Options(num_heads=4, num_kv_heads=2, head_size=64)


@pytest.fixture(name="batch")
def _batch(opts: Options) -> Batch:
    """A prefill and a decode sequence in a 16-token-block cache."""
    return make_batch(opts, [3, 1], [3, 18], 16, torch.float32)


def _forward(backend_cls: type[AttentionBackend], opts: Options, batch: Batch) -> torch.Tensor:
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    return impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)


def _to_meta(name: str, batch: Batch) -> None:
    """Move one metadata tensor to the meta device (another device than the query's)."""
    setattr(batch.metadata, name, getattr(batch.metadata, name).to("meta"))


def _to_zero_tensor(name: str, batch: Batch) -> None:
    """Replace one metadata tensor (or the cache) by a zero tensor of its shape and dtype."""
    owner = batch if name == "kv_cache" else batch.metadata
    tensor = getattr(owner, name)
    setattr(owner, name, torch._efficientzerotensor(tensor.shape, dtype=tensor.dtype))


def test_mismatched_key_heads(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A key with the wrong number of KV heads is named with its shape."""
    batch.key = torch.randn(4, 4, 64)

    with pytest.raises(InvalidInputError, match=r"key: shape \(4, 4, 64\) should be \[4, 2, 64\]"):
        _forward(backend_cls, opts, batch)


def test_mismatched_query_heads(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A query with the wrong number of heads is named with its shape."""
    batch.query = torch.randn(4, 8, 64)

    with pytest.raises(InvalidInputError, match=r"query: shape \(4, 8, 64\)"):
        _forward(backend_cls, opts, batch)


def test_wrong_dtype(backend_cls: type[AttentionBackend], opts: Options, batch: Batch) -> None:
    """A value whose dtype differs from the query's is refused."""
    batch.value = batch.value.half()

    with pytest.raises(InvalidInputError, match=r"value: dtype torch.float16 differs"):
        _forward(backend_cls, opts, batch)


def test_unsupported_dtype(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """float64 inputs are refused with the supported dtypes in the hint."""
    batch.query, batch.key, batch.value = (
        t.double() for t in (batch.query, batch.key, batch.value)
    )

    with pytest.raises(InvalidInputError, match=r"query: dtype torch.float64") as info:
        _forward(backend_cls, opts, batch)
    assert info.value.hint == "use one of float32, bfloat16, float16"


def test_slot_outside_cache(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A slot past the end of the cache is named with the cache's shape."""
    slots = int(batch.kv_cache.shape[1]) * 16
    batch.metadata.slot_mapping[0] = slots

    with pytest.raises(
        InvalidInputError, match=rf"slot_mapping: slot {slots} is outside the cache of shape"
    ):
        _forward(backend_cls, opts, batch)


def test_block_table_too_short(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A block table with fewer columns than seq_lens need is named with its shape."""
    batch.metadata.block_table = batch.metadata.block_table[:, :1]

    with pytest.raises(InvalidInputError, match=r"block_table: shape \(2, 1\) is too short"):
        _forward(backend_cls, opts, batch)


def test_block_number_outside_cache(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A used block number beyond the cache is refused."""
    batch.metadata.block_table[1, 1] = 10_000

    with pytest.raises(InvalidInputError, match=r"block_table: holds block numbers outside"):
        _forward(backend_cls, opts, batch)


@pytest.mark.parametrize("query_lens", [[3, 1], [1, 1]], ids=["mixed", "pure-decode"])
def test_a_zero_tensor_query_computes_as_its_zeros(
    backend_cls: type[AttentionBackend], opts: Options, query_lens: list[int]
) -> None:
    """A zero tensor (``torch._efficientzerotensor``: no memory) as the query gives what real
    zeros give, on every path (torch 2.13's CPU flash op alone, CPU_ATTN's pure-torch decode,
    read such a query as uninitialised memory: a wrong result, silently)."""
    batch = make_batch(opts, query_lens, [3, 18], 16, torch.float32)
    zeros = dataclasses.replace(batch, query=torch.zeros(batch.query.shape))
    lazy = dataclasses.replace(batch, query=torch._efficientzerotensor(batch.query.shape))
    zeros.kv_cache, lazy.kv_cache = batch.kv_cache.clone(), batch.kv_cache.clone()

    expected = _forward(backend_cls, opts, zeros)
    got = _forward(backend_cls, opts, lazy)

    real = batch.metadata.num_actual_tokens
    assert torch.equal(got[:real], expected[:real])


@pytest.mark.parametrize(
    ("name", "corrupt", "message"),
    [
        ("slot_mapping", lambda t: t.fill_(1 << 20), "slot_mapping: slot 1048576 is outside"),
        ("block_table", lambda t: t.fill_(10_000), "block_table: holds block numbers outside"),
        ("seq_lens", lambda t: t.zero_(), "seq_lens: .* shorter than query lengths"),
        ("query_start_loc", lambda t: t.fill_(5), "query_start_loc: .* must rise from 0"),
    ],
)
def test_metadata_written_in_place_after_a_forward_is_checked_again(
    backend_cls: type[AttentionBackend],
    opts: Options,
    batch: Batch,
    name: str,
    corrupt: Callable[[torch.Tensor], object],
    message: str,
) -> None:
    """The index checks pass once per metadata object; an in-place write makes them run again."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (batch.query, batch.key, batch.value, batch.kv_cache)
    impl.forward(None, *args, batch.metadata)  # checked and remembered
    corrupt(getattr(batch.metadata, name))
    before = batch.kv_cache.clone()

    with pytest.raises(InvalidInputError, match=message):
        impl.forward(None, *args, batch.metadata)
    assert not bool(differs(batch.kv_cache, before).any())


def test_layers_sharing_metadata_check_its_indices_once(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, mocker: MockerFixture
) -> None:
    """Layers of one step share the metadata: its index checks run for the first layer only."""
    from attn_di.backends import _common

    spy = mocker.spy(_common, "_check_metadata")
    impls = [backend_cls.get_impl_cls()(**opts.impl_kwargs()) for _ in range(3)]
    caches = [batch.kv_cache.clone() for _ in impls]
    for impl, kv_cache in zip(impls, caches, strict=True):
        impl.forward(None, batch.query, batch.key, batch.value, kv_cache, batch.metadata)
    assert spy.call_count == 1


def test_metadata_edited_under_inference_mode_is_checked_again(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """Under inference_mode the builder's tensors keep version counters, and metadata holding
    an inference tensor (none) is checked on every call: an edit is caught either way."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (batch.query, batch.key, batch.value, batch.kv_cache)
    with torch.inference_mode():
        built = AttentionMetadataBuilder(16).build(
            [3, 1], [3, 18], batch.metadata.block_table.clone()
        )
        assert not built.block_table.is_inference()
        impl.forward(None, *args, built)
        built.block_table.fill_(10_000)
        with pytest.raises(InvalidInputError, match="block_table: holds block numbers outside"):
            impl.forward(None, *args, built)
        inference_table = batch.metadata.block_table.clone()  # made here: an inference tensor
        assert inference_table.is_inference()
        built.block_table = inference_table
        impl.forward(None, *args, built)
        inference_table.fill_(10_000)
        with pytest.raises(InvalidInputError, match="block_table: holds block numbers outside"):
            impl.forward(None, *args, built)


def test_a_checked_metadata_carries_nothing_new(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """What forward remembers is kept beside the metadata: its fields, and so
    ``AttentionMetadata(**vars(metadata))``, are as they were."""
    before = set(vars(batch.metadata))
    _forward(backend_cls, opts, batch)
    assert set(vars(batch.metadata)) == before
    assert AttentionMetadata(**vars(batch.metadata)) == batch.metadata


def test_metadata_checked_against_each_cache(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """Metadata that fit one cache is checked again against a smaller one (and a new tensor)."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (batch.query, batch.key, batch.value)
    impl.forward(None, *args, batch.kv_cache, batch.metadata)
    small = torch.zeros(2, 1, 16, 2, 64)
    with pytest.raises(InvalidInputError, match=r"slot_mapping: slot .* is outside the cache"):
        impl.forward(None, *args, small, batch.metadata)
    batch.metadata.block_table = torch.full_like(batch.metadata.block_table, 10_000)
    with pytest.raises(InvalidInputError, match="block_table: holds block numbers outside"):
        impl.forward(None, *args, batch.kv_cache, batch.metadata)


def test_kv_cache_shape(backend_cls: type[AttentionBackend], opts: Options, batch: Batch) -> None:
    """A cache whose head axes do not match the layer is named with its shape."""
    batch.kv_cache = torch.zeros(2, 4, 16, 4, 64)

    with pytest.raises(InvalidInputError, match=r"kv_cache: shape \(2, 4, 16, 4, 64\)"):
        _forward(backend_cls, opts, batch)


def test_output_buffer_shape(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """An output buffer of the wrong shape is refused."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    with pytest.raises(InvalidInputError, match=r"output: shape \(4, 64\)"):
        impl.forward(
            None,
            batch.query,
            batch.key,
            batch.value,
            batch.kv_cache,
            batch.metadata,
            output=torch.empty(4, 64),
        )


def test_num_kv_heads_must_divide_num_heads(backend_cls: type[AttentionBackend]) -> None:
    """num_kv_heads that does not divide num_heads is refused at construction."""
    with pytest.raises(InvalidInputError, match=r"num_kv_heads: 3 does not divide num_heads 4"):
        backend_cls.get_impl_cls()(num_heads=4, head_size=64, scale=0.125, num_kv_heads=3)


def test_sinks_length(backend_cls: type[AttentionBackend]) -> None:
    """Sinks must have one logit per query head."""
    with pytest.raises(InvalidInputError, match=r"sinks: shape \(3,\) should be \[num_heads\]"):
        backend_cls.get_impl_cls()(num_heads=4, head_size=64, scale=0.125, sinks=torch.zeros(3))


def test_builder_refuses_short_block_table() -> None:
    """The metadata builder names a block table too short for seq_lens."""
    builder = AttentionMetadataBuilder(block_size=16)

    with pytest.raises(InvalidInputError, match=r"block_table: shape \(1, 1\) has too few columns"):
        builder.build([1], [17], [[0]])


def test_builder_refuses_query_longer_than_sequence() -> None:
    """A query longer than its sequence is refused."""
    with pytest.raises(InvalidInputError, match=r"query_lens: each must be in \[0, seq_len\]"):
        AttentionMetadataBuilder(block_size=16).build([5], [3], [[0]])


def test_invalid_input_error_is_a_value_error() -> None:
    """Callers catching ValueError still catch bad inputs."""
    with pytest.raises(ValueError, match="num_heads"):
        CPUAttentionImpl(num_heads=0, head_size=64, scale=1.0)


_BASE = {"num_heads": 4, "head_size": 64, "scale": 0.125}


@pytest.mark.parametrize(
    ("argument", "overrides"),
    [
        ("num_heads", {"num_heads": 8.0, "num_kv_heads": 2}),
        ("num_heads", {"num_heads": "4"}),
        ("num_heads", {"num_heads": True}),
        ("num_heads", {"num_heads": None}),
        ("num_heads", {"num_heads": -4}),
        ("head_size", {"head_size": 64.0}),
        ("head_size", {"head_size": 0}),
        ("num_kv_heads", {"num_kv_heads": 2.0}),
        ("num_kv_heads", {"num_kv_heads": False}),
        ("scale", {"scale": None}),
        ("scale", {"scale": "0.125"}),
        ("scale", {"scale": float("nan")}),
        ("scale", {"scale": float("inf")}),
        ("scale", {"scale": 1e39}),
        ("sliding_window", {"sliding_window": 2.5}),
        ("sliding_window", {"sliding_window": True}),
        ("sliding_window", {"sliding_window": 0}),
        ("sliding_window", {"sliding_window": 2**64}),
        ("logits_soft_cap", {"logits_soft_cap": float("nan")}),
        ("logits_soft_cap", {"logits_soft_cap": -1.0}),
        ("logits_soft_cap", {"logits_soft_cap": "30"}),
        ("logits_soft_cap", {"logits_soft_cap": 1e-300}),
        ("alibi_slopes", {"alibi_slopes": "abcd"}),
        ("alibi_slopes", {"alibi_slopes": [1.0, 2.0, 3.0]}),
        ("alibi_slopes", {"alibi_slopes": [[1.0, 2.0, 3.0, 4.0]]}),
        ("alibi_slopes", {"alibi_slopes": torch.ones(4, 1)}),
        ("alibi_slopes", {"alibi_slopes": [1.0, None, 3.0, 4.0]}),
        ("alibi_slopes", {"alibi_slopes": [1.0, float("nan"), 3.0, 4.0]}),
        ("alibi_slopes", {"alibi_slopes": torch.full((4,), 1e39, dtype=torch.float64)}),
        ("sinks", {"sinks": [0.0] * 3}),
        ("sinks", {"sinks": torch.zeros(4, 1)}),
        ("sinks", {"sinks": ["a"] * 4}),
        ("sinks", {"sinks": torch.ones(4, dtype=torch.bool)}),
        ("sinks", {"sinks": 0.0}),
        ("sinks", {"sinks": [0.0, 0.0, 0.0, float("nan")]}),
    ],
    ids=repr,
)
def test_constructor_refuses_bad_options(
    backend_cls: type[AttentionBackend], argument: str, overrides: dict[str, object]
) -> None:
    """Bad sizes, scales and options are refused with the argument's name and a hint."""
    impl_cls = backend_cls.get_impl_cls()
    if argument == "logits_soft_cap" and not impl_cls.supports_logits_soft_cap:
        pytest.skip(f"{backend_cls.get_name()} refuses any soft cap as unsupported")

    with pytest.raises(InvalidInputError) as info:
        impl_cls(**{**_BASE, **overrides})
    assert info.value.argument == argument
    assert info.value.hint


def test_constructor_refuses_positional_float_heads(backend_cls: type[AttentionBackend]) -> None:
    """``impl_cls(8.0, 32, 1.0, 2)`` used to be accepted and crash later in forward."""
    with pytest.raises(InvalidInputError, match=r"num_heads: must be a positive int, got 8\.0"):
        backend_cls.get_impl_cls()(8.0, 32, 1.0, 2)


def test_constructor_accepts_index_like_and_sequences(backend_cls: type[AttentionBackend]) -> None:
    """numpy ints count as ints; sinks/alibi_slopes may be lists; a +inf soft cap is off."""
    np = pytest.importorskip("numpy")
    impl_cls = backend_cls.get_impl_cls()
    impl = impl_cls(
        num_heads=np.int64(4),
        head_size=np.int32(64),
        scale=np.float32(0.125),
        num_kv_heads=np.int64(2),
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
        sliding_window=np.int64(8),
        sinks=[0.0, 1.0, float("-inf"), 2.0],
        logits_soft_cap=float("inf") if not impl_cls.supports_logits_soft_cap else 30.0,
    )

    assert (impl.num_heads, impl.head_size, impl.num_kv_heads) == (4, 64, 2)
    assert type(impl.num_heads) is int
    assert type(impl.sliding_window) is int
    assert isinstance(impl.scale, float)
    assert impl.alibi_slopes == [0.5, 0.25, 0.125, 0.0625]
    assert isinstance(impl.sinks, torch.Tensor)
    assert impl.sinks.dtype == torch.float32
    assert impl.sinks.tolist() == [0.0, 1.0, float("-inf"), 2.0]


@pytest.mark.parametrize("cap", [None, 0, 0.0, 1e300, float("inf")])
def test_soft_cap_off_values(cap: float | None) -> None:
    """None, 0, a cap beyond float32's range and +inf all turn the soft cap off
    (c * tanh(s / c) -> s as c -> inf; the cap is applied in float32)."""
    assert CPUAttentionImpl(**_BASE, logits_soft_cap=cap).logits_soft_cap is None


@pytest.mark.parametrize(
    ("options", "feature"),
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
        ({"attn_type": "encoder_decoder"}, "attention type encoder_decoder"),
        ({"kv_sharing_target_layer_name": "layers.0.attn"}, "kv_sharing_target_layer_name"),
    ],
    ids=["fp8", "encoder_decoder", "kv_sharing"],
)
def test_unsupported_features_carry_a_hint(
    backend_cls: type[AttentionBackend], options: dict[str, object], feature: str
) -> None:
    """Refused features say what to do instead."""
    with pytest.raises(UnsupportedFeatureError) as info:
        backend_cls.get_impl_cls()(**_BASE, **options)
    assert info.value.feature == feature
    assert info.value.hint
    assert "Hint:" in str(info.value)


def _as_list(tensor: torch.Tensor) -> object:
    return tensor.tolist()


@pytest.mark.parametrize(
    ("argument", "spoil"),
    [
        ("attn_metadata", lambda b: setattr(b, "metadata", None)),
        ("attn_metadata", lambda b: setattr(b, "metadata", {"slot_mapping": [0]})),
        ("query", lambda b: setattr(b, "query", _as_list(b.query))),
        ("key", lambda b: setattr(b, "key", _as_list(b.key))),
        ("value", lambda b: setattr(b, "value", _as_list(b.value))),
        ("kv_cache", lambda b: setattr(b, "kv_cache", _as_list(b.kv_cache))),
        ("num_actual_tokens", lambda b: setattr(b.metadata, "num_actual_tokens", 4.0)),
        (
            "slot_mapping",
            lambda b: setattr(b.metadata, "slot_mapping", b.metadata.slot_mapping[:, None]),
        ),
        (
            "slot_mapping",
            lambda b: setattr(b.metadata, "slot_mapping", b.metadata.slot_mapping.float()),
        ),
        (
            "slot_mapping",
            lambda b: setattr(b.metadata, "slot_mapping", b.metadata.slot_mapping[:2]),
        ),
        ("slot_mapping", lambda b: setattr(b.metadata, "slot_mapping", [0, 1, 2, 3])),
        (
            "query_start_loc",
            lambda b: setattr(b.metadata, "query_start_loc", b.metadata.query_start_loc.float()),
        ),
        (
            "query_start_loc",
            lambda b: setattr(b.metadata, "query_start_loc", b.metadata.query_start_loc[None]),
        ),
        ("seq_lens", lambda b: setattr(b.metadata, "seq_lens", b.metadata.seq_lens.double())),
        ("seq_lens", lambda b: setattr(b.metadata, "seq_lens", b.metadata.seq_lens[:, None])),
        (
            "block_table",
            lambda b: setattr(b.metadata, "block_table", b.metadata.block_table.float()),
        ),
        ("block_table", lambda b: setattr(b.metadata, "block_table", b.metadata.block_table[0])),
        ("block_table", lambda b: b.metadata.block_table.__setitem__((1, 0), -1)),
        ("kv_cache", lambda b: b.kv_cache.requires_grad_()),
        *(
            (name, functools.partial(_to_meta, name))
            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
        ),
        *(
            (name, functools.partial(_to_zero_tensor, name))
            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "kv_cache")
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_refused_forward_leaves_the_cache_unchanged(
    backend_cls: type[AttentionBackend],
    opts: Options,
    batch: Batch,
    argument: str,
    spoil: Callable[[Batch], None],
) -> None:
    """Wrong types, dtypes and ranks are refused, naming the input, before the cache is written."""
    cache = batch.kv_cache
    before = cache.clone()
    spoil(batch)

    with pytest.raises(InvalidInputError) as info:
        _forward(backend_cls, opts, batch)
    assert info.value.argument == argument
    assert info.value.hint
    assert not differs(cache, before).any()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda b: setattr(b, "key", torch.randn(4, 4, 64)),
        lambda b: setattr(b, "query", torch.randn(4, 8, 64)),
        lambda b: setattr(b, "value", b.value.half()),
        lambda b: b.metadata.slot_mapping.__setitem__(0, 10_000),
        lambda b: setattr(b.metadata, "block_table", b.metadata.block_table[:, :1]),
        lambda b: b.metadata.block_table.__setitem__((1, 1), 10_000),
        lambda b: setattr(b, "kv_cache", torch.zeros(2, 4, 16, 4, 64)),
        lambda b: setattr(b.metadata, "query_start_loc", torch.tensor([1, 3, 4])),
        lambda b: setattr(b.metadata, "seq_lens", torch.tensor([3, 0], dtype=torch.int32)),
    ],
    ids=[
        "key",
        "query",
        "value",
        "slot",
        "short_table",
        "block_number",
        "kv_cache",
        "qsl",
        "seq_lens",
    ],
)
def test_shape_and_index_errors_carry_a_hint(
    backend_cls: type[AttentionBackend],
    opts: Options,
    batch: Batch,
    spoil: Callable[[Batch], None],
) -> None:
    """The existing shape, dtype, slot and block-table refusals say what is expected."""
    spoil(batch)

    with pytest.raises(InvalidInputError) as info:
        _forward(backend_cls, opts, batch)
    assert info.value.hint


@pytest.mark.parametrize(
    ("argument", "args"),
    [
        ("query_lens", ([1.5], [2], [[0]])),
        ("query_lens", ([True], [2], [[0]])),
        ("query_lens", (["a"], [2], [[0]])),
        ("seq_lens", ([1], [2.0], [[0]])),
        ("block_table", ([1], [2], [[0.0]])),
        ("block_table", ([1], [2], [[-1]])),
        ("block_table", ([1, 1], [2, 20], [[0, 0], [1, -3]])),
        ("block_table", ([1], [2], "x")),
    ],
    ids=repr,
)
def test_builder_refuses_non_integers_and_negative_blocks(
    argument: str, args: tuple[object, object, object]
) -> None:
    """Fractional lengths are no longer truncated and negative block numbers give no slots."""
    with pytest.raises(InvalidInputError) as info:
        AttentionMetadataBuilder(block_size=16).build(*args)  # type: ignore[arg-type]
    assert info.value.argument == argument
    assert info.value.hint


def test_builder_ignores_negative_padding_in_unused_columns() -> None:
    """Block table columns past ceil(seq_len / block_size) may hold -1 padding."""
    metadata = AttentionMetadataBuilder(block_size=16).build([1], [2], [[3, -1]])

    assert metadata.slot_mapping.tolist() == [3 * 16 + 1]


@pytest.mark.parametrize(
    ("args", "where", "value"),
    [
        (([1, 1], [3, 4], [[0], [2**32 + 3]]), "block_table[1, 0]", 2**32 + 3),
        (([1], [3], torch.tensor([[2**40]])), "block_table[0, 0]", 2**40),
        (([1], [3], [[5, 2**64]]), "block_table[0, 1]", 2**64),
        (([1], [3], torch.tensor([[2**63]], dtype=torch.uint64)), "block_table[0, 0]", 2**63),
        (([1], [3], [[-(2**31) - 1]]), "block_table[0, 0]", -(2**31) - 1),
        (([1], [5, 2**31], None), "seq_lens[1]", 2**31),
        (([2**31], [2**31], None), "query_lens[0]", 2**31),
    ],
    ids=["block-2**32+3", "int64-tensor", "past-int64", "uint64", "below-int32", "seq-len-2**31",
         "query-len-2**31"],
)  # fmt: skip
def test_builder_refuses_numbers_outside_int32_by_name_and_value(
    args: tuple[object, object, object], where: str, value: int
) -> None:
    """The metadata holds lengths and block numbers in int32: one that does not fit is named
    with its position and the value given (``2**32 + 3`` became block 3, and ``2**31`` a
    negative length), before anything is allocated for it."""
    with pytest.raises(InvalidInputError) as info:
        AttentionMetadataBuilder(block_size=16).build(*args)  # type: ignore[arg-type]
    assert info.value.argument == where.partition("[")[0]
    assert info.value.problem.startswith(f"{where} = {value} does not fit int32")
    assert info.value.hint


def test_builder_refuses_query_lengths_adding_up_past_int32() -> None:
    """query_start_loc holds the running sum of the query lengths in int32."""
    with pytest.raises(InvalidInputError, match=r"query_lens: add up to 2147483648 tokens"):
        AttentionMetadataBuilder(block_size=16).build([2**30, 2**30], [2**30, 2**30], None)


def test_builder_keeps_the_largest_int32_numbers() -> None:
    """Block numbers and lengths up to ``2**31 - 1`` are kept exactly."""
    metadata = AttentionMetadataBuilder(block_size=1).build([1], [1], [[2**31 - 1]])
    assert metadata.block_table.tolist() == [[2**31 - 1]]
    assert metadata.slot_mapping.tolist() == [2**31 - 1]
    wide = AttentionMetadataBuilder(block_size=2**31 - 1).build([1], [2**31 - 1], None)
    assert wide.seq_lens.tolist() == [2**31 - 1]


@pytest.mark.parametrize("block_size", [0, -16, 16.0, True, "16", 2**31], ids=repr)
def test_builder_refuses_bad_block_size(block_size: object) -> None:
    """The builder's block size must be a positive int (below 2**31: slots are int64)."""
    with pytest.raises(InvalidInputError) as info:
        AttentionMetadataBuilder(block_size=block_size)  # type: ignore[arg-type]
    assert info.value.argument == "block_size"


@pytest.mark.parametrize(
    ("argument", "args"),
    [
        ("num_blocks", (-1, 16, 2, 64)),
        ("block_size", (10, 0, 2, 64)),
        ("num_kv_heads", (10, 16, 0, 64)),
        ("head_size", (10, 16, 2, -64)),
        ("block_size", (10, 16.0, 2, 64)),
        ("num_blocks", (True, 16, 2, 64)),
    ],
    ids=repr,
)
def test_kv_cache_shape_refuses_bad_sizes(
    backend_cls: type[AttentionBackend], argument: str, args: tuple[int, int, int, int]
) -> None:
    """Negative block counts and non-positive sizes no longer give nonsense shapes."""
    with pytest.raises(InvalidInputError) as info:
        backend_cls.get_kv_cache_shape(*args)
    assert info.value.argument == argument
    assert info.value.hint


def test_kv_cache_shape_accepts_zero_blocks_and_index_likes(
    backend_cls: type[AttentionBackend],
) -> None:
    """An empty cache (0 blocks) is fine, and numpy ints count as ints."""
    np = pytest.importorskip("numpy")

    assert backend_cls.get_kv_cache_shape(0, 16, 2, 64) == (2, 0, 16, 2, 64)
    assert backend_cls.get_kv_cache_shape(np.int64(3), 16, 2, 64) == (2, 3, 16, 2, 64)


@pytest.mark.parametrize("name", ["query_start_loc", "seq_lens", "block_table", "slot_mapping"])
def test_metadata_on_another_device_is_named(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, name: str
) -> None:
    """A metadata tensor on another device than the query is named, with both devices."""
    _to_meta(name, batch)

    with pytest.raises(InvalidInputError) as info:
        _forward(backend_cls, opts, batch)
    assert str(info.value) == (
        f"{name}: is on meta but query is on cpu\n"
        "Hint: build the metadata on the query's device: "
        "AttentionMetadataBuilder(block_size, device='cpu')"
    )


@pytest.mark.parametrize("argument", ["key", "value", "kv_cache", "output"])
def test_tensor_on_another_device_is_named(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, argument: str
) -> None:
    """key, value, kv_cache or output on another device than the query is named."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    tensors = {"key": batch.key, "value": batch.value, "kv_cache": batch.kv_cache}
    tensors["output"] = torch.empty(4, 4 * 64)
    tensors[argument] = tensors[argument].to("meta")

    with pytest.raises(InvalidInputError, match=rf"^{argument}: is on meta but query is on cpu"):
        impl.forward(
            None,
            batch.query,
            tensors["key"],
            tensors["value"],
            tensors["kv_cache"],
            batch.metadata,
            output=tensors["output"],
        )


@pytest.mark.parametrize("view", [False, True], ids=["leaf", "view-of-leaf"])
def test_cache_requiring_grad_is_refused_in_grad_mode(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, view: bool
) -> None:
    """A leaf cache (or a view of one) that requires grad is refused, naming kv_cache."""
    layers = batch.kv_cache[None].repeat(2, 1, 1, 1, 1, 1).requires_grad_()
    batch.kv_cache = layers[1] if view else layers

    with pytest.raises(InvalidInputError) as info:
        _forward(backend_cls, opts, batch)
    assert info.value.argument == "kv_cache"
    assert "requires grad" in info.value.problem
    assert info.value.hint is not None
    assert "kv_cache.detach()" in info.value.hint


def test_cache_requiring_grad_is_accepted_without_grad_mode(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """Under torch.no_grad() the same leaf cache is written in place and attended."""
    batch.kv_cache.requires_grad_()
    with torch.no_grad():
        out = _forward(backend_cls, opts, batch)

    assert bool(out.isfinite().all())
    flat = batch.kv_cache.view(2, -1, 2, 64)
    assert torch.equal(flat[0][batch.metadata.slot_mapping], batch.key)


def test_cache_in_a_graph_is_accepted(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A cache written from keys that require grad joins the graph and can be used again."""
    if not backend_cls.supports_backward:
        pytest.skip(f"{backend_cls.get_name()} declares no backward support")
    key = batch.key.clone().requires_grad_()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    impl.forward(None, batch.query, key, batch.value, batch.kv_cache, batch.metadata)
    assert batch.kv_cache.requires_grad
    assert not batch.kv_cache.is_leaf

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    out.sum().backward()

    assert key.grad is not None
    assert bool(key.grad.isfinite().all())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_query_len", 1, "max_query_len: 1 is less than the longest query length 4"),
        ("max_query_len", 0, "max_query_len: 0 is less than the longest query length 4"),
        ("max_seq_len", 3, "max_seq_len: 3 is less than the longest sequence length 9"),
        ("max_query_len", 4.0, "max_query_len: must be a non-negative int"),
        ("causal", "False", "causal: must be True or False"),
    ],
)
@pytest.mark.parametrize("edit", ["built", "in place"])
def test_metadata_lengths_disagreeing_with_the_indices_are_refused(
    backend_cls: type[AttentionBackend],
    opts: Options,
    field: str,
    value: object,
    message: str,
    edit: str,
) -> None:
    """A stale max_query_len or max_seq_len, below the longest length (or a causal flag that
    is not a bool), is refused, at the first call or after the metadata passed a check: a
    backend choosing its path by it would otherwise compute silently wrong (CPU_ATTN's
    kernel is causal)."""
    batch = make_batch(opts, [3, 4], [5, 9], 16, torch.float32)
    batch.metadata.causal = False
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (batch.query, batch.key, batch.value, batch.kv_cache)
    if edit == "in place":
        impl.forward(None, *args, batch.metadata)  # checked and remembered
    setattr(batch.metadata, field, value)
    before = batch.kv_cache.clone()
    with pytest.raises(InvalidInputError, match=message):
        impl.forward(None, *args, batch.metadata)
    assert not bool(differs(batch.kv_cache, before).any())


@pytest.mark.parametrize(("field", "bound"), [("max_query_len", 20), ("max_seq_len", 64)])
def test_a_larger_length_bound_is_accepted_and_exact(
    backend_cls: type[AttentionBackend], opts: Options, field: str, bound: int
) -> None:
    """max_query_len / max_seq_len above the longest length is a bound (as flash-attention's
    max_seqlen is): accepted, and the answer is the reference's."""
    batch = make_batch(opts, [3, 4, 1], [5, 9, 12], 16, torch.float32)
    setattr(batch.metadata, field, bound)
    out = _forward(backend_cls, opts, batch)
    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4)


_CHANGES: dict[str, tuple[Callable[[Batch], None], str]] = {
    "query dtype": (
        lambda b: setattr(b, "query", b.query.double()),
        r"query: dtype torch.float64 is not supported",
    ),
    "key heads": (lambda b: setattr(b, "key", torch.randn(4, 4, 64)), r"key: shape \(4, 4, 64\)"),
    "value device": (lambda b: setattr(b, "value", b.value.to("meta")), r"value: is on meta"),
    "cache strides": (
        lambda b: setattr(b, "kv_cache", torch.zeros(2, 8, 16, 2, 128)[..., ::2]),
        r"kv_cache: strides .* must be contiguous",
    ),
    "metadata tensor": (
        lambda b: setattr(b.metadata, "seq_lens", b.metadata.seq_lens.float()),
        r"seq_lens: dtype torch.float32 is not an integer dtype",
    ),
    "metadata in place": (
        lambda b: b.metadata.block_table.fill_(10_000),
        r"block_table: holds block numbers outside",
    ),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_checked_call_shape_skips_no_check_a_changed_input_needs(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, change: str
) -> None:
    """After a call passed its checks, a call with one thing changed (a tensor's dtype, shape,
    device or strides, a metadata tensor, an in-place edit) is checked again and refused as
    a first call would be, with the cache untouched: the remembered verdict covers only
    inputs with the same properties and unchanged metadata."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    impl.forward(None, *args)
    impl.forward(None, *args)  # the remembered path
    mutate, message = _CHANGES[change]
    mutate(batch)
    before = batch.kv_cache.clone()

    with pytest.raises(InvalidInputError, match=message):
        impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    assert not bool(differs(batch.kv_cache, before).any())


@pytest.mark.parametrize("window", [2**40, 2**63 - 1])
def test_a_window_longer_than_every_sequence_is_no_window(
    backend_cls: type[AttentionBackend], opts: Options, window: int
) -> None:
    """A sliding window up to int64's largest value gives the output of no window (the
    kernel's visibility arithmetic overflowed near 2**63 and rows saw wrong keys)."""
    if not backend_cls.get_impl_cls().supports_sliding_window:
        pytest.skip(f"{backend_cls.get_name()} has no sliding window")
    batch = make_batch(opts, [40, 4, 1], [40, 30, 18], 16, torch.float32)
    cache = batch.kv_cache.clone()
    expected = _forward(backend_cls, opts, batch)
    batch.kv_cache = cache

    got = _forward(backend_cls, dataclasses.replace(opts, sliding_window=window), batch)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda n, width: torch.zeros(1, width).expand(n, width),
        lambda n, width: torch.zeros(n * width).as_strided((n, width), (width // 2, 1)),
    ],
    ids=["expanded", "rows-overlap"],
)
def test_an_output_whose_elements_share_memory_is_refused_before_the_cache_is_written(
    backend_cls: type[AttentionBackend],
    opts: Options,
    batch: Batch,
    make: Callable[[int, int], torch.Tensor],
) -> None:
    """``output=`` with a stride of 0 or overlapping rows is an InvalidInputError naming it,
    before the cache is written (it was a bare RuntimeError from the op, the cache written),
    also after a call of the same shape with a proper output passed its checks."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    impl.forward(*args, output=torch.empty(4, 4 * 64))
    before = batch.kv_cache.clone()

    with pytest.raises(InvalidInputError, match=r"output: strides .* may share memory") as info:
        impl.forward(*args, output=make(4, 4 * 64))
    assert info.value.hint
    assert not differs(batch.kv_cache, before).any()


def test_a_cache_whose_slots_overlap_is_refused(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """A cache with no stride of 0 whose token rows overlap (token stride half a row) is
    refused naming kv_cache: its writes would clobber the previous slot."""
    shape = tuple(batch.kv_cache.shape)  # [2, num_blocks, 16, 2, 64]
    plane = shape[1] * shape[2] * 2 * 64
    overlapping = torch.zeros(2 * plane).as_strided(shape, (plane, 16 * 64, 64, 64, 1))

    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    with pytest.raises(InvalidInputError, match=r"kv_cache: strides .* no overlapping slots"):
        impl.forward(None, batch.query, batch.key, batch.value, overlapping, batch.metadata)
    assert not bool(overlapping.any())


@pytest.mark.parametrize("device", ["cpuu", "gpu:0", 3.5])
def test_builder_refuses_a_device_torch_does_not_know(device: object) -> None:
    """A misspelt device is refused when the builder is made, not at its first build()."""
    with pytest.raises(InvalidInputError, match=r"device: .* is not a torch device") as info:
        AttentionMetadataBuilder(16, device=device)  # type: ignore[arg-type]
    assert info.value.hint


def test_an_output_in_the_caches_memory_is_refused_before_the_cache_is_written(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch
) -> None:
    """``output=`` a view of the very cache the call writes is refused naming output, also
    after a call of the same shape and strides with a buffer of its own passed its checks."""
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    args = (None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    impl.forward(*args, output=torch.empty(4, 4 * 64))
    before = batch.kv_cache.clone()
    inside = batch.kv_cache.view(-1)[: 4 * 4 * 64].view(4, 4 * 64)

    with pytest.raises(InvalidInputError, match=r"output: lies in the memory of kv_cache"):
        impl.forward(*args, output=inside)
    assert not differs(batch.kv_cache, before).any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without CUDA")
def test_builder_on_a_device_this_torch_lacks_is_a_typed_error_at_build() -> None:
    """``device="cuda"`` is a torch device, so the builder is made; in a CPU build of torch
    its first build() is an InvalidInputError naming device (torch raised AssertionError)."""
    builder = AttentionMetadataBuilder(16, device="cuda")
    with pytest.raises(InvalidInputError, match=r"device: torch cannot make tensors on 'cuda'"):
        builder.build(query_lens=[1], seq_lens=[1], block_table=[[0]])
