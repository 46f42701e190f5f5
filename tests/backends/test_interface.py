"""The backend interface: validation reasons, vLLM-shaped classes, declared capabilities."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from attn_di.backend import (
    AttentionBackend,
    AttentionBackendProtocol,
    AttentionType,
    DeviceCapability,
    MultipleOf,
    validate_backend_configuration,
)
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.flex_attention import FlexAttentionBackend
from attn_di.backends.no_attention import NoAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend
from attn_di.exceptions import InvalidBackendTypeError, UnsupportedFeatureError

VALID = {
    "head_size": 128,
    "dtype": torch.bfloat16,
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "use_mla": False,
    "has_sink": False,
    "use_sparse": False,
    "device_capability": None,
}


class VLLMShapedBackend:
    """A test double with vLLM's method names that does not subclass attn_di's base."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8"]

    @staticmethod
    def get_name() -> str:
        return "VLLM_DOUBLE"

    @staticmethod
    def get_impl_cls() -> type[Any]:
        return object

    @staticmethod
    def get_builder_cls() -> type[Any]:
        return object

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: Any,
        attn_type: str = "decoder",
    ) -> list[str]:
        reasons = []
        if dtype not in cls.supported_dtypes:
            reasons.append("dtype not supported")
        if device_capability is not None and device_capability.major < 8:
            reasons.append("compute capability not supported")
        return reasons


def test_valid_configuration_has_no_reasons() -> None:
    """A configuration CPU_ATTN supports yields an empty list."""
    assert CPUAttentionBackend.validate_configuration(**VALID) == []


def test_every_reason_is_reported_in_vllm_wording() -> None:
    """Each unmet requirement yields vLLM's reason string, in vLLM's order."""

    class Narrow(AttentionBackend):
        supported_dtypes: ClassVar[list[str]] = ["float16"]

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return [64]

        @staticmethod
        def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
            return [32]

        @classmethod
        def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
            return capability is not None and capability >= DeviceCapability(9, 0)

    reasons = Narrow.validate_configuration(
        128, "bfloat16", "fp8", 16, True, True, True, DeviceCapability(8, 0), "encoder_only"
    )

    assert reasons == [
        "head_size not supported",
        "dtype not supported",
        "kv_cache_dtype not supported",
        "block_size not supported",
        "MLA not supported",
        "sink setting not supported",
        "sparse not supported",
        "compute capability not supported",
        "attention type encoder_only not supported",
    ]


def test_dtype_by_name_or_torch_dtype() -> None:
    """dtype is accepted as a torch dtype or its name string."""
    assert TorchSDPABackend.supports_dtype("bfloat16")
    assert TorchSDPABackend.supports_dtype(torch.float16)
    assert not TorchSDPABackend.supports_dtype("float64")


def test_block_size_none_means_any() -> None:
    """block_size None validates; multiples of a kernel size validate as in vLLM."""
    assert CPUAttentionBackend.supports_block_size(None)
    assert CPUAttentionBackend.supports_block_size(1)
    assert not CPUAttentionBackend.supports_block_size(0)

    class Sixteen(AttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
            return [MultipleOf(16)]

    assert Sixteen.supports_block_size(32)
    assert not Sixteen.supports_block_size(8)


def test_vllm_shaped_class_passes_through_unchanged() -> None:
    """A class with vLLM's method names is validated by its own method, reasons untouched."""
    assert isinstance(VLLMShapedBackend, AttentionBackendProtocol)

    reasons = validate_backend_configuration(
        VLLMShapedBackend, **{**VALID, "device_capability": DeviceCapability(7, 5)}
    )

    assert reasons == ["dtype not supported", "compute capability not supported"]


def test_attn_di_backends_satisfy_the_protocol() -> None:
    """attn_di's own backends satisfy the structural protocol."""
    for backend_cls in (
        CPUAttentionBackend,
        TorchSDPABackend,
        FlexAttentionBackend,
        NoAttentionBackend,
    ):
        assert isinstance(backend_cls, AttentionBackendProtocol)


def test_non_backend_is_refused() -> None:
    """Something without vLLM's methods is refused with a typed error."""
    with pytest.raises(InvalidBackendTypeError, match="backend_cls must be"):
        validate_backend_configuration(object, **VALID)


@pytest.mark.parametrize(
    ("backend_cls", "name"),
    [
        (CPUAttentionBackend, "CPU_ATTN"),
        (TorchSDPABackend, "TORCH_SDPA"),
        (FlexAttentionBackend, "FLEX_ATTENTION"),
        (NoAttentionBackend, "NO_ATTENTION"),
    ],
)
def test_names_and_cache_shape(backend_cls: type[AttentionBackend], name: str) -> None:
    """Each backend has its registry name and vLLM's FlashAttention cache layout."""
    assert backend_cls.get_name() == name
    shape = backend_cls.get_kv_cache_shape(10, 16, 2, 64)
    assert shape == ((2, 0, 16, 2, 64) if name == "NO_ATTENTION" else (2, 10, 16, 2, 64))
    assert backend_cls.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)


