"""transformers' layer types and mask kinds on attn_di's attention functions.

Each is computed (equal to transformers' own eager attention) or refused with a typed error
before any number is produced; a layer type or mask function that transformers adds later
fails the table tests until ``_masks.py`` classifies it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers import masking_utils
from transformers.configuration_utils import _LEGACY_LAYER_TYPE_REMAP, ALLOWED_LAYER_TYPES

from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError
from attn_di.integrations.transformers import (
    AttentionFunction,
    PagedCache,
    _attention,
    implementation_name,
    padding_mask,
)
from attn_di.integrations.transformers._masks import (
    LAYER_TYPES,
    MASK_FUNCTIONS,
    MaskPattern,
    mask_tag,
)

from .conftest import CPU_MEMBERS, left_padded, tiny_llama

CHUNK = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 9, 10, 11, 12, 13]]  # longer than a chunk
NEW_TOKENS = 8


def _transformers_layer_types() -> set[str]:
    names = set(ALLOWED_LAYER_TYPES)
    for key, value in masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.items():
        names.add(key)
        if isinstance(value, dict):
            names.update(value)
    names.update(_LEGACY_LAYER_TYPE_REMAP)
    names.update(_LEGACY_LAYER_TYPE_REMAP.values())
    return names


def test_every_layer_type_of_transformers_is_classified() -> None:
    """Every layer type transformers knows (its allowed types, its mask registry's keys, the
    old names it remaps) is in the table; an old name is classified as its new name."""
    missing = sorted(_transformers_layer_types() - set(LAYER_TYPES))
    assert missing == [], f"classify these layer types in _masks.LAYER_TYPES: {missing}"
    for old, new in _LEGACY_LAYER_TYPE_REMAP.items():
        assert LAYER_TYPES[old].kind == LAYER_TYPES[new].kind, old
    assert LAYER_TYPES["chunked_attention"].kind == "chunked"
    assert {LAYER_TYPES[name].kind for name in LAYER_TYPES} <= {
        "full", "sliding", "chunked", "not_attention", "refused",
    }  # fmt: skip


def test_every_mask_function_of_transformers_is_classified() -> None:
    """Every pattern function (``*_mask_function``, ``*_overlay``) and mask maker
    (``create_*``) of ``transformers.masking_utils`` is in the table."""
    functions = {
        name
        for name, value in vars(masking_utils).items()
        if inspect.isfunction(value)
        and value.__module__ == masking_utils.__name__
        and (name.endswith(("_mask_function", "_overlay")) or name.startswith("create_"))
    }
    missing = sorted(functions - set(MASK_FUNCTIONS))
    assert missing == [], f"classify these mask functions in _masks.MASK_FUNCTIONS: {missing}"
    assert functions == set(MASK_FUNCTIONS)  # no stale entry either
    assert MASK_FUNCTIONS["create_chunked_causal_mask"].kind == "computed"
    assert MASK_FUNCTIONS["blockwise_overlay"].kind == "refused"


def _llama4(chunk: int) -> transformers.PreTrainedModel:
    """A 2-layer random-weight Llama 4 text model: layer 0 chunked, layer 1 full."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
        attention_chunk_size=chunk,
    )  # fmt: skip
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.fixture(name="llama4", scope="module")
def _llama4_fixture() -> dict[str, Any]:
    """The Llama 4 model with eager's logits and greedy tokens on a left-padded batch."""
    model = _llama4(CHUNK)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    ids, mask = left_padded(PROMPTS)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        unchunked = _llama4(64)  # the same weights, one chunk: the chunks must matter here
        unchunked.set_attn_implementation("eager")
        full = unchunked(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (full[real] - logits[real]).abs().max() > 1e-2
    return {"model": model, "ids": ids, "mask": mask, "logits": logits, "tokens": tokens}


@pytest.fixture(name="chunk_calls")
def _chunk_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each call of the chunked paths of the attention function (a spy)."""
    calls: list[str] = []
    chunked = getattr(_attention, "_chunked", None)  # absent before attn_di ran chunks
    paged_chunks = getattr(_attention, "_paged_chunks", None)

    def spy_chunked(*args: Any) -> Any:
        calls.append("contiguous")
        return chunked(*args)  # type: ignore[misc]

    def spy_paged(*args: Any) -> Any:
        metadata = paged_chunks(*args)  # type: ignore[misc]
        calls.append("paged" if metadata is not None else "paged-first-chunk")
        return metadata

    if chunked is not None and paged_chunks is not None:
        monkeypatch.setattr(_attention, "_chunked", spy_chunked)
        monkeypatch.setattr(_attention, "_paged_chunks", spy_paged)
    return calls


@pytest.mark.parametrize("member", [*CPU_MEMBERS, None])
def test_chunked_attention_matches_eager(
    llama4: dict[str, Any], member: str | None, chunk_calls: list[str]
) -> None:
    """Llama 4's chunked layers give eager's logits (1e-5) and greedy tokens, on transformers'
    cache and on a PagedCache whose unused slots hold NaN, through attn_di's chunked paths."""
    model = llama4["model"]
    model.set_attn_implementation(implementation_name(member))
    ids, mask = llama4["ids"], llama4["mask"]
    real = mask.bool()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        dynamic = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        cache = PagedCache(model.config, block_size=2, fill_value=float("nan"))
        paged = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, cache=cache,
        )  # fmt: skip
    torch.testing.assert_close(logits[real], llama4["logits"][real], rtol=0, atol=1e-5)
    assert dynamic.tolist() == llama4["tokens"].tolist()
    assert paged.tolist() == llama4["tokens"].tolist()
    assert "contiguous" in chunk_calls
    assert "paged" in chunk_calls


