"""vLLM's attention selector while the bridge is installed, and the engine's start-up check.

vLLM caches its selector's answers (``vllm.v1.attention.selector._cached_get_attn_backend``
and ``_cached_get_mamba_attn_backend`` are ``functools.cache``\\ d): an override entered after
a first answer would be invisible. Here the caches key on :func:`attn_di.registry_version`
too, so every registration, override block (global or local to the thread / task) and
``use_container`` is seen, and exactly the previous answer comes back after it.

Where the platform answers with a path (vLLM's CPU platform always answers with
``AttentionBackendEnum.CPU_ATTN.get_path()``), the path is resolved to the object attn_di
holds for that member (a class defined in a test, a mock), not re-imported. A class written
to attn_di's own backend interface (:class:`attn_di.backend.AttentionBackend`) is wrapped as
a vLLM backend (:func:`attn_di.integrations.vllm.backends.vllm_backend`), and an attn_di
backend that cannot run the layer's configuration is refused here, with attn_di's reasons
(:class:`~attn_di.exceptions.BackendRejectedError`), not later inside a forward.

The engine's start-up check (``EngineArgs.create_engine_config``) asks the same question in the
process that starts the engine, for the model's configuration, before any worker starts: a
registered path that does not import, or an attn_di backend that refuses the model, is one
typed error there rather than a traceback from a worker process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from enum import Enum
from typing import TYPE_CHECKING, Any

import vllm.v1.attention.selector as selector
from vllm.engine.arg_utils import EngineArgs

import attn_di
from attn_di.exceptions import AttnDIError, BackendRejectedError

if TYPE_CHECKING:
    from attn_di.integrations.vllm._bridge import Side

__all__ = ["check_engine_config", "install", "record_lookup", "resolve_backend"]

_logger = logging.getLogger(__name__)
# A child of vLLM's logger: its lines appear among vLLM's (a server's log shows which backend).
_vllm_logger = logging.getLogger("vllm.attn_di")
_CACHE_SIZE = 256
# The get_path() answers given while the platform chose a backend: (side, member, path).
_lookups: ContextVar[list[tuple[Side, Enum, str]] | None] = ContextVar(
    "attn_di_vllm_lookups", default=None
)


def record_lookup(side: Side, member: Enum, path: str) -> None:
    """Note that ``member.get_path()`` answered ``path`` (while a selection is recording)."""
    lookups = _lookups.get()
    if lookups is not None:
        lookups.append((side, member, path))


@contextmanager
def _recording() -> Iterator[list[tuple[Side, Enum, str]]]:
    lookups: list[tuple[Side, Enum, str]] = []
    token = _lookups.set(lookups)
    try:
        yield lookups
    finally:
        _lookups.reset(token)


def install() -> Callable[[], None]:
    """Replace vLLM's selector caches and wrap ``EngineArgs.create_engine_config``.

    Returns:
        The function that puts the originals back.
    """
    original_attn = selector._cached_get_attn_backend
    original_mamba = selector._cached_get_mamba_attn_backend
    original_create = vars(EngineArgs)["create_engine_config"]
    choose_mamba = getattr(original_mamba, "__wrapped__", original_mamba)

    @functools.lru_cache(maxsize=_CACHE_SIZE)
    def select(
        backend: Any,
        attn_selector_config: Any,
        num_heads: int | None,
        run_kv_cache_dtype: Any,
        version: object,
    ) -> Any:
        return _select(backend, attn_selector_config, num_heads)

    def cached_get_attn_backend(
        backend: Any,
        attn_selector_config: Any,
        num_heads: int | None = None,
        *,
        _run_kv_cache_dtype: Any = None,
    ) -> Any:
        return select(
            backend,
            attn_selector_config,
            num_heads,
            _run_kv_cache_dtype,
            attn_di.registry_version(),
        )

    @functools.lru_cache(maxsize=_CACHE_SIZE)
    def select_mamba(mamba_type: Any, version: object) -> Any:
        return choose_mamba(mamba_type)

    def cached_get_mamba_attn_backend(mamba_type: Any) -> Any:
        return select_mamba(mamba_type, attn_di.registry_version())

    # vLLM's tests call cache_clear() on these (functools caches in vLLM).
    cached_get_attn_backend.cache_clear = select.cache_clear  # type: ignore[attr-defined]
    cached_get_attn_backend.cache_info = select.cache_info  # type: ignore[attr-defined]
    cached_get_mamba_attn_backend.cache_clear = select_mamba.cache_clear  # type: ignore[attr-defined]
    cached_get_mamba_attn_backend.cache_info = select_mamba.cache_info  # type: ignore[attr-defined]

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original_create(self, *args, **kwargs)
        check_engine_config(config)
        return config

    create_engine_config.__doc__ = original_create.__doc__
    selector._cached_get_attn_backend = cached_get_attn_backend
    selector._cached_get_mamba_attn_backend = cached_get_mamba_attn_backend
    EngineArgs.create_engine_config = create_engine_config

    def undo() -> None:
        selector._cached_get_attn_backend = original_attn
        selector._cached_get_mamba_attn_backend = original_mamba
        EngineArgs.create_engine_config = original_create

    return undo


def _select(backend: Any, config: Any, num_heads: int | None) -> Any:
    """What vLLM's selector does, resolving the platform's answer through attn_di."""
    from vllm.platforms import current_platform

    with _recording() as lookups:
        path = current_platform.get_attn_backend_cls(
            backend, attn_selector_config=config, num_heads=num_heads
        )
    if not path:
        raise ValueError(f"Invalid attention backend for {current_platform.device_name}")
    member, backend_cls = resolve_backend(path, lookups)
    if member is not None:
        check_backend(member, backend_cls, config, "vLLM's attention selector")
    return backend_cls


def resolve_backend(path: str, lookups: list[tuple[Side, Enum, str]]) -> tuple[Enum | None, Any]:
    """The backend a platform's answer ``path`` stands for, and vLLM's member behind it.

    When the path is what one of the members answered and attn_di holds a registration or an
    override for it, the object attn_di resolves the member to (a class, a mock, a class
    defined in a function); an attn_di-interface class comes back wrapped as a vLLM backend.
    Otherwise vLLM's own import of the path.

    Raises:
        BackendImportError: attn_di's registered path does not import (names the member).
    """
    from vllm.utils.import_utils import resolve_obj_by_qualname

    for side, member, answered in reversed(lookups):
        if answered == path:
            if not side.overridden(member):
                return member, resolve_obj_by_qualname(path)
            counterpart = side.counterpart(member)
            resolved = _as_vllm_backend(member.name, side.container().backend(counterpart))
            _announce(member, resolved, side.container().source(counterpart))
            return member, resolved
    return None, resolve_obj_by_qualname(path)


_announced: set[tuple[str, int, str]] = set()


def _announce(member: Enum, resolved: Any, source: str) -> None:
    """Log, once per member, class and source, what vLLM's member resolves to."""
    key = (member.name, id(resolved), source)
    if key in _announced:
        return
    _announced.add(key)
    name = getattr(resolved, "__qualname__", type(resolved).__qualname__)
    runs = ""
    attn_di_backend = getattr(resolved, "attn_di_backend", None)
    if callable(attn_di_backend):
        try:
            inner = attn_di_backend()
            runs = f", running {inner.__module__}.{inner.__qualname__}"
        except Exception:  # only a log line; building the layer reports the error
            runs = ""
    _vllm_logger.info(
        "attn_di: vLLM's %s resolves to %s.%s (%s in attn_di)%s",
        member.name,
        getattr(resolved, "__module__", "?"),
        name,
        source,
        runs,
    )


