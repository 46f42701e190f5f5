"""CPU_ATTN's compiled decode kernel: numerics on every feature, garbage-proofing, the fallback.

Every numerics test runs the same batch through the kernel and through the pure-torch path
and compares both with the float64 reference (tolerances as in test_correctness.py). The
cache of both holds NaN in every key slot and Inf in every value slot no sequence covers
(on top of make_batch's own garbage), so a path that read past a sequence, into another
sequence's block or a spare block, fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytest_mock import MockerFixture

from attn_di.backend import AttentionMetadata
from attn_di.backends import _cpu_kernel, cpu_attn
from attn_di.exceptions import InvalidInputError, KernelUnavailableWarning
from tests.backends.reference import (
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


requires_kernel = pytest.mark.usefixtures("kernel")


def poison_unused_slots(
    metadata: AttentionMetadata, kv_cache: torch.Tensor, block_size: int
) -> None:
    """Fill every cache slot outside the sequences' positions: keys NaN, values Inf."""
    written = torch.zeros(kv_cache.shape[1] * block_size, dtype=torch.bool)
    for row, seq_len in enumerate(metadata.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks = metadata.block_table[row, positions // block_size].long()
        written[blocks * block_size + positions % block_size] = True
    unwritten = slot_index(kv_cache, torch.nonzero(~written).flatten())
    kv_cache[0][unwritten] = float("nan")
    kv_cache[1][unwritten] = float("inf")


@dataclass
class KernelCase:
    """A decode / chunked-decode batch and layer options."""

    opts: Options
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    dtype: torch.dtype
    seed: int
    layout: str = "declared"


@st.composite
def kernel_cases(draw: st.DrawFn) -> KernelCase:
    """Short queries (1..16 tokens) over ragged contexts with every layer option."""
    ratio = draw(st.sampled_from([1, 2, 3, 4, 6, 7, 8]))  # GQA groups: 4s and 1-3 left
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = ratio * num_kv_heads
    seq_lens = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    query_lens = [draw(st.integers(1, min(s, cpu_attn.KERNEL_MAX_QUERY))) for s in seq_lens]
    opts = Options(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([7, 8, 40, 64, 72, 80, 96, 128, 256])),
        sliding_window=draw(st.none() | st.integers(1, 64)),
        logits_soft_cap=draw(st.none() | st.floats(2.0, 30.0)),
        alibi_slopes=draw(st.none() | st.just([2.0 ** -(h + 1) for h in range(num_heads)])),
        sinks=torch.randn(num_heads) if draw(st.booleans()) else None,
    )
    return KernelCase(
        opts,
        query_lens,
        seq_lens,
        block_size=draw(st.sampled_from([1, 3, 16, 64, 256])),
        dtype=draw(st.sampled_from(list(TOLERANCES))),
        seed=draw(st.integers(0, 2**16)),
        layout=draw(st.sampled_from(list(KV_LAYOUTS))),
    )


def run_both_paths(
    opts: Options, batch: Batch, kernel_calls: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kernel output, pure-torch output)`` of the batch, each on a copy of its cache.

    Both copies have every unused slot poisoned (:func:`poison_unused_slots`).
    """
    poisoned = batch.kv_cache.clone()
    poison_unused_slots(batch.metadata, poisoned, block_size)
    outputs = []
    for pure in (False, True):
        impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())
        kv_cache = poisoned.clone()
        before = len(kernel_calls)
        if pure:
            with _cpu_kernel.pure_torch():
                out = impl.forward(
                    None, batch.query, batch.key, batch.value, kv_cache, batch.metadata
                )
            assert len(kernel_calls) == before
        else:
            out = impl.forward(None, batch.query, batch.key, batch.value, kv_cache, batch.metadata)
            assert len(kernel_calls) == before + 1
        outputs.append(out)
    return outputs[0], outputs[1]


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Finite and within the dtype's tolerance of the float64 reference."""
    assert bool(torch.isfinite(out).all())
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@requires_kernel
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=kernel_cases())
def test_kernel_and_torch_path_match_reference(case: KernelCase, kernel_calls: list[int]) -> None:
    """Both paths match the float64 reference on short queries with every option, NaN around,
    in every cache layout (strided views read in place)."""
    batch = make_batch(
        case.opts,
        case.query_lens,
        case.seq_lens,
        case.block_size,
        case.dtype,
        seed=case.seed,
        layout=case.layout,
    )
    expected = reference_attention(case.opts, batch)

    kernel_out, torch_out = run_both_paths(case.opts, batch, kernel_calls, case.block_size)

    assert_matches(kernel_out, expected, case.dtype)
    assert_matches(torch_out, expected, case.dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize(
    ("features", "block_size"),
    [({}, 16), ({"sliding_window": 1000}, 256), ({"sinks": True, "logits_soft_cap": 30.0}, 1)],
    ids=["plain", "window", "sinks-softcap-block1"],
)
def test_long_context_single_sequence(
    dtype: torch.dtype, features: dict[str, object], block_size: int, kernel_calls: list[int]
) -> None:
    """B=1 over a 32k context (split in partitions, merged by log-sum-exp) is exact."""
    num_heads = 8
    opts = Options(
        num_heads=num_heads,
        num_kv_heads=2,
        head_size=64,
        sliding_window=features.get("sliding_window"),  # type: ignore[arg-type]
        logits_soft_cap=features.get("logits_soft_cap"),  # type: ignore[arg-type]
        sinks=torch.randn(num_heads) if features.get("sinks") else None,
    )
    batch = make_batch(opts, [1], [32768], block_size, dtype)

    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, block_size)

    expected = reference_attention(opts, batch)
    assert_matches(kernel_out, expected, dtype)
    assert_matches(torch_out, expected, dtype)


@requires_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_size"),
    [
        ([1], [560], 32),  # one sequence: split across the threads
        ([1, 1, 1], [600, 600, 600], 16),  # split on 2 threads, one item each on 3
        ([1, 4, 1, 2, 1], [1, 2000, 300, 4097, 90], 24),  # ragged, a block size not 2^k
        # Items of nearly equal work: each thread takes its next one early (the keys to L2).
        ([1] * 8, [560, 560, 559, 558, 530, 520, 560, 1], 128),
    ],
    ids=["one", "three-equal", "ragged-block24", "eight-taken-ahead"],
)
def test_decode_partitions_whatever_the_threads(
    threads: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    kernel_calls: list[int],
) -> None:
    """Decode batches planned for 1-3 threads (whole sequences, or key ranges merged by
    log-sum-exp where that balances the threads better) match the float64 reference."""
    opts = Options(num_heads=9, num_kv_heads=3, head_size=64, sinks=torch.randn(9))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            batch = make_batch(opts, query_lens, seq_lens, block_size, dtype)
            kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, block_size)
            expected = reference_attention(opts, batch)
            assert_matches(kernel_out, expected, dtype)
            assert_matches(torch_out, expected, dtype)
    finally:
        torch.set_num_threads(previous)