def test_chunked_attention_matches_eager_on_right_padding(llama4: dict[str, Any]) -> None:
    """Right padding (chunks counted from column 0) and one-chunk rows in the same batch."""
    model = llama4["model"]
    rows = [[5, 6, 7], [1, 2, 3, 4, 9, 10, 11, 12, 13, 14]]
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    real = mask.bool()
    outputs = {}
    for implementation in ("eager", implementation_name("CPU_ATTN")):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(
        outputs[implementation][real], outputs["eager"][real], rtol=0, atol=1e-5
    )


def test_paged_cache_refuses_a_block_size_that_does_not_divide_the_chunk(
    llama4: dict[str, Any],
) -> None:
    """A PagedCache whose blocks do not tile the chunks is refused when it is made."""
    with pytest.raises(
        InvalidInputError, match="does not divide the model's attention_chunk_size 4"
    ):
        PagedCache(llama4["model"].config, block_size=3)
    with pytest.raises(InvalidInputError) as caught:
        PagedCache(llama4["model"].config, block_size=3)
    assert (
        caught.value.hint
        == "use a block_size that divides 4, e.g. PagedCache(config, block_size=2)"
    )


def _layer(layer_type: str | None, **config: Any) -> torch.nn.Module:
    """An attention module as transformers' are: ``config``, ``layer_idx``, ``is_causal``."""
    module = torch.nn.Module()
    module.config = SimpleNamespace(  # type: ignore[assignment]
        layer_types=None if layer_type is None else ["full_attention", layer_type], **config
    )
    module.layer_idx = 1  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    return module


def _qkv(length: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, 4, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)


@pytest.mark.parametrize(
    "layer_type",
    [
        *sorted(name for name, support in LAYER_TYPES.items() if support.kind != "full"
                and support.kind not in ("sliding", "chunked")),
        "made_up_attention",
    ],
)  # fmt: skip
def test_a_refused_or_unknown_layer_type_is_refused_by_name(layer_type: str) -> None:
    """A layer whose type the table refuses (or does not know) fails before computing,
    naming the layer, its type and the fix."""
    with pytest.raises(UnsupportedFeatureError) as caught:
        AttentionFunction(None)(_layer(layer_type), *_qkv(), None)
    message = str(caught.value)
    assert f"at layer 1 (Module, layer type {layer_type!r})" in message
    assert "use another attn_implementation for this model" in message


def test_a_misspelled_layer_type_gets_the_closest_known_one() -> None:
    """An unknown layer type: the hint suggests the closest type attn_di runs and lists
    them all."""
    with pytest.raises(UnsupportedFeatureError) as caught:
        AttentionFunction(None)(_layer("full_attenton"), *_qkv(), None)
    hint = caught.value.hint or ""
    assert hint.startswith("did you mean 'full_attention'? the layer types attn_di runs: ")
    assert "sliding_attention" in hint
    assert "chunked_attention" in hint
    assert "indexed_attention" not in hint  # a refused type is no choice


