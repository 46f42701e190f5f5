"""``attn-di list``: every member, the path it resolves to, its source, whether it imports."""

from __future__ import annotations

import argparse
from typing import Any

from attn_di._default import get_container
from attn_di._enum import AttentionBackendEnum, runtime_members
from attn_di.cli._output import print_json, print_table
from attn_di.exceptions import AttnDIError

__all__ = ["describe_members", "run_list"]


def describe_members() -> list[dict[str, Any]]:
    """One record per member of the default container: name, path, source, imports, error.

    Importing is attempted (that is the point): vLLM's paths import only where vLLM is installed.
    """
    container = get_container()
    runtime = set(runtime_members())
    records = []
    for member in AttentionBackendEnum:
        record: dict[str, Any] = {
            "name": member.name,
            "path": None,
            "source": container.source(member),
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
        records.append(record)
    return records


def run_list(args: argparse.Namespace) -> int:
    """Print the members as a table or JSON; always exits 0."""
    records = describe_members()
    if args.json:
        print_json(records)
        return 0
    rows = [
        (
            record["name"] + (" *" if record["runtime_member"] else ""),
            record["path"] or "-",
            record["source"],
            "yes" if record["imports"] else "no",
            _short(record["error"]),
        )
        for record in records
    ]
    print_table(
        "attention backends (* = runtime member)",
        ["member", "path", "source", "imports", "why not"],
        rows,
    )
    return 0


def _short(error: str | None) -> str:
    if not error:
        return ""
    return error.split(": ", 1)[-1] if "cannot import" in error else error
