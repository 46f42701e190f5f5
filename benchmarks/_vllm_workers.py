"""What a vLLM worker ran: imported by name in every worker that ``collective_rpc`` reaches
(this folder is on the workers' ``sys.path``: spawned processes inherit the parent's)."""

from __future__ import annotations

from typing import Any

__all__ = ["worker_impls"]


def worker_impls(worker: Any) -> list[str]:
    """The sorted impl classes (``module.qualname``) of one vLLM worker's attention layers."""
    layers = worker.model_runner.vllm_config.compilation_config.static_forward_context.values()
    return sorted({f"{type(x.impl).__module__}.{type(x.impl).__qualname__}" for x in layers})
