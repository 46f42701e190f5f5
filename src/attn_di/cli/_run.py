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
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from attn_di._default import get_container
from attn_di._device import parse_device
from attn_di._enum import AttentionBackendEnum, parse_backend_name
from attn_di._selection import (
    ENV_BACKEND,
    AttentionSelectorConfig,
    canonical_dtype,
    select_backend,
)
from attn_di.cli._list import describe_cpu_attn_decode
from attn_di.cli._main import RUN_DEFAULTS
from attn_di.cli._output import TABLE_WIDTH, print_json, print_table
from attn_di.exceptions import (
    AttnDIError,
    BackendRejectedError,
    InvalidInputError,
    install_hint,
)

__all__ = ["MAX_ITERS", "MAX_SEED", "TOLERANCES", "MemoryEstimate", "estimate_memory", "run_batch"]

# Max absolute error allowed against the float64 reference, per dtype. Inputs are N(0, 1)
# and rounded to the dtype before both runs, so only the computation's rounding counts.
# float64 is run only by backends that declare it (attn_di's reference backends do not:
# selection refuses it with "dtype not supported", as everywhere else).
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2, "float64": 1e-10}
_ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
MAX_ITERS = 10_000
"""The most timed iterations ``--iters`` takes."""
MAX_SEED = 2**64 - 1
"""The largest ``--seed`` (``torch.Generator.manual_seed`` takes 64-bit seeds)."""


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
    estimate = estimate_memory(args, _ELEMENT_SIZES[dtype])
    _check_memory(args, estimate)
    try:
        import torch
    except ImportError as exc:
        raise InvalidInputError("attn-di run", "needs torch", hint=install_hint("torch")) from exc
    config = AttentionSelectorConfig(
        head_size=args.head_size, dtype=dtype, block_size=args.block_size
    )
    members, skipped = _backends(args.backend, config)
    machine = _machine(args, torch)
    problem = _build(args, getattr(torch, dtype))
    results = []
    with _Progress(len(members) * (args.iters + 1)) as advance:
        for member in members:
            results.append(_run_one(member, problem, args, dtype, advance))
    failed = [r for r in results if not r["passed"]]
    if args.json:
        print_json({"results": results, "skipped": skipped, "machine": machine})
    else:
        _print_results(args, dtype, results, skipped, machine)
    return 1 if failed else 0


