"""Argument parsing and dispatch for ``attn-di``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from attn_di.cli._output import print_error
from attn_di.exceptions import (
    AttnDIError,
    BackendRejectedError,
    NoValidBackendError,
    UnknownBackendError,
)

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_FAILED = 1  # a check failed, or no backend could be chosen
EXIT_USAGE = 2  # bad input: names, shapes, dtypes (argparse uses 2 as well)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``attn-di: error:`` line and a hint, exit 2."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{message}", f"see `{self.prog} --help`")
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``attn-di`` and its subcommands."""
    parser = _Parser(
        prog="attn-di",
        description="List, select and run attention backends (attn_di).",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    listing = commands.add_parser("list", help="every backend, where it comes from, if it imports")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")

    select = commands.add_parser("select", help="which backend a configuration gets, and why")
    _add_config_arguments(select)
    select.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:9.0, rocm (default: detect)"
    )
    select.add_argument("--backend", default=None, help="force a backend (name, or auto)")
    select.add_argument("--json", action="store_true", help="print JSON instead of text")

    run = commands.add_parser("run", help="run and check a paged-attention batch, with timings")
    run.add_argument("--backend", default="auto", help="auto, a backend name, or all")
    run.add_argument("--batch", type=int, default=8, help="sequences in the batch (default 8)")
    run.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    run.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="new tokens per chunked-prefill sequence; half the batch prefills (0: all decode)",
    )
    run.add_argument("--heads", type=int, default=32, help="query heads")
    run.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    run.add_argument("--head-size", type=int, default=128)
    run.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    run.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    run.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-size", type=int, required=True)
    parser.add_argument("--dtype", required=True, help="e.g. bfloat16, float16, float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--mla", action="store_true", help="multi-head latent attention")
    parser.add_argument("--sink", action="store_true", help="the layer has attention sinks")
    parser.add_argument("--sparse", action="store_true", help="sparse attention")
    parser.add_argument(
        "--attn-type",
        default="decoder",
        choices=["decoder", "encoder", "encoder_only", "encoder_decoder"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attn-di``; returns the exit code (0 ok, 1 failed check / no backend, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        _load_plugins_quietly()
        if args.command == "list":
            from attn_di.cli._list import run_list

            return run_list(args)
        if args.command == "select":
            from attn_di.cli._select import run_select

            return run_select(args)
        from attn_di.cli._run import run_batch

        return run_batch(args)
    except BackendRejectedError as exc:
        exc.origin = "--backend" if exc.origin == "backend= argument" else exc.origin
        print_error(exc.message(), "use --backend auto to let attn_di choose")
        return EXIT_FAILED
    except NoValidBackendError as exc:
        print_error(exc.message(), exc.hint)
        return EXIT_FAILED
    except UnknownBackendError as exc:
        all_hint = "`all` is for attn-di run" if str(exc.name).strip().lower() == "all" else None
        print_error(exc.message(), all_hint or exc.hint)
        return EXIT_USAGE
    except AttnDIError as exc:
        print_error(exc.message(), exc.hint)
        return EXIT_USAGE
    except (MemoryError, OverflowError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" not in str(exc):
            raise
        print_error(
            f"out of memory: {str(exc).splitlines()[0][:200]}", "use smaller sizes (see --help)"
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `attn-di list | head`: stop quietly, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _load_plugins_quietly() -> None:
    """Load ``attn_di.plugins`` entry points; failures are shown by ``attn-di list``, not as
    logged tracebacks on every command (unless the caller configured logging)."""
    import logging

    from attn_di._plugins import load_plugins

    plugin_logger = logging.getLogger("attn_di.plugins")
    if not logging.getLogger().handlers and not plugin_logger.handlers:
        plugin_logger.addHandler(logging.NullHandler())
    load_plugins()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
