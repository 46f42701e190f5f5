"""The engine: a TinyDecoder, a paged KV cache per layer, a block allocator, greedy generation.

Its constructor receives the attention backend class by injection:
``Provide[BackendContainer.selected]``, the backend attn_di selects for the container's
``attention`` settings (see :func:`configure`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from blocks import BlockAllocator
from dependency_injector.wiring import Provide, inject
from model import ModelConfig, TinyDecoder

from attn_di import BackendContainer


def configure(container: BackendContainer, config: ModelConfig, backend: str = "auto") -> None:
    """Give the container the selection inputs for this model (head size, dtype, block size)."""
    container.attention.from_dict(
        {
            "head_size": config.head_size,
            "dtype": config.dtype,
            "block_size": config.block_size,
            "device": "cpu",
            "backend": backend,
        }
    )


@dataclass
class Generation:
    """What :meth:`Engine.generate` returns.

    Attributes:
        tokens: the generated token ids, one list per prompt.
        prefill_s: seconds of the prefill step; decode_s: seconds of each decode step.
    """

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


class Engine:
    """Greedy generation for a batch of prompts through the injected attention backend.

    Args:
        config: the model; its seed fixes the weights.
        backend_cls: injected: the selected backend class.
    """

    @inject
    def __init__(
        self,
        config: ModelConfig | None = None,
        backend_cls: Any = Provide[BackendContainer.selected],
    ) -> None:
        self.config = config = config or ModelConfig()
        self.backend_cls = backend_cls
        impl_cls = backend_cls.get_impl_cls()
        impls = [
            impl_cls(
                num_heads=config.num_heads,
                head_size=config.head_size,
                scale=config.head_size**-0.5,
                num_kv_heads=config.num_kv_heads,
            )
            for _ in range(config.num_layers)
        ]
        self.model = TinyDecoder(config, impls)
        shape = backend_cls.get_kv_cache_shape(
            config.num_blocks, config.block_size, config.num_kv_heads, config.head_size
        )
        # Uninitialised, as a server allocates it: backends read only the slots a sequence covers.
        self.kv_caches = [
            torch.empty(shape, dtype=config.torch_dtype) for _ in range(config.num_layers)
        ]
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.builder = backend_cls.get_builder_cls()(config.block_size)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        """Prefill all prompts in one batch, then decode ``max_new_tokens - 1`` steps.

        Returns:
            The new tokens per prompt (``max_new_tokens`` each) and the step timings.
        """
        sequences = [list(prompt) for prompt in prompts]
        result = Generation(tokens=[[] for _ in prompts])
        query_lens = [len(prompt) for prompt in prompts]
        for step in range(max_new_tokens):
            start = time.perf_counter()
            logits = self._step(sequences, query_lens)
            for index, token in enumerate(logits.argmax(dim=-1).tolist()):
                sequences[index].append(token)
                result.tokens[index].append(token)
            elapsed = time.perf_counter() - start
            if step == 0:
                result.prefill_s = elapsed
            else:
                result.decode_s.append(elapsed)
            query_lens = [1] * len(sequences)
        for seq_id in range(len(sequences)):
            self.allocator.free(seq_id)
        return result

    def _step(self, sequences: list[list[int]], query_lens: list[int]) -> torch.Tensor:
        """Run the model on each sequence's last ``query_len`` tokens; logits of each last token."""
        seq_lens = [len(tokens) for tokens in sequences]
        tables = [self.allocator.ensure(i, n) for i, n in enumerate(seq_lens)]
        width = max(len(table) for table in tables)
        block_table = torch.tensor([table + [0] * (width - len(table)) for table in tables])
        metadata = self.builder.build(query_lens, seq_lens, block_table)
        token_ids = torch.tensor(
            [t for tokens, q in zip(sequences, query_lens, strict=True) for t in tokens[-q:]]
        )
        positions = torch.cat(
            [torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens, strict=True)]
        )
        logits: torch.Tensor = self.model(token_ids, positions, self.kv_caches, metadata)
        last = metadata.query_start_loc[1:].long() - 1
        return logits[last]
