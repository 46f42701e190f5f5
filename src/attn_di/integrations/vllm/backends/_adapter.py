"""vLLM v1 backend classes that run attn_di's backends (the contracts of vLLM 0.32's
``vllm/v1/attention/backend.py``: ``AttentionBackend``, ``AttentionMetadataBuilder``,
``AttentionImpl``).

- :class:`AttnDIBackend` answers vLLM's capability questions from the attn_di backend it runs,
  declares the KV layout it reads (:data:`KV_CACHE_LAYOUTS`) and writes the step's keys and
  values inside ``forward`` (``forward_includes_kv_cache_update = True``).
- :class:`AttnDIMetadataBuilder` turns vLLM's ``CommonAttentionMetadata`` into attn_di's
  :class:`~attn_di.backend.AttentionMetadata` once per step and KV-cache group (the layers
  share it), without copying a tensor; the token count is the real one
  (``query_start_loc[-1]``), not vLLM's padded ``num_actual_tokens``.
- Decoder attention runs over vLLM's paged cache; encoder-only attention (vLLM's
  ``EncoderOnlyAttention`` layers of pooling and embedding models, e.g. BERT) runs
  bidirectionally over each step's own keys and values, as vLLM allocates no KV cache for
  those layers. Other attention types (encoder-decoder models) are refused at selection.
- :class:`AttnDIImpl` is built by vLLM's attention layer (positional arguments, mapped here by
  keyword: vLLM's 10th is ``kv_sharing_target_layer_name``, attn_di's is ``sinks``). It
  resolves the attn_di backend through attn_di's container when the layer is built, so an
  attn_di override chooses the implementation inside vLLM too.

The KV cache: vLLM hands each layer a view ``[num_blocks, H_kv, block_size, 2 * D]`` of one
shared buffer (``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``), keys in
``[..., :D]`` and values in ``[..., D:]``, its axes in the negotiated physical order
(``vllm/v1/kv_cache_layout.py``). The impl gives attn_di the same memory as attn_di's logical
``(2, num_blocks, block_size, H_kv, D)`` (a view, never a copy): vLLM's page b stays attn_di's
block b, so vLLM's block zeroing, copy-on-write of prefix-cache blocks and KV connectors keep
working on it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend as VllmAttentionBackend,
)
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

import attn_di
from attn_di.backend import AttentionBackend, AttentionMetadata
from attn_di.backend import MultipleOf as AttnDIMultipleOf
from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError

__all__ = [
    "KV_CACHE_LAYOUTS",
    "AttnDIBackend",
    "AttnDIImpl",
    "AttnDIMetadataBuilder",
    "kv_cache_view",
    "vllm_backend",
]

#: The layouts attn_di's backends read, most preferred first: layer-compact, head-major blocks
#: (``[L, B, H, N, C]``, vLLM's own CPU_ATTN's), then layer-compact, token-major blocks
#: (``[L, B, N, H, C]``) for a worker whose other backends read only those. :func:`kv_cache_view`
#: says what a page holds in each. Head-major first: CPU_ATTN's bfloat16 decode over the
#: head-major interior ran 1.03-1.04x vLLM's op at SmolLM2's decode shape with 30 layers'
#: caches out of cache, against 1.38-1.50x over token-major pages (1 and 2 threads;
#: ``benchmarks/bench_vllm_layouts.py``, docs/benchmarks.md).
KV_CACHE_LAYOUTS: tuple[KVCacheLayout, ...] = (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

# The attention types the adapter runs inside vLLM (vLLM's ``AttentionType`` values):
# decoder self-attention over vLLM's paged cache, and encoder-only self-attention (pooling
# and embedding models such as BERT: bidirectional, over the step's own keys and values; vLLM
# allocates no KV cache for those layers). Encoder and cross attention of encoder-decoder
# models are not run (refused at selection).
_ATTN_TYPES: tuple[str, ...] = (AttentionType.DECODER.value, AttentionType.ENCODER_ONLY.value)


def _attn_type_name(attn_type: Any) -> str:
    """``"decoder"`` for vLLM's ``AttentionType.DECODER`` or the string itself."""
    return str(getattr(attn_type, "value", attn_type))


