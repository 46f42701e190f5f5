"""``attn-di run``: a paged-attention batch through backends, checked and timed.

The batch: ``--batch`` sequences, each with ``--context`` tokens already in a paged KV cache
(blocks assigned in a shuffled order, as an allocator would after some churn). Decode
sequences bring one new token; with ``--prefill P`` the first half of the batch are
chunked prefills bringing ``P`` new tokens each. Every backend runs the same batch from the
same cache; its output is compared with :func:`attn_di.reference.reference_attention`
(float64) and must stay within the dtype's tolerance.

Reported per backend: the max absolute error, the median time of ``--iters`` runs, tokens
per second (query tokens / median) and effective GB/s (bytes of K and V read / median).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from attn_di._default import get_container
from attn_di._device import parse_device
from attn_di._enum import AttentionBackendEnum, parse_backend_name
from attn_di._selection import AttentionSelectorConfig, canonical_dtype, select_backend
from attn_di.cli._output import print_json, print_table
from attn_di.exceptions import AttnDIError, BackendRejectedError, InvalidInputError

__all__ = ["TOLERANCES", "run_batch"]

# Max absolute error allowed against the float64 reference, per dtype. Inputs are N(0, 1)
# and rounded to the dtype before both runs, so only the computation's rounding counts.
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


@dataclass
class _Problem:
    query: Any
    key: Any
    value: Any
    kv_cache: Any
    metadata: Any
    scale: float
    reference: Any
    num_blocks: int
    kv_bytes: int


def run_batch(args: argparse.Namespace) -> int:
    """Build the batch, run the chosen backend(s), print the table; 1 if any check fails."""
    _check_sizes(args)
    dtype = canonical_dtype(args.dtype)
    if dtype not in TOLERANCES:
        raise InvalidInputError(
            "--dtype",
            f"{dtype} is not run here; choose one of {', '.join(TOLERANCES)}",
            hint="the float64 reference is what every run is checked against",
        )
    try:
        import torch
    except ImportError as exc:
        raise InvalidInputError(
            "attn-di run", "needs torch", hint="pip install torch==2.13.0 'attn_di[torch]'"
        ) from exc
    config = AttentionSelectorConfig(
        head_size=args.head_size, dtype=dtype, block_size=args.block_size
    )
    members, skipped = _backends(args.backend, config)
    _check_memory(args, torch.empty((), dtype=getattr(torch, dtype)).element_size(), len(members))
    problem = _build(args, getattr(torch, dtype))
    results = []
    with _Progress(len(members) * (args.iters + 1)) as advance:
        for member in members:
            results.append(_run_one(member, problem, args, dtype, advance))
    failed = [r for r in results if not r["passed"]]
    if args.json:
        print_json({"results": results, "skipped": skipped})
    else:
        _print_results(args, dtype, results, skipped)
    return 1 if failed else 0


def _check_sizes(args: argparse.Namespace) -> None:
    positive = ("batch", "heads", "kv_heads", "head_size", "block_size", "iters")
    for name in positive:
        if getattr(args, name) <= 0:
            flag = f"--{name.replace('_', '-')}"
            raise InvalidInputError(
                flag, f"must be positive, got {getattr(args, name)}", hint=f"e.g. {flag} 8"
            )
    for name in ("context", "prefill"):
        if getattr(args, name) < 0:
            raise InvalidInputError(
                f"--{name}", f"must be >= 0, got {getattr(args, name)}", hint=f"e.g. --{name} 0"
            )
    if args.heads % args.kv_heads:
        raise InvalidInputError(
            "--kv-heads",
            f"{args.kv_heads} does not divide --heads {args.heads}",
            hint="GQA needs heads to be a multiple of kv-heads, e.g. --heads 32 --kv-heads 8",
        )


def _check_memory(args: argparse.Namespace, element: int, backends: int) -> None:
    """Refuse a batch whose tensors would not fit comfortably in this machine's memory."""
    import os

    query_lens, seq_lens = _batch_lengths(args)
    blocks = sum(-(-n // args.block_size) for n in seq_lens) + 1
    cache = 2 * blocks * args.block_size * args.kv_heads * args.head_size
    tokens = sum(query_lens)
    # the shared cache + one copy per backend run, the float64 reference's per-sequence K/V and
    # scores, and the queries/outputs
    largest = max(seq_lens)
    reference = 8 * (2 * largest * args.heads * args.head_size + args.heads * largest * largest)
    needed = (
        cache * element * (2 + backends) + reference + 16 * tokens * args.heads * args.head_size
    )
    try:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return
    if needed > available // 2:
        raise InvalidInputError(
            "batch size",
            f"this batch needs about {needed / 1e9:.1f} GB (KV cache of {blocks} blocks x "
            f"{args.block_size} tokens, copies per backend, the float64 reference); this "
            f"machine has {available / 1e9:.1f} GB",
            hint="lower --batch, --context, --prefill, --heads/--kv-heads, --head-size or "
            "--block-size",
        )


def _backends(
    requested: str, config: AttentionSelectorConfig
) -> tuple[list[AttentionBackendEnum], dict[str, list[str]]]:
    """The members to run, and for ``all`` the ones skipped with their reasons."""
    if requested.strip().lower() != "all":
        selection = select_backend(config, device="cpu", backend=parse_backend_name(requested))
        if _attention_free(selection.backend_cls, config):
            raise InvalidInputError(
                "--backend",
                f"{selection.backend.name} is attention-free: an empty KV cache and nothing to "
                "compute or check",
                hint="run a computing backend, e.g. --backend CPU_ATTN, or --backend all",
            )
        return [selection.backend], {}
    members, skipped = [], {}
    container = get_container()
    preferred = list(container.candidates(parse_device("cpu"), config))
    ordered = preferred + [m for m in AttentionBackendEnum if m not in preferred]
    for member in ordered:
        try:
            selection = select_backend(config, device="cpu", backend=member)
        except BackendRejectedError as exc:
            skipped[member.name] = exc.reasons
            continue
        if _attention_free(selection.backend_cls, config):
            skipped[member.name] = ["attention-free: an empty KV cache and nothing to compute"]
        else:
            members.append(member)
    if not members:
        raise InvalidInputError(
            "--backend all",
            "no backend accepts this configuration here",
            hint="attn-di select shows every candidate's reasons",
        )
    return members, skipped


def _batch_lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Per-sequence query lengths and sequence lengths: the first half of the batch are
    ``--prefill``-token chunked prefills when ``--prefill`` is set, the rest decode one token."""
    prefills = (args.batch + 1) // 2 if args.prefill else 0
    query_lens = [args.prefill if i < prefills else 1 for i in range(args.batch)]
    return query_lens, [args.context + q for q in query_lens]


def _attention_free(backend_cls: Any, config: AttentionSelectorConfig) -> bool:
    shape = backend_cls.get_kv_cache_shape(1, config.block_size or 16, 1, config.head_size)
    return 0 in tuple(shape)


def _build(args: argparse.Namespace, dtype: Any) -> _Problem:
    import torch

    from attn_di.backend import AttentionMetadataBuilder
    from attn_di.reference import reference_attention

    generator = torch.Generator().manual_seed(args.seed)
    query_lens, seq_lens = _batch_lengths(args)
    blocks_per_seq = [-(-s // args.block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1  # block 0 stays unused, as a guard
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(blocks_per_seq)
    block_table = torch.zeros(args.batch, width, dtype=torch.int32)
    cursor = 0
    for i, count in enumerate(blocks_per_seq):
        block_table[i, :count] = torch.tensor(order[cursor : cursor + count])
        cursor += count
    metadata = AttentionMetadataBuilder(args.block_size).build(query_lens, seq_lens, block_table)
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_size)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, args.heads, args.head_size, generator=generator).to(dtype)
    key = torch.randn(num_tokens, args.kv_heads, args.head_size, generator=generator).to(dtype)
    value = torch.randn(num_tokens, args.kv_heads, args.head_size, generator=generator).to(dtype)
    scale = args.head_size**-0.5
    reference = reference_attention(query, key, value, kv_cache, metadata, scale)
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * sum(seq_lens) * args.kv_heads * args.head_size * element
    return _Problem(query, key, value, kv_cache, metadata, scale, reference, num_blocks, kv_bytes)


def _run_one(
    member: AttentionBackendEnum,
    problem: _Problem,
    args: argparse.Namespace,
    dtype: str,
    advance: Any,
) -> dict[str, Any]:
    import torch

    backend_cls = get_container().backend(member)
    expected_shape = tuple(
        backend_cls.get_kv_cache_shape(
            problem.num_blocks, args.block_size, args.kv_heads, args.head_size
        )
    )
    if expected_shape != tuple(problem.kv_cache.shape):
        raise AttnDIError(
            f"{member.name}'s KV-cache layout {expected_shape} differs from the common "
            f"{tuple(problem.kv_cache.shape)}; attn-di run compares backends on one layout"
        )
    impl = backend_cls.get_impl_cls()(
        num_heads=args.heads,
        head_size=args.head_size,
        scale=problem.scale,
        num_kv_heads=args.kv_heads,
    )
    kv_cache = problem.kv_cache.clone()
    with torch.inference_mode():
        output = impl.forward(
            None, problem.query, problem.key, problem.value, kv_cache, problem.metadata
        )
        advance()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            impl.forward(
                None, problem.query, problem.key, problem.value, kv_cache, problem.metadata
            )
            times.append(time.perf_counter() - start)
            advance()
    error = float((output.to(torch.float64) - problem.reference).abs().max())
    median = statistics.median(times)
    num_tokens = int(problem.query.shape[0])
    return {
        "backend": member.name,
        "dtype": dtype,
        "max_abs_error": error,
        "tolerance": TOLERANCES[dtype],
        "passed": error <= TOLERANCES[dtype],
        "median_ms": median * 1e3,
        "tokens_per_s": num_tokens / median,
        "gb_per_s": problem.kv_bytes / median / 1e9,
    }


def _print_results(
    args: argparse.Namespace,
    dtype: str,
    results: list[dict[str, Any]],
    skipped: dict[str, list[str]],
) -> None:
    if not args.prefill:
        kind = "decode"
    elif args.batch == 1:
        kind = f"chunked prefill ({args.prefill} new tokens)"
    else:
        kind = f"mixed ({args.prefill}-token prefills + decode)"
    title = (
        f"{kind}: batch {args.batch}, context {args.context}, heads {args.heads}/{args.kv_heads}, "
        f"head size {args.head_size}, {dtype}, block size {args.block_size}"
    )
    rows = [
        (
            r["backend"],
            f"{r['max_abs_error']:.2e} (<= {r['tolerance']:.0e})",
            "pass" if r["passed"] else "FAIL",
            f"{r['median_ms']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['gb_per_s']:.2f}",
        )
        for r in results
    ]
    print_table(title, ["backend", "max abs error", "check", "median ms", "tokens/s", "GB/s"], rows)
    by_reason: dict[str, list[str]] = {}
    for name, reasons in skipped.items():
        reason = "; ".join(reasons)
        if "module not found" in reason:
            reason = "not installed here (module not found)"
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        print(f"skipped {', '.join(names)}: {reason}")


class _Progress:
    """A transient rich progress bar on a terminal; a no-op elsewhere."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._bar: Any = None

    def __enter__(self) -> Any:
        import sys

        try:
            from rich.progress import Progress
        except ImportError:
            return lambda: None
        if not sys.stderr.isatty():
            return lambda: None
        self._bar = Progress(transient=True)
        self._bar.__enter__()
        task = self._bar.add_task("running backends", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
