"""The backend class interface: a faithful subset of vLLM's ``AttentionBackend``.

Source: vLLM's ``vllm/attention/backends/abstract.py`` (v0.11+), rewritten. A backend is a
class used through its class methods; it is never instantiated. Nothing here imports torch:
dtypes may be torch dtypes or their names (``torch.bfloat16`` or ``"bfloat16"``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from attn_di.backend._types import AttentionType, DeviceCapability, MultipleOf
from attn_di.exceptions import InvalidBackendTypeError, InvalidInputError

if TYPE_CHECKING:
    from attn_di.backend._impl import AttentionImpl
    from attn_di.backend._metadata import AttentionMetadataBuilder

__all__ = [
    "AttentionBackend",
    "AttentionBackendProtocol",
    "dtype_name",
    "validate_backend_configuration",
]

_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
}


def dtype_name(dtype: object) -> str:
    """The canonical name of a dtype: ``"bfloat16"`` for ``torch.bfloat16`` or ``"bf16"``.

    Args:
        dtype: a ``torch.dtype`` or a name: ``"bfloat16"``, ``"torch.float16"``, ``"half"``.

    Returns:
        The torch attribute name of the dtype, without the ``torch.`` prefix.
    """
    name = str(dtype).strip().removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(name, name)


def _cache_dim(argument: str, value: object, minimum: int, example: str) -> int:
    """``value`` as an int (``operator.index``, not bool) of at least ``minimum``."""
    index = None
    if not isinstance(value, bool):
        try:
            index = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            index = None
    kind = "a non-negative int" if minimum == 0 else "a positive int"
    if index is None or index < minimum:
        raise InvalidInputError(
            argument,
            f"must be {kind}, got {value!r} ({type(value).__name__})",
            hint=f"e.g. {example}",
        )
    return index


@runtime_checkable
class AttentionBackendProtocol(Protocol):
    """What the selector needs from a backend class, matched structurally.

    vLLM's own backend classes satisfy it, as do subclasses of :class:`AttentionBackend`;
    ``isinstance(backend_cls, AttentionBackendProtocol)`` checks the class object itself.
    """

    supported_dtypes: ClassVar[Sequence[Any]]
    supported_kv_cache_dtypes: ClassVar[Sequence[str]]

    def get_name(self) -> str: ...

    def get_impl_cls(self) -> type[Any]: ...

    def get_builder_cls(self) -> type[Any]: ...

    def get_kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]: ...

    def validate_configuration(
        self,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: Any,
        attn_type: str = "decoder",
    ) -> list[str]: ...


def validate_backend_configuration(
    backend_cls: object,
    head_size: int,
    dtype: Any,
    kv_cache_dtype: str | None,
    block_size: int | None,
    use_mla: bool,
    has_sink: bool,
    use_sparse: bool,
    device_capability: Any,
    attn_type: str = "decoder",
) -> list[str]:
    """Ask any vLLM-shaped backend class whether it can run a configuration.

    The class's own ``validate_configuration`` is called by keyword and its reasons are
    returned unchanged, so vLLM's backend classes work as well as attn_di's.

    Args:
        backend_cls: a class satisfying :class:`AttentionBackendProtocol`.
        head_size .. attn_type: as :meth:`AttentionBackend.validate_configuration`.

    Returns:
        One reason string per unmet requirement; empty when the configuration is valid.

    Raises:
        InvalidBackendTypeError: ``backend_cls`` lacks the protocol's methods.
    """
    if not isinstance(backend_cls, AttentionBackendProtocol):
        raise InvalidBackendTypeError(
            "backend_cls", backend_cls, "a class with vLLM's AttentionBackend methods"
        )
    return list(
        backend_cls.validate_configuration(
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            use_mla=use_mla,
            has_sink=has_sink,
            use_sparse=use_sparse,
            device_capability=device_capability,
            attn_type=attn_type,
        )
    )


class AttentionBackend:
    """Base class of attn_di's backends; every method is a class or static method.

    Subclasses set the class attributes and override ``get_name``, ``get_impl_cls`` and
    whatever capability they differ on. The defaults follow vLLM's: fp16/bf16, ``"auto"``
    KV cache only, any head size, any block size, decoder attention only, no MLA, sinks or
    sparsity, the CPU only (see :meth:`supports_compute_capability`).

    Attributes:
        supported_dtypes: model dtypes (torch dtypes or their names).
        supported_kv_cache_dtypes: KV-cache dtype strings (``"auto"`` = the model dtype).
        supported_attn_types: attention types the impl can run.
        supports_backward: whether autograd through ``forward`` is supported.
        supported_devices: device types (``"cpu"``, ``"cuda"``) the impl runs on.
    """

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[Sequence[Any]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[Sequence[str]] = ("auto",)
    supported_attn_types: ClassVar[Sequence[str]] = (AttentionType.DECODER,)
    supports_backward: ClassVar[bool] = False
    supported_devices: ClassVar[Sequence[str]] = ("cpu",)

    @staticmethod
    def get_name() -> str:
        """The backend's registry name, e.g. ``"CPU_ATTN"``."""
        raise NotImplementedError

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The :class:`AttentionImpl` subclass that runs this backend."""
        raise NotImplementedError

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The metadata builder class (attn_di's common builder by default)."""
        from attn_di.backend._metadata import AttentionMetadataBuilder

        return AttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """The paged KV cache's shape: ``(2, num_blocks, block_size, num_kv_heads, head_size)``.

        Index 0 of the first axis holds keys, 1 values (vLLM's FlashAttention layout).

        Raises:
            InvalidInputError: a negative ``num_blocks``, or a ``block_size``,
                ``num_kv_heads`` or ``head_size`` that is not a positive int.
        """
        return (
            2,
            _cache_dim("num_blocks", num_blocks, 0, "num_blocks=1024"),
            _cache_dim("block_size", block_size, 1, "block_size=16"),
            _cache_dim("num_kv_heads", num_kv_heads, 1, "num_kv_heads=8"),
            _cache_dim("head_size", head_size, 1, "head_size=128"),
        )

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """The physical order of the KV cache's axes; the identity (the shape is the layout)."""
        return (0, 1, 2, 3, 4)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        """Block sizes the kernel accepts: ints or :class:`MultipleOf` rules (any by default)."""
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Head sizes the kernel accepts; an empty list means any."""
        return []

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        """``(module, qualname)`` of the backend class."""
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether ``head_size`` is in :meth:`get_supported_head_sizes` (or that list is empty)."""
        supported = cls.get_supported_head_sizes()
        return not supported or head_size in supported

    @classmethod
    def supports_dtype(cls, dtype: Any) -> bool:
        """Whether the model dtype (torch dtype or name) is in :attr:`supported_dtypes`."""
        return dtype_name(dtype) in {dtype_name(d) for d in cls.supported_dtypes}

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        """Whether the KV-cache dtype string is supported; None means "don't care"."""
        if kv_cache_dtype is None:
            return True
        return not cls.supported_kv_cache_dtypes or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Whether the cache block size suits the kernel; None means any.

        As in vLLM, a block size is accepted when it is a multiple of one of
        :meth:`get_supported_kernel_block_sizes` (ints and :class:`MultipleOf` alike),
        so a cache block can be split into kernel blocks.
        """
        if block_size is None:
            return True
        if block_size <= 0:
            return False
        kernel_sizes = cls.get_supported_kernel_block_sizes()
        if not kernel_sizes:
            return True
        for size in kernel_sizes:
            base = size.base if isinstance(size, MultipleOf) else size
            if block_size % base == 0:
                return True
        return False

    @classmethod
    def is_mla(cls) -> bool:
        """Whether this is a multi-head latent attention backend (never, in attn_di)."""
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        """Whether the impl accepts per-head attention sinks."""
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        """Whether this is a sparse attention backend (never, in attn_di)."""
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Whether the impl runs sliding-window layers (its ``supports_sliding_window``)."""
        try:
            impl_cls = cls.get_impl_cls()
        except NotImplementedError:
            return False
        return bool(getattr(impl_cls, "supports_sliding_window", False))

    @classmethod
    def supports_dcp(cls) -> bool:
        """Whether the impl runs under decode context parallelism (never, in attn_di)."""
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Whether the impl runs ``attn_type`` (an :class:`AttentionType` or its string)."""
        return attn_type in cls.supported_attn_types

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """Whether the backend runs on a device of this compute capability.

        vLLM's ``validate_configuration`` has no device parameter: the capability is the device
        signal. ``None`` means the CPU (needs ``"cpu"`` in :attr:`supported_devices`); any
        capability means a GPU (needs ``"cuda"`` or ``"rocm"``), every capability by default.
        """
        if capability is None:
            return "cpu" in cls.supported_devices
        return bool({"cuda", "rocm"} & set(cls.supported_devices))

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: DeviceCapability | None,
    ) -> str | None:
        """A reason the combination fails even though each setting alone is fine, or None."""
        return None

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: Any,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: DeviceCapability | None,
        attn_type: str = "decoder",
        *,
        use_mm_prefix: bool = False,
        use_per_head_quant_scales: bool = False,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration; empty when it can.

        Reason strings are vLLM's, in vLLM's order (``validate_configuration`` in
        ``vllm/attention/backends/abstract.py``; the keyword-only flags are those vLLM 0.32
        added in ``vllm/v1/attention/backend.py``, so
        ``validate_configuration(device_capability=cap, **vllm_selector_config._asdict())``
        works as it does for vLLM's own backends). attn_di's backends implement none of those
        features but sliding windows, KV connectors and adaptive verification: a flag that is
        set adds vLLM's reason for it.

        Args:
            head_size: the attention head size.
            dtype: the model dtype, a torch dtype or its name (``"bfloat16"``).
            kv_cache_dtype: the KV-cache dtype string (``"auto"``), or None for any.
            block_size: the KV-cache block size in tokens, or None for any.
            use_mla: whether the model uses multi-head latent attention.
            has_sink: whether the layer has attention sinks.
            use_sparse: whether the layer uses sparse attention.
            device_capability: the device's compute capability (None on CPU).
            attn_type: an :class:`AttentionType` or its string.
            use_mm_prefix: multimodal prefix tokens attend bidirectionally.
            use_per_head_quant_scales: per-head quantization scales of the KV cache.
            has_sliding_window: the layer has a sliding window ("sliding window not
                supported" unless :meth:`supports_sliding_window`).
            use_non_causal: a non-causal decoder (prefix LM).
            use_batch_invariant: batch-invariant kernels are asked for.
            use_kv_connector: a KV connector moves the cache (supported).
            use_pcp: prefill context parallelism.
            use_adaptive_verification: speculative verification with device-trimmed query
                lengths (supported: attn_di reads query lengths from ``query_start_loc``).
            use_dcp: decode context parallelism ("DCP not supported" unless
                :meth:`supports_dcp`).
            use_rswa: reference sliding-window attention (R-SWA).

        Returns:
            Reason strings such as ``"head_size not supported"``.
        """
        reasons: list[str] = []
        if not cls.supports_head_size(head_size):
            reasons.append("head_size not supported")
        if not cls.supports_dtype(dtype):
            reasons.append("dtype not supported")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append("kv_cache_dtype not supported")
        if not cls.supports_block_size(block_size):
            reasons.append("block_size not supported")
        if use_mm_prefix:
            reasons.append("partial multimodal token full attention not supported")
        if use_mla != cls.is_mla():
            reasons.append("MLA not supported" if use_mla else "non-MLA not supported")
        if has_sink and not cls.supports_sink():
            reasons.append("sink setting not supported")
        if use_sparse != cls.is_sparse():
            reasons.append("sparse not supported" if use_sparse else "non-sparse not supported")
        if use_per_head_quant_scales:
            reasons.append("per-head quant scales not supported")
        if not cls.supports_compute_capability(device_capability):
            reasons.append("compute capability not supported")
        if not cls.supports_attn_type(attn_type):
            reasons.append(f"attention type {attn_type} not supported")
        if has_sliding_window and not cls.supports_sliding_window():
            reasons.append("sliding window not supported")
        unsupported = (
            (use_rswa, "R-SWA not supported"),
            (use_non_causal, "non-causal attention not supported"),
            (use_batch_invariant, "batch invariance not supported"),
            (use_pcp, "PCP not supported"),
            (use_dcp and not cls.supports_dcp(), "DCP not supported"),
        )
        reasons.extend(reason for flag, reason in unsupported if flag)
        del use_kv_connector, use_adaptive_verification  # supported by every attn_di backend
        combination = cls.supports_combination(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            device_capability,
        )
        if combination is not None:
            reasons.append(combination)
        return reasons
