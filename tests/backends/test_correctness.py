"""Every backend that declares a configuration matches the float64 reference on it.

Caches come from ``dirty_kv_cache``: every slot a batch does not cover holds NaN or +-Inf,
and the output must equal the one on a zero-filled cache bit for bit.

Tolerances (absolute and relative, on outputs of order 1, inputs rounded to the dtype
before the reference sees them): float32 1e-4; bfloat16 3e-2; float16 5e-3. The
low-precision budgets cover rounding of the output and of the probabilities fed to the
value product (2**-8 for bf16, 2**-11 for fp16) accumulated over a few hundred keys.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_di.backend import AttentionBackend
from attn_di.exceptions import UnsupportedFeatureError
from tests.backends.reference import (
    DIRTY_FILLS,
    KV_LAYOUTS,
    Batch,
    Options,
    make_batch,
    reference_attention,
    slot_index,
)

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


@dataclass
class Case:
    """One generated configuration and batch shape."""

    opts: Options
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    seed: int
    fill: str
    pad_tokens: int
    layout: str


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Mixed batches of prefill, chunked prefill and decode with random layer options."""
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    num_kv_heads = draw(st.integers(1, 2))
    num_heads = ratio * num_kv_heads
    head_size = draw(st.sampled_from([64, 80, 128, 256]))
    encoder_only = draw(st.booleans())
    query_lens, seq_lens = [], []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["prefill", "chunked", "decode"]))
        seq_len = draw(st.integers(1, 40))
        if encoder_only or kind == "prefill":
            query_len = seq_len
        elif kind == "decode":
            query_len = 1
        else:
            query_len = draw(st.integers(1, seq_len))
        query_lens.append(query_len)
        seq_lens.append(seq_len)
    opts = Options(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        sliding_window=draw(st.none() | st.integers(1, 24)),
        logits_soft_cap=draw(st.none() | st.floats(2.0, 30.0)),
        alibi_slopes=draw(st.none() | st.just([2.0 ** -(h + 1) for h in range(num_heads)])),
        sinks=torch.randn(num_heads) if draw(st.booleans()) else None,
        encoder_only=encoder_only,
    )
    return Case(
        opts,
        query_lens,
        seq_lens,
        block_size=draw(st.sampled_from([1, 16, 32])),
        seed=draw(st.integers(0, 2**16)),
        fill=draw(st.sampled_from(DIRTY_FILLS)),
        pad_tokens=draw(st.integers(0, 3)),
        layout=draw(st.sampled_from(list(KV_LAYOUTS))),
    )


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_backend_matches_reference(
    backend_cls: type[AttentionBackend], dtype: torch.dtype, case: Case
) -> None:
    """Output matches softmax(QK^T*scale + mask)V in float64, whatever uncovered slots hold,
    in every cache layout (a permuted buffer, read in place)."""
    try:
        impl = backend_cls.get_impl_cls()(**case.opts.impl_kwargs())
    except UnsupportedFeatureError:
        assert case.opts.logits_soft_cap is not None
        return
    outputs = []
    for fill in (case.fill, "zero"):
        batch = make_batch(
            case.opts,
            case.query_lens,
            case.seq_lens,
            case.block_size,
            dtype,
            seed=case.seed,
            fill=fill,
            pad_tokens=case.pad_tokens,
            backend_cls=backend_cls,
            layout=case.layout,
        )
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )
        outputs.append(out)
    dirty, clean = outputs
    expected = reference_attention(case.opts, batch)

    num_tokens = sum(case.query_lens)
    assert dirty.shape == (num_tokens + case.pad_tokens, case.opts.num_heads * case.opts.head_size)
    assert dirty.dtype == dtype
    assert bool(dirty[:num_tokens].isfinite().all())
    torch.testing.assert_close(dirty[:num_tokens], clean[:num_tokens], atol=0, rtol=0)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(dirty[:num_tokens].double(), expected, atol=tol, rtol=tol)