def _check_sizes(args: argparse.Namespace) -> None:
    positive = ("batch", "heads", "kv_heads", "head_size", "block_size", "iters")
    for name in positive:
        if getattr(args, name) <= 0:
            raise InvalidInputError(
                _flag(name),
                f"must be positive, got {getattr(args, name)}",
                hint=f"e.g. {_example(name)}",
            )
    if args.iters > MAX_ITERS:
        raise InvalidInputError(
            "--iters",
            f"must be at most {MAX_ITERS:,}, got {args.iters}",
            hint=f"the median settles within a few runs: e.g. {_example('iters')}",
        )
    if not 0 <= args.seed <= MAX_SEED:
        raise InvalidInputError(
            "--seed",
            f"must be in [0, 2**64 - 1] (torch's seed range), got {args.seed}",
            hint=f"e.g. {_example('seed')}",
        )
    for name in ("context", "prefill"):
        if getattr(args, name) < 0:
            raise InvalidInputError(
                _flag(name),
                f"must be >= 0, got {getattr(args, name)}",
                hint=f"e.g. {_example(name)}",
            )
    if args.threads is not None and args.threads <= 0:
        raise InvalidInputError(
            "--threads", f"must be positive, got {args.threads}", hint="e.g. --threads 1"
        )
    most = 4 * (os.cpu_count() or 1)
    if args.threads is not None and args.threads > most:
        raise InvalidInputError(
            "--threads",
            f"must be at most {most} (4 x this machine's {os.cpu_count()} CPUs), "
            f"got {args.threads}",
            hint=f"e.g. --threads {os.cpu_count() or 1}",
        )
    if args.heads % args.kv_heads:
        raise InvalidInputError(
            "--kv-heads",
            f"{args.kv_heads} does not divide --heads {args.heads}",
            hint="GQA needs heads to be a multiple of kv-heads, e.g. "
            f"{_example('heads')} {_example('kv_heads')}",
        )


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _example(name: str) -> str:
    """``--name DEFAULT``: hints quote the real defaults."""
    return f"{_flag(name)} {RUN_DEFAULTS[name]}"


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes ``attn-di run`` allocates for a batch, by part, from the sizes alone.

    Attributes:
        parts: ``{part: (bytes, flags that scale it)}``: the KV cache, the attention scores,
            the queries and outputs.
    """

    parts: dict[str, tuple[int, tuple[str, ...]]]

    @property
    def total(self) -> int:
        """All parts together, in bytes."""
        return sum(size for size, _ in self.parts.values())

    def largest(self) -> str:
        """The name of the largest part."""
        return max(self.parts, key=lambda part: self.parts[part][0])


def estimate_memory(args: argparse.Namespace, element: int) -> MemoryEstimate:
    """Estimate the peak memory of a run in closed form: no allocation, instant for any size.

    Counted (upper bounds): the KV cache (float32 random values, their ``element``-byte copy,
    and the copy each backend run writes into), the padded K/V a backend gathers (twice the
    cached tokens' K/V), the float64 reference's K/V of the longest sequence expanded to the
    query heads, the scores ``[heads, query_len, seq_len]`` of the largest sequence (in float64
    for the reference, three tensors: scores, masked, softmax) and of the whole batch for a
    backend (float32), and the queries, keys, values and outputs. Decode (query_len 1) is
    linear in ``--context``.

    Args:
        args: the run's sizes (batch, context, prefill, heads, kv_heads, head_size, block_size).
        element: bytes per element of the run's dtype.

    Returns:
        The estimate, by part.
    """
    prefills = (args.batch + 1) // 2 if args.prefill else 0
    decodes = args.batch - prefills
    per_block = args.block_size
    prefill_len = args.context + args.prefill
    blocks = decodes * -(-(args.context + 1) // per_block) + prefills * -(-prefill_len // per_block)
    slot_bytes = 2 * args.kv_heads * args.head_size  # K and V of one token, per byte of element
    cache = (blocks + 1) * per_block * slot_bytes * (4 + 2 * element)
    cached_tokens = decodes * (args.context + 1) + prefills * prefill_len
    longest = max(args.context + 1, prefill_len if prefills else 0)
    widest_query = args.prefill if prefills else 1
    gathered = 2 * cached_tokens * slot_bytes * element
    reference_kv = 8 * 2 * longest * (args.heads + args.kv_heads) * args.head_size
    scores = 3 * 8 * args.heads * widest_query * longest
    scores += (
        2 * 4 * args.heads * (decodes * (args.context + 1) + prefills * args.prefill * longest)
    )
    tokens = decodes + prefills * args.prefill
    activations = (
        tokens
        * args.head_size
        * ((args.heads + 2 * args.kv_heads) * (4 + element) + args.heads * (8 + 2 * element))
    )
    return MemoryEstimate(
        {
            "the KV cache": (
                cache + gathered + reference_kv,
                ("--batch", "--context", "--block-size", "--kv-heads", "--head-size"),
            ),
            "the attention scores": (scores, ("--prefill", "--context", "--heads", "--batch")),
            "the queries and outputs": (
                activations,
                ("--batch", "--prefill", "--heads", "--head-size"),
            ),
        }
    )


def _check_memory(args: argparse.Namespace, estimate: MemoryEstimate) -> None:
    """Refuse a batch whose tensors would not fit comfortably in this machine's memory."""
    import os

    try:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return
    if estimate.total <= available // 2:
        return
    part = estimate.largest()
    size, flags = estimate.parts[part]
    # name the flags of the largest part that were raised above their defaults (the cause)
    raised = [flag for flag in flags if _raised(args, flag)] or list(flags[:2])
    sizes = ", ".join(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in raised)
    raise InvalidInputError(
        " and ".join(raised),
        f"this batch needs about {_gigabytes(estimate.total)} GB, {_gigabytes(size)} GB of it "
        f"for {part} ({sizes}); this machine has {_gigabytes(available)} GB",
        hint=f"lower {' or '.join(raised)} (defaults: "
        + ", ".join(_example(flag[2:].replace("-", "_")) for flag in raised)
        + ")",
    )


def _raised(args: argparse.Namespace, flag: str) -> bool:
    name = flag[2:].replace("-", "_")
    return bool(getattr(args, name) > RUN_DEFAULTS[name])


def _gigabytes(size: int) -> str:
    gigabytes = size / 1e9
    return f"{gigabytes:,.1f}" if gigabytes < 1000 else f"{gigabytes:,.0f}"


def _machine(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """Apply ``--threads``; report threads, CPUs and the load average; without ``--threads``,
    warn on a busy machine.

    Under contention torch's default (one thread per core) makes timings swing by orders of
    magnitude: the warning names ``--threads 1``. A caller that chose its threads (as
    ``scripts/main.sh`` does, from the idle cores) is not warned about its own choice.
    """
    import os
    import sys

    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available on this platform
        load = None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    busy = load is not None and load + threads > cpus * 1.25 and load > 0.5 * cpus
    if busy and args.threads is None:
        print(
            f"attn-di: warning: this machine is busy (load average {load:.2f} on {cpus} CPUs, "
            f"{threads} torch thread(s)): timings will be noisy"
            + ("; try --threads 1" if threads > 1 else ""),
            file=sys.stderr,
        )
    return {"threads": threads, "cpus": cpus, "load_average": load, "busy": busy}


def _backends(
    requested: str, config: AttentionSelectorConfig
) -> tuple[list[AttentionBackendEnum], dict[str, list[str]]]:
    """The members to run, and for ``all`` the ones skipped with their reasons."""
    if requested.strip().lower() != "all":
        selection = select_backend(config, device="cpu", backend=parse_backend_name(requested))
        if _attention_free(selection.backend_cls, config):
            from_env = selection.origin == ENV_BACKEND
            raise InvalidInputError(
                f"{ENV_BACKEND}={os.environ.get(ENV_BACKEND, '')!r}" if from_env else "--backend",
                f"{selection.backend.name} is attention-free: an empty KV cache and nothing to "
                "compute or check",
                hint=f"unset {ENV_BACKEND} or set it to a computing backend, e.g. "
                f"{ENV_BACKEND}=CPU_ATTN"
                if from_env
                else "run a computing backend, e.g. --backend CPU_ATTN, or --backend all",
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
            hint="`attn-di select --head-size N --dtype D` shows every candidate's reasons",
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
    decode_path = _cpu_attn_path(impl)
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
        **({"decode_path": decode_path} if decode_path else {}),
    }


def _cpu_attn_path(impl: Any) -> str | None:
    """Which of CPU_ATTN's paths ran this batch (None for other backends' impls).

    ``compiled decode and prefill kernels (<isa>)`` or ``pure torch: <reason>``, as ``attn-di
    list`` words it; the kernels take every batch (decode, prefill, mixed) when loaded.
    """
    from attn_di.backends import cpu_attn

    if not isinstance(impl, cpu_attn.CPUAttentionImpl):
        return None
    return describe_cpu_attn_decode()


def _print_results(
    args: argparse.Namespace,
    dtype: str,
    results: list[dict[str, Any]],
    skipped: dict[str, list[str]],
    machine: dict[str, Any],
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
    for r in results:
        if "decode_path" in r:
            print(f"{r['backend']} ran: {r['decode_path']}")
    load = machine["load_average"]
    print(
        f"timed with {machine['threads']} torch thread(s) on {machine['cpus']} CPUs, "
        f"load average {'?' if load is None else f'{load:.2f}'}"
        + (" (busy: timings are noisy)" if machine["busy"] else "")
    )
    by_reason: dict[str, list[str]] = {}
    for name, reasons in skipped.items():
        reason = "; ".join(reasons)
        if "module not found" in reason:
            reason = "not installed here (module not found)"
        by_reason.setdefault(reason, []).append(name)
    import textwrap

    for reason, names in by_reason.items():
        line = f"skipped {', '.join(names)}: {reason}"
        print(textwrap.fill(line, TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False))


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
