"""attn_di's vLLM backends without an engine: vLLM's own cache views, metadata and impl calls.

The caches are made by vLLM's ``create_kv_cache_views`` over one NaN-filled buffer of two
layers (layer-compact LBHNC and LBNHC, what the backends declare, and block-outermost
BLNHC), the way vLLM's CPU worker allocates them; only the slots a batch covers are written.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    register_backend,
)
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

import attn_di
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend
from attn_di.exceptions import (
    BackendRejectedError,
    InvalidInputError,
    UnsupportedFeatureError,
)
from attn_di.integrations.vllm.backends import (
    CPU_ATTN,
    FLEX_ATTENTION,
    KV_CACHE_LAYOUTS,
    TORCH_SDPA,
    AttnDIMetadataBuilder,
    kv_cache_view,
)
from tests.backends.reference import Options, make_batch, reference_attention

BACKENDS = [CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION]


def vllm_caches(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Two layers' ``[num_blocks, H_kv, block_size, 2 * D]`` views of one NaN-filled buffer,
    made by vLLM's own ``create_kv_cache_views`` in ``layout``."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    layers = ["layer.0", "layer.1"]
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)  # bytes, [L, B, ...]
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * len(layers),
        layers=layers,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    raw = torch.full((tensor.size // dtype.itemsize,), math.nan, dtype=dtype).view(torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def common_metadata(metadata: Any, padded_tokens: int) -> CommonAttentionMetadata:
    """vLLM's per-step metadata for an attn_di batch, padded as vLLM pads a step."""
    slots = torch.cat([metadata.slot_mapping, torch.full((padded_tokens,), -1, dtype=torch.int64)])
    return CommonAttentionMetadata(
        query_start_loc=metadata.query_start_loc,
        query_start_loc_cpu=metadata.query_start_loc.clone(),
        seq_lens=metadata.seq_lens,
        num_reqs=metadata.num_seqs,
        num_actual_tokens=metadata.num_actual_tokens + padded_tokens,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        block_table_tensor=metadata.block_table,
        slot_mapping=slots,
    )


def builder(block_size: int) -> AttnDIMetadataBuilder:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32
    )
    return AttnDIMetadataBuilder(spec, ["layer.0"], VllmConfig(), torch.device("cpu"))


def _head_major(layout: KVCacheLayout) -> bool:
    """Whether ``layout`` keeps a block's heads outside its tokens (H before N in memory)."""
    return layout.value.index(2) < layout.value.index(3)


