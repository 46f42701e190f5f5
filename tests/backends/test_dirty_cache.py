"""Whatever the slots a batch does not cover hold (NaN, +-Inf), every backend gives the same output.

A server allocates its KV cache uninitialised and reuses blocks, so the tail of a
sequence's last block, stale block-table entries and padding tokens hold anything. Each case
here runs once on a cache from ``dirty_kv_cache`` and once on a zero-filled one built from
the same seed, and checks that the outputs are finite, identical, and equal to the float64
reference. For CPU_ATTN each case also checks which of its paths ran.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from pytest_mock import MockerFixture

from attn_di.backend import AttentionBackend
from attn_di.backends import _cpu_kernel, cpu_attn
from attn_di.backends._common import BatchPlan, cache_rows
from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from attn_di.exceptions import UnsupportedFeatureError
from tests.backends.reference import DIRTY_FILLS, Options, make_batch, reference_attention

TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
BASE = Options(num_heads=8, num_kv_heads=2, head_size=64)
MIXED = ([7, 1, 3, 1, 16], [7, 20, 12, 45, 16])
RAGGED_DECODE = ([1, 1, 1, 1, 1], [40, 1, 100, 17, 64])


@dataclass
class Scenario:
    """A batch shape, layer options and the CPU_ATTN path it must take."""

    query_lens: list[int]
    seq_lens: list[int]
    opts: Options
    cpu_path: str
    pad_tokens: int = 0


SCENARIOS = {
    "decode-ragged": Scenario(*RAGGED_DECODE, BASE, "decode"),
    "decode-sinks": Scenario(*RAGGED_DECODE, replace(BASE, sinks=torch.randn(8)), "decode"),
    "prefills-of-different-lengths": Scenario([5, 12, 33], [5, 12, 33], BASE, "flash"),
    "mixed": Scenario(*MIXED, BASE, "flash"),
    "padding-slots": Scenario(*MIXED, BASE, "flash", pad_tokens=3),
    "empty-sequence": Scenario([7, 0, 3], [7, 0, 12], BASE, "flash"),
    "decode-padding-slots": Scenario(*RAGGED_DECODE, BASE, "decode", pad_tokens=2),
    "sliding-window": Scenario(*MIXED, replace(BASE, sliding_window=6), "flash"),
    "decode-sliding-window": Scenario(*RAGGED_DECODE, replace(BASE, sliding_window=6), "flash"),
    "sinks": Scenario(*MIXED, replace(BASE, sinks=torch.randn(8)), "flash"),
    "soft-cap": Scenario(*MIXED, replace(BASE, logits_soft_cap=10.0), "matmul"),
    "alibi": Scenario(
        *MIXED, replace(BASE, alibi_slopes=[2.0 ** -(h + 1) for h in range(8)]), "matmul"
    ),
    "decode-soft-cap-sinks": Scenario(
        *RAGGED_DECODE, replace(BASE, logits_soft_cap=10.0, sinks=torch.randn(8)), "matmul"
    ),
}


def _spy_paths(mocker: MockerFixture) -> dict[str, object]:
    """Spies on CPU_ATTN's four paths."""
    return {
        "kernel": mocker.spy(CPUAttentionImpl, "_run_kernel"),
        "decode": mocker.spy(CPUAttentionImpl, "_decode_flash"),
        "flash": mocker.spy(CPUAttentionImpl, "_attend_flash"),
        "rows": mocker.spy(CPUAttentionImpl, "_attend_rows"),
    }


def _taken(spies: dict[str, object]) -> str:
    """The path the spied calls show: kernel, decode, flash or matmul."""
    counts = {name: spy.call_count for name, spy in spies.items()}  # type: ignore[attr-defined]
    if counts["kernel"]:
        assert counts["decode"] == counts["flash"] == counts["rows"] == 0
        return "kernel"
    if counts["decode"]:
        assert counts["rows"] == 0
        return "decode"
    return "flash" if counts["flash"] else "matmul"


