"""CPU_ATTN's decode kernel on vLLM's per-layer cache views, with caches as a model leaves them.

In a model, a layer's attention finds its KV cache out of the CPU caches: the other layers'
caches and weights went through them since its last call. This benchmark keeps ``--layers``
caches (one per layer, 30 as SmolLM2's) and between two calls streams ``--flush-mb`` MiB
(a layer's weights), then times only the attention calls. ``--flush write`` (the default,
as in the runs of docs/benchmarks.md) adds 1 to the buffer in place, leaving its lines dirty
for the next call to write back as it evicts them; ``--flush read`` only sums it, as a
model's GEMMs read their weights. attn_di's kernel
(``torch.ops.attn_di.paged_attention``) reads each layer's cache through
``attn_di.integrations.vllm.backends.kv_cache_view`` of a buffer made by vLLM's own
``create_kv_cache_views`` in each ``--layouts`` layout (``LBHNC``: head-major pages, keys
then values; ``LBNHC``: token-major pages, key then value per token), written by attn_di's
cache write; vLLM's op (``cpu_attention_with_kv_cache``) runs on its own cache written by
``cpu_attn_reshape_and_cache`` for the ISA vLLM picks here. Rounds alternate between the
contenders; the table gives per-call medians and the ratio attn_di / vLLM within this run.
Every output is checked against a float64 reference of the same batch first.

Run inside the vLLM venv::

    .venv-vllm/bin/python benchmarks/bench_vllm_layouts.py [--threads 2] [--layers 30] \
        [--flush-mb 16] [--flush write|read] [--dtypes bfloat16,float32] \
        [--shape 8,1,560,9,3,64,128]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

from _machine import cpu_flags, cpu_model
from attn_di.backends import _cpu_kernel
from attn_di.integrations.vllm.backends import kv_cache_view
from bench_vs_vllm import TOLERANCE, Shape, random_batch, reference_attention, vllm_isa, vllm_peer


def vllm_layer_cache(
    layout: KVCacheLayout, shape: Shape, num_blocks: int, dtype: torch.dtype
) -> torch.Tensor:
    """One layer's ``[num_blocks, H_kv, block_size, 2 * D]`` view, NaN-filled, as vLLM's CPU
    worker makes it in ``layout``."""
    spec = FullAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=shape.kv_heads,
        head_size=shape.head_size,
        dtype=dtype,
    )
    strides = compute_layout_strides(spec, num_blocks, 1, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks,
        layers=["layer"],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    raw = torch.full((tensor.size // dtype.itemsize,), math.nan, dtype=dtype).view(torch.int8)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


def make_layer(
    shape: Shape, dtype: torch.dtype, layouts: list[KVCacheLayout], isa: str, seed: int
) -> dict[str, Callable[[], Any]]:
    """A layer's calls: attn_di's per layout and vLLM's, each checked against float64."""
    batch = random_batch(shape, dtype, seed)
    query, keys, values = batch.query, batch.keys, batch.values
    scale = shape.head_size**-0.5
    reference = reference_attention(query, keys, values, shape)
    kernel = _cpu_kernel.paged_attention_op()
    write = _cpu_kernel.write_kv_cache_op()
    calls: dict[str, Callable[[], Any]] = {}
    for layout in layouts:
        view = kv_cache_view(vllm_layer_cache(layout, shape, batch.num_blocks, dtype))
        write(keys, values, view[0], view[1], batch.slots)
        out = torch.empty_like(query)

        def ours(view: torch.Tensor = view, out: torch.Tensor = out) -> torch.Tensor:
            kernel(query, view[0], view[1], batch.table, batch.seq_lens,
                   batch.query_start_loc, out, scale, 0, 0.0, None, None, True)  # fmt: skip
            return out

        calls[f"attn_di {layout.name}"] = ours
    peer, vllm_out = vllm_peer(batch, shape, dtype, isa)

    def peer_output() -> torch.Tensor:
        peer()
        return vllm_out

    calls["vLLM CPU_ATTN"] = peer_output
    for name, call in calls.items():
        error = float((call().double() - reference).abs().max())
        if not error <= TOLERANCE[dtype]:
            raise SystemExit(f"{name} is off the float64 reference by {error} ({dtype})")
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--flush-mb", type=int, default=16, help="MiB streamed between calls")
    parser.add_argument(
        "--flush", choices=("write", "read"), default="write", help="how the MiB are streamed"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=6, help="passes over the layers a round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--layouts", default="LBHNC,LBNHC")
    parser.add_argument("--shape", default="8,1,560,9,3,64,128", help="b,q,ctx,H,H_kv,D,bs")
    options = parser.parse_args()
    if min(options.threads, options.layers, options.rounds, options.calls) < 1:
        parser.error("--threads, --layers, --rounds and --calls must be at least 1")
    if options.flush_mb < 0:
        parser.error("--flush-mb must be at least 0")
    layouts = [KVCacheLayout[name] for name in options.layouts.split(",")]
    shape = Shape(*(int(n) for n in options.shape.split(",")))
    torch.set_num_threads(options.threads)
    status = _cpu_kernel.kernel_status()
    if not status.active:
        raise SystemExit(f"CPU_ATTN's kernel is not loaded: {status.describe()}")
    print(f"CPU: {cpu_model()}; flags: {cpu_flags()}; threads: {options.threads}; "
          f"attn_di kernel: {status.describe()}")  # fmt: skip
    print(f"shape {shape}; {options.layers} layers; {options.flush_mb} MiB streamed between "
          f"calls ({options.flush})")  # fmt: skip
    buffer = torch.ones(options.flush_mb * 1024 * 256) if options.flush_mb else None
    flush: Callable[[], object] | None = None
    if buffer is not None:
        flush = buffer.sum if options.flush == "read" else lambda: buffer.add_(1.0)
    for dtype_name in options.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        isa = vllm_isa(dtype, shape, None)
        layers = [make_layer(shape, dtype, layouts, isa, seed) for seed in range(options.layers)]
        times: dict[str, list[float]] = {name: [] for name in layers[0]}
        for _ in range(options.rounds):
            for name in times:
                spent = 0.0
                for _ in range(options.calls):
                    for layer in layers:
                        if flush is not None:
                            flush()
                        start = time.perf_counter()
                        layer[name]()
                        spent += time.perf_counter() - start
                times[name].append(spent / (options.calls * options.layers))
        peer = statistics.median(times["vLLM CPU_ATTN"])
        for name, samples in times.items():
            median = statistics.median(samples)
            print(f"{dtype_name:<9} {name:<16} (vLLM isa {isa}) {median * 1e6:8.1f} us "
                  f"{median / peer:6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
