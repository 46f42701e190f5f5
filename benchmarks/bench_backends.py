"""Decode benchmark of attn_di's backends against contiguous SDPA and the memory floor.

Decode step: batch 8, 32 query heads, 8 KV heads, head size 128, context 2048, block size
16, a shuffled paged cache; float32 and bfloat16 side by side. Reports the median time and
the effective bandwidth (bytes of K+V read / time). Run: ``python benchmarks/bench_backends.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table

from _machine import cpu_flags, cpu_model
from attn_di.backend import AttentionBackend, AttentionMetadataBuilder
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.flex_attention import FlexAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend

BATCH, HEADS, KV_HEADS, HEAD_SIZE, CONTEXT, BLOCK_SIZE = 8, 32, 8, 128, 2048, 16
BACKENDS: list[type[AttentionBackend]] = [
    CPUAttentionBackend,
    TorchSDPABackend,
    FlexAttentionBackend,
]


def median_ms(contenders: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall time in milliseconds of each contender.

    Contenders run round-robin (one call each per round, after one warm-up call each), so
    load from other processes on a shared machine falls on all of them alike. FLEX_ATTENTION,
    far slower in eager mode, runs in only the first three rounds.
    """
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in contenders}
    for round_number in range(rounds):
        for label, fn in contenders.items():
            if label.startswith("FLEX") and round_number >= 3:
                continue
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(samples) * 1e3 for label, samples in times.items()}


def run(dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Median milliseconds of every contender for one dtype."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = BATCH * CONTEXT // BLOCK_SIZE
    shape = (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(BATCH, -1).int()
    metadata = AttentionMetadataBuilder(BLOCK_SIZE).build(
        [1] * BATCH, [CONTEXT] * BATCH, block_table
    )
    query = torch.randn(BATCH, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    key = torch.randn(BATCH, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(BATCH, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    output = torch.empty(BATCH, HEADS * HEAD_SIZE, dtype=dtype)
    contenders: dict[str, Callable[[], object]] = {}
    for backend_cls in BACKENDS:
        impl = backend_cls.get_impl_cls()(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
        contenders[f"{backend_cls.get_name()} (paged)"] = functools.partial(
            impl.forward, None, query, key, value, kv_cache, metadata, output
        )
    k_contig = torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_SIZE, generator=gen).to(dtype)
    v_contig = torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_SIZE, generator=gen).to(dtype)
    q_contig = query.view(BATCH, HEADS, 1, HEAD_SIZE)
    contenders["torch SDPA (contiguous K/V)"] = functools.partial(
        F.scaled_dot_product_attention, q_contig, k_contig, v_contig, enable_gqa=True
    )
    # The same decode with GQA folded into the query axis: [B, H_kv, H / H_kv, D] queries,
    # exact for decode (one token per sequence, no mask) and torch's fastest CPU path.
    q_folded = query.view(BATCH, KV_HEADS, HEADS // KV_HEADS, HEAD_SIZE)
    contenders["torch SDPA (contiguous, GQA folded)"] = functools.partial(
        F.scaled_dot_product_attention, q_folded, k_contig, v_contig
    )
    contenders["memory floor (sum K, sum V)"] = lambda: (k_contig.sum(), v_contig.sum())
    return median_ms(contenders, rounds)


def main() -> None:
    """Run both dtypes and print one table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=170)
    console.print(
        f"CPU: {cpu_model()} | flags: {cpu_flags()} | cores: {os.cpu_count()} | torch threads: "
        f"{torch.get_num_threads()} | torch {torch.__version__} | "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    console.print(
        f"decode: batch {BATCH}, heads {HEADS}/{KV_HEADS} (q/kv), head size {HEAD_SIZE}, "
        f"context {CONTEXT}, block size {BLOCK_SIZE}, shuffled block table"
    )
    dtypes = [torch.float32, torch.bfloat16]
    results = {dtype: run(dtype, args.rounds) for dtype in dtypes}
    table = Table(title="Decode attention, median of runs")
    table.add_column("contender")
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        table.add_column(f"{name} ms", justify="right")
        table.add_column(f"{name} GB/s", justify="right")
        table.add_column(f"{name} vs SDPA", justify="right")
        table.add_column(f"{name} vs folded", justify="right")
    for label in results[dtypes[0]]:
        row = [label]
        for dtype in dtypes:
            ms = results[dtype][label]
            kv_bytes = 2 * BATCH * KV_HEADS * CONTEXT * HEAD_SIZE * dtype.itemsize
            sdpa = results[dtype]["torch SDPA (contiguous K/V)"]
            folded = results[dtype]["torch SDPA (contiguous, GQA folded)"]
            row += [
                f"{ms:.2f}",
                f"{kv_bytes / ms / 1e6:.1f}",
                f"{ms / sdpa:.2f}x",
                f"{ms / folded:.2f}x",
            ]
        table.add_row(*row)
    console.print(table)
    console.print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
