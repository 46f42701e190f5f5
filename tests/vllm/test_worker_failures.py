"""A failure in one of vLLM's processes reaches the test's process as attn_di's typed error.

The start-up check asks what the workers will ask (every attention type of the model; a class
that is an attention backend), so those mistakes are refused before any worker starts. What
only a worker can find (a backend that does not import there, a refusal when a layer is
built) is recorded by attn_di's plugin in that process and raised here, with the worker's
message and hint, instead of vLLM's "Engine core initialization failed".

Every engine here fails while it starts (no weights are loaded into an attention layer that
runs): a tiny random Llama (4 query heads over 2 KV heads, head size 32) written once for the
module, without a tokenizer (``skip_tokenizer_init``), and test_encoder_only's tiny BERT.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.selector import AttentionSelectorConfig

import attn_di
from attn_di.exceptions import (
    AttnDIError,
    BackendImportError,
    BackendRejectedError,
    UnsupportedFeatureError,
)
from attn_di.integrations.vllm._selector import check_backend
from attn_di.integrations.vllm.backends import CPU_ATTN
from tests.vllm.conftest import CPU_ATTN_PATH, engine
from tests.vllm.test_encoder_only import write_tiny_bert
from tests.vllm.worker_backends import MISSING_IN_ENV, MISSING_MODULE

MODES = pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])
MISSING_PATH = "tests.vllm.worker_only_missing.Backend"
CORE_FAILED = "Engine core initialization failed"


@pytest.fixture(autouse=True)
def _propagation() -> Iterator[None]:
    """Registrations reach vLLM's processes (``ATTN_DI_REGISTRATIONS``), as outside tests."""
    before = attn_di.set_auto_propagation(True)
    yield
    attn_di.set_auto_propagation(before)


@pytest.fixture(scope="module", name="bert")
def _bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def start(model: Path, *, multiprocess: bool = True, **options: object) -> None:
    """Start an engine on ``model`` that is expected to fail (small, no tokenizer)."""
    settings: dict[str, object] = {"max_model_len": 64, "skip_tokenizer_init": True}
    settings.update(options)
    with engine(model, multiprocess=multiprocess, **settings):
        pytest.fail("the engine started")


@MODES
def test_a_class_that_is_no_attention_backend(tiny_llama: Path, multiprocess: bool) -> None:
    """A registration naming a class that is no backend is refused at start-up, as a path
    naming a function is refused as "not a class": the member, the path, why, and the fix."""
    register_backend(AttentionBackendEnum.CPU_ATTN, "collections.OrderedDict")
    with pytest.raises(BackendImportError) as caught:
        start(tiny_llama, multiprocess=multiprocess)
    error = caught.value
    assert (error.member, error.class_path, error.reason) == (
        "CPU_ATTN",
        "collections.OrderedDict",
        BackendImportError.NOT_A_BACKEND,
    )
    assert str(error).startswith(
        "cannot import attention backend CPU_ATTN from 'collections.OrderedDict': not an "
        "attention backend (it names class collections.OrderedDict, which is neither a vLLM "
        "attention backend (vllm.v1.attention.backend.AttentionBackend) nor an attn_di one "
        "(attn_di.backend.AttentionBackend))\nHint: register an attention backend class for "
        "CPU_ATTN: a vLLM backend such as attn_di.integrations.vllm.backends.CPU_ATTN"
    )
    assert not getattr(error, "__notes__", [])  # raised in this process, not carried


@MODES
def test_an_attention_type_the_backend_cannot_run(bert: Path, multiprocess: bool) -> None:
    """An attn_di backend that runs decoder attention only is refused for an encoder-only
    (BERT) pooling model by the start-up check, which asks for encoder-only attention."""
    register_backend(AttentionBackendEnum.CPU_ATTN, "tests.vllm.worker_backends.DecoderOnlyBackend")
    with pytest.raises(BackendRejectedError) as caught:
        start(bert, multiprocess=multiprocess, runner="pooling")
    error = caught.value
    assert error.member == "CPU_ATTN"
    assert error.reasons == ["attention type encoder_only not supported"]
    assert error.origin.startswith("the engine's start-up check")
    assert "attn_type=encoder_only" in str(error)
    assert error.hint is not None
    assert error.hint.startswith(
        "register a backend that runs encoder_only attention (attn_di's CPU_ATTN or "
        "TORCH_SDPA: attn_di.integrations.vllm.backends.CPU_ATTN); or let vLLM use its own"
    )