def test_declared_capabilities() -> None:
    """Backends declare what they run: sinks, attention types, backward."""
    assert CPUAttentionBackend.supports_sink()
    assert CPUAttentionBackend.supports_attn_type("encoder_only")
    assert not CPUAttentionBackend.supports_attn_type(AttentionType.ENCODER_DECODER)
    assert not FlexAttentionBackend.supports_backward
    assert CPUAttentionBackend.supports_backward
    assert CPUAttentionBackend.validate_configuration(**{**VALID, "has_sink": True}) == []
    assert NoAttentionBackend.validate_configuration(**{**VALID, "has_sink": True}) == [
        "sink setting not supported"
    ]


def test_validate_configuration_by_position() -> None:
    """validate_configuration takes vLLM's parameters positionally too."""
    reasons = CPUAttentionBackend.validate_configuration(
        64, torch.float64, "auto", None, True, False, False, None, "encoder_decoder"
    )

    assert reasons == [
        "dtype not supported",
        "MLA not supported",
        "attention type encoder_decoder not supported",
    ]


def test_sdpa_refuses_soft_cap_naming_the_feature() -> None:
    """TORCH_SDPA refuses logits_soft_cap with a NotImplementedError naming it."""
    with pytest.raises(NotImplementedError, match="logits_soft_cap") as info:
        TorchSDPABackend.get_impl_cls()(4, 64, 0.125, logits_soft_cap=30.0)
    assert isinstance(info.value, UnsupportedFeatureError)
    assert info.value.hint == "use CPU_ATTN or FLEX_ATTENTION"


def test_unsupported_attention_type_is_refused(backend_cls: type[AttentionBackend]) -> None:
    """Cross-attention (encoder_decoder) is refused by every computing backend."""
    with pytest.raises(UnsupportedFeatureError, match="attention type encoder_decoder"):
        backend_cls.get_impl_cls()(4, 64, 0.125, attn_type="encoder_decoder")


def test_fp8_cache_and_kv_sharing_are_refused(backend_cls: type[AttentionBackend]) -> None:
    """An fp8 cache and KV sharing are refused, naming the feature."""
    impl_cls = backend_cls.get_impl_cls()
    with pytest.raises(UnsupportedFeatureError, match="kv_cache_dtype 'fp8'"):
        impl_cls(4, 64, 0.125, kv_cache_dtype="fp8")
    with pytest.raises(UnsupportedFeatureError, match="kv_sharing_target_layer_name"):
        impl_cls(4, 64, 0.125, kv_sharing_target_layer_name="layers.0.attn")


def test_no_attention_forward_raises() -> None:
    """NO_ATTENTION builds an impl but refuses to run it."""
    impl = NoAttentionBackend.get_impl_cls()(4, 64, 0.125)

    with pytest.raises(UnsupportedFeatureError, match="NO_ATTENTION does not support forward"):
        impl.forward(None, torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), None)  # type: ignore[arg-type]


def test_value_types() -> None:
    """AttentionType parses strings; DeviceCapability orders; MultipleOf accepts multiples."""
    assert AttentionType("encoder_only") is AttentionType.ENCODER_ONLY
    assert AttentionType.DECODER == "decoder"
    assert DeviceCapability(9, 0) > DeviceCapability(8, 9)
    assert DeviceCapability(9, 0).to_int() == 90
    assert MultipleOf(16).accepts(48)
    assert not MultipleOf(16).accepts(8)
