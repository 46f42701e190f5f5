"""attn_di backends as transformers attention on random-weight tiny models of five families.

Llama, Qwen3, Mistral (sliding window), Gemma2 (sliding window + soft cap) and gpt-oss
(sinks + sliding window), 2 layers, GQA, built from configs in the test. Each backend that
declares support must give eager's logits on a left-padded batch and eager's greedy tokens,
on transformers' own cache and on a PagedCache whose unused slots hold NaN; a backend that
cannot honour the model is refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from attn_di import AttentionBackendEnum, BackendContainer, BackendRejectedError, force_backend
from attn_di.exceptions import AttnDIError
from attn_di.integrations.transformers import PagedCache, implementation_name

from .conftest import CPU_MEMBERS, left_padded

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
WINDOWED = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}


def _config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=4)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **COMMON, **WINDOWED, attn_logit_softcapping=5.0, query_pre_attn_scalar=16
        )
    options = {**COMMON, "intermediate_size": 64}
    return transformers.GptOssConfig(
        **options, **WINDOWED, num_local_experts=4, num_experts_per_tok=2
    )


FAMILIES = ["llama", "qwen3", "mistral", "gemma2", "gpt_oss"]
# (family, member) pairs a backend refuses: TORCH_SDPA has no logits soft cap.
REFUSED = {("gemma2", "TORCH_SDPA")}
PROMPTS = [[5, 6, 7, 8], [1, 2, 3, 4, 9, 10, 11]]
NEW_TOKENS = 10


def _model(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval()
    if family == "gpt_oss":  # sinks start at zero: give them values that matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model


@pytest.fixture(name="tiny", scope="module")
def _tiny(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """A tiny model of one family with eager's reference logits and greedy tokens."""
    family: str = request.param
    model = _model(family)
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return family, model, {"ids": ids, "mask": mask, "logits": logits, "tokens": tokens}


SUPPORTED = [
    pytest.param(family, member, id=f"{family}-{member or 'auto'}")
    for family in FAMILIES
    for member in (*CPU_MEMBERS, None)
    if (family, member) not in REFUSED
]


@pytest.mark.parametrize(("tiny", "member"), SUPPORTED, indirect=["tiny"])
def test_logits_and_greedy_tokens_match_eager(
    tiny: tuple[str, Any, dict[str, torch.Tensor]], member: str | None
) -> None:
    """Each supporting backend gives eager's logits (1e-5) and tokens on both kinds of cache."""
    _, model, ref = tiny
    model.set_attn_implementation(implementation_name(member))
    real = ref["mask"].bool()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
        dynamic = model.generate(
            input_ids=ref["ids"], attention_mask=ref["mask"], max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        cache = PagedCache(model.config, block_size=4, fill_value=float("nan"))
        paged = model.generate(
            input_ids=ref["ids"], attention_mask=ref["mask"], max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0, cache=cache,
        )  # fmt: skip
    torch.testing.assert_close(logits[real], ref["logits"][real], rtol=0, atol=1e-5)
    assert dynamic.tolist() == ref["tokens"].tolist()
    assert paged.tolist() == ref["tokens"].tolist()
    assert cache.seq_lens == [len(p) + NEW_TOKENS - 1 for p in PROMPTS]


@pytest.mark.parametrize(("tiny", "member"), sorted(REFUSED), indirect=["tiny"])
def test_backend_without_a_feature_is_refused_by_name(
    tiny: tuple[str, Any, dict[str, torch.Tensor]], member: str
) -> None:
    """A named backend lacking a feature the model needs fails with a typed error naming both."""
    _, model, ref = tiny
    model.set_attn_implementation(implementation_name(member))
    with pytest.raises(BackendRejectedError) as caught:
        model(input_ids=ref["ids"], attention_mask=ref["mask"])
    assert caught.value.member == member
    assert "logits_soft_cap" in str(caught.value)
    assert "CPU_ATTN" in str(caught.value.hint)
    assert 'attn_implementation="attn_di"' in str(caught.value.hint)
    assert "backend=" not in str(caught.value.hint)


def test_forced_backend_without_a_feature_is_refused() -> None:
    """``force_backend`` on a model needing soft cap fails naming the force, never falls back."""
    model = _model("gemma2")
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation("attn_di")
    with force_backend("TORCH_SDPA"), pytest.raises(BackendRejectedError) as caught:
        model(input_ids=ids, attention_mask=mask)
    assert caught.value.origin == "force_backend()"
    assert "force_backend() off" in str(caught.value.hint)
    assert "backend=" not in str(caught.value.hint)


def test_named_backend_that_cannot_run_here_hints_at_attn_di() -> None:
    """A named backend the selector refuses hints at attn_implementation="attn_di", not backend=."""
    model = _model("llama")
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation(implementation_name("FLASH_ATTN"))
    with pytest.raises(BackendRejectedError, match="FLASH_ATTN") as caught:
        model(input_ids=ids, attention_mask=mask)
    assert 'attn_implementation="attn_di"' in str(caught.value.hint)
    assert "backend=" not in str(caught.value.hint)


def test_auto_selection_skips_a_candidate_without_soft_cap(container: BackendContainer) -> None:
    """With TORCH_SDPA first in the candidate policy, ``"attn_di"`` runs Gemma2 on the next one."""
    from dependency_injector import providers

    model = _model("gemma2")
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    policy = providers.Object(
        [AttentionBackendEnum.TORCH_SDPA, AttentionBackendEnum.FLEX_ATTENTION]
    )
    model.set_attn_implementation("attn_di")
    with container.candidates.override(policy), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("member", ["NO_ATTENTION", "FLASH_ATTN"])
def test_backend_that_cannot_run_here_fails_typed(member: str) -> None:
    """A member without CPU decoder attention fails with attn_di's typed error, by name."""
    model = _model("llama")
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation(implementation_name(member))
    with pytest.raises(AttnDIError, match=member):
        model(input_ids=ids, attention_mask=mask)


def test_a_named_backend_is_not_changed_by_force_backend() -> None:
    """``"attn_di:CPU_ATTN"`` keeps CPU_ATTN under force_backend of a backend that would refuse."""
    model = _model("gemma2")
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("attn_di:CPU_ATTN")
    with force_backend("TORCH_SDPA"), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)
