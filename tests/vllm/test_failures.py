"""attn_di errors recorded in one process and raised in another (``_failures``), without an
engine: the record's round trip, the folder's life around an engine's start, the recorder
the bridge installs, and the start-up refusal of a class that is no attention backend."""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

from attn_di.backends.torch_sdpa import TorchSDPABackend
from attn_di.exceptions import (
    AttnDIError,
    BackendImportError,
    BackendRejectedError,
    EnvSwitchError,
    UnsupportedFeatureError,
)
from attn_di.integrations.vllm._failures import (
    FAILURES_ENV,
    FailureRecord,
    collecting,
    read_records,
    write_record,
)

CORE_FAILED = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def _raised(error: AttnDIError, cause: BaseException | None = None) -> AttnDIError:
    """``error`` as raised (from ``cause``), with its traceback."""
    try:
        raise error from cause
    except AttnDIError as caught:
        return caught


def _errors() -> list[AttnDIError]:
    config = AttentionSelectorConfig(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=None
    )
    rejected = BackendRejectedError(
        "CPU_ATTN", ["attention type encoder_only not supported"], "the check", config, "cpu"
    )
    rejected.hint = "register a backend that runs encoder_only attention"
    return [
        BackendImportError(
            "CPU_ATTN",
            "pkg.mod.Backend",
            BackendImportError.MODULE_FAILED,
            "No module named 'x'",
            missing_module="x",
        ),
        rejected,
        UnsupportedFeatureError("NO_GQA", "grouped-query attention", ("CPU_ATTN", "TORCH_SDPA")),
        EnvSwitchError("ATTN_DI_VLLM_BRIDGE", "maybe", "install the bridge", "leave vLLM"),
    ]


@pytest.mark.parametrize("error", _errors(), ids=lambda error: type(error).__name__)
def test_a_record_rebuilds_the_error(tmp_path: Path, error: AttnDIError) -> None:
    """Written and read back, a record rebuilds the error: the same class, message, hint and
    attributes (a vLLM configuration object as its repr, tuples as tuples)."""
    write_record(tmp_path, FailureRecord.of(_raised(error), "Worker_TP1"))
    (record,) = read_records(tmp_path)
    rebuilt = record.rebuild()
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    assert rebuilt.hint == error.hint
    for name, value in vars(error).items():
        if not name.startswith("_"):
            shown = getattr(rebuilt, name)
            assert shown == value or repr(shown) == repr(value), name
    assert (record.process, record.pid) == ("Worker_TP1", os.getpid())


class _ProjectError(BackendRejectedError):
    """An attn_di error class of another package."""


def test_a_class_that_does_not_import_here_rebuilds_as_its_attn_di_base(tmp_path: Path) -> None:
    """A subclass that does not import in the reading process comes back as the closest
    attn_di class, with the message as it was."""
    error = _ProjectError("CPU_ATTN", ["no"], "there", object(), "cpu")
    record = FailureRecord.of(_raised(error), "EngineCore")
    assert record.types[0] == f"{__name__}._ProjectError"
    record.types[0] = "a_package_not_here.errors.ProjectError"
    rebuilt = record.rebuild()
    assert type(rebuilt) is BackendRejectedError
    assert str(rebuilt) == str(error)


def _start(records: list[tuple[AttnDIError, str]], failure: BaseException) -> None:
    """An engine start as this process sees it inside :func:`collecting`: vLLM's processes
    write ``records`` (error, process name) into the folder, then vLLM raises ``failure``.

    The folder is appended to ``_folders`` (the block always raises)."""
    with collecting():
        folder = Path(os.environ[FAILURES_ENV])
        _folders.append(folder)
        assert folder.is_dir()
        for error, process in records:
            write_record(folder, FailureRecord.of(error, process))
        raise failure


_folders: list[Path] = []


def test_collecting_raises_what_a_process_recorded(tmp_path: Path) -> None:
    """Inside the block the variable names a new folder; vLLM's error there becomes the
    recorded attn_di error, chained from it, with notes naming the process and the cause; the
    folder and the variable go after."""
    assert FAILURES_ENV not in os.environ
    cause = ModuleNotFoundError("No module named 'x'", name="x")
    error = _raised(_errors()[0], cause)
    with pytest.raises(BackendImportError) as caught:
        _start([(error, "EngineCore"), (error, "Worker_TP1")], RuntimeError(CORE_FAILED))
    folder = _folders[-1]
    carried = caught.value
    assert str(carried) == str(error)
    assert isinstance(carried.__cause__, RuntimeError)
    assert carried.__notes__[0].startswith("raised in vLLM's process EngineCore (pid ")
    assert carried.__notes__[0].endswith(f"from vLLM's RuntimeError: {CORE_FAILED}")
    assert carried.__notes__[1] == "raised there from ModuleNotFoundError: No module named 'x'"
    assert carried.__notes__[2].startswith("the same error was raised in Worker_TP1 (pid ")
    assert not folder.exists()
    assert FAILURES_ENV not in os.environ


def test_collecting_leaves_other_errors_as_they_are(tmp_path: Path) -> None:
    """Nothing recorded: vLLM's error itself. An attn_di error raised in this process (an
    engine core here) is never replaced by a record. A variable set before comes back."""
    os.environ[FAILURES_ENV] = str(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="Engine core initialization failed"):
            _start([], RuntimeError(CORE_FAILED))
        own = UnsupportedFeatureError("CPU_ATTN", "sinks")
        with pytest.raises(UnsupportedFeatureError) as caught:
            _start([(_errors()[2], "Worker")], own)
        assert caught.value is own
        assert os.environ[FAILURES_ENV] == str(tmp_path)
    finally:
        os.environ.pop(FAILURES_ENV, None)


def test_the_bridge_records_attn_di_errors_that_vllm_logs(tmp_path: Path) -> None:
    """With the variable naming another process's folder, an ERROR record carrying an attn_di
    error (or one raised from it) writes one record; a warning, or an error that is not
    attn_di's, writes none."""
    logger = logging.getLogger("vllm.attn_di_test")
    os.environ[FAILURES_ENV] = str(tmp_path)
    try:
        try:
            raise RuntimeError("WorkerProc initialization failed") from _errors()[2]
        except RuntimeError:
            logger.exception("WorkerProc failed to start.")
            logger.warning("not fatal", exc_info=True)
        try:
            raise ValueError("not attn_di's")
        except ValueError:
            logger.exception("EngineCore failed to start.")
    finally:
        del os.environ[FAILURES_ENV]
    (record,) = read_records(tmp_path)
    assert record.types[0] == "attn_di.exceptions.UnsupportedFeatureError"
    assert record.logged == "WorkerProc failed to start."
    assert record.pid == os.getpid()


def test_a_registration_naming_no_backend_class_suggests_the_closest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's selector refuses a registered class that is no attention backend, suggesting
    the backend class of its module with the closest name, and the path to register."""
    module = types.ModuleType("my_attention_backends")
    module.FastBackend = type("FastBackend", (TorchSDPABackend,), {})  # type: ignore[attr-defined]
    module.FastBackends = type("FastBackends", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    register_backend(AttentionBackendEnum.CPU_ATTN, "my_attention_backends.FastBackends")
    with set_current_vllm_config(VllmConfig()), pytest.raises(BackendImportError) as caught:
        get_attn_backend(64, torch.float32, None)
    error = caught.value
    assert (error.reason, error.suggestion) == (BackendImportError.NOT_A_BACKEND, "FastBackend")
    assert error.hint == "did you mean 'FastBackend'? (my_attention_backends.FastBackend)"
