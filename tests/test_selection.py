"""Automatic selection, forced choices, env var, caching and injection of the selected backend."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest
from dependency_injector import providers
from dependency_injector.wiring import Provide, inject

from attn_di import (
    AttentionBackendEnum,
    AttentionSelectorConfig,
    AttnDIError,
    BackendContainer,
    BackendRejectedError,
    InvalidBackendTypeError,
    NoValidBackendError,
    UnknownBackendError,
    force_backend,
    register_backend,
    select_backend,
)
from attn_di.exceptions import InvalidInputError

E = AttentionBackendEnum
CONFIG = AttentionSelectorConfig(head_size=128, dtype="bfloat16")


def fake_backend(
    name: str,
    *,
    head_sizes: Sequence[int] = (64, 128, 256),
    mla: bool = False,
    sink: bool = False,
    min_capability: int | None = None,
) -> type:
    """A vLLM-shaped backend class whose validate_configuration checks a few requirements."""

    def validate_configuration(
        cls: type,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: Any,
        attn_type: str = "decoder",
    ) -> list[str]:
        reasons = []
        if head_size not in head_sizes:
            reasons.append("head_size not supported")
        if use_mla != mla:
            reasons.append("MLA not supported" if use_mla else "non-MLA not supported")
        if has_sink and not sink:
            reasons.append("sink setting not supported")
        if min_capability is not None and (
            device_capability is None or device_capability.major < min_capability
        ):
            reasons.append("compute capability not supported")
        return reasons

    return type(
        name,
        (),
        {
            "validate_configuration": classmethod(validate_configuration),
            "get_name": staticmethod(lambda: name),
        },
    )


@pytest.fixture(name="cpu_fakes")
def _cpu_fakes(container: BackendContainer) -> dict[AttentionBackendEnum, type]:
    fakes = {
        member: fake_backend(member.name) for member in (E.CPU_ATTN, E.TORCH_SDPA, E.FLEX_ATTENTION)
    }
    for member, cls in fakes.items():
        register_backend(member, cls)
    return fakes


@pytest.fixture(name="cuda_fakes")
def _cuda_fakes(container: BackendContainer) -> dict[AttentionBackendEnum, type]:
    """Fake classes registered for vLLM's CUDA members (vLLM itself is not installed)."""
    mla_members = {E.FLASHINFER_MLA, E.CUTLASS_MLA, E.FLASH_ATTN_MLA, E.FLASHMLA, E.TRITON_MLA}
    members = [E.FLASH_ATTN, E.FLASHINFER, E.TRITON_ATTN, E.FLEX_ATTENTION, *mla_members]
    fakes = {}
    for member in members:
        fakes[member] = fake_backend(
            member.name,
            mla=member in mla_members,
            sink=member in (E.FLASH_ATTN, E.TRITON_ATTN),
            min_capability=10 if member is E.CUTLASS_MLA else None,
        )
        register_backend(member, fakes[member])
    return fakes


def test_cpu_auto_picks_cpu_attn(cpu_fakes: dict[AttentionBackendEnum, type]) -> None:
    """On the CPU, CPU_ATTN comes first and is chosen when it validates."""
    selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.CPU_ATTN
    assert selection.backend_cls is cpu_fakes[E.CPU_ATTN]
    assert selection.rejected == {}
    assert selection.origin == "auto"
    assert selection.path.endswith("CPU_ATTN")


