"""register(), the names, the container's reach into a loaded model, and import lightness."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
import transformers
from dependency_injector.wiring import Provide, inject
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils.generic import is_flash_attention_requested

import attn_di.integrations.transformers as integration
from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    UnknownBackendError,
    force_backend,
    register_backend,
)
from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from attn_di.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from attn_di.exceptions import AttnDIWarning, InvalidInputError
from attn_di.integrations.transformers import (
    PagedCache,
    attention_settings,
    implementation_name,
    register,
)

from .conftest import left_padded, tiny_llama

CALLS: list[str] = []


class RecordingCPUImpl(CPUAttentionImpl):
    """CPU_ATTN that records each forward."""

    backend: ClassVar[type[Any]]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CALLS.append("recording-cpu")
        return super().forward(*args, **kwargs)


class RecordingCPUBackend(CPUAttentionBackend):
    """A CPU_ATTN stand-in whose impl records its calls."""

    @staticmethod
    def get_impl_cls() -> type[RecordingCPUImpl]:
        return RecordingCPUImpl


class RecordingSDPAImpl(TorchSDPAImpl):
    """TORCH_SDPA that records each forward."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CALLS.append("recording-sdpa")
        return super().forward(*args, **kwargs)


class RecordingSDPABackend(TorchSDPABackend):
    """A TORCH_SDPA stand-in whose impl records its calls."""

    @staticmethod
    def get_impl_cls() -> type[RecordingSDPAImpl]:
        return RecordingSDPAImpl


RecordingCPUImpl.backend = RecordingCPUBackend
RecordingSDPAImpl.backend = RecordingSDPABackend


@pytest.fixture(name="llama")
def _llama() -> transformers.PreTrainedModel:
    """The tiny Llama of the conftest on ``"attn_di"``."""
    return tiny_llama("attn_di")


@pytest.fixture(name="calls")
def _calls() -> Callable[[], list[str]]:
    """The recording impls' calls since the test started."""
    CALLS.clear()
    return lambda: list(CALLS)


def _forward(model: transformers.PreTrainedModel) -> torch.Tensor:
    ids, mask = left_padded([[3, 4, 5], [6, 7]])
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids, attention_mask=mask).logits
    return logits


def test_register_adds_every_member_to_both_registries() -> None:
    """``"attn_di"`` and one ``"attn_di:<MEMBER>"`` per member land in both registries."""
    names = register()
    assert names[0] == "attn_di"
    assert names[1:] == [f"attn_di:{member.name}" for member in AttentionBackendEnum]
    for name in names:
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping
        assert "sdpa" not in name
        assert "flex_attention" not in name


def test_register_is_idempotent() -> None:
    """A second register() keeps the very same functions under the same names."""
    first = dict(AttentionInterface._global_mapping)
    register()
    for name in register():
        assert AttentionInterface._global_mapping[name] is first[name]


def test_implementation_name_parses_members_and_refuses_typos() -> None:
    """Names are parsed case-insensitively; a typo raises with the closest member."""
    assert implementation_name(None) == "attn_di"
    assert implementation_name("auto") == "attn_di"
    assert implementation_name("cpu_attn") == "attn_di:CPU_ATTN"
    assert implementation_name(AttentionBackendEnum.TORCH_SDPA) == "attn_di:TORCH_SDPA"
    with pytest.raises(UnknownBackendError, match="CPU_ATTN"):
        implementation_name("CPU_ATN")


def test_members_differing_only_by_case_each_run_their_own_backend(
    calls: Callable[[], list[str]], new_name: Callable[[], str]
) -> None:
    """``MY_X`` and ``my_x`` (both valid members) get names of their own, and the name
    implementation_name gives for each runs that member's backend, not the other's; a
    lowercase ``flash`` in a name is kept away from transformers' flash-attention checks."""
    upper = new_name()
    lower = upper.lower()
    flash = f"{lower}_flash"
    register_backend(upper, f"{__name__}.RecordingCPUBackend")
    with pytest.warns(AttnDIWarning, match="only by case"):
        register_backend(lower, f"{__name__}.RecordingSDPABackend")
    register_backend(flash, f"{__name__}.RecordingSDPABackend")
    names = register()
    assert implementation_name(upper) == f"attn_di:{upper}"
    assert implementation_name(lower) == f"attn_di:{lower}"
    assert implementation_name(flash) == f"attn_di:{lower}_f.lash"
    assert {implementation_name(upper), implementation_name(lower)} <= set(names)
    assert all("flash" not in name for name in names)
    model = tiny_llama("eager")
    for member, expected in ((upper, "recording-cpu"), (lower, "recording-sdpa")):
        model.set_attn_implementation(implementation_name(member))
        CALLS.clear()
        _forward(model)
        assert set(calls()) == {expected}
    model.set_attn_implementation(implementation_name(flash))
    assert not is_flash_attention_requested(model.config)
    CALLS.clear()
    _forward(model)
    assert set(calls()) == {"recording-sdpa"}


