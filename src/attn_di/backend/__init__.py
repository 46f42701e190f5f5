"""The attention backend interface, importable without torch.

A faithful subset of vLLM's ``AttentionBackend`` / ``AttentionImpl`` / metadata interface:
backends subclass :class:`AttentionBackend` (or just match :class:`AttentionBackendProtocol`),
their impls subclass :class:`AttentionImpl`, and a batch is described by
:class:`AttentionMetadata` made with :class:`AttentionMetadataBuilder`.
"""

from attn_di.backend._backend import (
    AttentionBackend,
    AttentionBackendProtocol,
    dtype_name,
    validate_backend_configuration,
)
from attn_di.backend._impl import AttentionImpl
from attn_di.backend._metadata import AttentionMetadata, AttentionMetadataBuilder
from attn_di.backend._types import AttentionType, DeviceCapability, MultipleOf

__all__ = [
    "AttentionBackend",
    "AttentionBackendProtocol",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "DeviceCapability",
    "MultipleOf",
    "dtype_name",
    "validate_backend_configuration",
]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