def kv_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """attn_di's ``(2, num_blocks, block_size, H_kv, D)`` view of vLLM's per-layer cache.

    vLLM hands each layer ``[num_blocks, H_kv, block_size, 2 * D]``; a page (one block of one
    KV head) holds ``block_size * 2 * D`` elements, and what they mean is the backend's, as
    long as the page stays vLLM's unit (block zeroing, copy-on-write of prefix-cache blocks,
    KV connectors copy whole pages or blocks). Two interiors, told apart by the strides:

    * **Head-major pages** (the page's ``[block_size, 2 * D]`` is contiguous: layouts with H
      before N, as ``LBHNC``, and any layout with one KV head): the page's first
      ``block_size * D`` elements are its keys, ``[block_size, D]`` row by row, the rest its
      values, ``[block_size, D]`` likewise. vLLM's own CPU_ATTN splits a page the same way
      (``vllm/v1/attention/backends/cpu_attn.py`` views it as ``[2 * block_size, D]`` and
      chunks it; its ``vec`` ISA then keeps the key half D-major, the value half as here).
      Each head's keys are one contiguous run, which a decode streams.
    * **Token-major pages** (``LBNHC``, ``BLNHC`` with several KV heads: a page's tokens
      ``H_kv * 2 * D`` apart): each token's ``2 * D`` holds its key, then its value
      (``view[0, b, n, h]`` is ``kv_cache[b, h, n, :D]``, ``view[1, b, n, h]`` its ``[D:]``).

    Args:
        kv_cache: vLLM's ``[num_blocks, H_kv, block_size, 2 * D]`` (any strides, last axis
            contiguous).

    Returns:
        A view of the same memory (no copy): what attn_di's backends write through it lands in
        vLLM's pages.
    """
    num_blocks, heads, block_size, content = kv_cache.shape
    size = content // 2
    page_contiguous = kv_cache.stride(3) == 1 and (block_size <= 1 or kv_cache.stride(2) == content)
    if page_contiguous:
        pages = kv_cache.view(num_blocks, heads, 2, block_size, size)  # [B, H, K|V, N, D]
        return pages.permute(2, 0, 3, 1, 4)
    split = kv_cache.view(num_blocks, heads, block_size, 2, size)  # the last axis is contiguous
    return split.permute(3, 0, 2, 1, 4)