@requires_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_ragged_batch_with_chunked_decode(dtype: torch.dtype, kernel_calls: list[int]) -> None:
    """Ragged lengths (one key, partial blocks, long and short) with 1-16 query tokens."""
    opts = Options(num_heads=12, num_kv_heads=4, head_size=96, alibi_slopes=[0.1] * 12)
    seq_lens = [1, 17, 4000, 33, 16, 900, 2, 1500]
    query_lens = [1, 5, 1, 16, 16, 3, 2, 1]
    batch = make_batch(opts, query_lens, seq_lens, 16, dtype, spare_blocks=9)

    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, 16)

    expected = reference_attention(opts, batch)
    assert_matches(kernel_out, expected, dtype)
    assert_matches(torch_out, expected, dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2's heads: queries held in registers (float32)
        (32, 8, 128, 24),  # 16-key tiles across blocks of 24
        (6, 1, 96, 32),  # G = 6: head groups of 4 and 2 rows, pairs at an offset
        (20, 2, 256, 16),  # G = 10, eight chunks of 32 values
        (8, 2, 32, 1),  # G = 4 of 32 (held queries), one-slot blocks: rows gathered
        (4, 4, 32, 7),  # G = 1
    ],
    ids=["smollm2", "g4-d128-block24", "g6-d96", "g10-d256", "g4-d32-block1", "g1-d32"],
)
def test_one_token_decode_register_paths(
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    kernel_calls: list[int],
) -> None:
    """One-token decode of D a multiple of 32, whose scores (float32, <= 3 query rows of 64 or
    <= 4 of 32 per KV head) take queries held in registers and whose P V (bfloat16, the
    avx512_bf16 build) takes VDPBF16PS on key pairs: odd and even lengths (an odd last key
    pairs with a zero row), lengths of 1 and past 16-key tiles, a value of +-Inf at a visible
    key, match the float64 reference on a cache whose unused slots hold NaN keys and Inf
    values."""
    opts = Options(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size)
    seq_lens = [1, 2, 15, 17, 34, 101, 560]
    batch = make_batch(opts, [1] * len(seq_lens), seq_lens, block_size, dtype)
    # Key 40 of the sequence of 101 keys: one value +Inf, another -Inf (the reference's
    # outputs there are +-Inf, every other column finite).
    block = int(batch.metadata.block_table[5, 40 // block_size])
    for plane in (batch.kv_cache[1, block, 40 % block_size], batch.full_values[5][40]):
        plane[0, 3] = math.inf
        plane[kv_heads - 1, head_size - 1] = -math.inf

    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, block_size)

    expected = reference_attention(opts, batch)
    infinite = ~torch.isfinite(expected)
    assert int(infinite.sum()) == 2 * heads // kv_heads  # the group's rows of those columns
    tol = TOLERANCES[dtype]
    for out in (kernel_out, torch_out):
        assert torch.equal(out.double()[infinite], expected[infinite])
        assert bool(torch.isfinite(out[~infinite]).all())
        torch.testing.assert_close(out.double()[~infinite], expected[~infinite], atol=tol, rtol=tol)


@requires_kernel
def test_padding_tokens_are_left_alone(kernel_calls: list[int]) -> None:
    """Padded query rows (past num_actual_tokens, slot -1) are neither read nor written."""
    opts = Options(num_heads=4, num_kv_heads=1, head_size=64)
    batch = make_batch(opts, [1, 1], [100, 7], 16, torch.float32)
    poison_unused_slots(batch.metadata, batch.kv_cache, 16)
    pad = 3
    nan_rows = torch.full((pad, 4, 64), float("nan"))
    query = torch.cat([batch.query, nan_rows])
    key = torch.cat([batch.key, nan_rows[:, :1]])
    value = torch.cat([batch.value, nan_rows[:, :1]])
    batch.metadata.slot_mapping = torch.cat(
        [batch.metadata.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)]
    )
    output = torch.full((2 + pad, 4 * 64), 7.0)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    impl.forward(None, query, key, value, batch.kv_cache, batch.metadata, output=output)

    assert kernel_calls == [1]
    assert_matches(output[:2], reference_attention(opts, batch), torch.float32)
    assert bool((output[2:] == 7.0).all())


@requires_kernel
def test_kernel_rejects_blocks_outside_the_cache() -> None:
    """Called directly with a block number past the cache, the op raises instead of reading."""
    kv_cache = torch.zeros(2, 4, 16, 1, 64)
    query = torch.zeros(1, 2, 64)
    out = torch.empty(1, 2, 64)
    table = torch.tensor([[0, 9]], dtype=torch.int32)
    op = _cpu_kernel.paged_attention_op()

    with pytest.raises(RuntimeError, match="outside"):
        op(query, kv_cache[0], kv_cache[1], table, torch.tensor([20]), torch.tensor([0, 1]), out,
           0.1, 0, 0.0)  # fmt: skip


def _linux_cpu_flags() -> set[str]:
    """The CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


_NO_AMX = "decode: AVX512_BF16 scores, float32 FMA P V (no AMX: "


@requires_kernel
def test_kernel_status_says_how_bfloat16_is_computed() -> None:
    """kernel_status().bfloat16 names the decode kernel's dot products and the prefill
    kernel's GEMMs this build and CPU use (AVX512_BF16 only in that build)."""
    status = _cpu_kernel.kernel_status()
    assert status.bfloat16 is not None
    decode, prefill = status.bfloat16.split("; ")
    if status.isa == "amx":
        assert decode in (
            "decode (D a multiple of 32): one-token queries of <= 16 heads per KV head run both "
            "products on AMX tiles with the value rows in place, other queries of query rows per "
            "KV head x D >= 512 run on AMX tiles, AVX512_BF16 scores and float32 FMA P V "
            "elsewhere",
            # the build runs where Linux refuses the tile state, and says so
            *([decode] if decode.startswith(_NO_AMX) else []),
        )
    elif status.isa == "avx512_bf16":
        assert decode == (
            "decode: AVX512_BF16 scores, AVX512_BF16 P V for one-token queries of D a multiple of "
            "32 (probabilities rounded to bfloat16), float32 FMA P V elsewhere"
        )
    else:
        assert decode == "decode: float32 FMA on converted rows"
    if status.isa == "amx" and not decode.startswith(_NO_AMX):
        assert prefill == "prefill: AMX tile GEMMs (D a multiple of 32, oneDNN's elsewhere)"
    else:
        assert prefill in (
            "prefill: AMX tile GEMMs (oneDNN)",
            "prefill: float32 GEMMs on converted tiles",
        )