def test_a_rejecting_override_moves_on_with_its_reason(
    cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """CPU_ATTN overridden by a class refusing head size 128: TORCH_SDPA, with the reason kept."""
    picky = fake_backend("Picky", head_sizes=(64,))
    with container.override(E.CPU_ATTN, picky):
        selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.TORCH_SDPA
    assert selection.rejected == {E.CPU_ATTN: ["head_size not supported"]}


def test_forced_backend_is_honoured(cpu_fakes: dict[AttentionBackendEnum, type]) -> None:
    """backend= and force_backend choose a lower-priority backend that validates."""
    assert (
        select_backend(CONFIG, device="cpu", backend="flex_attention").backend is E.FLEX_ATTENTION
    )
    with force_backend(E.FLEX_ATTENTION):
        selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.FLEX_ATTENTION
    assert selection.origin == "force_backend()"


def test_forced_backend_is_used_on_any_device(cuda_fakes: dict[AttentionBackendEnum, type]) -> None:
    """A forced backend that validates is used whatever the device: no substitution."""
    register_backend(E.CPU_ATTN, fake_backend("CPU"))
    selection = select_backend(CONFIG, device="cuda:9.0", backend="CPU_ATTN")
    assert selection.backend is E.CPU_ATTN
    assert selection.origin == "backend= argument"


def test_forced_backend_that_rejects_raises_with_reasons(
    cpu_fakes: dict[AttentionBackendEnum, type],
) -> None:
    """A forced backend refusing the config raises, naming it and its reasons: no fallback."""
    register_backend(E.FLEX_ATTENTION, fake_backend("Flex", head_sizes=(64,)))
    with pytest.raises(BackendRejectedError) as caught:
        select_backend(CONFIG, device="cpu", backend=E.FLEX_ATTENTION)
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.member == "FLEX_ATTENTION"
    assert error.reasons == ["head_size not supported"]
    assert error.origin == "backend= argument"
    assert "FLEX_ATTENTION" in str(error)
    assert "head_size not supported" in str(error)


def test_forced_backend_that_cannot_be_imported(container: BackendContainer) -> None:
    """A forced vLLM backend without vLLM installed is rejected with the import error."""
    with pytest.raises(BackendRejectedError, match="module not found"):
        select_backend(CONFIG, device="cuda:9.0", backend="FLASH_ATTN")


@pytest.mark.parametrize(
    ("device", "expected_order"),
    [
        ("cuda:9.0", [E.FLASH_ATTN, E.FLASHINFER, E.TRITON_ATTN, E.FLEX_ATTENTION]),
        ("cuda:10.0", [E.FLASHINFER, E.FLASH_ATTN, E.TRITON_ATTN, E.FLEX_ATTENTION]),
    ],
)
def test_cuda_priority_by_capability(
    device: str,
    expected_order: list[AttentionBackendEnum],
    cuda_fakes: dict[AttentionBackendEnum, type],
    container: BackendContainer,
) -> None:
    """The CUDA order follows vLLM's: FlashInfer first on capability 10, FlashAttention else."""
    chosen = []
    for _ in expected_order:
        selection = select_backend(CONFIG, device=device)
        chosen.append(selection.backend)
        assert list(selection.rejected) == chosen[:-1]
        container.override(selection.backend, fake_backend("No", head_sizes=())).__enter__()
    assert chosen == expected_order
    for member in expected_order:
        container.provider(member)._layers.clear()
        container.provider(member).invalidate()


def test_cuda_mla_orders(cuda_fakes: dict[AttentionBackendEnum, type]) -> None:
    """MLA layers get MLA backends; CUTLASS_MLA needs capability 10 (vLLM's orders)."""
    mla = AttentionSelectorConfig(head_size=128, dtype="bfloat16", use_mla=True)
    assert select_backend(mla, device="cuda:9.0").backend is E.FLASH_ATTN_MLA
    assert select_backend(mla, device="cuda:10.0").backend is E.FLASHINFER_MLA
    register_backend(E.FLASHINFER_MLA, fake_backend("No", mla=True, head_sizes=()))
    assert select_backend(mla, device="cuda:10.0").backend is E.CUTLASS_MLA
    register_backend(E.FLASH_ATTN_MLA, fake_backend("No", mla=True, head_sizes=()))
    selection = select_backend(mla, device="cuda:9.0")
    assert selection.backend is E.FLASHMLA
    assert selection.rejected == {E.FLASH_ATTN_MLA: ["head_size not supported"]}


def test_sinks_requirement(cuda_fakes: dict[AttentionBackendEnum, type]) -> None:
    """A layer with sinks skips backends without sink support, with vLLM's reason."""
    with_sink = AttentionSelectorConfig(head_size=128, dtype="bfloat16", has_sink=True)
    selection = select_backend(with_sink, device="cuda:10.0")
    assert selection.backend is E.FLASH_ATTN
    assert selection.rejected == {E.FLASHINFER: ["sink setting not supported"]}


def test_nothing_valid_lists_every_candidate(cuda_fakes: dict[AttentionBackendEnum, type]) -> None:
    """No valid backend: a ValueError with the config and each candidate's reasons."""
    odd = AttentionSelectorConfig(head_size=72, dtype="float16")
    with pytest.raises(NoValidBackendError) as caught:
        select_backend(odd, device="cuda:9.0")
    error = caught.value
    assert isinstance(error, ValueError)
    assert list(error.rejected) == ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]
    text = str(error)
    assert "head_size=72" in text
    assert "cuda:9.0" in text
    assert "  FLASHINFER: head_size not supported" in text