class AttnDIBackend(VllmAttentionBackend):  # type: ignore[misc]
    """A vLLM backend that runs the attn_di backend its member resolves to.

    Subclasses name the member (:attr:`member_name`, also what :meth:`get_name` returns, so
    vLLM's ``AttentionBackendEnum[backend.get_name()]`` finds it). The attn_di backend is
    ``attn_di.get_container().backend(member)``, asked when vLLM asks: at selection and when
    a layer is built. Where that is a vLLM-side class (this adapter registered for the member,
    a test's spy wrapping it), attn_di's own default class for the member runs.

    Attributes:
        member_name: the attention member (``"CPU_ATTN"``).
        fixed_backend: an attn_di backend class to run instead of resolving one (set by
            :func:`vllm_backend`).
    """

    member_name: ClassVar[str] = "CPU_ATTN"
    fixed_backend: ClassVar[type[AttentionBackend] | None] = None
    impl_cls: ClassVar[type[AttnDIImpl]]

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "impl_cls" not in vars(cls):
            cls.impl_cls = type(
                f"{cls.__name__}Impl",
                (AttnDIImpl,),
                {"vllm_backend": cls, "__module__": cls.__module__},
            )

    # -- what runs ---------------------------------------------------------------------
    @classmethod
    def attn_di_backend(cls) -> type[AttentionBackend]:
        """The attn_di backend class this vLLM backend runs now (see the class docstring).

        Raises:
            BackendImportError: the member's class does not import.
        """
        if cls.fixed_backend is not None:
            return cls.fixed_backend
        resolved = attn_di.get_container().backend(cls.member_name)
        if (
            isinstance(resolved, type)
            and issubclass(resolved, AttentionBackend)
            and not issubclass(resolved, VllmAttentionBackend)
        ):
            return resolved
        return _attn_di_default(cls.member_name)

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError  # replaced per subclass (a staticmethod, as vLLM calls it)

    @classmethod
    def get_impl_cls(cls) -> type[AttnDIImpl]:
        return cls.impl_cls

    @staticmethod
    def get_builder_cls() -> type[AttnDIMetadataBuilder]:
        return AttnDIMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return KV_CACHE_LAYOUTS

    # -- capabilities: the attn_di backend's answers -----------------------------------
    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        sizes = cls.attn_di_backend().get_supported_kernel_block_sizes()
        return [MultipleOf(s.base) if isinstance(s, AttnDIMultipleOf) else s for s in sizes]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.attn_di_backend().get_supported_head_sizes())

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return bool(cls.attn_di_backend().supports_dtype(dtype))

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return bool(cls.attn_di_backend().supports_kv_cache_dtype(kv_cache_dtype))

    @classmethod
    def supports_sink(cls) -> bool:
        return bool(cls.attn_di_backend().supports_sink())

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return bool(cls.attn_di_backend().supports_sliding_window())

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Decoder attention (over vLLM's paged cache) and encoder-only attention (vLLM's
        ``EncoderOnlyAttention`` layers of pooling models: bidirectional, no KV cache), where
        the attn_di backend runs that type (decoder, encoder-only)."""
        name = _attn_type_name(attn_type)
        return name in _ATTN_TYPES and bool(cls.attn_di_backend().supports_attn_type(name))

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return bool(cls.attn_di_backend().supports_compute_capability(capability))

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool = False,
        use_per_head_quant_scales: bool = False,
        device_capability: Any = None,
        attn_type: str = AttentionType.DECODER,
        **flags: bool,
    ) -> list[str]:
        """attn_di's reasons (:meth:`attn_di.backend.AttentionBackend.validate_configuration`)
        for vLLM's configuration, plus "attention type X not supported" for a type this
        adapter does not run inside vLLM (anything but decoder and encoder-only attention)."""
        backend = cls.attn_di_backend()
        reasons = backend.validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            device_capability,
            str(getattr(attn_type, "value", attn_type)),
            use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales,
            **flags,
        )
        name = _attn_type_name(attn_type)
        if name not in _ATTN_TYPES:
            reason = f"attention type {name} not supported"
            if reason not in reasons:
                reasons.append(reason)
        return list(reasons)


class AttnDIMetadataBuilder(AttentionMetadataBuilder[AttentionMetadata]):  # type: ignore[misc]
    """vLLM's ``CommonAttentionMetadata`` -> attn_di's ``AttentionMetadata``, no copies.

    vLLM calls :meth:`build` once per step for each KV-cache group; every layer of the group
    gets the same object (attn_di's impls check its indices once per step because of that).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttentionMetadata:
        """attn_di's metadata of the step: vLLM's tensors themselves (views, not copies).

        Raises:
            UnsupportedFeatureError: a per-request causal mask (vLLM's prefix-LM batches).
        """
        common = common_attn_metadata
        causal = common.causal
        if isinstance(causal, torch.Tensor):
            raise UnsupportedFeatureError(
                "attn_di's vLLM backends", "per-request causal masks (prefix-LM attention)"
            )
        num_tokens = int(common.query_start_loc_cpu[-1])  # the real tokens, not the padded
        slot_mapping = common.slot_mapping
        if int(slot_mapping.shape[0]) != num_tokens:
            slot_mapping = slot_mapping[:num_tokens]
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=int(common.max_query_len),
            query_start_loc=common.query_start_loc,
            max_seq_len=int(common.max_seq_len),
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=slot_mapping,
            causal=bool(causal),
        )