def _page_entry(
    cache: torch.Tensor, layout: KVCacheLayout, block: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[H_kv, D]`` key and value of slot ``(block, offset)`` read from vLLM's raw pages
    (not through ``kv_cache_view``): on a contiguous page (a head-major layout, or one KV
    head in any layout) the offset-th D-row of each head's first half and of its second; on
    a token-major page the token's ``[:D]`` and ``[D:]``."""
    _, kv_heads, block_size, content = cache.shape
    size = content // 2
    if _head_major(layout) or kv_heads == 1:
        pages = cache[block].reshape(cache.shape[1], -1)  # [H_kv, N * 2D], contiguous pages
        keys = pages[:, offset * size : (offset + 1) * size]
        values = pages[:, (block_size + offset) * size : (block_size + offset + 1) * size]
        return keys, values
    row = cache[block, :, offset]  # [H_kv, 2D]
    return row[:, :size], row[:, size:]


def test_the_cache_view_is_vllms_memory_page_for_page() -> None:
    """attn_di's (2, B, N, H, D) view of a vLLM layer cache is the same memory, page for page,
    in every layout: on a head-major page (H before N) [0, b, n, h] is the n-th D-row of page
    (b, h)'s first half and [1, b, n, h] of its second; on a token-major page vLLM's
    [b, h, n, :D] and [b, h, n, D:]. vLLM's zeroing of a block zeroes the view's block."""
    for layout in KVCacheLayout:
        cache = vllm_caches(layout, 5, 16, 3, 8, torch.float32)[1]
        view = kv_cache_view(cache)
        assert view.shape == (2, 5, 16, 3, 8)
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        view[0, 4, 7, 2] = 1.0
        view[1, 4, 7, 2] = 2.0
        if _head_major(layout):
            page = cache[4, 2].reshape(-1)  # contiguous: a view, no copy
            assert page.data_ptr() == cache[4, 2, 0].data_ptr()
            assert int(page.isnan().sum()) == 16 * 16 - 16
        key, value = _page_entry(cache, layout, 4, 7)
        assert torch.equal(key[2], torch.full((8,), 1.0))
        assert torch.equal(value[2], torch.full((8,), 2.0))
        assert int(cache.isnan().logical_not().sum()) == 16
        cache[3].zero_()  # vLLM's block zeroing of block 3
        assert bool((view[:, 3] == 0).all())
        assert bool(view[:, 2].isnan().all())


def test_head_major_pages_split_as_vllms_cpu_attn_splits_them() -> None:
    """On LBHNC pages the view's key and value halves are vLLM's own CPU_ATTN's: what vLLM's
    ``cpu_attn_reshape_and_cache`` (its ``vec`` ISA, float32) writes at a slot is the view's
    value there, and its key there once the page's key half (vLLM's D-major) is transposed."""
    from vllm import _custom_ops as vllm_ops

    gen = torch.Generator().manual_seed(3)
    cache = vllm_caches(KVCacheLayout.LBHNC, 4, 32, 2, 32, torch.float32)[0]
    slots = torch.tensor([0, 5, 31, 32, 70, 127])
    keys = torch.randn(6, 2, 32, generator=gen)
    values = torch.randn(6, 2, 32, generator=gen)
    pages = cache.view(4, 2, 64, 32)  # vLLM's [B, H, 2N, D], as its CPU_ATTN views it
    key_cache, value_cache = pages.chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec")
    view = kv_cache_view(cache)
    blocks, offsets = slots // 32, slots % 32
    assert torch.equal(view[1, blocks, offsets], values)
    key_half = view[0].permute(0, 2, 1, 3)  # [B, H, N, D], row-major in memory
    assert key_half[0, 0].is_contiguous()
    vllm_keys = key_half.reshape(4, 2, 32, 32).transpose(-1, -2)  # read as vLLM's [D, N]
    assert torch.equal(vllm_keys[blocks, :, offsets], keys)


def test_the_builder_shares_vllms_tensors_and_counts_real_tokens() -> None:
    """No copies: the metadata holds vLLM's tensors; num_actual_tokens is query_start_loc[-1],
    not vLLM's padded count, and the slot mapping is cut to it."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [5, 1, 3], [5, 9, 20], 16, torch.float32)
    common = common_metadata(batch.metadata, padded_tokens=4)
    metadata = builder(16).build(0, common)
    assert metadata.num_actual_tokens == 9
    assert metadata.query_start_loc is common.query_start_loc
    assert metadata.seq_lens is common.seq_lens
    assert metadata.block_table is common.block_table_tensor
    assert metadata.slot_mapping.data_ptr() == common.slot_mapping.data_ptr()
    assert metadata.slot_mapping.shape == (9,)
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.causal) == (5, 20, True)


def test_a_per_request_causal_mask_is_refused() -> None:
    """vLLM's prefix-LM batches (a causal tensor) are refused, naming the feature."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    common = common_metadata(make_batch(opts, [2], [2], 16, torch.float32).metadata, 0)
    common.causal = torch.tensor([True])
    with pytest.raises(UnsupportedFeatureError, match="per-request causal masks"):
        builder(16).build(0, common)


CASES = [
    pytest.param(Options(num_heads=8, num_kv_heads=2, head_size=64), id="gqa"),
    pytest.param(Options(num_heads=4, num_kv_heads=4, head_size=32, sliding_window=7), id="window"),
    pytest.param(
        Options(num_heads=4, num_kv_heads=2, head_size=64, logits_soft_cap=30.0), id="soft-cap"
    ),
    pytest.param(
        Options(
            num_heads=4,
            num_kv_heads=1,
            head_size=64,
            sinks=torch.tensor([0.5, -1.0, 2.0, -math.inf]),
        ),
        id="sinks",
    ),
]


RUNS = [
    pytest.param(backend, case.values[0], id=f"{backend.get_name().lower()}-{case.id}")
    for backend in (CPU_ATTN, TORCH_SDPA)
    for case in CASES
    if not (backend is TORCH_SDPA and case.id == "soft-cap")  # refused: see below
]


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize(
    "layout",
    [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC],
    ids=lambda layout: layout.name,
)
@pytest.mark.parametrize(("vllm_backend", "opts"), RUNS)
def test_forward_on_vllms_cache_matches_the_reference(
    vllm_backend: Any, opts: Options, block_size: int, layout: KVCacheLayout
) -> None:
    """Prefill, chunked prefill and decode rows in one step on a vLLM cache view that is NaN
    outside the written slots: the float64 reference's output, the step's keys and values in
    vLLM's pages at their slots, padding rows left alone, the other layer untouched."""
    batch = make_batch(
        opts, [7, 1, 3, 1], [7, 40, 150, 129], block_size, torch.float32, pad_tokens=2
    )
    num_blocks = int(batch.kv_cache.shape[1])
    caches = vllm_caches(
        layout, num_blocks, block_size, opts.num_kv_heads, opts.head_size, torch.float32
    )
    view = kv_cache_view(caches[1])
    view.copy_(batch.kv_cache)  # the cached prefixes (NaN elsewhere)
    other_before = caches[0].clone()
    metadata = builder(block_size).build(0, common_metadata(batch.metadata, 0))
    metadata.slot_mapping = batch.metadata.slot_mapping  # with the 2 padding slots (-1)
    impl = vllm_backend.get_impl_cls()(
        opts.num_heads, opts.head_size, opts.scale, opts.num_kv_heads, None,
        opts.sliding_window, "auto", opts.logits_soft_cap, "decoder", None, sinks=opts.sinks,
    )  # fmt: skip
    output = torch.full((batch.query.shape[0], opts.num_heads, opts.head_size), -7.0)
    impl.forward(None, batch.query, batch.key, batch.value, caches[1], metadata, output=output)
    real = metadata.num_actual_tokens
    expected = reference_attention(opts, batch)
    torch.testing.assert_close(
        output[:real].reshape(real, -1).double(), expected, atol=2e-4, rtol=2e-4
    )
    assert bool((output[real:] == -7.0).all())
    slots = metadata.slot_mapping[:real]
    blocks, offsets = slots // block_size, slots % block_size
    for token in range(real):
        key, value = _page_entry(caches[1], layout, int(blocks[token]), int(offsets[token]))
        assert torch.equal(key, batch.key[token])
        assert torch.equal(value, batch.value[token])
    assert torch.equal(caches[0].isnan(), other_before.isnan())


def test_flex_attention_on_vllms_cache_matches_the_reference() -> None:
    """FLEX_ATTENTION (torch's flex_attention, slow in eager mode: one small case) gives the
    reference's output on vLLM's cache view."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=32, sliding_window=9)
    batch = make_batch(opts, [5, 1], [5, 37], 16, torch.float32)
    caches = vllm_caches(
        KVCacheLayout.LBNHC, int(batch.kv_cache.shape[1]), 16, 2, 32, torch.float32
    )
    kv_cache_view(caches[0]).copy_(batch.kv_cache)
    metadata = builder(16).build(0, common_metadata(batch.metadata, 0))
    impl = FLEX_ATTENTION.get_impl_cls()(
        4, 32, opts.scale, 2, None, 9, "auto", None, "decoder", None
    )
    output = torch.empty(6, 4, 32)
    impl.forward(None, batch.query, batch.key, batch.value, caches[0], metadata, output=output)
    expected = reference_attention(opts, batch)
    torch.testing.assert_close(output.reshape(6, -1).double(), expected, atol=2e-4, rtol=2e-4)


def test_a_layer_feature_the_backend_lacks_is_refused_when_the_layer_is_built() -> None:
    """attn_di's TORCH_SDPA has no soft cap: vLLM's layer construction raises attn_di's
    UnsupportedFeatureError naming the feature and the backends that have it."""
    with pytest.raises(
        UnsupportedFeatureError, match="TORCH_SDPA does not support logits_soft_cap"
    ):
        TORCH_SDPA.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto", 30.0, "decoder", None)


def test_impl_arguments_are_mapped_by_keyword() -> None:
    """vLLM's layer passes ten positional arguments, the 10th kv_sharing_target_layer_name
    (attn_di's 10th is sinks): it reaches attn_di's keyword, which refuses cache sharing."""
    impl_cls = CPU_ATTN.get_impl_cls()
    impl = impl_cls(8, 64, 0.125, 2, None, 4096, "auto", 50.0, "decoder", None)
    assert (impl.impl.sliding_window, impl.impl.logits_soft_cap, impl.impl.sinks) == (
        4096,
        50.0,
        None,
    )
    with pytest.raises(UnsupportedFeatureError, match="kv_sharing_target_layer_name"):
        impl_cls(8, 64, 0.125, 2, None, None, "auto", None, "decoder", "model.layers.0.attn")
    with pytest.raises(UnsupportedFeatureError, match="block_m"):
        impl_cls(8, 64, 0.125, 2, None, None, "auto", None, "decoder", None, block_m=64)


def test_sinks_are_checked_when_used() -> None:
    """vLLM builds layers before loading weights: uninitialised (NaN) sinks are accepted at
    construction; the first forward checks the loaded values."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [3], [3], 16, torch.float32)
    sinks = torch.full((4,), math.nan)
    impl = CPU_ATTN.get_impl_cls()(
        4, 64, 0.125, 2, None, None, "auto", None, "decoder", None, sinks=sinks
    )
    caches = vllm_caches(
        KVCacheLayout.LBNHC, int(batch.kv_cache.shape[1]), 16, 2, 64, torch.float32
    )
    metadata = builder(16).build(0, common_metadata(batch.metadata, 0))
    output = torch.empty(3, 4, 64)
    with pytest.raises(InvalidInputError, match="sinks: holds NaN or \\+inf"):
        impl.forward(None, batch.query, batch.key, batch.value, caches[0], metadata, output=output)
    sinks.copy_(torch.tensor([0.0, 1.0, -math.inf, 2.0]))  # what loading the weights does
    impl.forward(None, batch.query, batch.key, batch.value, caches[0], metadata, output=output)
    assert impl.impl.sinks is sinks
    assert bool(output.isfinite().all())


def test_warm_up_without_metadata_computes_nothing() -> None:
    """vLLM's profiling run passes attn_metadata=None: the output comes back untouched."""
    impl = CPU_ATTN.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto", None, "decoder", None)
    output = torch.full((2, 4, 64), 3.0)
    query = torch.zeros(2, 4, 64)
    assert (
        impl.forward(None, query, query[:, :2], query[:, :2], torch.tensor([]), None, output)
        is output
    )
    assert bool((output == 3.0).all())


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.get_name())
def test_capabilities_are_attn_dis(backend: Any) -> None:
    """The layout it reads, vLLM's default block size 128, fp32/bf16, decoder and
    encoder-only attention, and attn_di's reasons for what it cannot run."""
    assert backend.supported_kv_cache_layouts() == KV_CACHE_LAYOUTS
    assert KV_CACHE_LAYOUTS == (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
    assert backend.forward_includes_kv_cache_update
    assert backend.supports_block_size(128)
    assert backend.supports_block_size(16)
    ok: dict[str, Any] = dict(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128,
        use_mla=False, has_sink=False, use_sparse=False, device_capability=None,
        attn_type="decoder",
    )  # fmt: skip
    assert backend.validate_configuration(**ok) == []
    assert backend.validate_configuration(**{**ok, "kv_cache_dtype": "fp8"}) == [
        "kv_cache_dtype not supported"
    ]
    assert "DCP not supported" in backend.validate_configuration(**ok, use_dcp=True)
    assert backend.validate_configuration(**{**ok, "attn_type": "encoder_only"}) == []
    assert backend.supports_attn_type("encoder_only")
    for refused in ("encoder", "encoder_decoder"):  # encoder-decoder models: not run
        assert f"attention type {refused} not supported" in backend.validate_configuration(
            **{**ok, "attn_type": refused}
        )
        assert not backend.supports_attn_type(refused)
    assert AttentionBackendEnum[backend.get_name()].name == backend.get_name()


def test_the_selector_refuses_what_attn_di_cannot_run() -> None:
    """With attn_di's CPU_ATTN registered, vLLM's selector refuses an fp8 KV cache at
    selection, naming the member, attn_di's reason and the fix (no forward ever runs)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, "attn_di.integrations.vllm.backends.CPU_ATTN")
    with set_current_vllm_config(VllmConfig()):
        assert get_attn_backend(64, torch.float32, None) is CPU_ATTN
        with pytest.raises(BackendRejectedError) as caught:
            get_attn_backend(64, torch.float32, "fp8")
    text = str(caught.value)
    for part in ("attention backend CPU_ATTN", "kv_cache_dtype not supported"):
        assert part in text
    for part in ("Hint: use kv_cache_dtype='auto'", "clear_override()"):
        assert part in text


class _NoHalf(TorchSDPABackend):
    """An attn_di backend that declares float32 and bfloat16 only."""

    supported_dtypes = ("float32", "bfloat16")


def test_a_refused_dtype_is_answered_with_the_dtypes_the_backend_declares() -> None:
    """The hint lists the refusing backend's own dtypes (never one it refuses)."""
    container = attn_di.get_container()
    with (
        set_current_vllm_config(VllmConfig()),
        container.override(AttentionBackendEnum.CPU_ATTN, _NoHalf),
        pytest.raises(BackendRejectedError) as caught,
    ):
        get_attn_backend(64, torch.float16, None)
    assert caught.value.reasons == ["dtype not supported"]
    assert caught.value.hint is not None
    assert caught.value.hint.startswith(
        "use dtype='float32' or 'bfloat16' (what TORCH_SDPA declares); or let vLLM use"
    )
    assert "float16'" not in caught.value.hint.replace("bfloat16'", "")


def test_the_selector_follows_overrides_after_caching() -> None:
    """vLLM's selector caches its answers; an override entered later is still seen, an
    attn_di-interface class comes back as a vLLM backend running it, and after the block
    the cached answer is exactly the previous one."""
    register_backend(AttentionBackendEnum.CPU_ATTN, "attn_di.integrations.vllm.backends.CPU_ATTN")
    container = attn_di.get_container()
    with set_current_vllm_config(VllmConfig()):
        assert get_attn_backend(64, torch.float32, None) is CPU_ATTN
        with container.override(AttentionBackendEnum.CPU_ATTN, TorchSDPABackend):
            wrapped = get_attn_backend(64, torch.float32, None)
            assert wrapped.attn_di_backend() is TorchSDPABackend
            assert wrapped.get_name() == "CPU_ATTN"
        with container.override(AttentionBackendEnum.CPU_ATTN, TORCH_SDPA, local=True):
            assert get_attn_backend(64, torch.float32, None) is TORCH_SDPA
        assert get_attn_backend(64, torch.float32, None) is CPU_ATTN
    AttentionBackendEnum.CPU_ATTN.clear_override()
    with set_current_vllm_config(VllmConfig()):
        assert get_attn_backend(64, torch.float32, None).__module__ == (
            "vllm.v1.attention.backends.cpu_attn"
        )


def test_cpu_attn_runs_what_the_member_resolves_to_at_build() -> None:
    """The adapter's impl runs attn_di's CPU_ATTN by default and the override's class when an
    attn_di override is active while the layer is built."""
    assert CPU_ATTN.attn_di_backend() is CPUAttentionBackend
    with attn_di.get_container().override(attn_di.AttentionBackendEnum.CPU_ATTN, TorchSDPABackend):
        impl = CPU_ATTN.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto", None, "decoder", None)
    assert impl.attn_di_backend is TorchSDPABackend
    assert np.isclose(impl.scale, 0.125)