def _as_vllm_backend(name: str, resolved: Any) -> Any:
    """``resolved`` itself, or for a class of attn_di's backend interface that is not a vLLM
    backend, the vLLM backend class that runs it."""
    from vllm.v1.attention.backend import AttentionBackend as VllmAttentionBackend

    from attn_di.backend import AttentionBackend

    if (
        isinstance(resolved, type)
        and issubclass(resolved, AttentionBackend)
        and not issubclass(resolved, VllmAttentionBackend)
    ):
        from attn_di.integrations.vllm.backends import vllm_backend

        return vllm_backend(name, resolved)
    return resolved


def check_backend(member: Enum, backend_cls: Any, config: Any, origin: str) -> None:
    """Refuse a configuration an attn_di-run vLLM backend cannot run, with its reasons.

    Raises:
        BackendRejectedError: naming the member, attn_di's reasons and what to change.
    """
    from attn_di.integrations.vllm.backends import AttnDIBackend

    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttnDIBackend)):
        return
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    reasons = backend_cls.validate_configuration(device_capability=capability, **config._asdict())
    if reasons:
        raise rejected(member.name, backend_cls, reasons, config, origin)


def rejected(
    name: str, backend_cls: Any, reasons: list[str], config: Any, origin: str
) -> BackendRejectedError:
    """The error for an attn_di backend that refuses a vLLM configuration (with the fix)."""
    from vllm.platforms import current_platform

    error = BackendRejectedError(
        name,
        reasons,
        f"{origin}: {backend_cls.__module__}.{backend_cls.__qualname__} runs attn_di's "
        f"{backend_cls.attn_di_backend().get_name()}",
        config,
        str(current_platform.device_name),
    )
    fixes = [_fix(reason, backend_cls.attn_di_backend()) for reason in reasons]
    error.hint = "; ".join(
        [
            *filter(None, fixes),
            f"or let vLLM use its own backend: AttentionBackendEnum.{name}.clear_override() "
            "(and unset ATTN_DI_REGISTRATIONS for new processes)",
        ]
    )
    return error


