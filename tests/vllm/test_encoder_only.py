"""Encoder-only models in vLLM: a BERT embedding model runs on attn_di's CPU_ATTN and
TORCH_SDPA, with vLLM's own backend's embeddings.

The model is a tiny BERT (2 layers, 2 heads of 32, random weights with a wide init so that
attention is far from uniform) written once per module with transformers, with a WordPiece
tokenizer over the sentences' words. vLLM runs BERT's attention as ``EncoderOnlyAttention``
(bidirectional, no KV cache) and pools the CLS token: a backend that attended causally would
give the CLS token only itself to see, so every sentence would get the same embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import torch
from pytest_mock import MockerFixture
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

import attn_di
from attn_di.integrations.vllm.backends import AttnDIImpl
from tests.vllm.conftest import CPU_ATTN_PATH, TORCH_SDPA_PATH, engine, layer_impls

SENTENCES = [
    "the water is long and the man is old",
    "a small animal came back to the house",
    "how many people live in the world",
    "the water is long and the man is young",
]
#: float32 throughout; measured differences to vLLM's own are ~3e-7 on unit-length vectors.
ATOL = 1e-5


def write_tiny_bert(folder: Path) -> Path:
    """A random-weight ``BertModel`` and its tokenizer as an HF folder (seeded: the same
    weights every time)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = dict.fromkeys(word for sentence in SENTENCES for word in sentence.split())
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)})
    assert tokenizer.unk_token_id not in tokenizer(SENTENCES)["input_ids"][0]
    tokenizer.save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.2,
        architectures=["BertModel"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", name="bert")
def _bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def embed(model: Path) -> tuple[torch.Tensor, list[Any]]:
    """The sentences' embeddings from an in-process pooling engine, and its layers' impls."""
    with engine(model, runner="pooling", max_model_len=128) as llm:
        outputs = llm.embed(SENTENCES, use_tqdm=False)
        impls = layer_impls(llm)
    return torch.tensor([output.outputs.embedding for output in outputs]), impls


@pytest.fixture(scope="module", name="reference")
def _reference(bert: Path) -> torch.Tensor:
    """vLLM's own CPU_ATTN's embeddings (nothing registered in attn_di)."""
    with attn_di.use_container():
        embeddings, impls = embed(bert)
    assert {type(impl).__module__ for impl in impls} == {"vllm.v1.attention.backends.cpu_attn"}
    assert len(impls) == 2
    return embeddings


@pytest.fixture(name="spy")
def _spy(mocker: MockerFixture) -> Any:
    """Every call of the adapter's impl forward (its ``self`` and arguments)."""
    return mocker.spy(AttnDIImpl, "forward")


@pytest.mark.parametrize(
    ("class_path", "runs"),
    [
        (CPU_ATTN_PATH, "attn_di.backends.cpu_attn.CPUAttentionBackend"),
        (TORCH_SDPA_PATH, "attn_di.backends.torch_sdpa.TorchSDPABackend"),
    ],
    ids=["cpu_attn", "sdpa"],
)
def test_an_embedding_model_runs_on_attn_di_with_vllms_embeddings(
    bert: Path, reference: torch.Tensor, spy: Any, class_path: str, runs: str
) -> None:
    """Both encoder-only layers are attn_di's (encoder-only impls running ``runs``), their
    forward ran on the sentences' tokens, and the embeddings are vLLM's own within ATOL."""
    with attn_di.use_container():
        register_backend(AttentionBackendEnum.CPU_ATTN, class_path)
        embeddings, impls = embed(bert)
    assert len(impls) == 2
    for impl in impls:
        assert isinstance(impl, AttnDIImpl)
        backend = impl.attn_di_backend
        assert f"{backend.__module__}.{backend.__qualname__}" == runs
        assert impl.impl.attn_type.value == "encoder_only"
    ran = [call for call in spy.call_args_list if call.args[6] is not None]  # with metadata
    assert {id(call.args[0]) for call in ran} == {id(impl) for impl in impls}
    assert all(call.args[6].causal is False for call in ran)
    assert max(call.args[6].num_actual_tokens for call in ran) >= 9  # a whole sentence
    assert embeddings.shape == reference.shape == (len(SENTENCES), 64)
    torch.testing.assert_close(embeddings, reference, atol=ATOL, rtol=0)
    # The CLS token saw every token: sentences differing in their last word differ.
    assert (embeddings[0] - embeddings[3]).abs().max() > 100 * ATOL
