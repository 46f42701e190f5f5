"""CPU_ATTN's compiled kernels against its pure-torch path, contiguous SDPA and the floor.

Shapes (32 query / 8 KV heads, head size 128 unless said; block size 16, shuffled block
tables):

* ``decode``: batch 8, context 2048 (the shape of ``bench_backends.py``);
* ``long``: batch 1, context 32768;
* ``wide``: batch 32, context 512;
* ``mixed``: batch 8, context 2048, half the sequences chunked prefills of 128 new tokens
  (no contiguous peer; one op call: the decode kernel takes the decodes, the prefill kernel
  the chunks);
* ``spec``: batch 8, context 2048, 4 query tokens per sequence (chunked decode /
  speculative decoding), against the pure-torch path;
* ``smollm2``: batch 4, context 544, 9 query / 3 KV heads of 64 (GQA groups of 3):
  SmolLM2-135M's decode in ``bench_transformers.py``.

Contenders run round-robin (one call each per round, after a warm-up call), so load from
other processes falls on all alike; the table gives medians and ratios within this run.
Peer: torch SDPA on the same K/V laid out contiguously ``[B, H_kv, L, D]`` with GQA folded
into the query axis (exact for one query token). Floor: one pass summing K and one summing V.
The kernel also runs on the same cache in head-major memory (each KV head's block contiguous,
as vLLM's CPU backend keeps it): the measurement behind CPU_ATTN's declared layout.

Run: ``python benchmarks/bench_kernel.py [--rounds N] [--threads N] [--only decode,long]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from _machine import cpu_flags, cpu_model
from attn_di.backend import AttentionMetadataBuilder
from attn_di.backends import _cpu_kernel
from attn_di.backends.cpu_attn import CPUAttentionImpl

BLOCK_SIZE = 16


class Shape(NamedTuple):
    """A benchmark batch: every sequence has ``context`` tokens; the even-numbered ones query
    ``long_q`` of them, the others ``short_q``."""

    batch: int
    context: int
    long_q: int
    short_q: int
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128


SHAPES: dict[str, Shape] = {
    "decode": Shape(8, 2048, 1, 1),
    "long": Shape(1, 32768, 1, 1),
    "wide": Shape(32, 512, 1, 1),
    "spec": Shape(8, 2048, 4, 4),
    "mixed": Shape(8, 2048, 128, 1),
    # SmolLM2-135M's attention (9 query / 3 KV heads of 64: GQA groups of 3) in
    # bench_transformers.py's decode: batch 4, 512-token prompts plus up to 64 new tokens.
    "smollm2": Shape(4, 544, 1, 1, heads=9, kv_heads=3, head_size=64),
}


def medians(contenders: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each contender, interleaved round-robin after a warm-up."""
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(samples) * 1e3 for label, samples in times.items()}


def pure_torch(fn: Callable[[], object]) -> object:
    """Call ``fn`` with CPU_ATTN on its pure-torch path."""
    with _cpu_kernel.pure_torch():
        return fn()


def contenders_for(shape: str, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The callables of one shape and dtype."""
    batch, context, long_q, short_q, heads, kv_heads, head_size = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    num_blocks = batch * context // BLOCK_SIZE
    kv_cache = torch.randn(
        (2, num_blocks, BLOCK_SIZE, kv_heads, head_size), generator=gen, dtype=torch.float32
    ).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, -1).int()
    query_lens = [long_q if i % 2 == 0 else short_q for i in range(batch)]
    metadata = AttentionMetadataBuilder(BLOCK_SIZE).build(
        query_lens, [context] * batch, block_table
    )
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
    output = torch.empty(tokens, heads * head_size, dtype=dtype)
    impl = CPUAttentionImpl(heads, head_size, head_size**-0.5, kv_heads)
    forward = functools.partial(impl.forward, None, query, key, value, kv_cache, metadata, output)
    head_major = kv_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same values
    contenders: dict[str, Callable[[], object]] = {
        "CPU_ATTN kernel (paged)": forward,
        "CPU_ATTN kernel (paged, head-major)": functools.partial(
            impl.forward, None, query, key, value, head_major, metadata, output
        ),
        "CPU_ATTN pure torch (paged)": functools.partial(pure_torch, forward),
    }
    if long_q == short_q == 1:
        k_contig = kv_cache[0][block_table.long()].view(batch, context, kv_heads, head_size)
        v_contig = kv_cache[1][block_table.long()].view(batch, context, kv_heads, head_size)
        k_contig = k_contig.transpose(1, 2).contiguous()
        v_contig = v_contig.transpose(1, 2).contiguous()
        q_folded = query.view(batch, kv_heads, heads // kv_heads, head_size)
        contenders["SDPA contiguous, GQA folded (peer)"] = functools.partial(
            F.scaled_dot_product_attention, q_folded, k_contig, v_contig
        )
        contenders["memory floor (sum K, sum V)"] = lambda: (k_contig.sum(), v_contig.sum())
    return contenders


def main() -> None:
    """Run every shape in both dtypes and print one table per shape."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--only", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    status = _cpu_kernel.kernel_status()
    print(
        f"CPU: {cpu_model()} | flags: {cpu_flags()} | torch capability: "
        f"{torch.backends.cpu.get_cpu_capability()} | cores: {os.cpu_count()} | torch "
        f"threads: {torch.get_num_threads()} | torch {torch.__version__}"
    )
    print(f"CPU_ATTN decode: {status.describe()} | load average: {os.getloadavg()[0]:.2f}")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    for shape in args.only.split(","):
        batch, context, long_q, short_q, heads, kv_heads, head_size = SHAPES[shape]
        print(
            f"\n{shape}: batch {batch}, context {context}, query tokens {long_q}/{short_q}, "
            f"heads {heads}/{kv_heads}, head size {head_size}, block size {BLOCK_SIZE}"
        )
        results = {dtype: medians(contenders_for(shape, dtype), args.rounds) for dtype in dtypes}
        header = f"{'contender':<38}"
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            header += f"{name + ' ms':>12}{'vs peer':>9}{'vs floor':>9}{'vs torch':>9}"
        print(header)
        for label in results[dtypes[0]]:
            line = f"{label:<38}"
            for dtype in dtypes:
                row = results[dtype]
                ms = row[label]
                peer = row.get("SDPA contiguous, GQA folded (peer)")
                floor = row.get("memory floor (sum K, sum V)")
                torch_path = row["CPU_ATTN pure torch (paged)"]
                line += f"{ms:12.2f}"
                line += f"{ms / peer:8.2f}x" if peer else f"{'-':>9}"
                line += f"{ms / floor:8.2f}x" if floor else f"{'-':>9}"
                line += f"{ms / torch_path:8.2f}x"
            print(line)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