def test_a_chunked_layer_without_attn_dis_mask_is_refused() -> None:
    """A chunked layer given no mask of attn_di's (a plain 2-D mask, None) is refused:
    its chunk boundaries are unknown, and full causal attention would be wrong."""
    module = _layer("chunked_attention", attention_chunk_size=4)
    for attention_mask in (None, torch.ones(1, 6, dtype=torch.bool)):
        with pytest.raises(UnsupportedFeatureError) as caught:
            AttentionFunction(None)(module, *_qkv(), attention_mask)
        message = str(caught.value)
        assert "chunked attention (attention_chunk_size=4) without attn_di's mask" in message
        assert "layer type 'chunked_attention'" in message


def _config(**options: Any) -> transformers.PretrainedConfig:
    config = transformers.Llama4TextConfig(**options)
    config._attn_implementation = implementation_name(None)
    return config


def _make(maker: str, config: transformers.PretrainedConfig, **options: Any) -> Any:
    embeds = torch.zeros(2, 8, 4)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0
    return getattr(masking_utils, maker)(
        config=config, inputs_embeds=embeds, attention_mask=mask, cache=None, **options
    )


@pytest.mark.parametrize(
    ("maker", "options", "expected"),
    [
        ("create_causal_mask", {}, {MaskPattern("causal")}),
        ("create_bidirectional_mask", {}, {MaskPattern("bidirectional")}),
        ("create_sliding_window_causal_mask", {"sliding_window": 3}, {MaskPattern("sliding", 3)}),
        ("create_chunked_causal_mask", {"attention_chunk_size": 3}, {MaskPattern("chunked", 3)}),
    ],
)
def test_the_mask_records_the_pattern_transformers_asked_for(
    maker: str, options: dict[str, Any], expected: set[MaskPattern]
) -> None:
    """attn_di's mask function finds, of the mask transformers asks for, the pattern attn_di
    computes that equals it (and only that one, on 6 real tokens past a window of 3)."""
    made = _make(maker, _config(**options))
    tag = mask_tag(made)
    assert tag is not None
    assert set(tag.patterns) == expected
    assert made.tolist()[0] == [False, False] + [True] * 6


BLOCKS = torch.tensor([[-1, -1, -1, 0, 0, 0, -1, -1]] * 2)  # an image of 3 tokens in each row


@pytest.mark.parametrize(
    ("maker", "options", "what"),
    [
        ("create_causal_mask", {"block_sequence_ids": BLOCKS}, "a mask pattern that is none of"),
        ("create_bidirectional_sliding_window_mask", {}, "a mask pattern that is none of"),
        ("create_causal_mask", {"or_mask_function": masking_utils.bidirectional_mask_function},
         "custom mask functions of the model"),
    ],
)  # fmt: skip
def test_a_mask_attn_di_does_not_compute_is_refused_when_made(
    maker: str, options: dict[str, Any], what: str
) -> None:
    """Bidirectional blocks (block_sequence_ids), a bidirectional window and a model's own
    mask functions are refused by the mask function, before any layer runs."""
    with pytest.raises(UnsupportedFeatureError, match=what):
        _make(maker, _config(sliding_window=3), **options)


def test_packed_sequences_are_refused() -> None:
    """Two sequences packed in one row (position_ids restarting, no attention_mask): eager
    keeps them apart; attn_di refuses rather than attend across them."""
    model = tiny_llama(implementation_name(None))
    ids = torch.tensor([[5, 6, 7, 8, 1, 2, 3]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    with torch.no_grad(), pytest.raises(UnsupportedFeatureError) as caught:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    assert "packed sequences" in str(caught.value.hint)


def test_a_layer_whose_mask_is_not_its_pattern_is_refused() -> None:
    """A layer asking for a window over a plainly causal mask (eager would ignore the window)
    is refused, naming both patterns."""
    q, k, v = _qkv()
    mask = padding_mask(
        1, 6, 6, mask_function=masking_utils.causal_mask_function,
        attention_mask=torch.ones(1, 6, dtype=torch.long),
    )  # fmt: skip
    with pytest.raises(
        UnsupportedFeatureError, match=r"its mask is causal, but the layer would run sliding\(2\)"
    ):
        AttentionFunction(None)(_layer(None), q, k, v, mask, sliding_window=2)