def test_container_override_swaps_attention_in_a_loaded_model(
    llama: transformers.PreTrainedModel,
    container: BackendContainer,
    calls: Callable[[], list[str]],
) -> None:
    """``container.override`` reaches an already loaded model, and the block's end undoes it."""
    expected = _forward(llama)
    with container.override(AttentionBackendEnum.CPU_ATTN, RecordingCPUBackend):
        overridden = _forward(llama)
    assert calls() == ["recording-cpu"] * 2
    _forward(llama)
    assert calls() == ["recording-cpu"] * 2
    torch.testing.assert_close(overridden, expected)


def test_force_backend_and_env_swap_attention(
    llama: transformers.PreTrainedModel,
    container: BackendContainer,
    calls: Callable[[], list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``force_backend`` and ``ATTN_DI_BACKEND`` choose the backend of ``"attn_di"`` per call."""
    with container.override(AttentionBackendEnum.TORCH_SDPA, RecordingSDPABackend):
        _forward(llama)
        assert calls() == []
        with force_backend("TORCH_SDPA"):
            _forward(llama)
        assert calls() == ["recording-sdpa"] * 2
        monkeypatch.setenv("ATTN_DI_BACKEND", "TORCH_SDPA")
        _forward(llama)
        assert calls() == ["recording-sdpa"] * 4


@inject
def _engine_backend(backend_cls: Any = Provide[BackendContainer.selected]) -> Any:
    return backend_cls


def test_inject_hands_an_engine_the_models_backend(
    llama: transformers.PreTrainedModel,
    container: BackendContainer,
    calls: Callable[[], list[str]],
) -> None:
    """With attention_settings(model), ``Provide[selected]`` injects the class the model runs."""
    container.attention.from_dict(attention_settings(llama, block_size=16))
    container.wire(modules=[__name__])
    try:
        with container.override(AttentionBackendEnum.CPU_ATTN, RecordingCPUBackend):
            assert _engine_backend() is RecordingCPUBackend
            _forward(llama)
            assert calls() == ["recording-cpu"] * 2
    finally:
        container.unwire()


def test_attention_settings_describe_the_model(llama: transformers.PreTrainedModel) -> None:
    """The settings carry the model's head size, dtype and attention type."""
    settings = attention_settings(llama, block_size=8)
    assert settings == {
        "head_size": 8,
        "dtype": "float32",
        "block_size": 8,
        "has_sink": False,
        "attn_type": "decoder",
        "device": "cpu",
    }


def test_paged_cache_needs_an_attn_di_implementation(llama: transformers.PreTrainedModel) -> None:
    """A PagedCache under another implementation fails loudly instead of dropping history."""
    llama.set_attn_implementation("eager")
    ids, mask = left_padded([[3, 4, 5]])
    with pytest.raises(InvalidInputError, match="attn_di attention implementation"):
        llama(input_ids=ids, attention_mask=mask, cache=PagedCache(llama.config))


def test_dropout_is_refused(llama: transformers.PreTrainedModel) -> None:
    """Training-mode attention dropout is refused by name (the backends have none)."""
    for layer in llama.model.layers:
        layer.self_attn.attention_dropout = 0.1
    llama.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        _forward(llama)


def test_import_attn_di_imports_neither_torch_nor_transformers() -> None:
    """``import attn_di`` (and the integrations package) stays light."""
    code = (
        "import sys, attn_di, attn_di.integrations; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_missing_transformers_names_the_extra() -> None:
    """Without transformers the integration raises MissingExtraError naming the extra."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from attn_di.exceptions import MissingExtraError\n"
        "try:\n    import attn_di.integrations.transformers\n"
        "except MissingExtraError as exc:\n    print(exc)\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert "pip install torch==2.13.0, then pip install -e '.[transformers]'" in completed.stdout


def test_cli_does_not_import_transformers() -> None:
    """``attn-di list`` and ``select`` never import transformers (their speed is unchanged)."""
    code = (
        "import sys\nfrom attn_di.cli import main\n"
        "main(['list'])\n"
        "main(['select', '--head-size', '64', '--dtype', 'float32', '--device', 'cpu'])\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_exports_are_pinned() -> None:
    """The integration exports exactly its documented, sorted names."""
    assert integration.__all__ == [
        "ATTENTION_NAME",
        "AttentionFunction",
        "PagedCache",
        "attention_settings",
        "implementation_name",
        "padding_mask",
        "register",
    ]
    assert integration.PagedCache.__module__ == "attn_di.integrations.transformers"
