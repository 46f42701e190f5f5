"""``attn-di select``: the backend a configuration gets, and every rejected candidate's reasons."""

from __future__ import annotations

import argparse
from typing import Any

from attn_di._selection import AttentionSelectorConfig, Selection, select_backend
from attn_di.cli._output import print_json, print_table

__all__ = ["run_select", "selection_record"]


def run_select(args: argparse.Namespace) -> int:
    """Select and print; exit 0 when a backend was chosen (errors are handled by main)."""
    config = AttentionSelectorConfig(
        head_size=args.head_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        use_mla=args.mla,
        has_sink=args.sink,
        use_sparse=args.sparse,
        attn_type=args.attn_type,
    )
    selection = select_backend(config, device=args.device, backend=args.backend)
    if args.json:
        print_json(selection_record(selection))
        return 0
    print(f"selected: {selection.backend.name} ({selection.path})")
    print(f"  origin: {selection.origin}; device: {selection.device}; config: {config!r}")
    if selection.rejected:
        print_table(
            "rejected candidates",
            ["backend", "reasons"],
            [(member.name, "; ".join(reasons)) for member, reasons in selection.rejected.items()],
        )
    return 0


def selection_record(selection: Selection) -> dict[str, Any]:
    """A JSON-serialisable description of a selection."""
    config = selection.config
    return {
        "backend": selection.backend.name,
        "path": selection.path,
        "origin": selection.origin,
        "device": str(selection.device),
        "config": None if config is None else dict(vars(config)),
        "rejected": {member.name: reasons for member, reasons in selection.rejected.items()},
    }
