"""The backend interface must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_backend_interface_does_not_import_torch() -> None:
    """Importing attn_di and attn_di.backend leaves torch unimported."""
    code = "import attn_di, attn_di.backend, sys; assert 'torch' not in sys.modules"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_backend_all_is_pinned() -> None:
    """attn_di.backend exports exactly its documented, sorted names."""
    import attn_di.backend

    assert attn_di.backend.__all__ == [
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
