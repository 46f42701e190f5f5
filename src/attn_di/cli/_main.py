"""Argument parsing and dispatch for ``attn-di``.

Before a subcommand runs, ``main`` loads the installed plugins, imports the ``--import``
modules and applies the ``--register`` registrations (in that order: the most specific last),
then checks every backend name (``--backend`` and ``ATTN_DI_BACKEND``), so that a typo is
reported at once, before torch is imported.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from attn_di.cli._output import print_error
from attn_di.exceptions import (
    ALL_BACKENDS_COMMAND,
    AttnDIError,
    BackendImportError,
    BackendRejectedError,
    InvalidInputError,
    NoValidBackendError,
    UnknownBackendError,
    closest_name,
)

__all__ = ["RUN_DEFAULTS", "build_parser", "main"]

EXIT_OK = 0
EXIT_FAILED = 1  # a check failed, or no backend could be chosen
EXIT_USAGE = 2  # bad input: names, shapes, dtypes (argparse uses 2 as well)

_COMMAND = "COMMAND"  # the metavar of the subcommand: argparse's messages about it name it

BACKEND_ENV = "ATTN_DI_BACKEND"  # attn_di._selection.ENV_BACKEND, read without importing it

RUN_DEFAULTS: dict[str, Any] = {
    "backend": "auto",
    "batch": 8,
    "context": 2048,
    "prefill": 0,
    "heads": 32,
    "kv_heads": 8,
    "head_size": 128,
    "dtype": "float32",
    "block_size": 16,
    "iters": 5,
    "seed": 0,
    "threads": None,
}
"""The defaults of ``attn-di run``: the parser's, and the values hints quote as examples."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``attn-di: error:`` line and a hint, exit 2.

    Attributes:
        given: the arguments being parsed, when the caller records them (:func:`_parse`
            does, for the top-level parser): a failure of the top-level parser caused by
            an unknown option before the command is then reported as that option.
    """

    given: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        hint = f"see `{self.prog} --help`"
        unknown = _first_unknown_option(self, self.given, message)
        invalid = _INVALID_CHOICE.search(message)
        if unknown is not None:
            message = f"unrecognized arguments: {unknown}"
            hint = _unknown_option_hint(self, unknown, self.given)
        elif invalid is not None:  # an unknown command, or a value outside an option's choices
            choices = re.findall(r"'([^']*)'", invalid.group("choices"))
            close = closest_name(invalid.group("value"), choices)
            if invalid.group("argument") == _COMMAND:
                message = (
                    f"unknown command {invalid.group('value')!r} (choose from {', '.join(choices)})"
                )
                if close is not None:
                    hint = f"did you mean `{self.prog} {close}`? see `{self.prog} --help`"
            elif close is not None:
                hint = f"did you mean {close!r}? see `{self.prog} --help`"
        print_error(message, hint)
        sys.exit(EXIT_USAGE)


_INVALID_CHOICE = re.compile(
    r"argument (?P<argument>\S+): invalid choice: '(?P<value>[^']*)' "
    r"\(choose from (?P<choices>.*)\)"
)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the default is None or a flag's."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``attn-di`` and its subcommands."""
    parser = _Parser(
        prog="attn-di",
        description="List, select and run attention backends (attn_di).",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_registration_arguments(parser, suffix="")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar=_COMMAND, parser_class=_Parser
    )

    def add_command(name: str, help_text: str) -> argparse.ArgumentParser:
        command = commands.add_parser(
            name, help=help_text, description=help_text, formatter_class=_HelpFormatter
        )
        _add_registration_arguments(command, suffix="_after")
        return command

    listing = add_command("list", "every backend, where it comes from, if it imports")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "--wide",
        action="store_true",
        help="the table as wide as its cells, with whole error messages "
        "(default: it fits 100 columns, paths wrapped)",
    )

    select = add_command("select", "which backend a configuration gets, and why")
    _add_config_arguments(select)
    select.add_argument("--device", help="cpu, cuda, cuda:9.0 or rocm (default: detect)")
    select.add_argument("--backend", help="force a backend: a name from `attn-di list`, or auto")
    select.add_argument("--json", action="store_true", help="print JSON instead of text")

    run = add_command("run", "run and check a paged-attention batch, with timings")
    run.set_defaults(**RUN_DEFAULTS)
    run.add_argument("--backend", help="auto, a name from `attn-di list`, or all")
    run.add_argument("--batch", type=int, help="sequences in the batch")
    run.add_argument("--context", type=int, help="cached tokens per sequence")
    run.add_argument(
        "--prefill",
        type=int,
        help="new tokens per chunked-prefill sequence; half the batch prefills (0: all decode)",
    )
    run.add_argument("--heads", type=int, help="query heads")
    run.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    run.add_argument("--head-size", type=int, help="channels per head")
    run.add_argument("--dtype", help="float32, bfloat16 or float16")
    run.add_argument("--block-size", type=int, help="KV-cache block size in tokens")
    run.add_argument("--iters", type=int, help="timed iterations (the median is reported)")
    run.add_argument("--seed", type=int, help="seed of the random batch")
    run.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's, one per core; 1 on a busy machine)",
    )
    run.add_argument("--json", action="store_true", help="print JSON instead of a table")

    conform = add_command(
        "conform", "check a backend against the float64 reference over the feature matrix"
    )
    conform.add_argument(
        "target",
        metavar="TARGET",
        help="a member name (CPU_ATTN, a runtime member) or a class path "
        "(my_pkg.attention:MyBackend or dotted; found from the current directory too)",
    )
    conform.add_argument(
        "--full", action="store_true", help="the full product of the axes (long), not pairwise"
    )
    conform_output = conform.add_mutually_exclusive_group()
    conform_output.add_argument("--json", action="store_true", help="print the report as JSON")
    conform_output.add_argument(
        "--markdown", action="store_true", help="print the report as Markdown (for docs)"
    )
    conform.add_argument(
        "--seed", type=int, default=0, help="picks the pairwise cells and every cell's data"
    )
    conform.add_argument(
        "--dtype",
        action="append",
        metavar="DTYPE",
        help="only cells of this dtype (float32, bfloat16, float16; repeatable, or "
        "comma-separated: --dtype float32,bfloat16)",
    )
    conform.add_argument(
        "--case",
        action="append",
        metavar="ID",
        help="run only this cell (its id, as a failing cell's rerun line gives it; repeatable)",
    )
    conform.add_argument(
        "--shard",
        metavar="K/N",
        help="run only the K-th of N shards of the cells (every N-th cell from the K-th), so "
        "N jobs share one run, e.g. --full --shard 3/8",
    )
    return parser