def test_unimportable_candidates_are_reasons_not_crashes(container: BackendContainer) -> None:
    """Without vLLM, vLLM's CUDA candidates are rejected with their import errors, and
    attn_di's CPU-only FLEX_ATTENTION for the device."""
    with pytest.raises(NoValidBackendError) as caught:
        select_backend(CONFIG, device="cuda:9.0")
    rejected = caught.value.rejected
    assert rejected.pop("FLEX_ATTENTION") == ["compute capability not supported"]
    assert list(rejected) == ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"]
    assert all("module not found" in reasons[0] for reasons in rejected.values())


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("flash_attn", E.FLASH_ATTN),
        (" Auto ", E.CPU_ATTN),
        ("", E.CPU_ATTN),
        ("TORCH_SDPA", E.TORCH_SDPA),
    ],
)
def test_env_var(
    env: str,
    expected: AttentionBackendEnum,
    monkeypatch: pytest.MonkeyPatch,
    cpu_fakes: dict[AttentionBackendEnum, type],
) -> None:
    """ATTN_DI_BACKEND is parsed case-insensitively; "auto" (any spacing/case) means automatic."""
    register_backend(E.FLASH_ATTN, fake_backend("FA"))
    monkeypatch.setenv("ATTN_DI_BACKEND", env)
    selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is expected
    assert selection.origin == ("auto" if expected is E.CPU_ATTN else "ATTN_DI_BACKEND")


def test_unknown_env_value_is_never_ignored(
    monkeypatch: pytest.MonkeyPatch, cpu_fakes: dict[AttentionBackendEnum, type]
) -> None:
    """ATTN_DI_BACKEND=NOPE raises the unknown-backend error, pointing at the variable."""
    monkeypatch.setenv("ATTN_DI_BACKEND", "NOPE")
    with pytest.raises(UnknownBackendError) as caught:
        select_backend(CONFIG, device="cpu")
    assert "ATTN_DI_BACKEND='NOPE'" in "\n".join(caught.value.__notes__)
    monkeypatch.setenv("ATTN_DI_BACKEND", "cpu_atn")
    with pytest.raises(UnknownBackendError, match="did you mean 'CPU_ATTN'"):
        select_backend(CONFIG, device="cpu")


def test_all_from_the_env_is_refused_without_a_far_fetched_suggestion(
    monkeypatch: pytest.MonkeyPatch, cpu_fakes: dict[AttentionBackendEnum, type]
) -> None:
    """ATTN_DI_BACKEND=All: no "did you mean" (PALLAS is spelled with 'all'), the hint names
    the one command that takes `all`, and the message lists the member names."""
    monkeypatch.setenv("ATTN_DI_BACKEND", "All")
    with pytest.raises(UnknownBackendError) as caught:
        select_backend(CONFIG, device="cpu")
    error = caught.value
    assert error.suggestion is None
    assert "Valid options are: FLASH_ATTN, " in str(error)
    assert "CPU_ATTN, CUSTOM" in str(error)
    assert "`all` is accepted only by `attn-di run --backend all`" in str(error.hint)
    assert "did you mean" not in str(error)


