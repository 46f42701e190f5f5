"""attn_di's backends as vLLM v1 attention backends.

``CPU_ATTN``, ``TORCH_SDPA`` and ``FLEX_ATTENTION`` are vLLM backend classes (vLLM 0.32's
``AttentionBackend`` contract) whose impl runs the attn_di backend their member resolves to
through attn_di's container when vLLM builds the layer: attn_di's own class by default,
an attn_di override's class inside ``with attn_di.get_container().override(...)``. vLLM's CPU
platform always asks for CPU_ATTN, so one line selects one of them::

    register_backend(AttentionBackendEnum.CPU_ATTN, "attn_di.integrations.vllm.backends.CPU_ATTN")

(vLLM's or attn_di's ``register_backend``; with the bridge installed both register in
attn_di, whose ``ATTN_DI_REGISTRATIONS`` carries it to vLLM's worker processes).
"""

from attn_di.integrations.vllm.backends._adapter import (
    KV_CACHE_LAYOUTS,
    AttnDIBackend,
    AttnDIImpl,
    AttnDIMetadataBuilder,
    _named,
    kv_cache_view,
    vllm_backend,
)

__all__ = [
    "CPU_ATTN",
    "FLEX_ATTENTION",
    "KV_CACHE_LAYOUTS",
    "TORCH_SDPA",
    "AttnDIBackend",
    "AttnDIImpl",
    "AttnDIMetadataBuilder",
    "kv_cache_view",
    "vllm_backend",
]

CPU_ATTN = _named(
    "CPU_ATTN",
    "CPU_ATTN",
    doc="vLLM backend running the attn_di backend CPU_ATTN resolves to (attn_di's "
    "CPUAttentionBackend by default: its compiled decode and prefill kernels, pure torch "
    "where they are not built).",
    module=__name__,
)
TORCH_SDPA = _named(
    "TORCH_SDPA",
    "TORCH_SDPA",
    doc="vLLM backend running the attn_di backend TORCH_SDPA resolves to (attn_di's "
    "TorchSDPABackend by default: torch.nn.functional.scaled_dot_product_attention).",
    module=__name__,
)
FLEX_ATTENTION = _named(
    "FLEX_ATTENTION",
    "FLEX_ATTENTION",
    doc="vLLM backend running the attn_di backend FLEX_ATTENTION resolves to (attn_di's "
    "FlexAttentionBackend by default: torch's flex_attention).",
    module=__name__,
)

for _cls in (AttnDIBackend, AttnDIImpl, AttnDIMetadataBuilder):
    _cls.__module__ = __name__
del _cls