def _add_registration_arguments(parser: argparse.ArgumentParser, suffix: str) -> None:
    """``--register`` and ``--import``, before the subcommand (suffix "") or after ("_after")."""
    parser.add_argument(
        "--register",
        dest=f"register{suffix}",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a backend for this invocation, e.g. MY_ATTN=my_pkg.attention:MyBackend "
        "(repeatable; a new NAME adds a runtime member)",
    )
    parser.add_argument(
        "--import",
        dest=f"import{suffix}",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so that the registrations it makes at import apply "
        "(repeatable; the current directory is searched too)",
    )


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-size", type=int, required=True, help="channels per head")
    parser.add_argument("--dtype", required=True, help="e.g. bfloat16, float16, float32")
    parser.add_argument("--kv-cache-dtype", default="auto", help="e.g. auto, fp8")
    parser.add_argument("--block-size", type=int, help="KV-cache block size in tokens")
    parser.add_argument("--mla", action="store_true", help="multi-head latent attention")
    parser.add_argument("--sink", action="store_true", help="the layer has attention sinks")
    parser.add_argument("--sparse", action="store_true", help="sparse attention")
    parser.add_argument(
        "--attn-type",
        default="decoder",
        choices=["decoder", "encoder", "encoder_only", "encoder_decoder"],
        help="the layer's attention type",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attn-di`` (the console script and ``python -m attn_di`` call this).

    Args:
        argv: the arguments after the command's name (``["list", "--wide"]``); None reads
            ``sys.argv[1:]``.

    Returns:
        The exit code: 0 ok, 1 a failed check or no backend, 2 bad input (printed as one
        line and a hint, never a traceback).
    """
    args = _parse(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:  # e.g. `attn-di list | head -1`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except BackendRejectedError as exc:
        from_env = exc.origin == BACKEND_ENV
        exc.origin = "--backend" if exc.origin == "backend= argument" else exc.origin
        if from_env:
            hint = (
                f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV, '')} asked for it: unset "
                f"{BACKEND_ENV} to let attn_di choose, or set it to a backend that runs here"
            )
        elif isinstance(exc.__cause__, BackendImportError) and exc.__cause__.suggestion:
            cause = exc.__cause__
            hint = f"did you mean {cause.suggestion!r}? ({cause.fixed_path()})"
        elif (
            isinstance(exc.__cause__, BackendImportError)
            and (exc.__cause__.missing_module or "").partition(".")[0] == "vllm"
            and exc.__cause__.hint
        ):
            hint = exc.__cause__.hint  # how to set vLLM up, or use attn_di's own members
        elif any("must be registered before use" in reason for reason in exc.reasons):
            hint = (
                f"register a class for it in this run: --register {exc.member}=pkg.module:Class "
                "(or --import a module that registers it)"
            )
        else:
            hint = "use --backend auto to let attn_di choose; `attn-di list` shows what imports"
        print_error(exc.message(), hint)
        return EXIT_FAILED
    except NoValidBackendError as exc:
        print_error(
            exc.message(),
            "change the configuration, or register a backend that supports it "
            "(--register NAME=pkg.module:Class); `attn-di list` shows every backend",
        )
        return EXIT_FAILED
    except UnknownBackendError as exc:
        print_error(exc.message(), _unknown_backend_hint(exc))
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
    except OSError as exc:  # the output cannot be written (a full disk, `>/dev/full`)
        if exc.errno not in _WRITE_ERRORS:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print_error(f"cannot write the output: {exc.strerror}", "check the file or disk it goes to")
        return EXIT_FAILED


_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; an unknown option is reported by the subcommand it was given to."""
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if isinstance(parser, _Parser):
        parser.given = given
    args, extras = parser.parse_known_args(given)
    if extras:
        message = f"unrecognized arguments: {' '.join(extras)}"
        wrong = next((extra for extra in extras if extra.startswith("-")), extras[0])
        print_error(message, _unknown_option_hint(parser, wrong, given))
        sys.exit(EXIT_USAGE)
    args.register = [*args.register, *args.register_after]
    args.imports = [*getattr(args, "import"), *args.import_after]
    return args


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name (none for a subcommand's own parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings]


def _first_unknown_option(
    parser: argparse.ArgumentParser, given: Sequence[str], message: str
) -> str | None:
    """The first option before the command that ``parser`` (the top level) does not know,
    when argparse's ``message`` is about the command.

    An unknown option before the command makes argparse take the next word for the command
    (``--registr X=m:C run`` fails as "invalid choice: 'X=m:C'"), or find none: the option
    is the error to report. Exact options and the unique prefixes argparse accepts count
    as known.
    """
    commands = _commands(parser)
    if not commands or _COMMAND not in message:
        return None
    known = _options(parser)
    invalid = re.search(r"invalid choice: '([^']*)'", message)
    for word in given:
        if word == "--" or word in commands:
            return None
        if invalid is not None and word == invalid.group(1):
            return None  # an unknown command comes first: it is the error to report
        option = word.split("=", 1)[0]
        if not word.startswith("-") or word == "-" or _is_negative_number(word):
            continue
        prefix_of = [o for o in known if o.startswith("--") and o.startswith(option)]
        if option not in known and not (option.startswith("--") and len(prefix_of) == 1):
            return word
    return None


def _is_negative_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _unknown_option_hint(parser: argparse.ArgumentParser, wrong: str, given: Sequence[str]) -> str:
    """The closest option among attn-di's own and the command's (the first command word in
    ``given``), and the help that documents it."""
    commands = _commands(parser)
    command_name = next((word for word in given if word in commands), None)
    command = commands[command_name] if command_name else None
    command_options = _options(command) if command is not None else []
    global_options = _options(parser)
    close = closest_name(wrong.split("=", 1)[0], [*command_options, *global_options])
    if close is None:
        help_of = command if command is not None else parser
        return f"see `{help_of.prog} --help`"
    if command is not None and close in command_options:
        words = list(given)
        before = (
            command_name is not None
            and wrong in words
            and words.index(wrong) < words.index(command_name)
        )
        where = f" (after `{command_name}`)" if before and close not in global_options else ""
        return f"did you mean {close}{where}? see `{command.prog} --help`"
    where = f" (before `{command_name}`)" if command_name else ""
    return f"did you mean {close}{where}? see `{parser.prog} --help`"


def _dispatch(args: argparse.Namespace) -> int:
    _load_plugins_quietly()
    _import_modules(args.imports)
    _register(args.register)
    _check_backend_names(args)
    if args.command in ("select", "run"):
        args.dtype = _canonical_dtype(args.dtype)
    if args.command == "conform":
        from attn_di.cli._conform import run_conform

        args.dtype = [d.strip() for given in args.dtype or () for d in given.split(",")]
        _add_cwd_to_path()
        return run_conform(args)
    if args.command == "list":
        from attn_di.cli._list import run_list

        return run_list(args)
    if args.command == "select":
        from attn_di.cli._select import run_select

        return run_select(args)
    from attn_di.cli._run import run_batch

    return run_batch(args)


def _import_modules(modules: Sequence[str]) -> None:
    """``--import``: import each module (its registrations apply), the current directory first.

    Raises:
        InvalidInputError: a name that is not a dotted module name (a file path, a relative
            or empty name), a module that is not found, or one whose import raises anything
            but ``KeyboardInterrupt`` (``SystemExit`` included).
    """
    import importlib

    for module in modules:
        _check_module_name(module)
    if modules:
        _add_cwd_to_path()
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise InvalidInputError(
                "--import",
                f"cannot import {module!r}: {exc}",
                hint="give a module name (my_pkg.attention, not a file path) that is installed "
                "or found from the current directory",
            ) from exc
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a module's failure is not attn-di's exit
            raise InvalidInputError(
                "--import",
                f"importing {module!r} raised {type(exc).__name__}: {exc}",
                hint=f"fix the module, or check that `python -c 'import {module}'` works",
            ) from exc


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_module_name(module: str) -> None:
    """Refuse what ``importlib.import_module`` cannot take as an absolute module name."""
    if _MODULE_NAME.fullmatch(module):
        return
    stem = os.path.splitext(os.path.basename(module.rstrip("/\\")))[0]
    if stem.isidentifier() and (os.sep in module or "/" in module or module.endswith(".py")):
        hint = (
            f"give a module name, not a file path: run attn-di from the directory that holds "
            f"it and pass --import {stem}"
        )
    else:
        hint = "give a dotted module name, e.g. --import my_pkg.attention"
    what = "an empty name" if not module.strip() else repr(module)
    raise InvalidInputError("--import", f"{what} is not a module name", hint=hint)


def _add_cwd_to_path() -> None:
    """Find modules from the current directory, as ``python -m`` does."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _register(specs: Sequence[str]) -> None:
    """``--register NAME=PATH`` (``mamba:NAME=PATH`` for a Mamba backend): register each path
    (lazily, found from the current directory too) in the default container."""
    from attn_di import register_backend

    if specs:
        _add_cwd_to_path()
    for spec in specs:
        name, sep, class_path = spec.partition("=")
        if not sep or not name.strip() or not class_path.strip():
            raise InvalidInputError(
                "--register",
                f"expected NAME=pkg.module:Class, got {spec!r}",
                hint="e.g. --register MY_ATTN=my_pkg.attention:MyBackend",
            )
        family, colon, member = name.strip().rpartition(":")
        is_mamba = colon == ":" and family == "mamba"
        if colon and not is_mamba:
            raise InvalidInputError(
                "--register",
                f"{spec}: unknown family {family!r} (only 'mamba:' prefixes a name)",
                hint="e.g. --register mamba:MY_SSM=my_pkg.ssm:MySSMBackend",
            )
        try:
            register_backend(member, class_path.strip(), is_mamba=is_mamba)
        except AttnDIError as exc:
            raise InvalidInputError("--register", f"{spec}: {exc.message()}", exc.hint) from exc


def _check_backend_names(args: argparse.Namespace) -> None:
    """Refuse an unknown ``--backend`` or ``ATTN_DI_BACKEND`` now, naming where it came from."""
    from attn_di import parse_backend_name

    flag: str | None = getattr(args, "backend", None)
    word = (flag or "").strip().lower()
    given = word not in ("", "auto")
    if given and not (args.command == "run" and word == "all"):
        try:
            parse_backend_name(flag)
        except UnknownBackendError as exc:
            message, hint = exc.message(), _unknown_backend_hint(exc)
            if args.command == "run":  # `run` also takes `all`: list it, and suggest it
                message += ", all"
                if _means_all(exc):
                    hint = "did you mean 'all' (every backend, one after another)? `attn-di list` "
                    hint += "shows every backend"
            raise InvalidInputError("--backend", message, hint) from exc
    env = os.environ.get(BACKEND_ENV)
    if env is not None and not given and args.command != "list":
        try:
            parse_backend_name(env)
        except UnknownBackendError as exc:
            raise InvalidInputError(
                f"{BACKEND_ENV}={env!r}", exc.message(), _unknown_backend_hint(exc, BACKEND_ENV)
            ) from exc


def _canonical_dtype(text: str) -> str:
    """``--dtype`` as a canonical name; an unknown one is refused with a suggestion
    (:func:`attn_di._selection.canonical_dtype`)."""
    from attn_di._selection import canonical_dtype

    try:
        return canonical_dtype(text)
    except InvalidInputError as exc:
        exc.argument = "--dtype"
        if not exc.hint or not exc.hint.startswith("did you mean"):
            exc.hint = f"e.g. --dtype {RUN_DEFAULTS['dtype']}"
        raise


def _means_all(exc: UnknownBackendError) -> bool:
    """The unknown name is `all` or a typo of it (closer to it than to any member)."""
    return closest_name(str(exc.name), [*exc.choices, "all"]) == "all"


def _unknown_backend_hint(exc: UnknownBackendError, variable: str | None = None) -> str:
    """The CLI's hint for an unknown name: the closest one, and CLI commands (not Python)."""
    if _means_all(exc):
        where = f", not by {variable}: set it to one backend name or unset it" if variable else ""
        near = "" if str(exc.name).strip().lower() == "all" else "did you mean all? "
        return (
            f"{near}`all` is accepted only by `{ALL_BACKENDS_COMMAND}`{where}; "
            "`attn-di list` shows every backend"
        )
    if variable is not None:
        advice = (
            f"did you mean {variable}={exc.suggestion}? "
            if exc.suggestion
            else f"unset {variable} (or set it to auto) to let attn_di choose; "
        )
        return f"{advice}`attn-di list` shows every backend"
    if exc.suggestion:
        return f"did you mean {exc.suggestion!r}? `attn-di list` shows every backend"
    if "auto" not in exc.choices:  # a command that takes one backend (conform)
        return exc.hint or "`attn-di list` shows every backend"
    return "use auto to let attn_di choose; `attn-di list` shows every backend and if it imports"


def _load_plugins_quietly() -> None:
    """Load ``attn_di.plugins`` entry points; failures are shown by ``attn-di list``, not as
    logged tracebacks on every command (unless the caller configured logging)."""
    import logging

    from attn_di import load_plugins

    plugin_logger = logging.getLogger("attn_di.plugins")
    if not logging.getLogger().handlers and not plugin_logger.handlers:
        plugin_logger.addHandler(logging.NullHandler())
    load_plugins()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attn-di")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree, not installed
        return "(not installed)"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
