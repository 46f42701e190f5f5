"""vLLM generating with attn_di's CPU_ATTN vs vLLM's own CPU_ATTN (run in .venv-vllm).

Default workload (issue 15's): SmolLM2-135M-Instruct, 8 prompts of 500 random tokens, 64 new
greedy tokens each, float32 and bfloat16, block size 128, prefix caching off so that no run
reads another's cache. Two engine modes (``--modes``):

* ``eager``: vLLM's in-process engine with ``enforce_eager`` (2 torch threads here);
* ``default``: vLLM as users start it, its defaults: the compiled model (torch.compile, the
  attention call a splitting op outside the graph) and the multiprocess engine (front end,
  engine core and worker in separate processes; the worker pinned to its cores).

Each mode runs in a process of its own (vLLM reads its environment once). For each dtype the
two contenders run alternately, ``--rounds`` times, each round on a freshly built engine with
one warm-up generation first and then ``--repeats`` timed generations of ``--new-tokens``
greedy tokens (fresh random prompts for each); every worker is then asked (``collective_rpc``)
which impl its attention layers ran, so a row is never another backend's. No round runs beside
another engine: before an engine is built the script waits (up to 60 s, then stops) until no
process with vLLM's process title runs on the machine, and after its shutdown until the engine's
own processes have exited (vLLM kills an engine core slow to stop; its worker can outlive it).
The two rates come from vLLM's own request stats of the same generation
(``disable_log_stats=False``, the ``RequestStateStats`` each output carries), so neither is a
difference of two generations' wall times. The table shows the median over all timed generations of:

* time to first token: the longest of the 8 requests' ``first_token_latency`` (vLLM's TTFT:
  arrival at the front end to the first token; here the prefill of all 8 prompts, in one
  scheduler step, or two when the first request arrives alone);
* decode tokens/s: the batch (8) over the time of a decode step: the time from first to last
  token over the 63 tokens after the first, of the requests whose first token came last (in the
  multiprocess engine the first request may arrive alone and be prefilled before the others
  arrive, so it decodes while they prefill);
* total wall: the generation's wall time;

each with its ratio to vLLM's and, in parentheses, the lowest and highest of the rounds' ratios
(a round's: the median of its generations, the two contenders' engines built one after the
other): the spread of single rounds, which need not bracket the ratio of the medians over all
generations.

Also whether the two contenders' greedy tokens are equal. Targets (issue 23): time to first
token <= 1.0x and decode tokens/s >= 1.0x of vLLM's own in both dtypes and both modes.
Run: ``.venv-vllm/bin/python benchmarks/bench_vllm.py`` (``--markdown``: the rows as a
markdown table, which docs/benchmarks.md condenses; ``--prompts 2 --prompt-len 64 --new-tokens 8
--rounds 1 --repeats 1 --dtypes float32`` to smoke-test). The SmolLM2 folder is the one
``scripts/setup-vllm.sh`` makes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import psutil  # a dependency of vLLM's
import torch
from vllm.inputs import TokensPrompt
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import attn_di
from _machine import cpu_flags, cpu_model  # beside this script (the script's folder is on sys.path)
from _vllm_workers import worker_impls
from attn_di.integrations import vllm as bridge
from vllm import LLM, SamplingParams
from vllm import envs as vllm_envs

CONTENDERS = {
    "vLLM CPU_ATTN": None,
    "attn_di CPU_ATTN": "attn_di.integrations.vllm.backends.CPU_ATTN",
}
# Engine modes, and the VLLM_ENABLE_V1_MULTIPROCESSING each runs under (run_mode sets both
# for the process it starts; vLLM reads its environment once per process).
MODES = {"eager": "0", "default": "1"}
MODE = os.environ.get("ATTN_DI_BENCH_VLLM_MODE", "eager")  # this process's
DTYPES = ("float32", "bfloat16", "float16")
ROWS_MARKER = "ATTN_DI_BENCH_VLLM_ROWS "  # the line of a mode's process that holds its rows
# The module of each contender's impl class, as the workers report it.
IMPL_MODULES = {
    "vLLM CPU_ATTN": "vllm.v1.attention.backends.cpu_attn",
    "attn_di CPU_ATTN": "attn_di.integrations.vllm.",
}
EXIT_TIMEOUT_S = 60.0  # how long an engine's processes get to exit before a round fails


def model_folder() -> Path:
    """The SmolLM2 folder of ``scripts/smollm2_hf_folder.py``."""
    explicit = os.environ.get("ATTN_DI_MODEL_CACHE")
    base = Path(explicit) if explicit else Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "attn_di", "models"
    )  # fmt: skip
    folder = base / "SmolLM2-135M-Instruct-bf16"  # smollm2_hf_folder.FOLDER_NAME
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(f"{folder} is missing: run bash scripts/setup-vllm.sh")
    return folder


def random_prompts(count: int, length: int, seed: int, vocab: int) -> list[Any]:
    """``count`` prompts of ``length`` random token ids (no special tokens)."""
    rng = random.Random(seed)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(length)])
        for _ in range(count)
    ]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)


def engine_processes() -> list[psutil.Process]:
    """This process's descendants but multiprocessing's resource tracker (which lives as long
    as this process): the engine core and workers of the multiprocess engine."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(process.cmdline()):
                found.append(process)
        except psutil.ZombieProcess:
            found.append(process)  # exited, not yet reaped: wait_procs reaps it
        except psutil.NoSuchProcess:
            pass
    return found