def test_the_best_build_follows_torch_and_the_cpu_flags(mocker: MockerFixture) -> None:
    """AMX where torch dispatches to AVX-512 and the CPU reports AMX tiles with bfloat16 and
    avx512_bf16; AVX512_BF16 where it reports avx512_bf16; torch's own set otherwise
    (ATEN_CPU_CAPABILITY=avx2 gives avx2 on any CPU)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 builds")
    amx = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    for capability, flags, best in (
        ("AVX512", amx, "amx"),
        ("AVX512", amx - {"amx_bf16"}, "avx512_bf16"),  # AMX-INT8 alone (no bfloat16 tiles)
        ("AVX2", amx, "avx2"),
        ("AVX512", {"avx512f", "avx512_bf16"}, "avx512_bf16"),
        ("AVX512", {"avx512f"}, "avx512"),
        ("AVX2", {"avx512f", "avx512_bf16"}, "avx2"),
        ("DEFAULT", {"avx512_bf16"}, "default"),
    ):
        mocker.patch.object(torch.backends.cpu, "get_cpu_capability", return_value=capability)
        mocker.patch.object(_cpu_kernel, "_cpu_flags", return_value=frozenset(flags))
        assert _cpu_kernel._best_isa() == best


def test_a_forced_build_must_be_one_this_cpu_runs(
    mocker: MockerFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTN_DI_CPU_KERNEL_ISA picks a build this CPU runs; a misspelt one or one the CPU does
    not run is an InvalidInputError naming the runnable builds (and the closest)."""
    mocker.patch.object(_cpu_kernel, "_best_isa", return_value="avx512")
    monkeypatch.setenv(_cpu_kernel.ENV_ISA, " AVX2 ")
    assert _cpu_kernel._native_isa() == "avx2"
    monkeypatch.setenv(_cpu_kernel.ENV_ISA, "avx51")
    with pytest.raises(InvalidInputError) as misspelt:
        _cpu_kernel._native_isa()
    assert misspelt.value.argument == "ATTN_DI_CPU_KERNEL_ISA"
    assert "not a build; the builds this CPU runs: avx512, avx2, default" in str(misspelt.value)
    assert "did you mean 'avx512'?" in str(misspelt.value)
    monkeypatch.setenv(_cpu_kernel.ENV_ISA, "avx512_bf16")
    with pytest.raises(InvalidInputError, match="which this CPU does not run"):
        _cpu_kernel._native_isa()
    monkeypatch.setenv(_cpu_kernel.ENV_ISA, "")
    assert _cpu_kernel._native_isa() == "avx512"


@requires_kernel
def test_kernel_is_built_for_torchs_instruction_set() -> None:
    """The loaded build targets what torch dispatches to on this CPU (never -march=native)."""
    status = _cpu_kernel.kernel_status()
    capability = torch.backends.cpu.get_cpu_capability().lower()
    expected = capability if capability in ("avx2", "avx512") else "default"
    if expected == "avx512" and {"avx512_bf16", "amx_tile", "amx_bf16"} <= _linux_cpu_flags():
        expected = "amx"
    elif expected == "avx512" and "avx512_bf16" in _linux_cpu_flags():
        expected = "avx512_bf16"

    assert status.isa == expected
    assert torch.ops.attn_di.isa() == expected
    assert status.describe() == f"compiled decode and prefill kernels ({expected})"
    assert all("march" not in flag for isa in _cpu_kernel.ISAS for flag in _cpu_kernel._flags(isa))


@requires_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime() -> None:
    """The kernel runs on torch's own OpenMP runtime: one libgomp in the process, not two."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "gomp" in line.split()[-1]}

    assert len(libraries) == 1, libraries


def _objdump(library: str, *options: str) -> str:
    """What binutils' objdump prints for ``library`` with ``options``."""
    done = subprocess.run(
        ["objdump", *options, library], capture_output=True, text=True, check=True
    )
    return done.stdout


@requires_kernel
@pytest.mark.skipif(
    shutil.which("objdump") is None or platform.machine() != "x86_64",
    reason="reads the x86-64 build's instructions with binutils' objdump",
)
def test_the_build_keeps_the_prefetches_its_source_asks_for() -> None:
    """GCC deletes every call of a helper made only of ``__builtin_prefetch`` that it did not
    inline first (kernel.h's ATTN_DI_PREFETCH_HELPER). In the loaded GCC build, per dtype, the
    decode kernel keeps its L2 prefetches (PREFETCHT1: the item's value rows in pass 1, the
    next item's key rows in pass 2) and its key and value row touches (PREFETCHT0), two
    instructions each (prefetch_row's two branches), and each prefill instantiation its query
    prefetch (one) and its output prefetch (two). Counted per class, so it reads GCC's choice
    to keep run_item out of line; other compilers are not read."""
    library = _cpu_kernel.kernel_status().library
    assert library is not None
    if "clang" in _objdump(library, "-s", "-j", ".comment"):
        pytest.skip("the counts are GCC's; this build is clang's")
    found: dict[str, Counter[str]] = {}
    owner = ""
    member = re.compile(r"[0-9a-f]+ <attn_di_kernel::[^<]*((?:Kernel|Prefill)<[^>]*>)::")
    for line in _objdump(library, "-d", "-C", "--no-show-raw-insn").splitlines():
        if header := member.match(line):
            owner = header.group(1)
        elif line.endswith(">:"):
            owner = ""
        elif owner and (op := re.search(r"\s(prefetch\w*)\s", line)):
            found.setdefault(owner, Counter())[op.group(1)] += 1
    dtypes = ("float", "c10::BFloat16", "c10::Half")

    for dtype in dtypes:
        decode = found.get(f"Kernel<{dtype}>", Counter())
        assert decode["prefetcht1"] >= 4, (dtype, found)
        assert decode["prefetcht0"] >= 4, (dtype, found)
    prefill = {owner: sum(count.values()) for owner, count in found.items() if "Prefill<" in owner}
    assert len(prefill) == 5, found
    assert min(prefill.values()) >= 3, found


