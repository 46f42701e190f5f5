"""A backend module that imports in the test's process but not in the vLLM process that
``ATTN_DI_TEST_MISSING_IN`` names (``EngineCore``, ``VllmWorker-1``): there it raises
``ModuleNotFoundError`` for a dependency, as a package installed on the driver's machine only
would."""

from __future__ import annotations

from tests.vllm.worker_backends import MISSING_MODULE, missing_here

if missing_here():
    raise ModuleNotFoundError(f"No module named {MISSING_MODULE!r}", name=MISSING_MODULE)

from attn_di.backends.torch_sdpa import TorchSDPABackend


class Backend(TorchSDPABackend):
    """attn_di's TORCH_SDPA, where this module imports."""