def _dirty_and_clean(
    backend_cls: type[AttentionBackend],
    scenario: Scenario,
    dtype: torch.dtype,
    fill: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs on the dirty and on the zero-filled cache (real tokens only), and the reference."""
    impl = backend_cls.get_impl_cls()(**scenario.opts.impl_kwargs())
    outputs = []
    for cache_fill in (fill, "zero"):
        batch = make_batch(
            scenario.opts,
            scenario.query_lens,
            scenario.seq_lens,
            16,
            dtype,
            fill=cache_fill,
            pad_tokens=scenario.pad_tokens,
            backend_cls=backend_cls,
        )
        out = impl.forward(
            None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )
        outputs.append(out[: batch.metadata.num_actual_tokens])
    return outputs[0], outputs[1], reference_attention(scenario.opts, batch)


@pytest.mark.parametrize("fill", DIRTY_FILLS)
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_dirty_slots_do_not_change_the_output(
    backend_cls: type[AttentionBackend],
    scenario: Scenario,
    dtype: torch.dtype,
    fill: str,
    mocker: MockerFixture,
) -> None:
    """On a NaN/Inf cache the output is finite, equals the zero-cache output and the reference."""
    spies = _spy_paths(mocker)
    try:
        dirty, clean, expected = _dirty_and_clean(backend_cls, scenario, dtype, fill)
    except UnsupportedFeatureError:
        assert backend_cls.get_name() == "TORCH_SDPA"
        assert scenario.opts.logits_soft_cap is not None
        return

    assert bool(dirty.isfinite().all())
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(dirty.double(), expected, atol=tol, rtol=tol)
    if backend_cls is CPUAttentionBackend:
        assert _taken(spies) == _expected_cpu_path(scenario)


def _expected_cpu_path(scenario: Scenario) -> str:
    """The compiled kernel where it is on and takes the batch, else the scenario's torch path."""
    if _cpu_kernel.paged_attention_op() is not None:  # it takes every batch, prefills too
        return "kernel"
    return scenario.cpu_path


@pytest.mark.parametrize("fill", DIRTY_FILLS)
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("scenario", ["decode-ragged", "mixed", "soft-cap"])
def test_cpu_attn_chunk_boundaries_skip_dirty_slots(
    monkeypatch: pytest.MonkeyPatch,
    mocker: MockerFixture,
    scenario: str,
    dtype: torch.dtype,
    fill: str,
) -> None:
    """CPU_ATTN's pure-torch paths cut into the smallest chunks (whole chunks past a
    sequence's end) stay exact."""
    monkeypatch.setattr(cpu_attn, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(cpu_attn, "_DECODE_CHUNK_BYTES", 1)
    spies = _spy_paths(mocker)

    with _cpu_kernel.pure_torch():
        dirty, clean, expected = _dirty_and_clean(
            CPUAttentionBackend, SCENARIOS[scenario], dtype, fill
        )

    assert _taken(spies) == SCENARIOS[scenario].cpu_path
    assert bool(dirty.isfinite().all())
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(dirty.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("fill", DIRTY_FILLS)
def test_encoder_only_ignores_nan_padding_tokens(
    backend_cls: type[AttentionBackend], fill: str
) -> None:
    """Without a cache, NaN padding rows past num_actual_tokens never reach real outputs."""
    opts = replace(BASE, encoder_only=True)
    batch = make_batch(opts, [9, 3, 17], [9, 3, 17], 16, torch.float32, fill=fill, pad_tokens=4)
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    real = out[: batch.metadata.num_actual_tokens]
    assert bool(real.isfinite().all())
    torch.testing.assert_close(
        real.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4
    )


def test_padded_key_indices_name_only_covered_slots() -> None:
    """BatchPlan's kv_index names only slots a sequence covers (an empty one: written slots)."""
    opts = replace(BASE, sliding_window=6)
    batch = make_batch(opts, [7, 1, 0, 3, 1, 16], [7, 20, 0, 12, 45, 16], 16, torch.float32)
    impl = CPUAttentionImpl(**opts.impl_kwargs())
    metadata = batch.metadata
    covered = [
        {
            int(metadata.block_table[i, pos // 16]) * 16 + pos % 16
            for pos in range(int(metadata.seq_lens[i]))
        }
        for i in range(len(batch.query_lens))
    ]

    (group,) = BatchPlan(impl, metadata, cache_rows(batch.kv_cache)).groups()

    written = set().union(*covered)
    for slots, seq_covered in zip(group.kv_index.tolist(), covered, strict=True):
        assert set(slots) <= (seq_covered or written)
