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


def _import_ms(code: str, runs: int) -> float:
    script = f"import time; t = time.perf_counter(); {code}; print((time.perf_counter() - t) * 1e3)"
    times = [
        float(subprocess.check_output([sys.executable, "-c", script], text=True))
        for _ in range(runs)
    ]
    return statistics.median(times)


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

    di_import = (
        "import dependency_injector.containers, dependency_injector.providers, "
        "dependency_injector.wiring"
    )
    di_ms = _import_ms(di_import, import_runs)
    both_ms = _import_ms(f"{di_import}; import attn_di", import_runs)
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
            "override enter+exit: attn_di / dependency-injector",
            results["with container.override(member, Fake)"]
            / results["with di_provider.override(Fake) (dependency-injector)"],
            "ratio",
        ),
        ("import dependency_injector (median)", di_ms, "ms"),
        ("import dependency_injector + attn_di (median)", both_ms, "ms"),
        ("attn_di's own import cost", both_ms - di_ms, "ms"),
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
