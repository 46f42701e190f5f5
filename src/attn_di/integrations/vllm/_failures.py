"""attn_di's errors raised in vLLM's other processes, carried to the process that starts the engine.

vLLM starts its engine core and its workers as processes of their own (spawned: they inherit
the environment, not the memory). When one of them fails while the engine starts, vLLM logs the
exception there ("EngineCore failed to start.", "WorkerProc failed to start.") and the process
that started the engine gets only vLLM's own error ("RuntimeError: Engine core initialization
failed. See root cause above. Failed core proc(s): ..."). Here:

- :func:`collecting`, around vLLM's engine-core client construction
  (``EngineCoreClient.make_client`` and ``make_async_mp_client``, which ``LLM``, ``LLMEngine``
  and ``AsyncLLM`` call in the process that starts the engine), makes a folder and names it in
  :data:`FAILURES_ENV` for the processes vLLM starts. When the construction fails with anything
  but an attn_di error, it raises the first attn_di error recorded there instead (the same
  type, message and hint; a note names the process), chained from vLLM's error. The folder
  goes when the construction ends, and the variable is put back.
- :func:`install` (run by the bridge in every vLLM process) wraps the logging module's record
  factory: a log record at ERROR or above whose exception is, or was caused by, an attn_di
  error writes one small JSON file (:class:`FailureRecord`) into that folder. vLLM logs every
  fatal start-up exception that way, whichever of its loggers and handlers are configured.

What this cannot carry (the log line to look for is in docs/guides/vllm.md, "When a worker
fails"): failures after the engine started (at a step: vLLM raises ``EngineDeadError``), engine
processes on another machine or started by another command (``--headless``, several API
servers), and processes whose logging is set above ERROR (no record is made).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attn_di.exceptions import AttnDIError

__all__ = [
    "FAILURES_ENV",
    "FailureRecord",
    "attn_di_error_in",
    "carried_error",
    "collecting",
    "install",
    "patch_engine_client",
    "read_records",
    "write_record",
]

FAILURES_ENV = "ATTN_DI_VLLM_FAILURES"
"""The folder where vLLM's processes record attn_di errors while an engine starts (set by
:func:`collecting` in the process that starts it; inherited by the processes vLLM starts)."""

_FORMAT = 1
_REPR_KEY = "__attn_di_repr__"
_TUPLE_KEY = "__attn_di_tuple__"
_logger = logging.getLogger(__name__)
# The folders this process made, with the pid that made it (a forked child is not the owner).
_owned: dict[str, int] = {}
# (class, attribute, original) of each patched engine-client constructor.
_patched: list[tuple[type, str, Any]] = []


@dataclass
class FailureRecord:
    """One attn_di error as a vLLM process recorded it (the JSON file's fields).

    Attributes:
        types: the error's class and its bases that are attn_di errors, as ``module.qualname``,
            most derived first (the user's process rebuilds the first one it can import).
        args: the error's ``args`` (tuples kept as tuples; values JSON cannot hold, such as
            vLLM's configuration objects, kept as their ``repr``).
        attributes: the error's attributes (``member``, ``class_path``, ``hint``, ...), the same.
        message: the error's message without the hint (:meth:`AttnDIError.message`).
        hint: its hint, or None.
        process: vLLM's name for the process (``EngineCore``, ``Worker_TP1``).
        pid: the process id.
        causes: ``Type: text`` of each exception the error was raised from, outermost first.
        logged: the log message that carried the exception (``EngineCore failed to start.``).
        time_ns: when it was recorded (``time.time_ns()``).
    """

    types: list[str]
    args: list[Any]
    attributes: dict[str, Any]
    message: str
    hint: str | None
    process: str
    pid: int
    causes: list[str] = field(default_factory=list)
    logged: str = ""
    time_ns: int = 0

    @classmethod
    def of(cls, error: AttnDIError, process: str, logged: str = "") -> FailureRecord:
        """The record of ``error`` raised in this process (vLLM's name for it: ``process``)."""
        types = [
            f"{klass.__module__}.{klass.__qualname__}"
            for klass in type(error).__mro__
            if issubclass(klass, AttnDIError)
        ]
        attributes = {
            name: _encode(value) for name, value in vars(error).items() if not name.startswith("_")
        }
        attributes["hint"] = error.hint
        return cls(
            types=types,
            args=[_encode(arg) for arg in error.args],
            attributes=attributes,
            message=error.message(),
            hint=error.hint,
            process=process,
            pid=os.getpid(),
            causes=_causes(error),
            logged=logged,
            time_ns=time.time_ns(),
        )

    def rebuild(self) -> AttnDIError | None:
        """The error again, in this process: its class (or the closest attn_di base class that
        imports here), attributes, message and hint; None if no class imports."""
        klass = _first_class(self.types)
        if klass is None:
            return None
        args = [_decode(arg) for arg in self.args]
        try:
            error = klass(*args)
        except Exception:  # a constructor that takes other arguments than its args
            error = klass.__new__(klass, *args)
        for name, value in self.attributes.items():
            vars(error)[name] = _decode(value)
        error.hint = self.hint
        try:
            same = error.message() == self.message
        except Exception:
            same = False
        if not same:  # a message made from state that did not travel: show it as it was
            vars(error)["message"] = functools.partial(str, self.message)
        return error

    def describe(self) -> str:
        """``Worker_TP1 (pid 123)``."""
        return f"{self.process} (pid {self.pid})"


def write_record(folder: Path, record: FailureRecord) -> Path:
    """Write ``record`` into ``folder`` as one JSON file (written whole, then renamed, so a
    reader never sees half of it).

    Returns:
        The file's path.

    Raises:
        OSError: the folder is gone or not writable.
    """
    name = f"{record.time_ns:020d}-{record.pid}-{os.urandom(4).hex()}"
    partial = folder / f".{name}.tmp"
    partial.write_text(json.dumps({"format": _FORMAT, **asdict(record)}), encoding="utf-8")
    final = folder / f"{name}.json"
    os.replace(partial, final)
    return final


def read_records(folder: Path) -> list[FailureRecord]:
    """The records in ``folder``, oldest first; files that are not records are skipped."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
            if fields.pop("format", None) != _FORMAT:
                continue
            records.append(FailureRecord(**fields))
        except (OSError, ValueError, TypeError):
            _logger.debug("attn_di: %s is no failure record", path, exc_info=True)
    return sorted(records, key=lambda record: record.time_ns)


def attn_di_error_in(exc: BaseException | None) -> AttnDIError | None:
    """``exc`` itself if it is an attn_di error, else the first one it was raised from
    (``__cause__``, else ``__context__``), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, AttnDIError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def carried_error(folder: Path, failure: BaseException) -> AttnDIError | None:
    """The attn_di error to raise for ``failure`` (vLLM's error in this process) from the
    records in ``folder``, with notes naming where it was raised; None where ``failure`` is
    an attn_di error already (an engine core in this process) or nothing was recorded."""
    if attn_di_error_in(failure) is not None:
        return None
    records = read_records(folder)
    for index, record in enumerate(records):
        error = record.rebuild()
        if error is None:
            continue
        first_line = str(failure).splitlines()[0] if str(failure) else ""
        error.add_note(
            f"raised in vLLM's process {record.describe()} while the engine started, and "
            f"carried here by attn_di from vLLM's {type(failure).__name__}: {first_line}"
        )
        for cause in record.causes:
            error.add_note(f"raised there from {cause}")
        others = [
            other.describe()
            for other in records[index + 1 :]
            if (other.types, other.message) == (record.types, record.message)
        ]
        if others:
            error.add_note(f"the same error was raised in {', '.join(others)}")
        return error
    return None


@contextmanager
def collecting() -> Iterator[None]:
    """Around the start of a vLLM engine in this process: the attn_di error one of vLLM's
    processes recorded replaces vLLM's generic error (see the module docstring).

    Nested uses (``make_client`` calling ``make_async_mp_client``) share the outer folder.

    Raises:
        AttnDIError: what a vLLM process recorded, chained from vLLM's error, when the body
            fails with an error that is not an attn_di error itself.
    """
    current = os.environ.get(FAILURES_ENV)
    if current is not None and _owned.get(current) == os.getpid():
        yield
        return
    folder = tempfile.mkdtemp(prefix="attn_di-vllm-failures-")
    _owned[folder] = os.getpid()
    os.environ[FAILURES_ENV] = folder
    try:
        yield
    except Exception as failure:
        carried = carried_error(Path(folder), failure)
        if carried is None:
            raise
        raise carried from failure
    finally:
        if current is None:
            os.environ.pop(FAILURES_ENV, None)
        else:
            os.environ[FAILURES_ENV] = current
        _owned.pop(folder, None)
        shutil.rmtree(folder, ignore_errors=True)


def install() -> Callable[[], None]:
    """Record, in this process, the attn_di errors vLLM logs (see the module docstring).

    Returns:
        The function that stops recording and puts back what :func:`patch_engine_client`
        patched.
    """
    factory = _RecordingFactory(logging.getLogRecordFactory())
    logging.setLogRecordFactory(factory)
    if "vllm.v1.engine.core_client" in sys.modules:  # an engine may start without EngineArgs
        patch_engine_client()

    def undo() -> None:
        factory.active = False
        if logging.getLogRecordFactory() is factory:
            logging.setLogRecordFactory(factory.wrapped)
        # else another factory wraps ours (vLLM's own): it stays in the chain, switched off.
        while _patched:
            klass, name, original = _patched.pop()
            setattr(klass, name, original)

    return undo


def patch_engine_client() -> None:
    """Wrap vLLM's ``EngineCoreClient.make_client`` and ``make_async_mp_client`` in
    :func:`collecting` (idempotent; undone by :func:`install`'s undo).

    Called by :func:`install` where vLLM's client module is imported already, and where an
    engine is about to start in this process (the engine's start-up check): vLLM's processes
    that never start one are not made to import that module.
    """
    if _patched:
        return
    from vllm.v1.engine.core_client import EngineCoreClient

    for name in ("make_client", "make_async_mp_client"):
        original = vars(EngineCoreClient).get(name)
        if not isinstance(original, staticmethod):  # vLLM changed shape: nothing carried
            _logger.debug("attn_di: EngineCoreClient.%s is not a staticmethod", name)
            continue
        setattr(EngineCoreClient, name, staticmethod(_collected(original.__func__)))
        _patched.append((EngineCoreClient, name, original))


def _collected(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with collecting():
            return function(*args, **kwargs)

    return wrapper


class _RecordingFactory:
    """A log record factory that writes a :class:`FailureRecord` for each record at ERROR or
    above whose exception is (or comes from) an attn_di error, while :data:`FAILURES_ENV`
    names a folder of another process. It never raises and never changes the record."""

    def __init__(self, wrapped: Callable[..., logging.LogRecord]) -> None:
        self.wrapped = wrapped
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        log_record = self.wrapped(*args, **kwargs)
        if self.active and log_record.levelno >= logging.ERROR and log_record.exc_info:
            # Recording is best effort: the log line itself must go out.
            with contextlib.suppress(Exception):
                self._record(log_record)
        return log_record

    def _record(self, log_record: logging.LogRecord) -> None:
        folder = os.environ.get(FAILURES_ENV)
        if not folder or _owned.get(folder) == os.getpid() or not os.path.isdir(folder):
            return
        exc_info = log_record.exc_info
        error = attn_di_error_in(exc_info[1] if exc_info else None)
        if error is None:
            return
        record = FailureRecord.of(error, _process_name(log_record), str(log_record.msg))
        write_record(Path(folder), record)


def _process_name(log_record: logging.LogRecord) -> str:
    """vLLM's name for this process (``Worker_TP1``), else multiprocessing's."""
    name = getattr(log_record, "vllm_process_name", None)
    info = getattr(sys.modules.get("vllm.logger"), "_vllm_process_info", None)
    if isinstance(info, tuple) and len(info) == 2 and info[1] == os.getpid():
        name = info[0]
    return str(name or multiprocessing.current_process().name)


def _causes(error: BaseException) -> list[str]:
    """``Type: first line`` of each exception ``error`` was raised from, outermost first."""
    causes = []
    seen = {id(error)}
    exc = error.__cause__ or error.__context__
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).splitlines()[0] if str(exc) else ""
        causes.append(f"{type(exc).__name__}: {text}")
        exc = exc.__cause__ or exc.__context__
    return causes


class _Shown:
    """A value recorded in another process as its ``repr`` (a vLLM configuration object):
    shown here exactly as it was there."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shown) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _encode(value: Any) -> Any:
    """``value`` as JSON holds it (a tuple as ``{_TUPLE_KEY: [...]}``); anything else as its
    repr (``{_REPR_KEY: repr}``)."""
    kind = type(value)  # exact types: a NamedTuple (vLLM's selector config) is shown as such
    if value is None or kind in (str, bool, int, float):
        return value
    if kind is list:
        return [_encode(item) for item in value]
    if kind is tuple:
        return {_TUPLE_KEY: [_encode(item) for item in value]}
    if kind is dict and all(type(key) is str for key in value):
        return {key: _encode(item) for key, item in value.items()}
    return {_REPR_KEY: repr(value)}


def _decode(value: Any) -> Any:
    """The inverse of :func:`_encode` (reprs become :class:`_Shown`)."""
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if isinstance(value, dict):
        if set(value) == {_REPR_KEY}:
            return _Shown(str(value[_REPR_KEY]))
        if set(value) == {_TUPLE_KEY} and isinstance(value[_TUPLE_KEY], list):
            return tuple(_decode(item) for item in value[_TUPLE_KEY])
        return {key: _decode(item) for key, item in value.items()}
    return value


def _first_class(types: list[str]) -> type[AttnDIError] | None:
    """The first of ``types`` (``module.qualname``) that is an attn_di error class here: from
    a module imported already, or one of attn_di's own (nothing else is imported)."""
    for qualified in types:
        module_name, _, qualname = qualified.rpartition(".")
        module = sys.modules.get(module_name)
        if module is None and module_name.split(".")[0] == "attn_di":
            try:
                module = __import__(module_name, fromlist=["_"])
            except ImportError:
                continue
        klass: Any = module
        for part in qualname.split("."):
            klass = getattr(klass, part, None)
        if isinstance(klass, type) and issubclass(klass, AttnDIError):
            return klass
    return None
