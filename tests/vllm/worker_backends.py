"""Backends that fail in vLLM's worker processes, for ``tests/vllm/test_worker_failures.py``.

A module of its own so that vLLM's spawned processes import them by path (they inherit the
test process's ``sys.path``, not its memory). Each is attn_di's TORCH_SDPA with one thing
changed; importing this module needs torch, not vLLM.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, ClassVar

from attn_di.backend import AttentionType
from attn_di.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from attn_di.exceptions import UnsupportedFeatureError

#: Names the process (``multiprocessing``'s name: ``EngineCore``, ``VllmWorker-1``) where
#: :class:`MissingInAWorker` does not import, as a package installed on one machine only.
MISSING_IN_ENV = "ATTN_DI_TEST_MISSING_IN"
MISSING_MODULE = "fast_attention_ext"


class DecoderOnlyBackend(TorchSDPABackend):
    """TORCH_SDPA declaring decoder attention only (an encoder-only model cannot run on it)."""

    supported_attn_types: ClassVar[tuple[str, ...]] = (AttentionType.DECODER,)


class NoGroupedQueryImpl(TorchSDPAImpl):
    """Refuses grouped-query attention when the layer is built (not at selection)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_kv_heads != self.num_heads:
            raise UnsupportedFeatureError(
                "NO_GQA",
                f"grouped-query attention ({self.num_heads} query heads over "
                f"{self.num_kv_heads} KV heads)",
                ("CPU_ATTN", "TORCH_SDPA"),
            )


class NoGroupedQueryBackend(TorchSDPABackend):
    """TORCH_SDPA whose impl refuses grouped-query attention (:class:`NoGroupedQueryImpl`)."""

    @staticmethod
    def get_impl_cls() -> type[NoGroupedQueryImpl]:
        return NoGroupedQueryImpl


def missing_here() -> bool:
    """Whether this process is the one :data:`MISSING_IN_ENV` names."""
    wanted = os.environ.get(MISSING_IN_ENV)
    return wanted is not None and multiprocessing.current_process().name == wanted
