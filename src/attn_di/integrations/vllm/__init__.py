"""attn_di inside vLLM: one registry on both sides, and attn_di's backends as vLLM backends.

:func:`install` makes vLLM's ``AttentionBackendEnum``, ``MambaAttentionBackendEnum`` and
``register_backend`` (``vllm.v1.attention.backends.registry``) and vLLM's attention selector
(``vllm.v1.attention.selector``) resolve through attn_di's current container
(:func:`attn_di.get_container`): a registration made on either side is seen by both, and
``with attn_di.get_container().override(AttentionBackendEnum.CPU_ATTN, MyBackend):`` (global
or ``local=True``) is what vLLM's ``get_class()``, ``get_path()``, ``is_overridden()`` and
selector answer inside the block, and nothing after it. :func:`uninstall` puts vLLM back as it
was. vLLM installs the bridge itself in every process (front end, engine core, workers)
through the ``vllm.general_plugins`` entry point ``attn_di`` (:func:`load_plugin`); vLLM's
``VLLM_PLUGINS`` allowlist applies and ``ATTN_DI_VLLM_BRIDGE=0`` turns it off. An engine that
would run attention in processes where this process's answer does not hold (an override block
around a TP/PP/DP or multiprocess engine, a bridge those processes will not install) is
refused before they start: :class:`~attn_di.exceptions.BackendNotPropagatedError`; register
instead, or use ``override(..., propagate=True)``.

The defaults rule: each side keeps its own default classes. With nothing registered or
overridden, vLLM's ``AttentionBackendEnum.CPU_ATTN.get_class()`` is vLLM's CPU backend and
``attn_di.get_container().backend(AttentionBackendEnum.CPU_ATTN)`` is attn_di's; a
registration or an override (made on either side) is seen by both.

attn_di's backends as vLLM backends live in :mod:`attn_di.integrations.vllm.backends`
(``CPU_ATTN``, ``TORCH_SDPA``, ``FLEX_ATTENTION``); one line selects one::

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "attn_di.integrations.vllm.backends.CPU_ATTN")

Importing this package needs vLLM (0.32 or later); ``import attn_di`` never imports it.
"""

try:
    import vllm.v1.attention.backends.registry as _registry  # noqa: F401
except ImportError as _exc:
    from attn_di.exceptions import MissingExtraError

    raise MissingExtraError(
        "vllm",
        "attn_di.integrations.vllm",
        hint="vLLM (0.32 or later) goes in an environment of its own, attn_di installed "
        "into it with --no-deps (its transformers extra needs a newer transformers than vLLM "
        "allows): in attn_di's clone `bash scripts/setup-vllm.sh` makes .venv-vllm; the "
        "steps are in docs/guides/vllm.md, section Install",
    ) from _exc

from attn_di.integrations.vllm._bridge import (
    BRIDGE_ENV,
    install,
    is_installed,
    load_plugin,
    uninstall,
)

__all__ = ["BRIDGE_ENV", "install", "is_installed", "load_plugin", "uninstall"]
