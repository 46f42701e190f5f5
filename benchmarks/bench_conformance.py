"""How long the conformance kit takes: the default run of a backend, and the full matrix.

Run: ``python benchmarks/bench_conformance.py [TARGET ...]`` (default ``CPU_ATTN``;
``--markdown`` prints the rows for docs/benchmarks.md). For each target it prints the CPU
model, its vector ISA, the torch threads and the load average, then:

- the default run (``attn-di conform TARGET``): every cell, timed end to end (wall clock,
  the subprocess of the bad-input cells included), and its outcome counts;
- the full matrix (``--full``): its size, and its time estimated from a measured sample, one
  shard of it (``--sample-shards``, every N-th cell of the product, so the sample spans every
  axis), scaled by the full size. The full matrix itself takes days on two cores.

One run, one process per target (``ATTN_DI_CPU_KERNEL=0`` picks CPU_ATTN's pure-torch
path). Compare figures from one run; the machine's load is printed with them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from _machine import cpu_flags, cpu_model
from attn_di.conformance import plan_conformance


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("targets", nargs="*", default=["CPU_ATTN"])
    parser.add_argument(
        "--sample-shards",
        type=int,
        default=3456,
        help="the full-matrix sample is shard 1 of this many (default 3456: about 200 cells)",
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    print(f"CPU: {cpu_model()}; ISA: {cpu_flags()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load {_load()}")  # fmt: skip
    rows = []
    for target in args.targets:
        plan = plan_conformance(target)
        started = time.perf_counter()
        report = plan.run()
        default_s = time.perf_counter() - started
        counts = ", ".join(f"{n} {name}" for name, n in report.counts().items() if n)
        full = plan_conformance(target, full=True)
        sample = plan_conformance(target, full=True, shard=(1, args.sample_shards))
        started = time.perf_counter()
        sampled = sample.run()
        sample_s = time.perf_counter() - started
        per_cell = sample_s / max(len(sampled.results), 1)
        estimate_h = per_cell * len(full) / 3600
        rows.append((target, len(plan), default_s, counts, len(full), len(sample), per_cell,
                     estimate_h, report.ok and sampled.ok))  # fmt: skip
        print(f"{target}: default run {len(plan)} cells in {default_s:.1f} s ({counts}); "
              f"full matrix {len(full):,} cells, sample of {len(sample)} at "
              f"{per_cell * 1000:.0f} ms a cell: about {estimate_h:.0f} h; "
              f"conformant: {report.ok and sampled.ok}; load {_load()}")  # fmt: skip
    if args.markdown:
        print("\n| target | default run | cells | full matrix | sampled | per cell | full, est. |")
        print("|---|---|---|---|---|---|---|")
        for target, n, secs, _, size, sampled_n, per_cell, hours, _ in rows:
            print(f"| {target} | {secs:.0f} s | {n} | {size:,} cells | {sampled_n} cells | "
                  f"{per_cell * 1000:.0f} ms | {hours:.0f} h |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
