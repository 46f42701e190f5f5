"""Generate with the tiny model through the selected (injected) attention backend.

Run: ``python examples/tiny_llm/generate.py --backend auto --tokens 32 [--check]``.
The model's weights are random (seeded by ``--seed``), so the token ids it prints mean
nothing as text: what they show is that a paged-attention engine runs end to end on the
backend attn_di selected and injected. ``--check`` also generates with the float64 reference
path (the same weights in float64, every attention call through ``attn_di.reference``) and
exits 1 unless the tokens are equal. Prints the backend used and the per-token latency, with
the torch thread count and the load average (without ``--threads``, a busy machine gets a
warning: timings will be noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm_engine import Engine, configure
from model import ModelConfig

from attn_di import get_container
from attn_di.exceptions import AttnDIError

PROMPTS = [
    [1, 17, 42, 99, 7],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [300],
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backend", default="auto", help="auto or a backend name")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (None: one per core)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare the tokens with the float64 reference path's (exit 1 if they differ)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    config = ModelConfig(dtype=args.dtype, seed=args.seed)
    capacity = (config.num_blocks - 1) * config.block_size
    needed = sum(-(-(len(p) + args.tokens) // config.block_size) for p in PROMPTS)
    if args.tokens < 1 or needed > config.num_blocks - 1:
        limit = capacity // len(PROMPTS) - max(map(len, PROMPTS)) - config.block_size
        parser.error(f"--tokens must be between 1 and about {limit} (the KV cache's size)")
    threads, load = _threads_and_load(args.threads)
    container = get_container()
    configure(container, config, args.backend)
    container.wire(modules=["llm_engine"], warn_unresolved=True)
    try:
        selection = container.selection()
        engine = Engine(config)
        result = engine.generate(PROMPTS, args.tokens)
    except AttnDIError as exc:  # a bad --backend or --dtype: one readable message, no traceback
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        container.unwire()
    print(f"backend: {selection.backend.name} ({selection.path}, {selection.origin})")
    for prompt, tokens in zip(PROMPTS, result.tokens, strict=True):
        print(f"prompt {prompt} -> {tokens}")
    if args.check:
        reference = _reference_tokens(args.seed, args.tokens)
        same = reference == result.tokens
        print(
            "check: the tokens equal the float64 reference path's (same weights in float64, "
            f"attention by attn_di.reference): {'yes' if same else 'NO'}"
        )
        if not same:
            for prompt, tokens in zip(PROMPTS, reference, strict=True):
                print(f"reference {prompt} -> {tokens}")
            return 1
    if result.decode_s:
        per_token = statistics.median(result.decode_s) * 1e3
        print(
            f"prefill {result.prefill_s * 1e3:.2f} ms; decode {per_token:.2f} ms per token "
            f"(median of {len(result.decode_s)} steps, batch {len(PROMPTS)}; "
            f"{threads} torch thread(s), load average {load:.2f} on {os.cpu_count()} CPUs)"
        )
    return 0


def _reference_tokens(seed: int, tokens: int) -> list[list[int]]:
    """The float64 reference path's tokens: the same seeded weights, reference attention."""
    from reference_backend import ReferenceBackend

    engine = Engine(ModelConfig(dtype="float64", seed=seed), backend_cls=ReferenceBackend)
    return engine.generate(PROMPTS, tokens).tokens


def _threads_and_load(threads: int | None) -> tuple[int, float]:
    """Apply ``--threads``; without it, warn on stderr when the machine is busy (timings will
    be noisy)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    used = torch.get_num_threads()
    if threads is None and load + used > 1.25 * cpus and load > 0.5 * cpus:
        advice = "; try --threads 1" if used > 1 else ""
        print(
            f"generate.py: warning: this machine is busy (load average {load:.2f} on {cpus} "
            f"CPUs, {used} torch thread(s)): timings will be noisy{advice}",
            file=sys.stderr,
        )
    return used, load


if __name__ == "__main__":
    raise SystemExit(main())