_FIXES = {
    "kv_cache_dtype not supported": "use kv_cache_dtype='auto' (the model dtype)",
    "head_size not supported": "use a model whose head size the backend supports",
    "block_size not supported": "use a block_size the backend supports",
    "attention sinks not supported": "register attn_di's CPU_ATTN or TORCH_SDPA, which run sinks",
}


def _fix(reason: str, backend: Any) -> str:
    """What to change for one of vLLM's reason strings, from what ``backend`` (the attn_di
    backend that refused) declares; "" where there is nothing to suggest but the fallback."""
    if reason == "dtype not supported":
        from attn_di.backend import dtype_name

        names = [repr(dtype_name(dtype)) for dtype in backend.supported_dtypes]
        listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        return f"use dtype={listed} (what {backend.get_name()} declares)"
    return _FIXES.get(reason, "")


def check_engine_config(vllm_config: Any) -> None:
    """Resolve and check, before any worker starts, the backend vLLM will ask for.

    Only where attn_di holds a registration or an override for it (vLLM's own backends are
    left to vLLM). Uses the model's head size, dtype, KV-cache dtype and block size; the
    per-layer features (sinks, windows) are checked again when the layers are built.

    Raises:
        BackendImportError: the registered path does not import.
        BackendRejectedError: an attn_di backend refuses the model's configuration.
    """
    try:
        config, backend = _selector_config(vllm_config)
    except Exception:  # vLLM's configuration object changed shape: leave it to the workers
        _logger.debug("attn_di: no start-up check of the attention backend", exc_info=True)
        return
    if config is None:
        return
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    with set_current_vllm_config(vllm_config), _recording() as lookups:
        try:
            path = current_platform.get_attn_backend_cls(backend, attn_selector_config=config)
        except AttnDIError:
            raise
        except Exception:  # the platform refuses: vLLM says so itself, later
            _logger.debug("attn_di: the platform chose no backend at start-up", exc_info=True)
            return
    mine = [(side, member) for side, member, answered in lookups if answered == path]
    if not mine or not mine[-1][0].overridden(mine[-1][1]):
        return
    member, backend_cls = resolve_backend(path, lookups)
    if member is not None:
        check_backend(member, backend_cls, config, "the engine's start-up check")


def _selector_config(vllm_config: Any) -> tuple[Any, Any]:
    """vLLM's selector configuration for the model's (non-MLA, decoder) attention layers."""
    model_config = vllm_config.model_config
    if model_config is None or getattr(model_config, "use_mla", False):
        return None, None
    cache_config = vllm_config.cache_config
    block_size = cache_config.block_size if cache_config.user_specified_block_size else None
    config = selector.AttentionSelectorConfig(
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
        kv_cache_dtype=cache_config.cache_dtype,
        block_size=block_size,
    )
    return config, vllm_config.attention_config.backend