class AttnDIImpl(AttentionImpl[AttentionMetadata]):  # type: ignore[misc]
    """vLLM's attention impl around one attn_di impl (see the module docstring).

    Arguments are vLLM's (``Attention`` passes the first ten positionally); unknown extra
    keyword options of vLLM's layer are refused, naming them.

    Raises:
        UnsupportedFeatureError, InvalidInputError: from the attn_di impl (a feature its
            backend lacks, bad sizes), or an extra option this adapter does not understand.
    """

    vllm_backend: ClassVar[type[AttnDIBackend]]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **options: Any,
    ) -> None:
        backend = self.vllm_backend.attn_di_backend()
        name = self.vllm_backend.member_name
        if options:
            raise UnsupportedFeatureError(name, f"vLLM layer option(s) {sorted(options)}")
        if sinks is not None and not backend.supports_sink():
            raise UnsupportedFeatureError(name, "sinks", ("CPU_ATTN", "TORCH_SDPA"))
        # Sinks are checked at the first forward: vLLM builds layers before loading weights.
        self.impl = backend.get_impl_cls()(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
            attn_type=str(getattr(attn_type, "value", attn_type)),
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
        )
        self.attn_di_backend = backend
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self._encoder_only = _attn_type_name(attn_type) == AttentionType.ENCODER_ONLY.value
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._sinks_checked = sinks is None
        self._kv_source: torch.Tensor | None = None
        self._kv_view: torch.Tensor | None = None

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the step's keys/values into vLLM's cache and attend, into ``output``.

        Args:
            layer: vLLM's attention layer (passed on).
            query: ``[T, H, D]``; only the first ``attn_metadata.num_actual_tokens`` are real.
            key, value: ``[T, H_kv, D]``.
            kv_cache: vLLM's ``[num_blocks, H_kv, block_size, 2 * D]`` view for this layer
                (ignored for encoder-only layers, which have no cache).
            attn_metadata: the step's metadata from :class:`AttnDIMetadataBuilder`; None
                while vLLM profiles or warms up (nothing is computed then).
            output: ``[T, H, D]`` (or ``[T, H * D]``), written in place.

        Raises:
            UnsupportedFeatureError: fused output quantization was asked for.
            InvalidInputError: the layer's sinks hold NaN or +inf (checked once, at the
                first forward, after vLLM loaded them).
        """
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedFeatureError(
                self.vllm_backend.member_name, "fused output quantization"
            )
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None:
            return output
        if not self._sinks_checked:
            self._attach_sinks()
        if self._encoder_only:
            # vLLM binds no cache to these layers (an empty tensor): attn_di attends over the
            # step's own keys and values, bidirectionally (vLLM's builder set causal=False).
            kv_cache = query.new_empty(0)
        if kv_cache is not self._kv_source:
            self._kv_view = kv_cache_view(kv_cache) if kv_cache.dim() == 4 else kv_cache
            self._kv_source = kv_cache
        num_tokens = attn_metadata.num_actual_tokens
        rows = output.view(output.shape[0], -1)
        if int(query.shape[0]) != num_tokens:
            query, key, value = query[:num_tokens], key[:num_tokens], value[:num_tokens]
            rows = rows[:num_tokens]
        kv_view = self._kv_view
        assert kv_view is not None
        self.impl.forward(layer, query, key, value, kv_view, attn_metadata, rows)
        return output

    def _attach_sinks(self) -> None:
        """Check the loaded sinks (``[num_heads]``, no NaN or +inf) and hand them to attn_di."""
        sinks = self.sinks
        assert sinks is not None
        hint = f"sinks must be [{self.num_heads}] finite logits (-inf: no sink for that head)"
        if tuple(sinks.shape) != (self.num_heads,) or sinks.is_complex():
            raise InvalidInputError(
                "sinks", f"shape {tuple(sinks.shape)} dtype {sinks.dtype}", hint=hint
            )
        values = sinks.detach().double()
        if bool((torch.isnan(values) | (values == math.inf)).any()):
            raise InvalidInputError("sinks", f"holds NaN or +inf: {values.tolist()}", hint=hint)
        self.impl.sinks = sinks
        self._sinks_checked = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.impl!r})"


@functools.cache
def _attn_di_default(member_name: str) -> type[AttentionBackend]:
    """attn_di's own default class for an attention member (a fresh container's answer)."""
    backend: type[AttentionBackend] = attn_di.BackendContainer().backend(member_name)
    return backend


def vllm_backend(member_name: str, backend_cls: type[AttentionBackend]) -> type[AttnDIBackend]:
    """A vLLM backend class that runs ``backend_cls`` (an attn_di-interface backend) for the
    vLLM member ``member_name``; the same class for the same arguments.

    vLLM's selector answers with it when attn_di resolves a member to a class written to
    attn_di's interface (an override with an attn_di backend, for instance).
    """
    key = (member_name, backend_cls)
    made = _MADE.get(key)
    if made is None:
        made = _MADE[key] = _named(
            f"AttnDI_{member_name}_{backend_cls.__qualname__.replace('.', '_')}",
            member_name,
            fixed_backend=backend_cls,
            doc=f"vLLM backend running attn_di's {backend_cls.__module__}."
            f"{backend_cls.__qualname__}.",
        )
    return made


_MADE: dict[tuple[str, type[Any]], type[AttnDIBackend]] = {}


def _named(
    class_name: str,
    member_name: str,
    *,
    fixed_backend: type[AttentionBackend] | None = None,
    doc: str,
    module: str = __name__,
) -> type[AttnDIBackend]:
    """An :class:`AttnDIBackend` subclass for ``member_name``."""
    get_name = staticmethod(lambda: member_name)
    namespace: dict[str, Any] = {
        "member_name": member_name,
        "fixed_backend": fixed_backend,
        "get_name": get_name,
        "__doc__": doc,
        "__module__": module,
        "__qualname__": class_name,
    }
    return type(class_name, (AttnDIBackend,), namespace)