def test_precedence(
    monkeypatch: pytest.MonkeyPatch, cpu_fakes: dict[AttentionBackendEnum, type]
) -> None:
    """backend= beats force_backend, which beats the env var, which beats automatic."""
    monkeypatch.setenv("ATTN_DI_BACKEND", "TORCH_SDPA")
    assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
    with force_backend("flex_attention"):
        assert select_backend(CONFIG, device="cpu").backend is E.FLEX_ATTENTION
        assert select_backend(CONFIG, device="cpu", backend="cpu_attn").backend is E.CPU_ATTN
        with force_backend("auto"):  # lifts the outer force: back to the env var
            assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
        assert select_backend(CONFIG, device="cpu", backend="auto").backend is E.FLEX_ATTENTION


def test_two_asyncio_tasks_force_different_backends(
    cpu_fakes: dict[AttentionBackendEnum, type],
) -> None:
    """force_backend is per task: interleaved tasks each see their own force."""

    async def run(member: AttentionBackendEnum) -> list[AttentionBackendEnum]:
        seen = []
        with force_backend(member):
            for _ in range(4):
                seen.append(select_backend(CONFIG, device="cpu").backend)
                await asyncio.sleep(0)
        return seen

    async def main() -> list[list[AttentionBackendEnum]]:
        return list(await asyncio.gather(run(E.TORCH_SDPA), run(E.FLEX_ATTENTION)))

    assert asyncio.run(main()) == [[E.TORCH_SDPA] * 4, [E.FLEX_ATTENTION] * 4]
    assert select_backend(CONFIG, device="cpu").backend is E.CPU_ATTN


