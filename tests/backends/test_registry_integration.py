"""The reference backends are the defaults of their enum members, resolved through the container."""

from __future__ import annotations

import pytest

from attn_di import AttentionBackendEnum, BackendContainer
from attn_di.backend import AttentionBackend, AttentionBackendProtocol, AttentionImpl

OURS = [
    AttentionBackendEnum.CPU_ATTN,
    AttentionBackendEnum.TORCH_SDPA,
    AttentionBackendEnum.FLEX_ATTENTION,
    AttentionBackendEnum.NO_ATTENTION,
]


@pytest.mark.parametrize("member", OURS, ids=lambda m: m.name)
def test_member_resolves_to_its_backend(
    member: AttentionBackendEnum, container: BackendContainer
) -> None:
    """container.backend(member) and member.get_class() give attn_di's class of that name."""
    backend_cls = container.backend(member)
    assert backend_cls is member.get_class()
    assert issubclass(backend_cls, AttentionBackend)
    assert isinstance(backend_cls, AttentionBackendProtocol)
    assert backend_cls.get_name() == member.name
    assert issubclass(backend_cls.get_impl_cls(), AttentionImpl)
    assert container.get_path(member) == member.value
    assert container.source(member) == "default"


@pytest.mark.parametrize("member", OURS[:3], ids=lambda m: m.name)
def test_computing_backends_accept_a_common_decoder_config(
    member: AttentionBackendEnum, container: BackendContainer
) -> None:
    """The CPU backends validate a plain fp32/bf16 decoder layer on the CPU."""
    backend_cls = container.backend(member)
    for dtype in ("float32", "bfloat16"):
        reasons = backend_cls.validate_configuration(
            head_size=128,
            dtype=dtype,
            kv_cache_dtype="auto",
            block_size=16,
            use_mla=False,
            has_sink=False,
            use_sparse=False,
            device_capability=None,
        )
        assert reasons == []