def vllm_processes() -> list[psutil.Process]:
    """The processes on this machine that carry vLLM's process title (``VLLM::EngineCore``,
    ``VLLM::Worker``...), whoever started them."""
    prefix = f"{vllm_envs.VLLM_PROCESS_NAME_PREFIX}::"
    found = psutil.process_iter(["name", "status", "ppid"])
    return [
        p
        for p in found
        if (p.info["name"] or "").startswith(prefix)
        # another program's zombie runs nothing and only its parent can reap it
        and (p.info["status"] != psutil.STATUS_ZOMBIE or p.info["ppid"] == os.getpid())
    ]


def wait_for_exit(processes: list[psutil.Process], when: str) -> None:
    """Wait up to EXIT_TIMEOUT_S for ``processes`` to exit, so that no round runs beside another
    engine's processes (vLLM's shutdown kills an engine core that is slow to stop, and the
    worker it started may outlive it for a while).

    Raises:
        SystemExit: some are still running; they are named.
    """
    running = [p for p in processes if p.is_running()]
    start = time.perf_counter()
    _, alive = psutil.wait_procs(running, timeout=EXIT_TIMEOUT_S)
    waited = time.perf_counter() - start
    if waited > 0.5:  # said, so that a run shows how often an engine outlived its shutdown
        print(f"{when}: waited {waited:.1f} s for {len(running)} to exit", file=sys.stderr)
    if alive:
        names = []
        for process in alive:
            try:
                names.append(f"{process.pid} {process.name()}")
            except psutil.NoSuchProcess:  # exited since the timeout
                continue
        if names:
            left = ", ".join(names)
            raise SystemExit(f"{when}: still running after {EXIT_TIMEOUT_S:.0f} s: {left}")


Sample = tuple[float, float, float]  # first-token s, decode tokens/s, total wall s


def rates(outputs: list[Any], wall: float) -> Sample:
    """(first-token s, decode tokens/s, total s) of one generation, from vLLM's request stats.

    The decode rate is the batch over the time of one decode step: the median over the
    requests that reached their first token last (all of them in the in-process engine; in the
    multiprocess engine the first request may arrive alone and be prefilled before the others)
    of their time from first to last token over their tokens after the first.

    Raises:
        SystemExit: an output carries no stats (the engine was built with log stats off).
    """
    stats = [output.metrics for output in outputs]
    if any(stat is None or stat.num_generation_tokens < 2 for stat in stats):
        raise SystemExit(f"{MODE} mode: an output has no request stats of 2+ tokens: {stats}")
    ttft = max(stat.first_token_latency for stat in stats)
    decoding = max(stat.first_token_ts for stat in stats)  # every request decodes from here
    step = statistics.median(
        (stat.last_token_ts - stat.first_token_ts) / (stat.num_generation_tokens - 1)
        for stat in stats
        if stat.first_token_ts == decoding
    )
    return ttft, len(stats) / max(step, 1e-9), wall