@pytest.mark.skipif(shutil.which(_cpu_kernel._compiler()) is None, reason="no compiler")
def test_kernel_is_active_where_a_compiler_exists() -> None:
    """With a C++ compiler present (as in CI), the kernel is built and used, not skipped."""
    status = _cpu_kernel.kernel_status()

    assert status.active, status.reason


@pytest.fixture(name="fresh_kernel_state")
def _fresh_kernel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's kernel status for one test (restored afterwards)."""
    monkeypatch.setattr(_cpu_kernel, "_STATUS", None)
    monkeypatch.setattr(_cpu_kernel, "_OP", None)


@pytest.mark.usefixtures("fresh_kernel_state")
def test_build_failure_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    """A kernel that cannot be built: one KernelUnavailableWarning, then exact torch results."""

    def fail(isa: str) -> None:
        raise RuntimeError("Error building extension 'attn_di_cpu' (simulated)")

    monkeypatch.setattr(_cpu_kernel, "_load", fail)
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, sinks=torch.randn(4))
    batch = make_batch(opts, [1, 1, 1], [40, 1, 100], 16, torch.float32)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    def forward() -> torch.Tensor:
        return impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )

    with pytest.warns(KernelUnavailableWarning) as record:
        first, second = forward(), forward()

    assert len(record) == 1
    warning = record[0].message
    assert isinstance(warning, KernelUnavailableWarning)
    assert "simulated" in warning.reason
    assert str(warning).startswith("CPU_ATTN's compiled kernel is unavailable (RuntimeError:")
    assert "Hint: " in str(warning)
    assert kernel_calls == []
    expected = reference_attention(opts, batch)
    assert_matches(first, expected, torch.float32)
    torch.testing.assert_close(second, first)
    status = _cpu_kernel.kernel_status()
    assert not status.active
    assert status.describe().startswith("pure torch: RuntimeError: Error building extension")


@pytest.fixture(name="nothing_loaded")
def _nothing_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader sees no kernel registered in this process, as in a fresh one (for tests
    whose cache holds no build to load: loading one beside the registered ops would abort)."""
    monkeypatch.setattr(_cpu_kernel, "_registered", lambda: False)


@pytest.mark.usefixtures("fresh_kernel_state", "nothing_loaded")
def test_missing_compiler_is_named_in_the_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No compiler on PATH (and nothing built): the warning says so and how to fix it."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ there
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, os.devnull + "-absent")

    with pytest.warns(KernelUnavailableWarning, match="no C.. compiler") as record:
        status = _cpu_kernel.kernel_status()

    assert not status.active
    assert "apt-get install g++" in str(record[0].message)


@pytest.mark.usefixtures("fresh_kernel_state")
def test_switch_chooses_pure_torch_without_warning(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]
) -> None:
    """ATTN_DI_CPU_KERNEL=0 picks the pure-torch path quietly (warnings are errors here)."""
    monkeypatch.setenv(_cpu_kernel.ENV_SWITCH, "0")
    opts = Options(num_heads=2, num_kv_heads=1, head_size=64)
    batch = make_batch(opts, [1], [50], 16, torch.float32)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    assert kernel_calls == []
    assert (
        _cpu_kernel.kernel_status().describe() == "pure torch: switched off (ATTN_DI_CPU_KERNEL=0)"
    )
    assert_matches(out, reference_attention(opts, batch), torch.float32)


@pytest.mark.usefixtures("fresh_kernel_state")
def test_switch_refuses_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that is neither on nor off is an error naming the variable, not ignored."""
    monkeypatch.setenv(_cpu_kernel.ENV_SWITCH, "fast")

    with pytest.raises(InvalidInputError) as caught:
        _cpu_kernel.kernel_status()

    assert caught.value.argument == "ATTN_DI_CPU_KERNEL"
    assert (
        caught.value.hint
        == "set ATTN_DI_CPU_KERNEL=1 (use the compiled kernel) or 0 (pure torch), "
        "or unset it for the default"
    )