def test_a_refusal_when_a_layer_is_built(tiny_llama: Path) -> None:
    """An impl that refuses the layer when vLLM builds it (grouped-query attention) in the
    multiprocess engine's worker (a process started by the engine-core process): its
    UnsupportedFeatureError, message and hint, is raised here, chained from vLLM's
    RuntimeError, with a note naming the worker."""
    register_backend(
        AttentionBackendEnum.CPU_ATTN, "tests.vllm.worker_backends.NoGroupedQueryBackend"
    )
    with pytest.raises(UnsupportedFeatureError) as caught:
        start(tiny_llama)
    error = caught.value
    assert (error.backend, error.supported_by) == ("NO_GQA", ("CPU_ATTN", "TORCH_SDPA"))
    assert str(error) == (
        "NO_GQA does not support grouped-query attention (4 query heads over 2 KV heads)\n"
        "Hint: use CPU_ATTN or TORCH_SDPA"
    )
    assert isinstance(error.__cause__, RuntimeError)
    assert CORE_FAILED in str(error.__cause__)
    assert "raised in vLLM's process Worker (pid " in "\n".join(error.__notes__)


def test_a_backend_that_does_not_import_in_one_tp_worker(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At tensor-parallel size 2 (the engine core in this process, two worker processes), a
    class missing in rank 1's worker only: that worker's BackendImportError is raised here,
    naming Worker_TP1."""
    monkeypatch.setenv(MISSING_IN_ENV, "VllmWorker-1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    register_backend(AttentionBackendEnum.CPU_ATTN, MISSING_PATH)
    with pytest.raises(BackendImportError) as caught:
        start(tiny_llama, multiprocess=False, tensor_parallel_size=2)
    error = caught.value
    assert (error.member, error.reason, error.missing_module) == (
        "CPU_ATTN",
        BackendImportError.MODULE_FAILED,
        MISSING_MODULE,
    )
    assert str(error) == (
        f"cannot import attention backend CPU_ATTN from {MISSING_PATH!r}: module failed to "
        f"import (No module named {MISSING_MODULE!r})\nHint: the module exists but raised "
        "while importing: see the chained exception"
    )
    assert error.__cause__ is not None
    assert not isinstance(error.__cause__, AttnDIError)  # vLLM's own error
    notes = "\n".join(error.__notes__)
    assert "raised in vLLM's process Worker_TP1 (pid " in notes
    assert f"raised there from ModuleNotFoundError: No module named {MISSING_MODULE!r}" in notes


class _ModelConfig:
    """What the start-up check reads of vLLM's ``ModelConfig``: its ``attn_type``."""

    def __init__(self, attn_type: str | None) -> None:
        self._attn_type = attn_type

    @property
    def attn_type(self) -> str:
        if self._attn_type is None:
            raise AttributeError("attn_type")  # an older vLLM: no such property
        return self._attn_type


@pytest.mark.parametrize(
    ("model_type", "asked"),
    [
        ("decoder", ("decoder",)),
        ("encoder_only", ("encoder_only",)),
        ("encoder_decoder", ("decoder", "encoder_decoder")),
        ("hybrid", ("decoder",)),
        ("attention_free", ()),
        (None, ("decoder",)),
    ],
)
def test_the_start_up_check_asks_for_each_attention_type_of_the_model(
    model_type: str | None, asked: tuple[str, ...]
) -> None:
    """One question per attention type the model's layers ask vLLM's selector for (decoder
    and cross attention for an encoder-decoder model); decoder where vLLM does not say."""
    from attn_di.integrations.vllm._selector import layer_attn_types

    assert layer_attn_types(_ModelConfig(model_type)) == asked


def test_an_attention_type_no_attn_di_backend_runs_is_refused_naming_the_fallback() -> None:
    """Cross attention: the hint says attn_di's vLLM backends do not run it, and how to let
    vLLM's own backend run the model."""
    with set_current_vllm_config(VllmConfig()):
        config = AttentionSelectorConfig(
            head_size=64,
            dtype=torch.float32,
            kv_cache_dtype="auto",
            block_size=None,
            attn_type="encoder_decoder",
        )
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH)
        with pytest.raises(BackendRejectedError) as caught:
            check_backend(AttentionBackendEnum.CPU_ATTN, CPU_ATTN, config, "the check")
    assert caught.value.reasons == ["attention type encoder_decoder not supported"]
    assert caught.value.hint == (
        "attn_di's vLLM backends run decoder and encoder-only attention, not encoder_decoder; "
        "or let vLLM use its own backend: AttentionBackendEnum.CPU_ATTN.clear_override() "
        "(and unset ATTN_DI_REGISTRATIONS for new processes)"
    )
