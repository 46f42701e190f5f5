"""Fixtures of the tests against the real vLLM (run in .venv-vllm: ``bash scripts/setup-vllm.sh``).

Every module here starts with ``pytest.importorskip("vllm", ...)``: outside .venv-vllm they are
skipped with a reason naming the missing package. In CI (``CI`` set) a missing SmolLM2 folder
fails instead of skipping, so CI can never pass these tests by not running them.

Engines are few and shared (module-scoped fixtures), built with ``enforce_eager=True``, a
1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE=1``) and ``max_model_len=512``, one at a time (two
cores are shared); :func:`engine` shuts each down (and frees its memory) after its module.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[2]
#: scripts/smollm2_hf_folder.py's FOLDER_NAME: the bfloat16 folder (engines here that compare
#: tokens ask for float32 themselves: ``engine()`` passes ``dtype="float32"``).
MODEL_FOLDER_NAME = "SmolLM2-135M-Instruct-bf16"
CPU_ATTN_PATH = "attn_di.integrations.vllm.backends.CPU_ATTN"
TORCH_SDPA_PATH = "attn_di.integrations.vllm.backends.TORCH_SDPA"

#: >= 6 chat prompts (the same-token tests generate 32 greedy tokens for each).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Who wrote Hamlet?",
    "Explain gravity in one sentence.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
]
NEW_TOKENS = 32


def model_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (written by ``scripts/smollm2_hf_folder.py``)."""
    explicit = os.environ.get("ATTN_DI_MODEL_CACHE")
    if explicit:
        root = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "attn_di" / "models"
    return root / MODEL_FOLDER_NAME


@pytest.fixture(scope="session", name="smollm2")
def _smollm2() -> Path:
    """The model folder; skipped (failed in CI) when it is missing."""
    folder = model_folder()
    if not (folder / "model.safetensors").is_file():
        reason = (
            f"{folder} is missing: run bash scripts/setup-vllm.sh (it runs "
            ".venv/bin/python scripts/smollm2_hf_folder.py)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _bridge() -> None:
    """The bridge, installed as vLLM's plugin would install it (idempotent)."""
    from attn_di.integrations.vllm import install

    install()


def chat(prompt: str) -> list[dict[str, str]]:
    """One user turn."""
    return [{"role": "user", "content": prompt}]


def greedy(tokens: int = NEW_TOKENS) -> Any:
    """vLLM's sampling parameters for exactly ``tokens`` greedy tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)


def generate_tokens(llm: Any, prompts: list[str] = CHAT_PROMPTS) -> list[list[int]]:
    """Greedy token ids of each chat prompt."""
    outputs = llm.chat([chat(p) for p in prompts], greedy(), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@contextmanager
def engine(model: Path, *, multiprocess: bool = False, **options: Any) -> Iterator[Any]:
    """A vLLM ``LLM`` on SmolLM2 (small, eager), shut down and freed on exit."""
    from vllm import LLM

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    settings: dict[str, Any] = {
        "model": str(model),
        "enforce_eager": True,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "dtype": "float32",
        "seed": 0,
    }
    settings.update(options)
    llm = None
    try:
        llm = LLM(**settings)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


def layer_impls(llm: Any) -> list[Any]:
    """The attention impls of an in-process engine's layers."""
    from vllm.model_executor.layers.attention import Attention

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = runner.model_runner.model
    return [module.impl for module in model.modules() if isinstance(module, Attention)]


_REFERENCE: dict[str, list[list[int]]] = {}


def remember_reference(dtype: str, tokens: list[list[int]]) -> None:
    """Keep vLLM's own tokens made by a test's engine (so no other engine has to make them)."""
    _REFERENCE.setdefault(dtype, tokens)


@pytest.fixture(scope="session", name="vllm_reference_tokens")
def _vllm_reference_tokens(smollm2: Path) -> list[list[int]]:
    """vLLM's own CPU_ATTN's greedy tokens (in-process, float32), the reference.

    Made by the override test's engine built after its block when that test ran first."""
    if "float32" not in _REFERENCE:
        import attn_di

        with attn_di.use_container(), engine(smollm2) as llm:
            assert {type(impl).__module__ for impl in layer_impls(llm)} == {
                "vllm.v1.attention.backends.cpu_attn"
            }
            _REFERENCE["float32"] = generate_tokens(llm)
    return _REFERENCE["float32"]


def attention_impls(model: Any) -> list[str]:
    """``module.Impl`` (and the attn_di backend it runs) of a model's attention layers; run in
    vLLM's worker through ``llm.apply_model`` (a module-level function, pickled by name)."""
    from vllm.model_executor.layers.attention import Attention

    found = set()
    for module in model.modules():
        if isinstance(module, Attention):
            impl = module.impl
            runs = getattr(impl, "attn_di_backend", None)
            found.add(
                f"{type(impl).__module__}.{type(impl).__qualname__}"
                + (f" runs {runs.__module__}.{runs.__qualname__}" if runs is not None else "")
            )
    return sorted(found)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def serving(
    command: list[str], env: dict[str, str], log: Path, port: int, *, timeout_s: float
) -> Iterator[str]:
    """Run a vLLM server ``command`` (its output into ``log``) until its ``/health`` answers
    200 on ``port``, yield its base URL, then stop it by its PID (SIGTERM, SIGKILL after 60 s).

    Fails the test, with the log's tail, if the server exits or does not answer in
    ``timeout_s`` seconds.
    """
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = log.read_text()[-4000:]
                pytest.fail(f"the server did not answer in {timeout_s:.0f} s:\n{tail}")
            time.sleep(1.0)
        yield base
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def write_tiny_llama(folder: Path) -> Path:
    """A random-weight Llama (2 layers, 4 query heads and 2 KV heads of 64, a vocabulary of
    256 ids, float32) as an HF folder, seeded; no tokenizer: engines on it take token ids
    (``skip_tokenizer_init=True``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", name="tiny_llama")
def _tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


#: Token-id prompts for engines on the tiny Llama (no tokenizer).
TOKEN_PROMPTS = [[1, 17, 42, 99, 7], [1, 5, 6, 200]]


def tiny_settings(model: Path, **options: Any) -> dict[str, Any]:
    """Engine arguments for the tiny Llama: small, eager unless told, token ids in and out."""
    settings: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 64,
        "max_num_seqs": 2,
        "dtype": "float32",
        "seed": 0,
    }
    settings.update(options)
    return settings


def worker_impls(worker: Any) -> tuple[int, list[str]]:
    """``(data-parallel rank, sorted impl classes)`` of one vLLM worker's attention layers;
    run in every worker through ``collective_rpc`` (pickled by name). The rank is vLLM's
    ``data_parallel_index`` (a dense model's DP ranks run as independent DP=1 engines, whose
    ``data_parallel_rank`` is 0)."""
    config = worker.model_runner.vllm_config
    layers = config.compilation_config.static_forward_context.values()
    impls = {f"{type(layer.impl).__module__}.{type(layer.impl).__qualname__}" for layer in layers}
    return int(config.parallel_config.data_parallel_index), sorted(impls)