def test_output_buffer_is_filled_and_returned(backend_cls: type[AttentionBackend]) -> None:
    """A given output buffer receives the result and is returned itself."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [5, 1], [5, 9], 16, torch.float32)
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    buffer = torch.full((6, 4 * 64), float("nan"))

    out = impl.forward(
        None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, output=buffer
    )

    assert out is buffer
    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4)


def test_long_prefill_is_chunked_exactly(
    backend_cls: type[AttentionBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score budget smaller than one sequence still gives the exact result (query chunks)."""
    from attn_di.backends import _common

    monkeypatch.setattr(_common, "SCORE_BUDGET", 4 * 40 * 16)
    opts = Options(num_heads=4, num_kv_heads=1, head_size=64, sliding_window=20)
    batch = make_batch(opts, [40, 1, 30], [40, 60, 50], 16, torch.float32)
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("soft_cap", [None, 20.0], ids=["flash-kernel", "matmul"])
def test_cpu_attn_key_chunks_match(monkeypatch: pytest.MonkeyPatch, soft_cap: float | None) -> None:
    """CPU_ATTN merges many small key chunks exactly, on both of its paths."""
    from attn_di.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "_CHUNK_BYTES", 1)
    opts = Options(
        num_heads=8, num_kv_heads=2, head_size=64, sinks=torch.randn(8), logits_soft_cap=soft_cap
    )
    batch = make_batch(opts, [40, 1, 3], [40, 100, 77], 16, torch.float32)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["many-chunks", "one-chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_cpu_attn_decode_path_matches(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, dtype: torch.dtype, sinks: bool
) -> None:
    """CPU_ATTN's pure-torch decode path (block gathers, chunks merged by LSE) is exact."""
    from attn_di.backends import _cpu_kernel, cpu_attn

    calls: list[int] = []
    decode = cpu_attn.CPUAttentionImpl._decode_flash

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attn, "_DECODE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(cpu_attn.CPUAttentionImpl, "_decode_flash", counted)
    opts = Options(
        num_heads=8, num_kv_heads=2, head_size=64, sinks=torch.randn(8) if sinks else None
    )
    # Ragged lengths: a partial last block, a single-key sequence, unequal block counts.
    batch = make_batch(opts, [1, 1, 1, 1], [40, 1, 100, 64], 16, dtype)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    with _cpu_kernel.pure_torch():
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )

    assert calls == [1]
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=tol, rtol=tol)


def _scores_below_half_range(batch: Batch, low: float = -800.0, high: float = 400.0) -> None:
    """Make every real score of ``batch`` exactly -80000 or +40000 (head size 64): queries
    become 800 on channel 0 and 0 elsewhere; a key's channel 0 becomes ``low`` or ``high``
    by the sign of its channel 1 (the cache's NaN slots keep NaN elsewhere). A query that
    sees only low keys scores below float16's -65504, so a mask of ``finfo(float16).min``
    would let a masked slot win (a zeroed tail scores -65504; a high key hidden by causality
    -25504). The exact answer, the mean of the visible values of the highest score, is free
    of rounding in the scores."""

    def channel_0(keys: torch.Tensor) -> None:
        keys[..., 0] = torch.where(keys[..., 1] < 0, low, high).to(keys.dtype)

    batch.query.zero_()
    batch.query[..., 0] = -low
    channel_0(batch.key)
    channel_0(batch.kv_cache[0])
    for keys in batch.full_keys:
        channel_0(keys)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1, 1], [40, 1, 100, 17]), ([7, 1, 3, 16], [7, 20, 12, 45])],
    ids=["ragged-decode", "mixed"],
)
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-chunk", "many-chunks"])
def test_float16_scores_below_the_dtype_minimum_stay_masked(
    backend_cls: type[AttentionBackend],
    monkeypatch: pytest.MonkeyPatch,
    query_lens: list[int],
    seq_lens: list[int],
    chunk_bytes: int | None,
) -> None:
    """In float16, real scores lower than -65504 (scores accumulate in float32) still beat
    every masked slot: masks have -inf semantics on every path, as the compiled kernel's."""
    from attn_di.backends import cpu_attn

    if chunk_bytes is not None:  # many key chunks: some rows see no key in a chunk at all
        monkeypatch.setattr(cpu_attn, "_CHUNK_BYTES", chunk_bytes)
        monkeypatch.setattr(cpu_attn, "_DECODE_CHUNK_BYTES", chunk_bytes)
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    if torch.float16 not in backend_cls.supported_dtypes:
        pytest.skip(f"{backend_cls.get_name()} does not run float16")
    batch = make_batch(opts, query_lens, seq_lens, 16, torch.float16)
    _scores_below_half_range(batch)
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    assert bool(out.isfinite().all())
    reference = reference_attention(opts, batch)
    torch.testing.assert_close(out.double(), reference, atol=5e-3, rtol=5e-3)