def test_prefills_and_mixed_batches_take_the_kernel(kernel_calls: list[int]) -> None:
    """A batch with a query longer than KERNEL_MAX_QUERY (a prefill beside a decode) goes
    through the compiled kernels whole: one call, the prefill kernel taking the long one."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    long_query = cpu_attn.KERNEL_MAX_QUERY + 1
    batch = make_batch(opts, [long_query, 1], [long_query, 30], 16, torch.float32)
    poison_unused_slots(batch.metadata, batch.kv_cache, 16)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    assert kernel_calls == [1]
    assert_matches(out, reference_attention(opts, batch), torch.float32)


def test_poison_helper_leaves_written_slots() -> None:
    """The NaN helper poisons exactly the slots no sequence covers."""
    opts = Options(num_heads=2, num_kv_heads=1, head_size=8)
    batch = make_batch(opts, [1, 1], [5, 20], 16, torch.float32, spare_blocks=2, fill="zero")

    poison_unused_slots(batch.metadata, batch.kv_cache, 16)

    poisoned = torch.isnan(batch.kv_cache[0]).any(-1).any(-1).sum()
    total = batch.kv_cache.shape[1] * 16
    assert int(poisoned) == total - 25
    assert int(torch.isinf(batch.kv_cache[1]).any(-1).any(-1).sum()) == total - 25


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_one_impl_shared_by_threads_matches_one_thread(path: str) -> None:
    """Four threads forwarding different batches through one impl get the one-thread results."""
    if path == "kernel" and not _cpu_kernel.kernel_status().active:
        pytest.skip(f"CPU_ATTN's kernel: {_cpu_kernel.kernel_status().describe()}")
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, sinks=torch.randn(4))
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())
    # Prefills (the grouped path) and pure decode, of different sizes: every workspace user.
    shapes = [([40, 1], [40, 300]), ([1, 1, 1], [700, 90, 5]), ([33], [33]), ([1], [2000])]
    batches = [make_batch(opts, q, s, 16, torch.float32, seed=i) for i, (q, s) in enumerate(shapes)]

    def forward(batch: Batch) -> torch.Tensor:
        return impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata
        )

    with _cpu_kernel.pure_torch() if path == "torch" else contextlib.nullcontext():
        expected = [forward(batch) for batch in batches]
        barrier = threading.Barrier(len(batches))
        results: list[list[torch.Tensor]] = [[] for _ in batches]

        def worker(index: int) -> None:
            barrier.wait()
            for _ in range(15):
                results[index].append(forward(batches[index]))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    for outs, want in zip(results, expected, strict=True):
        assert len(outs) == 15
        for out in outs:
            torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@requires_kernel
def test_sinks_updated_in_place_reach_the_kernel(kernel_calls: list[int]) -> None:
    """bf16 sinks changed in place after a first call (as load_state_dict does) are used."""
    sinks = torch.zeros(4, dtype=torch.bfloat16)
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, sinks=sinks)
    batch = make_batch(opts, [1, 3], [60, 20], 16, torch.bfloat16)
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())
    assert impl.sinks is sinks
    impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata)

    sinks.fill_(5.0)
    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, 16)
    # run_both_paths makes new impls: also the first impl, whose options are cached.
    again = impl.forward(
        None, batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata
    )

    expected = reference_attention(opts, batch)
    assert_matches(torch_out, expected, torch.bfloat16)
    assert_matches(kernel_out, expected, torch.bfloat16)
    assert_matches(again, expected, torch.bfloat16)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_strided_output_is_filled(path: str) -> None:
    """A non-contiguous ``output=`` (every other column) gets the result on both paths."""
    if path == "kernel" and not _cpu_kernel.kernel_status().active:
        pytest.skip(f"CPU_ATTN's kernel: {_cpu_kernel.kernel_status().describe()}")
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [1, 2], [50, 9], 16, torch.float32)
    storage = torch.full((3, 2 * 4 * 64), 7.0)
    output = storage[:, ::2]
    impl = cpu_attn.CPUAttentionImpl(**opts.impl_kwargs())

    with _cpu_kernel.pure_torch() if path == "torch" else contextlib.nullcontext():
        result = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, output
        )

    assert result is output
    assert_matches(output, reference_attention(opts, batch), torch.float32)
    assert bool((storage[:, 1::2] == 7.0).all())


def _copy_of_this_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler: str | None = None
) -> tuple[Path, Path]:
    """``(build directory, library)``: this CPU's build, copied into a new cache in tmp_path
    under the name a process with this environment looks for.

    ``compiler``: set ``CXX`` to it first (the build then stands for one made by that
    compiler: a name not on PATH makes a machine whose image holds a build but no compiler).
    """
    status = _cpu_kernel.kernel_status()
    if not status.active or status.library is None or status.isa is None:
        pytest.skip(f"CPU_ATTN's kernel: {status.describe()}")
    source = Path(status.library)
    if compiler is not None:
        monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, str(tmp_path / "cache"))
    name, directory = _cpu_kernel._build_dir(status.isa)
    shutil.copytree(source.parent, directory)
    (directory / source.name).rename(directory / f"{name}.so")
    return directory, directory / f"{name}.so"


def _damage(library: Path, how: str) -> None:
    """Truncate the library to half, or overwrite its middle with garbage (same size)."""
    data = library.read_bytes()
    if how == "truncated":
        library.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        library.write_bytes(data[:middle] + b"\xff" * 4096 + data[middle + 4096 :])


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_damaged_build_without_compiler_falls_back_naming_it(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged cached library is never loaded: without a compiler, one warning names it."""
    directory, library = _copy_of_this_build(tmp_path, monkeypatch, "attn-di-no-such-compiler")
    _damage(library, how)
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    env.pop(_cpu_kernel.ENV_SWITCH, None)

    done = subprocess.run(
        [sys.executable, "-m", "attn_di.backends._cpu_kernel", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stderr  # a dlopen of the truncated file: SIGBUS
    assert done.stdout.startswith("CPU_ATTN runs: pure torch: CPU_ATTN's kernel in ")
    assert f"in {directory} is damaged" in done.stdout
    assert done.stderr.count("KernelUnavailableWarning") == 1
    assert f"delete {directory}" in done.stderr
    assert "build --force" in done.stderr


@pytest.fixture(name="fake_compile")
def _fake_compile(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces the compiler with one that writes a small file; lists the libraries built."""
    built: list[Path] = []

    def compile_(name: str, isa: str, directory: Path, verbose: bool) -> None:
        library = directory / f"{name}.so"
        library.write_bytes(b"rebuilt %d" % len(built))
        built.append(library)

    monkeypatch.setattr(_cpu_kernel, "_compile", compile_)
    monkeypatch.setenv("CXX", sys.executable)  # a compiler "on PATH"
    return built


def test_damaged_build_is_rebuilt_and_force_rebuilds(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_compile: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A damaged build is rebuilt (announced at WARNING); a good one is reused; force rebuilds."""
    directory, library = _copy_of_this_build(tmp_path, monkeypatch)
    isa = _cpu_kernel._native_isa()
    assert _cpu_kernel.build(isa) == library
    assert fake_compile == []  # the copied build verifies
    _damage(library, "truncated")

    with caplog.at_level(logging.WARNING, logger="attn_di.backends"):
        assert _cpu_kernel.build(isa) == library

    (built,) = fake_compile  # built in a directory of its own, then renamed into place
    assert built.name == library.name
    assert built.parent != directory
    assert library.read_bytes() == b"rebuilt 0"
    assert sorted(p.name for p in directory.parent.iterdir()) == [
        directory.name,
        f"{directory.name}.lock",
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"building CPU_ATTN's kernel once (~20 s) into {directory}"
    ]
    assert caplog.records[0].levelno == logging.WARNING
    assert _cpu_kernel.build(isa) == library
    assert len(fake_compile) == 1
    assert _cpu_kernel.build(isa, force=True) == library
    assert library.read_bytes() == b"rebuilt 1"


@pytest.mark.usefixtures("fresh_kernel_state", "nothing_loaded", "fake_compile")
def test_unusable_cache_directory_is_named_in_the_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTN_DI_KERNEL_CACHE naming a file: the fallback warning names the variable and path."""
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, str(not_a_directory))

    with pytest.warns(KernelUnavailableWarning) as record:
        status = _cpu_kernel.kernel_status()

    assert not status.active
    warning = record[0].message
    assert isinstance(warning, KernelUnavailableWarning)
    assert f"ATTN_DI_KERNEL_CACHE={not_a_directory} is not a usable directory" in warning.reason
    assert warning.hint == (
        f"set ATTN_DI_KERNEL_CACHE to a writable directory (it is "
        f"ATTN_DI_KERNEL_CACHE={not_a_directory}); CPU_ATTN works meanwhile"
    )


def test_status_command_reports_a_bad_switch_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m attn_di.backends._cpu_kernel status`` with a bad switch: one line, exit 2."""
    env = {**os.environ, _cpu_kernel.ENV_SWITCH: "fast"}

    done = subprocess.run(
        [sys.executable, "-m", "attn_di.backends._cpu_kernel", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith(
        "python -m attn_di.backends._cpu_kernel: error: ATTN_DI_CPU_KERNEL: is 'fast', not one of"
    )
    assert lines[1:] == [
        "hint: set ATTN_DI_CPU_KERNEL=1 (use the compiled kernel) or 0 (pure torch), or unset "
        "it for the default"
    ]


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "head-major view"])
def test_compiled_cache_write_matches_the_torch_write(dtype: torch.dtype, layout: str) -> None:
    """write_kv_cache writes what index_copy_ writes (padding slots skipped, strided rows
    read through their strides) and leaves every other slot's garbage as it was."""
    from attn_di.backends._common import write_kv_cache

    op = _cpu_kernel.write_kv_cache_op()
    assert op is not None
    generator = torch.Generator().manual_seed(0)
    if layout == "contiguous":
        key = torch.randn(7, 3, 40, generator=generator).to(dtype)
        value = torch.randn(7, 3, 40, generator=generator).to(dtype)
    else:  # [H_kv, N, D] transposed to [N, H_kv, D], as a model's projections often come
        key = torch.randn(3, 7, 40, generator=generator).to(dtype).transpose(0, 1)
        value = torch.randn(3, 7, 40, generator=generator).to(dtype).transpose(0, 1)
    slots = torch.tensor([5, -1, 0, 63, 17, -1, 30])
    expected = torch.full((2, 4, 16, 3, 40), float("nan"), dtype=dtype)
    got = expected.clone()
    write_kv_cache(key, value, expected, slots)
    op(key, value, got[0], got[1], slots)
    torch.testing.assert_close(got, expected, equal_nan=True, atol=0, rtol=0)
    assert int(got.isnan().any(dim=(-1, -2)).sum()) == 2 * 64 - 2 * 5  # five slots written


@requires_kernel
def test_compiled_cache_write_refuses_a_slot_outside_before_writing() -> None:
    """A slot past the cache is refused with nothing written (the impl checks it earlier)."""
    op = _cpu_kernel.write_kv_cache_op()
    assert op is not None
    kv_cache = torch.zeros(2, 1, 4, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 4 is outside the cache"):
        op(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kv_cache[0], kv_cache[1], torch.tensor([0, 4]))
    assert not bool(kv_cache.any())


_RACE_SCRIPT = """
import sys, time
from pathlib import Path
from attn_di.backends import _cpu_kernel

log, go = Path(sys.argv[1]), Path(sys.argv[2])

def compile_(name, isa, directory, verbose):  # a compiler that takes a while
    with log.open("a") as out:
        out.write(f"compile {directory}\\n")
    time.sleep(1.0)
    library = Path(directory) / f"{name}.so"
    library.write_bytes(b"built by %d" % len(log.read_text().splitlines()))

_cpu_kernel._compile = compile_
while not go.exists():  # start together
    time.sleep(0.01)
print(_cpu_kernel.build("default"))
"""


def test_processes_building_at_once_build_once(tmp_path: Path) -> None:
    """Six processes asking for one build in an empty cache at the same moment: one compiles,
    the others wait for it and get the same library; nothing half-built is left behind."""
    script = tmp_path / "race.py"
    script.write_text(_RACE_SCRIPT)
    log, go, cache = tmp_path / "compiles.log", tmp_path / "go", tmp_path / "cache"
    env = {**os.environ, _cpu_kernel.ENV_CACHE: str(cache), "CXX": sys.executable}
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(log), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    time.sleep(1.0)  # let every process get to the start line
    go.touch()
    results = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0] * 6, results
    libraries = {stdout.strip() for stdout, _ in results}
    assert len(libraries) == 1
    (library,) = (Path(path) for path in libraries)
    assert len(log.read_text().splitlines()) == 1
    assert library.read_bytes() == b"built by 1"
    assert sorted(p.name for p in cache.iterdir()) == [
        library.parent.name,
        f"{library.parent.name}.lock",
    ]


def test_processes_starting_together_all_get_the_kernel(tmp_path: Path) -> None:
    """Three processes using CPU_ATTN's kernel for the first time on an empty cache: all end
    with the compiled kernel, built once (the real compiler; about 20 s)."""
    if shutil.which(_cpu_kernel._compiler()) is None:
        pytest.skip("no C++ compiler")
    env = {**os.environ, _cpu_kernel.ENV_CACHE: str(tmp_path / "cache")}
    env.pop(_cpu_kernel.ENV_SWITCH, None)
    code = (
        "from attn_di.backends import _cpu_kernel\nprint(_cpu_kernel.kernel_status().describe())\n"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [process.communicate(timeout=600) for process in processes]
    assert [stdout.strip() for stdout, _ in results] == [
        f"compiled decode and prefill kernels ({_cpu_kernel._native_isa()})"
    ] * 3, results
    stderr = "".join(err for _, err in results)
    assert stderr.count("building CPU_ATTN's kernel once") == 1, stderr
    assert "KernelUnavailableWarning" not in stderr


_READ_ONLY_SCRIPT = """
import builtins, errno, io, json, os, warnings

root = os.environ["ATTN_DI_KERNEL_CACHE"]
writes = []

def guard(path, writing):
    # A read-only file system: any write under the cache root fails with EROFS (and is noted).
    if writing and not isinstance(path, int) and os.fspath(path).startswith(root):
        writes.append(os.fspath(path))
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

real_open, real_os_open = io.open, os.open

def fake_open(file, mode="r", *args, **kwargs):
    guard(file, any(flag in mode for flag in "wax+"))
    return real_open(file, mode, *args, **kwargs)

def fake_os_open(path, flags, *args, **kwargs):
    guard(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
    return real_os_open(path, flags, *args, **kwargs)

def refusing(function):
    def call(path, *args, **kwargs):
        guard(path, True)
        return function(path, *args, **kwargs)
    return call

io.open = builtins.open = fake_open
os.open = fake_os_open
for name in ("mkdir", "makedirs", "rename", "replace", "remove", "unlink", "rmdir"):
    setattr(os, name, refusing(getattr(os, name)))

import torch
from attn_di.backends import _cpu_kernel

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    status = _cpu_kernel.kernel_status()
print(json.dumps({
    "status": status.describe(), "library": status.library, "writes": writes,
    "warnings": [str(w.message) for w in caught], "running": torch.ops.attn_di.isa(),
}))
"""


@pytest.mark.parametrize("lock_file", [True, False], ids=["with-lock-file", "without-lock-file"])
def test_a_read_only_cache_with_a_verified_build_is_loaded_without_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock_file: bool
) -> None:
    """A cache holding a complete, verified build on a read-only file system (a container
    image, a read-only mount) is loaded as it is: nothing is opened for writing (loading took
    the build lock by opening its file for appending, failed, and fell back to pure torch).

    Root ignores permission bits, so ``chmod -R a-w`` alone proves nothing here: in a process
    of its own every write under the cache (open for writing, os.open with a write flag,
    mkdir, rename, remove) fails with EROFS, as on a read-only mount, and is recorded."""
    directory, library = _copy_of_this_build(tmp_path, monkeypatch, "attn-di-no-such-compiler")
    cache = directory.parent
    if lock_file:
        (cache / f"{directory.name}.lock").write_bytes(b"")
    for path in (*cache.rglob("*"), cache):
        path.chmod(path.stat().st_mode & ~0o222)
    env = {**os.environ}
    env.pop(_cpu_kernel.ENV_SWITCH, None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READ_ONLY_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for path in (cache, *cache.rglob("*")):
            path.chmod(path.stat().st_mode | 0o200)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    native = _cpu_kernel._native_isa()
    assert report == {
        "status": f"compiled decode and prefill kernels ({native})",
        "library": str(library),
        "writes": [],
        "warnings": [],
        "running": native,
    }


_BUILD_IN_A_USER_SCRIPT = """
import json, torch
from attn_di.backends import _cpu_kernel

native = _cpu_kernel._native_isa()
_cpu_kernel.build("default")  # before first use: loads nothing here
registered_by_the_build = hasattr(torch.ops.attn_di, "paged_attention")
status = _cpu_kernel.kernel_status()
running = torch.ops.attn_di.isa()
_cpu_kernel.build("default", force=True)  # in a process that runs the kernel: it lives on
print(json.dumps({
    "registered_by_the_build": registered_by_the_build,
    "status": [status.active, status.isa, status.library],
    "running": running,
    "loaded": sorted(torch.ops.loaded_libraries),
    "after": _cpu_kernel.kernel_status().describe(),
}))
"""


@pytest.mark.skipif(shutil.which(_cpu_kernel._compiler()) is None, reason="no compiler")
def test_a_build_never_loads_into_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build(isa="default")`` before first use registers nothing (kernel_status named this
    CPU's build while the default one ran), and ``build(force=True)`` in a process running the
    kernel leaves it running (a second TORCH_LIBRARY(attn_di) aborted the process, a
    ``.building-*`` directory left behind). Two real compiles (about 20 s each)."""
    directory, library = _copy_of_this_build(tmp_path, monkeypatch)
    env = {**os.environ}
    env.pop(_cpu_kernel.ENV_SWITCH, None)

    done = subprocess.run(
        [sys.executable, "-c", _BUILD_IN_A_USER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert done.returncode == 0, done.stderr  # -6 (SIGABRT) before
    report = json.loads(done.stdout.splitlines()[-1])
    native = _cpu_kernel._native_isa()
    assert report == {
        "registered_by_the_build": False,
        "status": [True, native, str(library)],
        "running": native,
        "loaded": [str(library)],
        "after": f"compiled decode and prefill kernels ({native})",
    }
    leftovers = [
        p.name for p in directory.parent.iterdir() if ".building-" in p.name or ".old-" in p.name
    ]
    assert leftovers == []


def test_a_failed_build_reports_the_compiler_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that fails: the RuntimeError names the build process's exit status and its
    last output lines; the staging directory is gone."""
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", shutil.which("false") or "false")

    with pytest.raises(
        RuntimeError,
        match=r"Error building extension 'attn_di_cpu_default_\w+': "
        r"the build process exited with status 1",
    ):
        _cpu_kernel.build("default")

    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        f"{_cpu_kernel._build_dir('default')[0]}.lock"
    ]


def test_a_build_is_named_by_the_compiler_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """CXX enters the build's name, so a build made by one compiler is never loaded for
    another; the default (unset) is ``c++``, and nothing is run to name it (a machine without
    a compiler finds its image's build)."""
    monkeypatch.delenv("CXX", raising=False)
    unset = _cpu_kernel._build_dir("default")[0]
    monkeypatch.setenv("CXX", "c++")
    assert _cpu_kernel._build_dir("default")[0] == unset
    monkeypatch.setenv("CXX", "clang++")
    clang = _cpu_kernel._build_dir("default")[0]
    assert clang != unset
    assert clang.startswith("attn_di_cpu_default_")
    monkeypatch.setenv("CXX", "/nonexistent/compiler")
    assert _cpu_kernel._build_dir("default")[0] not in (unset, clang)
    monkeypatch.setenv("CXX", "")  # as scripts/setup.sh reads it: the default
    assert _cpu_kernel._build_dir("default")[0] == unset


@pytest.mark.usefixtures("fresh_kernel_state", "nothing_loaded")
def test_a_cxx_not_on_path_is_named_as_cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CXX set to something not on PATH: the reason names CXX and the hint says to fix or
    unset it (installing a compiler would not help)."""
    monkeypatch.setenv("CXX", "attn-di-no-such-compiler")
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, str(tmp_path / "cache"))

    with pytest.raises(RuntimeError) as caught:
        _cpu_kernel.build("default")

    assert "no C++ compiler (CXX='attn-di-no-such-compiler' is not on PATH)" in str(caught.value)
    assert getattr(caught.value, "hint", "").startswith("set CXX to an installed compiler")


# Where a non-finite value goes in (what, its value): a key every query row of KV head 0 sees,
# one query row's query, one element of a value row every query row of KV head 0 sees. (A NaN
# sink never gets this far: the impl refuses it, typed.)
_NON_FINITE = {
    "nan-key": ("key", math.nan),
    "inf-key": ("key", math.inf),
    "nan-query": ("query", math.nan),
    "inf-query": ("query", math.inf),
    "nan-value": ("value", math.nan),
}
# (query length, head size): the decode kernel on vector registers, on AMX tiles (bfloat16
# on the amx build), and the prefill kernel.
_KERNEL_PATHS = {"decode": (1, 64), "decode-tiles": (4, 128), "prefill": (20, 64)}


@requires_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("path", list(_KERNEL_PATHS))
@pytest.mark.parametrize("case", list(_NON_FINITE))
def test_non_finite_inputs_reach_the_output_as_the_reference_has_them(
    case: str, path: str, dtype: torch.dtype, kernel_calls: list[int]
) -> None:
    """A NaN or infinite key, or a NaN or infinite query, that a query row sees gives that
    row NaN where the float64 reference gives NaN, never zeros or a finite row that left the
    key out; the other rows are unaffected. (The kernels' exp once clamped a NaN score to a
    probability of ~0, and their maxima dropped NaN.) The pure-torch path agrees (it once
    gave finite rows for an infinite key in bfloat16 / float16)."""
    what, bad = _NON_FINITE[case]
    q_len, head_size = _KERNEL_PATHS[path]
    opts = Options(num_heads=8, num_kv_heads=2, head_size=head_size)
    batch = make_batch(opts, [q_len, 1], [40, 70], 16, dtype)
    if what == "key":  # the first new token of sequence 0 (position 40 - q_len), KV head 0
        batch.key[0, 0, 5] = bad
        batch.full_keys[0][40 - q_len, 0, 5] = bad
    elif what == "value":
        batch.value[0, 0, 5] = bad
        batch.full_values[0][40 - q_len, 0, 5] = bad
    else:
        batch.query[0, 1, 3] = bad
    expected = reference_attention(opts, batch)
    assert bool(expected.isnan().any())  # the case does poison some rows

    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, 16)

    tol = TOLERANCES[dtype]
    for out in (kernel_out, torch_out):
        assert torch.equal(out.isnan(), expected.isnan())
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, equal_nan=True)


def _infinite_key_dim(batch: Batch, seq: int, first: int, last: int, dim: int) -> None:
    """Set ``dim`` of KV head 0's keys at positions [first, last) of sequence ``seq`` to +inf,
    in the cache (the cached prefix), the step's keys (the new tokens) and the reference's."""
    table = batch.metadata.block_table
    seq_len = batch.full_keys[seq].shape[0]
    q_len = batch.query_lens[seq]
    start = sum(batch.query_lens[:seq])
    block_size = int(batch.kv_cache.shape[2])
    for pos in range(first, last):
        if pos < seq_len - q_len:
            slot = table[seq, pos // block_size].long() * block_size + pos % block_size
            block, offset = slot_index(batch.kv_cache, slot)
            batch.kv_cache[0][block, offset, 0, dim] = math.inf
        else:
            batch.key[start + pos - (seq_len - q_len), 0, dim] = math.inf
        batch.full_keys[seq][pos, 0, dim] = math.inf


@requires_kernel
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("path", list(_KERNEL_PATHS))
def test_rows_that_see_only_minus_inf_scores_get_nan_as_the_reference(
    path: str, dtype: torch.dtype, sinks: bool, kernel_calls: list[int]
) -> None:
    """KV head 0's keys +inf in one dimension: query heads negative there score -inf on those
    keys, positive ones +inf. A row whose every visible score is -inf is NaN in the float64
    reference (-inf - (-inf)), or 0 with a finite sink (the sink takes all the weight), never
    the 0 of a row that saw nothing; a row with any finite score is finite. Sequence 0 has
    infinite keys only, sequence 1 in its first 300 of 700 positions; 700 keys are split into
    key ranges (merged) on two threads. The pure-torch path agrees (it once gave such rows 0
    without a sink)."""
    q_len, head_size = _KERNEL_PATHS[path]
    sink_values = torch.full((8,), 0.5) if sinks else None
    opts = Options(num_heads=8, num_kv_heads=2, head_size=head_size, sinks=sink_values)
    batch = make_batch(opts, [q_len, q_len], [700, 700], 16, dtype)
    _infinite_key_dim(batch, 0, 0, 700, 5)
    _infinite_key_dim(batch, 1, 0, 300, 5)
    batch.query[:, 0:2, 5] = -1.0  # heads 0 and 1 (KV head 0) score -inf
    batch.query[:, 2:4, 5] = 1.0  # heads 2 and 3 score +inf: NaN either way
    expected = reference_attention(opts, batch)
    seq0 = slice(0, q_len)
    assert bool(expected[seq0, 0 : 2 * head_size].isnan().all()) != sinks
    assert not bool(expected[q_len:, 0 : 2 * head_size].isnan().any())

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outputs = run_both_paths(opts, batch, kernel_calls, 16)
    finally:
        torch.set_num_threads(previous)

    tol = TOLERANCES[dtype]
    for out in outputs:
        assert torch.equal(out.isnan(), expected.isnan())
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, equal_nan=True)


@requires_kernel
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("slope", [90.0, 100.0])
def test_an_infinite_value_under_a_vanishing_probability_stays_non_finite(
    slope: float, dtype: torch.dtype, kernel_calls: list[int]
) -> None:
    """An ALiBi slope of 90-100 puts the cached key ~90-100 below the new one: its float32
    probability is below the normal range, which the kernels' exp flushes to 0, and an
    infinite value there gives NaN where the float64 reference has +inf (0 x Inf;
    docs/guides/reliability.md). The column is non-finite either way, never a finite
    number, and the other columns match the reference."""
    opts = Options(num_heads=1, num_kv_heads=1, head_size=32, alibi_slopes=[slope])
    batch = make_batch(opts, [1], [2], 16, dtype)
    slot = batch.metadata.block_table[0, 0].long() * 16  # position 0, cached
    block, offset = slot_index(batch.kv_cache, slot)
    batch.kv_cache[1][block, offset, 0, 5] = math.inf
    batch.full_values[0][0, 0, 5] = math.inf
    expected = reference_attention(opts, batch)
    assert math.isinf(float(expected[0, 5]))

    kernel_out, _ = run_both_paths(opts, batch, kernel_calls, 16)

    assert not math.isfinite(float(kernel_out[0, 5]))
    others = torch.arange(32) != 5
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        kernel_out[:, others].double(), expected[:, others], atol=tol, rtol=tol
    )


def test_the_build_command_shows_why_and_what_to_do(tmp_path: Path) -> None:
    """``python -m attn_di.backends._cpu_kernel build`` that cannot build exits 1 with the
    reason and the hint, each on its own line."""
    env = {**os.environ, "CXX": "attn-di-no-such-compiler", _cpu_kernel.ENV_CACHE: str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "attn_di.backends._cpu_kernel", "build", "--isa", "default"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "CPU_ATTN's kernel was not built: no C++ compiler "
        "(CXX='attn-di-no-such-compiler' is not on PATH) to build CPU_ATTN's kernel"
    )
    assert lines[1].startswith("hint: set CXX to an installed compiler, or unset it, then run")
