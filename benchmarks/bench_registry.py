"""Registry benchmark: attn_di's resolution and overrides against a vLLM 0.11-style baseline.

Run: ``python benchmarks/bench_registry.py`` (prints a table; ``--markdown`` prints the rows
for docs/benchmarks.md). Every figure is the best of several timeit repeats, in ns per call,
measured side by side in one process; compare ratios, not absolute times.

The baseline resolves as vLLM 0.11's registry does (``vllm/attention/backends/registry.py``):
``get_class()`` calls ``get_path()`` (an override dict keyed by the enum member, else the
member's value) then ``importlib.import_module`` + ``getattr`` on every call, with no cache.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import os
import platform
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable
from typing import Any

from dependency_injector import providers

from attn_di import AttentionBackendEnum, get_container, register_backend, use_container

TARGET_PATH = "collections.OrderedDict"  # an already-imported module: pure resolution cost


class _VllmStyleEnum(enum.Enum):
    """A stand-in for vLLM 0.11's enum: standard Enum hashing, value = default class path."""

    TRITON_ATTN = TARGET_PATH

    def get_path(self, include_classname: bool = True) -> str:
        path = _VLLM_OVERRIDES.get(self, self.value)
        if not path:
            raise ValueError(f"{self.name} has no path")
        if not include_classname:
            path = path.rsplit(".", 1)[0]
        return str(path)

    def get_class(self) -> Any:
        module_name, class_name = self.get_path().rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)


_VLLM_OVERRIDES: dict[_VllmStyleEnum, str] = {}


def _ns_per_call(stmt: str, namespace: dict[str, Any], repeat: int = 7) -> float:
    timer = timeit.Timer(stmt, globals=namespace)
    number, _ = timer.autorange()
    number = max(number, 10_000)
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e9


def _paired_ratio(ours: str, theirs: str, namespace: dict[str, Any], rounds: int = 41) -> float:
    """Median over rounds of (ours / theirs), the two timed back to back in every round.

    On a shared machine load drifts within seconds; pairing cancels it out of the ratio.
    """
    ours_timer = timeit.Timer(ours, globals=namespace)
    theirs_timer = timeit.Timer(theirs, globals=namespace)
    ratios = []
    for _ in range(rounds):
        mine = min(ours_timer.repeat(repeat=3, number=2000))
        other = min(theirs_timer.repeat(repeat=3, number=2000))
        ratios.append(mine / other)
    return statistics.median(ratios)


def _import_ms(runs: int) -> tuple[float, float]:
    """Medians over fresh interpreters of (dependency_injector's import, then attn_di's on top).

    Both are timed inside the same process, so attn_di's cost is not the difference of two
    noisy medians.
    """
    script = (
        "import time; t0 = time.perf_counter(); "
        "import dependency_injector.containers, dependency_injector.providers, "
        "dependency_injector.wiring; t1 = time.perf_counter(); import attn_di; "
        "t2 = time.perf_counter(); print((t1 - t0) * 1e3, (t2 - t1) * 1e3)"
    )
    # With bytecode caches, as for any installed package: a warm-up run writes the .pyc files
    # (these machines set PYTHONDONTWRITEBYTECODE=1, under which compiling dominates).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.check_output([sys.executable, "-c", script], text=True, env=env)
    pairs = [
        [float(x) for x in subprocess.check_output([sys.executable, "-c", script], env=env).split()]
        for _ in range(runs)
    ]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def measure(import_runs: int = 15) -> list[tuple[str, float, str]]:
    """Run every measurement; returns rows ``(what, value, unit)``."""
    with use_container():
        return _measure(import_runs)


def _measure(import_runs: int) -> list[tuple[str, float, str]]:
    member = AttentionBackendEnum.TRITON_ATTN
    container = get_container()
    register_backend(member, TARGET_PATH)
    baseline_member = _VllmStyleEnum.TRITON_ATTN
    assert container.backend(member) is baseline_member.get_class() is member.get_class()

    di_provider = providers.Object(object())

    class _Fake:
        pass

    namespace: dict[str, Any] = {
        "container": container,
        "member": member,
        "baseline_member": baseline_member,
        "di_provider": di_provider,
        "Fake": _Fake,
    }
    results: dict[str, float] = {}
    cases: dict[str, str] = {
        "baseline get_class() (vLLM 0.11 style)": "baseline_member.get_class()",
        "container.backend(member)": "container.backend(member)",
        "member.get_class()": "member.get_class()",
        'container.backend("TRITON_ATTN")': 'container.backend("TRITON_ATTN")',
        "BackendContainer.TRITON_ATTN provider call": "container.TRITON_ATTN()",
        "with container.override(member, Fake)": (
            "with container.override(member, Fake):\n    pass"
        ),
        "with di_provider.override(Fake) (dependency-injector)": (
            "with di_provider.override(Fake):\n    pass"
        ),
    }
    for label, stmt in cases.items():
        results[label] = _ns_per_call(stmt, namespace)
    override_ratio = _paired_ratio(
        cases["with container.override(member, Fake)"],
        cases["with di_provider.override(Fake) (dependency-injector)"],
        namespace,
    )

    di_ms, attn_di_ms = _import_ms(import_runs)
    heavy = subprocess.check_output(
        [
            sys.executable,
            "-c",
            "import sys, attn_di; print(sorted(m for m in ('torch', 'vllm', 'numpy',"
            " 'attn_di.backends') if m in sys.modules))",
        ],
        text=True,
    ).strip()

    baseline = results["baseline get_class() (vLLM 0.11 style)"]
    rows: list[tuple[str, float, str]] = [(k, v, "ns") for k, v in results.items()]
    rows += [
        (
            "speed-up: container.backend vs baseline",
            baseline / results["container.backend(member)"],
            "x",
        ),
        ("speed-up: member.get_class vs baseline", baseline / results["member.get_class()"], "x"),
        (
            "override enter+exit: attn_di / dependency-injector (median of 41 paired rounds)",
            override_ratio,
            "ratio",
        ),
        ("import dependency_injector (median)", di_ms, "ms"),
        ("attn_di's own import cost, on top of it (median, same process)", attn_di_ms, "ms"),
    ]
    print(f"heavy modules after `import attn_di`: {heavy}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--markdown", action="store_true", help="print markdown table rows")
    parser.add_argument("--import-runs", type=int, default=15)
    args = parser.parse_args(argv)
    rows = measure(args.import_runs)
    machine = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    if args.markdown:
        print(f"| measurement ({machine}) | value |\n|---|---|")
        for label, value, unit in rows:
            print(f"| {label} | {value:,.2f} {unit} |")
        return 0
    _print_table(rows, machine)
    return 0


def _print_table(rows: list[tuple[str, float, str]], machine: str) -> None:
    show: Callable[[str], None]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is in the test extra; fall back to plain text
        for label, value, unit in rows:
            print(f"{label:60s} {value:12,.2f} {unit}")
        return
    table = Table(title=f"attn_di registry benchmark ({machine})")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for label, value, unit in rows:
        table.add_row(label, f"{value:,.2f} {unit}")
    show = Console().print
    show(table)


if __name__ == "__main__":
    raise SystemExit(main())