def measure(
    folder: Path, name: str, dtype: str, args: argparse.Namespace, seed: int
) -> tuple[list[Sample], list[list[int]]]:
    """The samples of ``args.repeats`` generations on a new engine, and the first one's tokens.

    Raises:
        SystemExit: a worker's attention layers ran another impl than ``name``'s, an output
            carries no request stats, or vLLM processes (an earlier engine's, or another
            program's) run before the engine is built or after it is shut down.
    """
    class_path = CONTENDERS[name]
    samples: list[Sample] = []
    wait_for_exit(vllm_processes(), f"before {name}'s {MODE} engine, vLLM processes")
    with attn_di.use_container():
        if class_path is not None:
            attn_di.register_backend(attn_di.AttentionBackendEnum.CPU_ATTN, class_path)
        llm = LLM(
            model=str(folder),
            dtype=dtype,
            enforce_eager=MODE == "eager",
            max_model_len=args.prompt_len + args.new_tokens + 16,
            max_num_seqs=args.prompts,
            enable_prefix_caching=False,
            disable_log_stats=False,  # the request stats that rates() reads
            seed=0,
        )
        started = engine_processes()
        try:
            vocab = llm.llm_engine.model_config.get_vocab_size()
            warm_up = random_prompts(args.prompts, args.prompt_len, 1, vocab)
            llm.generate(warm_up, greedy(4), use_tqdm=False)
            generated: list[list[int]] = []
            for repeat in range(args.repeats):
                prompts = random_prompts(args.prompts, args.prompt_len, seed * 100 + repeat, vocab)
                start = time.perf_counter()
                outputs = llm.generate(prompts, greedy(args.new_tokens), use_tqdm=False)
                samples.append(rates(outputs, time.perf_counter() - start))
                if not generated:
                    generated = [list(o.outputs[0].token_ids) for o in outputs]
            ran = llm.collective_rpc(worker_impls)
            if not ran or not all(
                impls and all(impl.startswith(IMPL_MODULES[name]) for impl in impls)
                for impls in ran
            ):
                raise SystemExit(f"{name} in {MODE} mode: the workers ran {ran}")
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    # Not in the finally: a failed round's own reason stops the run, not this wait's.
    wait_for_exit(started, f"after {name}'s {MODE} engine shut down, its processes")
    return samples, generated


# mode, dtype, contender, first-token s, its ratio, the lowest and highest of the rounds' ratios,
# decode tok/s, its ratio, the rounds' lowest and highest, total s, greedy tokens equal to vLLM's
Row = tuple[str, str, str, float, float, float, float, float, float, float, float, float, bool]


def round_ratios(mine: list[Sample], base: list[Sample], repeats: int, i: int) -> list[float]:
    """Per round, the median of field ``i`` of ``mine``'s generations over ``base``'s (both in
    round order, ``repeats`` generations a round): the spread of a row's ratio."""
    return [
        statistics.median(r[i] for r in mine[k : k + repeats])
        / statistics.median(r[i] for r in base[k : k + repeats])
        for k in range(0, len(base), repeats)
    ]


def measure_mode(folder: Path, args: argparse.Namespace) -> list[Row]:
    """The rows of this process's mode (MODE): per dtype and contender, the medians over
    rounds, their ratios to vLLM's own CPU_ATTN, and the range of the rounds' ratios."""
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    rows: list[Row] = []
    for dtype in args.dtypes.split(","):
        results: dict[str, list[Sample]] = {name: [] for name in CONTENDERS}
        tokens: dict[str, list[list[int]]] = {}
        for round_index in range(args.rounds):
            for name in CONTENDERS:
                samples, generated = measure(folder, name, dtype, args, seed=100 + round_index)
                results[name].extend(samples)
                tokens.setdefault(name, generated)
        reference = "vLLM CPU_ATTN"
        base = [statistics.median(r[i] for r in results[reference]) for i in range(3)]
        for name in CONTENDERS:
            ttft, decode, total = (statistics.median(r[i] for r in results[name]) for i in range(3))
            first = round_ratios(results[name], results[reference], args.repeats, 0)
            step = round_ratios(results[name], results[reference], args.repeats, 1)
            same = tokens[name] == tokens[reference]
            first_token = (ttft, ttft / base[0], min(first), max(first))
            decoding = (decode, decode / base[1], min(step), max(step))
            rows.append((MODE, dtype, name, *first_token, *decoding, total, same))
    return rows