_NON_FINITE_QUERIES = {
    "nan-element": (math.nan, 3),
    "nan-row": (math.nan, None),
    "inf-element": (math.inf, 3),
    "inf-row": (math.inf, None),
    "minus-inf-row": (-math.inf, None),
}


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["many-chunks", "one-chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [5, 1, 3, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize(
    ("seq_lens", "block_size"),
    [([40, 1, 100, 67], 16), ([12, 12, 12, 12], 4)],
    ids=["ragged-16", "even-4"],
)
@pytest.mark.parametrize("case", list(_NON_FINITE_QUERIES))
def test_cpu_attn_pure_torch_gives_nan_where_the_reference_does(
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    seq_lens: list[int],
    block_size: int,
    query_lens: list[int],
    dtype: torch.dtype,
    chunk_bytes: int,
) -> None:
    """A NaN query, or an infinite one (its scores NaN or +-inf), makes its row NaN in
    CPU_ATTN's pure-torch path wherever the float64 reference's softmax is NaN, and leaves
    the other rows as the reference has them, over one key chunk or many. (torch's CPU
    flash kernel, given fewer than 16 keys and no mask, takes a row of all-NaN scores for
    one that sees no key: output 0; the even batch in 4-key chunks is that case.) A NaN key
    merged over many chunks of a ragged batch also reaches its rows."""
    from attn_di.backends import _cpu_kernel, cpu_attn

    monkeypatch.setattr(cpu_attn, "_DECODE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(cpu_attn, "_CHUNK_BYTES", chunk_bytes)
    bad, dim = _NON_FINITE_QUERIES[case]
    opts = Options(num_heads=8, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, query_lens, seq_lens, block_size, dtype)
    batch.query[0, 1, slice(None) if dim is None else dim] = bad
    batch.key[sum(query_lens) - 1, 0, 7] = math.nan  # sequence 3's last key, KV head 0
    batch.full_keys[3][seq_lens[3] - 1, 0, 7] = math.nan
    expected = reference_attention(opts, batch)
    assert bool(expected[0, 64:128].isnan().all())
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    with _cpu_kernel.pure_torch():
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )

    assert torch.equal(out.isnan(), expected.isnan())
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("pure_torch", [True, False], ids=["pure-torch", "default"])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["many-chunks", "one-chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_cpu_attn_a_non_finite_value_stays_in_its_sequence(
    monkeypatch: pytest.MonkeyPatch,
    bad: float,
    dtype: torch.dtype,
    chunk_bytes: int,
    pure_torch: bool,
) -> None:
    """A NaN or infinite value that the longest sequence of a decode batch wrote reaches
    that sequence's rows as the reference has it and no other sequence's rows, whose
    block tables are shorter: the pure-torch decode path gathers whole blocks, its unused
    block-table entries name the longest sequence's first block, and a masked key's
    probability of 0 times Inf is NaN unless those rows are zeroed."""
    from attn_di.backends import _cpu_kernel, cpu_attn

    monkeypatch.setattr(cpu_attn, "_DECODE_CHUNK_BYTES", chunk_bytes)
    opts = Options(num_heads=8, num_kv_heads=2, head_size=64)
    seq_lens = [7, 16, 100, 31]  # sequence 2 is the longest: its first block holds position 9
    batch = make_batch(opts, [1, 1, 1, 1], seq_lens, 16, dtype)
    slot = batch.metadata.block_table[2, 0].long() * 16 + 9
    block, offset = slot_index(batch.kv_cache, slot)
    batch.kv_cache[1][block, offset, 1, 11] = bad
    batch.full_values[2][9, 1, 11] = bad
    expected = reference_attention(opts, batch)
    assert not bool(expected[[0, 1, 3]].isnan().any())
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    with _cpu_kernel.pure_torch() if pure_torch else contextlib.nullcontext():
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )

    assert torch.equal(out.isnan(), expected.isnan())
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1, 1], [257, 257, 257, 257]), ([2], [1025])],
    ids=["decode", "speculative"],
)
def test_cpu_attn_pure_torch_an_infinite_key_alone_in_a_chunk_weighs_nothing(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype
) -> None:
    """A key of score -inf (its channel 0 -inf against positive queries) as the only key of
    sequence 0's last key chunk (256-key chunks in decode, 1024 in the speculative batch,
    with 8 KV heads of 128) gets no weight: torch's CPU flash kernel gives such a chunk a
    log-sum-exp of 0, which merged as a key of score 0 outweighed the real keys (every
    score about -9 here) and gave a wrong finite row."""
    from attn_di.backends import _cpu_kernel, cpu_attn

    opts = Options(num_heads=8, num_kv_heads=8, head_size=128)
    batch = make_batch(opts, query_lens, seq_lens, 16, dtype)
    q_len, last = query_lens[0], seq_lens[0] - 1
    batch.query[:q_len, :, 0] = batch.query[:q_len, :, 0].abs() + 0.5
    batch.query[:q_len, :, 1] = -5.0
    for keys in (batch.kv_cache[0], batch.key, *batch.full_keys):
        keys[..., 1] = 20.0  # with the queries' -5: every real score about -9
    batch.key[q_len - 1, :, 0] = -math.inf  # sequence 0's last key, every KV head
    batch.full_keys[0][last, :, 0] = -math.inf
    expected = reference_attention(opts, batch)
    assert bool(torch.isfinite(expected).all())
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    with _cpu_kernel.pure_torch():
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )

    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("encoder_only", [True, False], ids=["encoder", "decoder"])
def test_alibi_over_long_sequences_keeps_bfloat16_accuracy(
    backend_cls: type[AttentionBackend], encoder_only: bool
) -> None:
    """ALiBi biases of ~30 (slope 0.23 over 137 positions) keep the bfloat16 tolerance: a
    backend that rounds the bias to bfloat16 (steps of 0.125 there) misses it by ~3x, as
    TORCH_SDPA's bfloat16 mask did over bidirectional sequences."""
    opts = Options(
        num_heads=1, num_kv_heads=1, head_size=80, alibi_slopes=[0.2298], encoder_only=encoder_only
    )
    batch = make_batch(opts, [138], [138], 16, torch.bfloat16, seed=100)
    try:
        impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )
    except UnsupportedFeatureError:
        pytest.skip(f"{backend_cls.get_name()} declares no ALiBi or encoder attention")

    tol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=tol, rtol=tol)
