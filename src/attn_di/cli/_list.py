"""``attn-di list``: every member of every backend enum (attention, then Mamba), the path it
resolves to, its source, whether it imports."""

from __future__ import annotations

import argparse
import textwrap
import warnings
from typing import Any

from attn_di._default import get_container
from attn_di._family import BackendFamily, families
from attn_di._plugins import PluginRecord, plugin_report
from attn_di.cli._output import TABLE_WIDTH, print_json, print_table
from attn_di.exceptions import AttnDIError, BackendImportError, BackendNotRegisteredError

__all__ = [
    "describe_cpu_attn_bfloat16",
    "describe_cpu_attn_decode",
    "describe_members",
    "describe_plugins",
    "run_list",
]


def describe_members(family: BackendFamily | None = None) -> list[dict[str, Any]]:
    """One record per member of one enum (the attention enum by default) in the default
    container: name, path, source, imports, error.

    Importing is attempted (that is the point): vLLM's paths import only where vLLM is installed.
    """
    family = family or families()[0]
    container = get_container()
    runtime = set(family.runtime_members())
    report = plugin_report()
    records = []
    for member in family.members():
        record: dict[str, Any] = {
            "name": member.name,
            "path": None,
            "source": container.source(member),
            "plugin": _plugin_of(report.origin(member)),
            "runtime_member": member in runtime,
            "imports": False,
            "error": None,
        }
        try:
            record["path"] = container.get_path(member)
            container.backend(member)
            record["imports"] = True
        except AttnDIError as exc:
            record["error"] = exc.message()
            record["why_not"] = _why_not(exc)
        records.append(record)
    return records


def describe_plugins() -> list[dict[str, Any]]:
    """One record per ``attn_di.plugins`` entry point seen: distribution, status, members, error."""
    return [
        {
            "name": record.name,
            "target": record.value,
            "distribution": record.distribution,
            "version": record.version,
            "status": record.status,
            "members": list(record.members),
            "error": record.error,
        }
        for record in plugin_report().plugins
    ]


def run_list(args: argparse.Namespace) -> int:
    """Print the members (and the plugins) as tables or JSON; always exits 0."""
    by_family = {family: describe_members(family) for family in families()}
    plugins = describe_plugins()
    missing = list(plugin_report().missing)
    cpu_attn_decode = describe_cpu_attn_decode()
    cpu_attn_bfloat16 = describe_cpu_attn_bfloat16()
    if args.json:
        output: dict[str, Any] = {
            ("members" if index == 0 else f"{family.key}_members"): records
            for index, (family, records) in enumerate(by_family.items())
        }
        print_json(
            {
                **output,
                "plugins": plugins,
                "missing_plugins": missing,
                "cpu_attn_decode": cpu_attn_decode,
                "cpu_attn_bfloat16": cpu_attn_bfloat16,
            }
        )
        return 0
    wide = getattr(args, "wide", False)
    for family, records in by_family.items():
        rows = [
            (
                record["name"] + (" *" if record["runtime_member"] else ""),
                (record["path"] or "-") if wide else _shorten(record["path"] or "-"),
                record["source"] + _plugin_note(record, wide),
                "yes" if record["imports"] else "no",
                _short(record["error"]) if wide else record.get("why_not", ""),
            )
            for record in records
        ]
        print_table(
            f"{family.label}s: {family.enum.__name__} (* = runtime member)",
            ["member", "path", "source", "imports", "why not"],
            rows,
            width=None if wide else TABLE_WIDTH,
            wrap=(1, 2, 4),
        )
    if not wide:
        print(f"({VLLM_PREFIX_SHOWN} = {VLLM_PREFIX}; whole paths and errors: attn-di list --wide)")
    if cpu_attn_decode:
        print(f"CPU_ATTN runs: {cpu_attn_decode}")
    if cpu_attn_bfloat16:
        _print_parts("CPU_ATTN bfloat16: ", cpu_attn_bfloat16, wide)
    shown = [plugin for plugin in plugins if plugin["status"] != "skipped"]
    if len(shown) < len(plugins):
        print(f"{len(plugins) - len(shown)} installed plugin(s) not loaded: not in ATTN_DI_PLUGINS")
    if shown:
        print_table(
            "plugins (entry points attn_di.plugins; ATTN_DI_PLUGINS allowlists them)",
            ["plugin", "distribution", "status", "registered", "error"],
            [
                (
                    plugin["name"],
                    f"{plugin['distribution'] or '?'} {plugin['version'] or ''}".strip(),
                    plugin["status"],
                    ", ".join(plugin["members"]) or "-",
                    plugin["error"] or "",
                )
                for plugin in shown
            ],
        )
    for name in missing:
        print(f"ATTN_DI_PLUGINS names {name!r}, but no installed plugin has that name")
    return 0


