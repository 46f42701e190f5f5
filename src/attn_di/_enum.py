"""The backend enums: ``AttentionBackendEnum`` and ``MambaAttentionBackendEnum``.

Both are instances of the generic mechanism of :mod:`attn_di._family`. Members and default
paths follow vLLM (``vllm/v1/attention/backends/registry.py``): the attention members of vLLM
0.11, except that CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION and NO_ATTENTION default to attn_di's
own reference backends; the Mamba members of vLLM 0.33. CUSTOM (value None, no default) can
never alias another member. Members can be added at runtime (``Enum.register(name, path)``,
or ``register_backend("NAME", path)``), as in vLLM >= 0.32.

To add a third enum: declare it here as a :class:`BackendEnum` with a :class:`BackendFamily`,
and give it a container class in :mod:`attn_di._container`.
"""

from __future__ import annotations

from typing import Any

from attn_di._family import BackendEnum, BackendFamily, family_of

__all__ = [
    "ATTENTION",
    "MAMBA",
    "AttentionBackendEnum",
    "MambaAttentionBackendEnum",
    "parse_backend_name",
    "remove_runtime_member",
    "runtime_members",
]

_VLLM = "vllm.v1.attention.backends."
_OURS = "attn_di.backends."


class AttentionBackendEnum(BackendEnum):
    """Attention backends by name; each value is the member's default dotted class path.

    ``AttentionBackendEnum["NAME"]`` raises :class:`~attn_di.exceptions.UnknownBackendError`
    (a ``ValueError``: "Unknown attention backend: 'NAME'. Valid options are: ...") and
    suggests the closest name.
    """

    FLASH_ATTN = _VLLM + "flash_attn.FlashAttentionBackend"
    FLASH_SINK_ATTN = _VLLM + "flash_sink_attn.FlashSinkAttentionBackend"
    TRITON_ATTN = _VLLM + "triton_attn.TritonAttentionBackend"
    XFORMERS = _VLLM + "xformers.XFormersAttentionBackend"
    ROCM_ATTN = _VLLM + "rocm_attn.RocmAttentionBackend"
    ROCM_AITER_MLA = _VLLM + "mla.rocm_aiter_mla.AiterMLABackend"
    ROCM_AITER_FA = _VLLM + "rocm_aiter_fa.AiterFlashAttentionBackend"
    TORCH_SDPA = _OURS + "torch_sdpa.TorchSDPABackend"
    FLASHINFER = _VLLM + "flashinfer.FlashInferBackend"
    FLASHINFER_MLA = _VLLM + "mla.flashinfer_mla.FlashInferMLABackend"
    TRITON_MLA = _VLLM + "mla.triton_mla.TritonMLABackend"
    CUTLASS_MLA = _VLLM + "mla.cutlass_mla.CutlassMLABackend"
    FLASHMLA = _VLLM + "mla.flashmla.FlashMLABackend"
    FLASHMLA_SPARSE = _VLLM + "mla.flashmla_sparse.FlashMLASparseBackend"
    FLASH_ATTN_MLA = _VLLM + "mla.flashattn_mla.FlashAttnMLABackend"
    PALLAS = _VLLM + "pallas.PallasAttentionBackend"
    IPEX = _VLLM + "ipex.IpexAttentionBackend"
    NO_ATTENTION = _OURS + "no_attention.NoAttentionBackend"
    FLEX_ATTENTION = _OURS + "flex_attention.FlexAttentionBackend"
    TREE_ATTN = _VLLM + "tree_attn.TreeAttentionBackend"
    ROCM_AITER_UNIFIED_ATTN = _VLLM + "rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend"
    CPU_ATTN = _OURS + "cpu_attn.CPUAttentionBackend"
    CUSTOM = None  # no default: register one. Unique value, so never an alias.


class MambaAttentionBackendEnum(BackendEnum):
    """Backends of Mamba-style (state-space, linear-attention) layers, as in vLLM 0.33.

    Same API as :class:`AttentionBackendEnum`, with its own members, registrations and
    overrides; the two never see each other's names. ``register_backend(..., is_mamba=True)``
    with a string name adds a member here.
    """

    MAMBA1 = _VLLM + "mamba1_attn.Mamba1AttentionBackend"
    MAMBA2 = _VLLM + "mamba2_attn.Mamba2AttentionBackend"
    SHORT_CONV = _VLLM + "short_conv_attn.ShortConvAttentionBackend"
    LINEAR = _VLLM + "linear_attn.LinearAttentionBackend"
    GDN_ATTN = _VLLM + "gdn_attn.GDNAttentionBackend"
    CUSTOM = None  # no default: register one.


ATTENTION = BackendFamily(AttentionBackendEnum, "attention", "attention backend")
"""The primary family: the members of every container's class body."""

MAMBA = BackendFamily(
    MambaAttentionBackendEnum,
    "mamba",
    "Mamba attention backend",
    # vLLM's Mamba enum shares the attention enum's metaclass, so an unknown Mamba name
    # reads "Unknown attention backend: 'X'. Valid options are: ..." there too (0.33).
    unknown_phrase="Unknown attention backend",
)
"""Mamba-style layers: ``container.mamba`` holds their providers."""


# -- the attention family's functions, by their historical names --------------------------
def parse_backend_name(name: object) -> AttentionBackendEnum | None:
    """Parse an attention backend name as typed by a user (env var, CLI, config file).

    Case-insensitive, surrounding spaces ignored, inner spaces and hyphens read as ``_``;
    ``None``, ``""`` and ``"auto"`` mean automatic selection and give None. A member is returned
    as is; an exact (case-sensitive) name wins over a case-insensitive match.

    Raises:
        UnknownBackendError: an unknown name (never ignored), with the closest suggestion.
        InvalidBackendTypeError: neither a string nor a member.
    """
    return ATTENTION.parse(name)  # type: ignore[no-any-return]


def runtime_members() -> list[AttentionBackendEnum]:
    """The attention members added at runtime, oldest first."""
    return ATTENTION.runtime_members()


def remove_runtime_member(member: Any) -> None:
    """Remove a runtime member (of either enum) and its provider in every container.

    For test isolation, and for a bridge whose other side dropped the member (vLLM's tests
    remove the runtime members they create by hand). The name can be registered again.
    A member already removed by hand only loses its providers.

    Raises:
        InvalidBackendNameError: ``member`` is a built-in member (declared in the enum).
        InvalidBackendTypeError: ``member`` is not a backend enum member.
    """
    family_of(member).remove_member(member)