def test_cache_is_never_stale(
    cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """Repeated selections are cached; registrations, clears, overrides and policies are seen."""
    calls = []
    counting = fake_backend("Counting")
    original = counting.validate_configuration

    def validate(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(kwargs)
        return list(original(*args, **kwargs))

    counting.validate_configuration = validate  # type: ignore[attr-defined]
    register_backend(E.CPU_ATTN, counting)
    first = select_backend(CONFIG, device="cpu")
    assert select_backend(CONFIG, device="cpu") == first
    assert len(calls) == 1  # the second call came from the cache
    register_backend(E.CPU_ATTN, fake_backend("No", head_sizes=()))
    assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
    register_backend(E.CPU_ATTN, counting)
    assert select_backend(CONFIG, device="cpu").backend is E.CPU_ATTN
    with container.override(E.CPU_ATTN, fake_backend("No", head_sizes=()), local=True):
        assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
    policy = providers.Callable(lambda device, config: [E.TORCH_SDPA])
    with container.candidates.override(policy):
        assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
        with policy.override(providers.Callable(lambda device, config: [E.FLEX_ATTENTION])):
            assert select_backend(CONFIG, device="cpu").backend is E.FLEX_ATTENTION
    assert select_backend(CONFIG, device="cpu") == first


def test_a_returned_selection_cannot_corrupt_the_cache(
    cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """Changing a returned Selection's rejected dict does not change later results."""
    with container.override(E.CPU_ATTN, fake_backend("No", head_sizes=())):
        select_backend(CONFIG, device="cpu").rejected.clear()
        assert select_backend(CONFIG, device="cpu").rejected == {
            E.CPU_ATTN: ["head_size not supported"]
        }


@pytest.mark.parametrize(
    "policy",
    [
        providers.Object(["torch_sdpa", "CPU_ATTN"]),
        providers.Callable(lambda device, config: ("TORCH_SDPA",)),
    ],
)
def test_a_policy_may_return_names(
    policy: Any, cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """Names in a policy's result are parsed like any backend name."""
    with container.candidates.override(policy):
        assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA


@pytest.mark.parametrize(
    "policy",
    [
        providers.Object(None),
        providers.Object([42]),
        providers.Object(["NOPE"]),
        providers.Callable(lambda: [E.CPU_ATTN]),
        providers.Callable(lambda device, config: 1 / 0),
    ],
)
def test_a_broken_policy_is_a_typed_error(
    policy: Any, cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """A policy that fails or returns junk raises an AttnDIError, never a bare exception."""
    with container.candidates.override(policy), pytest.raises(AttnDIError):
        select_backend(CONFIG, device="cpu")


def test_custom_policy_is_injected_through_the_container(
    cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """A user policy receives (device, config) and decides the candidates."""
    calls = []

    def policy(device: Any, config: AttentionSelectorConfig) -> list[AttentionBackendEnum]:
        calls.append((str(device), config.head_size))
        return [E.TORCH_SDPA, E.CPU_ATTN]

    with container.candidates.override(providers.Callable(policy)):
        assert select_backend(CONFIG, device="cpu").backend is E.TORCH_SDPA
    assert calls == [("cpu", 128)]


def test_selected_is_injectable(
    cpu_fakes: dict[AttentionBackendEnum, type], container: BackendContainer
) -> None:
    """Provide[BackendContainer.selected] injects the class chosen for the container's settings."""

    @inject
    def build(backend_cls: Any = Provide[BackendContainer.selected]) -> Any:
        return backend_cls

    container.attention.from_dict({"head_size": 128, "dtype": "bfloat16", "device": "cpu"})
    container.wire(modules=[__name__])
    try:
        assert build() is cpu_fakes[E.CPU_ATTN]
        container.attention.backend.from_value("torch_sdpa")
        assert build() is cpu_fakes[E.TORCH_SDPA]
        assert container.selection().origin == "backend= argument"
    finally:
        container.unwire()


def test_selected_without_settings_says_what_is_missing(container: BackendContainer) -> None:
    """Resolving selected before head_size/dtype are set explains how to set them."""
    with pytest.raises(InvalidInputError, match="missing head_size, dtype"):
        container.selected()


def test_logging(
    cpu_fakes: dict[AttentionBackendEnum, type],
    container: BackendContainer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The "attn_di" logger reports the choice and each rejection at debug level."""
    caplog.set_level(logging.DEBUG, logger="attn_di")
    with container.override(E.CPU_ATTN, fake_backend("No", head_sizes=())):
        select_backend(AttentionSelectorConfig(head_size=64, dtype="float32"), device="cpu")
    messages = [record.getMessage() for record in caplog.records if record.name == "attn_di"]
    assert "rejected CPU_ATTN: head_size not supported" in messages
    assert any(message.startswith("selected TORCH_SDPA") for message in messages)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"head_size": 0, "dtype": "float32"}, "head_size"),
        ({"head_size": 64, "dtype": "float33"}, "dtype"),
        ({"head_size": 64, "dtype": "float32", "block_size": -16}, "block_size"),
        ({"head_size": 64, "dtype": "float32", "attn_type": "decodr"}, "attn_type"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], argument: str) -> None:
    """Bad configuration values are ValueErrors naming the field."""
    with pytest.raises(InvalidInputError) as caught:
        AttentionSelectorConfig(**kwargs)
    assert caught.value.argument == argument


def test_config_is_hashable_and_normalises_dtype() -> None:
    """dtype aliases and torch dtypes normalise to one name; equal configs hash equal."""
    torch = pytest.importorskip("torch")
    a = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16)
    b = AttentionSelectorConfig(head_size=64, dtype="BF16")
    assert a == b
    assert hash(a) == hash(b)
    assert a.dtype == "bfloat16"
    assert "head_size=64, dtype='bfloat16'" in repr(a)


def test_unknown_dtype_suggests() -> None:
    """An unknown dtype lists the valid ones and suggests the closest."""
    with pytest.raises(InvalidInputError, match="did you mean 'bfloat16'"):
        AttentionSelectorConfig(head_size=64, dtype="bfloat61")


@pytest.mark.parametrize("device", ["gpu", "cuda:9", "cuda:x.y", "tpu:1.0", 3])
def test_bad_devices(device: Any, cpu_fakes: dict[AttentionBackendEnum, type]) -> None:
    """A malformed device is a ValueError listing the accepted forms."""
    with pytest.raises(InvalidInputError, match="device"):
        select_backend(CONFIG, device=device)


def test_cuda_without_a_gpu_says_so(cpu_fakes: dict[AttentionBackendEnum, type]) -> None:
    """Asking for "cuda" on a machine without one explains how to give a capability."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidInputError, match=r"cuda:9\.0"):
        select_backend(CONFIG, device="cuda")


# -- with attn_di's real reference backends -------------------------------------------------


def test_real_cpu_auto_picks_cpu_attn(container: BackendContainer) -> None:
    """On the CPU with the shipped backends, CPU_ATTN is chosen with nothing rejected."""
    selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.CPU_ATTN
    assert selection.backend_cls.get_name() == "CPU_ATTN"
    assert selection.rejected == {}


def test_real_rejecting_override_falls_to_torch_sdpa(container: BackendContainer) -> None:
    """CPU_ATTN overridden by a class refusing the config: the real TORCH_SDPA is chosen."""
    with container.override(E.CPU_ATTN, fake_backend("Picky", head_sizes=(64,))):
        selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.TORCH_SDPA
    assert selection.backend_cls.get_name() == "TORCH_SDPA"
    assert selection.rejected == {E.CPU_ATTN: ["head_size not supported"]}


def test_real_forced_flex_attention_on_cpu(container: BackendContainer) -> None:
    """A forced FLEX_ATTENTION on the CPU is honoured."""
    with force_backend("FLEX_ATTENTION"):
        selection = select_backend(CONFIG, device="cpu")
    assert selection.backend is E.FLEX_ATTENTION
    assert selection.backend_cls.get_name() == "FLEX_ATTENTION"


def test_real_forced_backend_rejecting_raises(container: BackendContainer) -> None:
    """TORCH_SDPA forced for an fp8 KV cache raises with its own reason."""
    fp8 = AttentionSelectorConfig(head_size=128, dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(BackendRejectedError) as caught:
        select_backend(fp8, device="cpu", backend="torch_sdpa")
    assert caught.value.reasons == ["kv_cache_dtype not supported"]


def test_real_sinks_and_mla_requirements(container: BackendContainer) -> None:
    """Sinks are supported by CPU_ATTN; an MLA layer finds no CPU backend, with vLLM's reasons."""
    sinks = AttentionSelectorConfig(head_size=64, dtype="float32", has_sink=True)
    assert select_backend(sinks, device="cpu").backend is E.CPU_ATTN
    mla = AttentionSelectorConfig(head_size=128, dtype="bfloat16", use_mla=True)
    with pytest.raises(NoValidBackendError) as caught:
        select_backend(mla, device="cpu")
    assert caught.value.rejected == {
        "CPU_ATTN": ["MLA not supported"],
        "TORCH_SDPA": ["MLA not supported"],
        "FLEX_ATTENTION": ["MLA not supported"],
    }


def test_example_engine_receives_the_selected_backend(
    container: BackendContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny_llm engine's constructor gets Provide[BackendContainer.selected]."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "tiny_llm"))
    engine_module = importlib.import_module("llm_engine")
    model = importlib.import_module("model")
    config = model.ModelConfig(num_layers=1, num_blocks=16)
    engine_module.configure(container, config, backend="torch_sdpa")
    container.wire(modules=[engine_module], warn_unresolved=True)
    try:
        engine = engine_module.Engine(config)
        assert engine.backend_cls.get_name() == "TORCH_SDPA"
        result = engine.generate([[1, 2, 3], [4]], max_new_tokens=3)
        assert [len(tokens) for tokens in result.tokens] == [3, 3]
    finally:
        container.unwire()


class ModelledSelectorConfig(NamedTuple):
    """A NamedTuple with the fields attn_di models, in vLLM's selector-config layout."""

    head_size: int
    dtype: Any
    kv_cache_dtype: str | None
    block_size: int | None
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    attn_type: str = "decoder"


class VllmSelectorConfig(NamedTuple):
    """vLLM's ``AttentionSelectorConfig`` field set (vllm/v1/attention/selector.py), with the
    flags attn_di does not model (multimodal prefix, per-head quant scales, non-causal)."""

    head_size: int
    dtype: Any
    kv_cache_dtype: str | None
    block_size: int | None
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    use_mm_prefix: bool = False
    use_per_head_quant_scales: bool = False
    attn_type: str = "decoder"
    use_non_causal: bool = False


def test_select_backend_accepts_a_named_tuple(cpu_fakes: dict[AttentionBackendEnum, type]) -> None:
    """A NamedTuple of the modelled fields selects like the equivalent config (None cache
    dtype read as "auto"), and a collections.namedtuple works too."""
    selection = select_backend(ModelledSelectorConfig(64, "bf16", None, 16), device="cpu")
    expected = AttentionSelectorConfig(head_size=64, dtype="bfloat16", block_size=16)
    assert selection.config == expected
    assert selection.backend is select_backend(expected, device="cpu").backend
    plain = collections.namedtuple("plain", ["head_size", "dtype", "backend"])
    forced = select_backend(plain(64, "float32", "torch_sdpa"), device="cpu")
    assert forced.backend is E.TORCH_SDPA
    assert forced.origin == "backend= argument"


def test_vllms_own_config_selects_while_its_extra_flags_ask_for_nothing(
    cpu_fakes: dict[AttentionBackendEnum, type],
) -> None:
    """vLLM's field set with its unmodelled flags False selects like attn_di's own config; the
    same keys in a mapping are still typo-checked (a mapping's keys are typed by hand)."""
    vllm_config = VllmSelectorConfig(64, "bfloat16", "auto", 16)
    expected = AttentionSelectorConfig(head_size=64, dtype="bfloat16", block_size=16)
    selection = select_backend(vllm_config, device="cpu")
    assert selection.config == expected
    assert selection.backend is select_backend(expected, device="cpu").backend
    with pytest.raises(InvalidInputError, match=r"unknown keys \['use_mm_prefix', "):
        select_backend(vllm_config._asdict(), device="cpu")


@pytest.mark.parametrize("off", [None, 0, "false", "0", "no"], ids=repr)
def test_an_unmodelled_flag_reads_false_as_the_modelled_flags_do(
    cpu_fakes: dict[AttentionBackendEnum, type], off: object
) -> None:
    """An unmodelled flag off in any form a modelled flag takes as False asks for nothing."""
    config = VllmSelectorConfig(64, "bfloat16", "auto", 16, use_mm_prefix=off)  # type: ignore[arg-type]
    assert select_backend(config, device="cpu").config.head_size == 64


@pytest.mark.parametrize(
    "flags",
    [{"use_mm_prefix": True}, {"use_non_causal": True, "use_per_head_quant_scales": True}],
    ids=str,
)
def test_an_unmodelled_flag_that_is_set_is_refused(flags: dict[str, bool]) -> None:
    """A set flag attn_di does not model is refused, naming it and the NamedTuple class,
    with no "did you mean" (field names of another project are not typos)."""
    vllm_config = VllmSelectorConfig(64, "bfloat16", "auto", 16)._replace(**flags)
    with pytest.raises(InvalidInputError) as caught:
        select_backend(vllm_config, device="cpu")
    error = caught.value
    assert error.argument == "config (VllmSelectorConfig)"
    asked = ", ".join(f"{name}=True" for name in sorted(flags))
    assert str(error).startswith(f"config (VllmSelectorConfig): asks for {asked}, which ")
    assert "did you mean" not in str(error)
    assert "leave them False" in str(error.hint)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"head_size": 0}, "head_size: must be a positive int, got 0"),
        ({"dtype": "bfloat"}, "did you mean 'bfloat16'"),
        ({"attn_type": "decodr"}, "did you mean 'decoder'"),
        ({"dtype": None}, r"config \(ModelledSelectorConfig\): missing dtype"),
    ],
)
def test_a_named_tuple_is_validated_like_a_config(fields: dict[str, Any], match: str) -> None:
    """Ill-typed or missing fields of a NamedTuple give the config's own typed errors."""
    named = ModelledSelectorConfig(64, "bf16", None, None)._replace(**fields)
    with pytest.raises(InvalidInputError, match=match):
        select_backend(named, device="cpu")


def test_a_plain_tuple_is_not_a_config() -> None:
    """A tuple without field names is still refused with a typed error naming ``config``."""
    with pytest.raises(InvalidBackendTypeError, match="config must be an AttentionSelectorConfig"):
        select_backend((64, "bf16"), device="cpu")  # type: ignore[arg-type]