def describe_cpu_attn_decode() -> str | None:
    """Which path attn_di's CPU_ATTN runs here (its compiled decode and prefill kernels, or
    pure torch).

    None when torch is not installed. Loads (or builds) the kernel; a failure is described
    here rather than warned about.
    """
    try:
        from attn_di.backends import _cpu_kernel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _cpu_kernel.kernel_status().describe()
    except ImportError:
        return None


def describe_cpu_attn_bfloat16() -> str | None:
    """How CPU_ATTN's compiled kernels compute bfloat16 here (the decode: AMX tiles, AVX512_BF16
    scores, float32 FMA; the prefill GEMMs: AMX tiles or float32), or None when torch
    is not installed or the kernels are not used."""
    try:
        from attn_di.backends import _cpu_kernel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _cpu_kernel.kernel_status().bfloat16
    except ImportError:
        return None


def _print_parts(label: str, text: str, wide: bool) -> None:
    """``label`` and ``text`` on one line (``wide``), else each ``"; "``-separated part of
    ``text`` on lines of its own under the label, wrapped to the table's width."""
    if wide:
        print(f"{label}{text}")
        return
    indent = " " * len(label)
    for number, part in enumerate(text.split("; ")):
        first = label if number == 0 else indent
        print(textwrap.fill(part, TABLE_WIDTH, initial_indent=first, subsequent_indent=indent))


def _plugin_note(record: dict[str, Any], wide: bool) -> str:
    """`` (plugin from distribution)`` (wide), `` (plugin)`` (the plugins table names the rest)."""
    if not record["plugin"]:
        return ""
    return f" ({record['plugin'] if wide else record['plugin'].split(' from ')[0]})"


def _plugin_of(record: PluginRecord | None) -> str | None:
    if record is None:
        return None
    return f"{record.name} from {record.distribution or 'an unknown distribution'}"


VLLM_PREFIX = "vllm.v1.attention.backends."
"""The package of vLLM's backend classes (most members' defaults)."""
VLLM_PREFIX_SHOWN = "vllm..."
"""How the narrow table shows :data:`VLLM_PREFIX`."""


def _shorten(path: str) -> str:
    return (
        VLLM_PREFIX_SHOWN + path.removeprefix(VLLM_PREFIX) if path.startswith(VLLM_PREFIX) else path
    )


def _why_not(exc: AttnDIError) -> str:
    """Why a member does not import, in a few words (``--wide`` and ``--json`` show it all)."""
    if isinstance(exc, BackendNotRegisteredError):
        return "not registered"
    if isinstance(exc, BackendImportError):
        if exc.missing_module:
            return f"needs {exc.missing_module.partition('.')[0]}"
        if exc.reason == BackendImportError.ATTRIBUTE_NOT_FOUND and exc.suggestion:
            return f"{exc.reason} (did you mean {exc.suggestion}?)"
        return exc.reason
    return exc.message().splitlines()[0]


def _short(error: str | None) -> str:
    if not error:
        return ""
    return error.split(": ", 1)[-1] if "cannot import" in error else error