def run_mode(mode: str, argv: list[str]) -> list[Row]:
    """The rows of ``mode``, measured by this script in a process of its own (vLLM reads its
    environment once per process).

    Raises:
        SystemExit: that process failed (its output is printed above).
    """
    env = dict(os.environ, ATTN_DI_BENCH_VLLM_MODE=mode, VLLM_ENABLE_V1_MULTIPROCESSING=MODES[mode])
    # collective_rpc(worker_impls) reaches the multiprocess engine's worker pickled (a function
    # of this folder); the processes are this benchmark's own.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--modes", mode, "--json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(ROWS_MARKER)]
    try:
        if done.returncode != 0 or not lines:
            raise ValueError("no rows")
        rows = json.loads(lines[-1][len(ROWS_MARKER) :])["rows"]
    except (ValueError, KeyError, TypeError):
        print(done.stdout)
        raise SystemExit(
            f"the {mode} mode's run failed (exit status {done.returncode}): its output is above"
        ) from None
    return [tuple(row) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating fresh engines")
    parser.add_argument("--repeats", type=int, default=2, help="timed generations per engine")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="eager (in-process, enforce_eager), default"
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown table rows")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # run_mode's
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2")
    for option in ("rounds", "repeats", "prompts", "prompt_len"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    dtypes = args.dtypes.split(",")
    bad = [dtype for dtype in dtypes if dtype not in DTYPES]
    if bad:
        parser.error(f"unknown dtype(s) {bad}: choose from {', '.join(DTYPES)}")
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    bridge.install()
    folder = model_folder()
    if args.json:  # one mode, in this process (run_mode started it, MODE set to it)
        if modes != [MODE]:
            parser.error(f"--json measures this process's mode ({MODE}), not {modes}")
        print(ROWS_MARKER + json.dumps({"rows": measure_mode(folder, args)}))
        return
    load = os.getloadavg()[0]
    print(
        f"# {cpu_model()} ({cpu_flags()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load {load:.1f}; "
        f"{args.prompts} x {args.prompt_len} tokens + {args.new_tokens} new, "
        f"{args.rounds} rounds of {args.repeats} generations"
    )
    argv = [arg for arg in sys.argv[1:] if arg != "--markdown"]
    passed: list[str] = []
    skip = False
    for arg in argv:  # everything but --modes (run_mode passes its own)
        if skip:
            skip = False
        elif arg == "--modes":
            skip = True
        elif not arg.startswith("--modes="):
            passed.append(arg)
    rows = [row for mode in modes for row in run_mode(mode, passed)]
    if args.markdown:
        print(
            "| mode | dtype | contender | first token s | vs vLLM (rounds) | decode tok/s "
            "| vs vLLM (rounds) | total s | same tokens |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for mode, dtype, name, ttft, r1, lo1, hi1, decode, r2, lo2, hi2, total, same in rows:
            print(
                f"| {mode} | {dtype} | {name} | {ttft:.2f} | {r1:.2f}x ({lo1:.2f}-{hi1:.2f}) "
                f"| {decode:.0f} | {r2:.2f}x ({lo2:.2f}-{hi2:.2f}) | {total:.2f} | {same} |"
            )
    else:
        for mode, dtype, name, ttft, r1, lo1, hi1, decode, r2, lo2, hi2, total, same in rows:
            print(
                f"{mode:7} {dtype:9} {name:17} first token {ttft:6.2f} s ({r1:4.2f}x, "
                f"rounds {lo1:4.2f}-{hi1:4.2f})  decode {decode:7.1f} tok/s ({r2:4.2f}x, "
                f"rounds {lo2:4.2f}-{hi2:4.2f})  total {total:6.2f} s  same tokens {same}"
            )


if __name__ == "__main__":
    main()
