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
import sys
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

__all__ = [
    "check_engine_config",
    "install",
    "platform_choice",
    "quiet_announcements",
    "record_lookup",
    "resolve_backend",
]

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
        from attn_di.integrations.vllm._failures import patch_engine_client

        patch_engine_client()  # an engine starts here: its processes' errors come back
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
        BackendImportError: attn_di's registered path does not import, or names a class that
            is no attention backend (names the member).
    """
    from vllm.utils.import_utils import resolve_obj_by_qualname

    for side, member, answered in reversed(lookups):
        if answered == path:
            if not side.overridden(member):
                return member, resolve_obj_by_qualname(path)
            counterpart = side.counterpart(member)
            resolved = _as_vllm_backend(member.name, side.container().backend(counterpart))
            check_is_backend(member.name, resolved, _class_path(side, counterpart, resolved))
            _announce(member, resolved, side.container().source(counterpart))
            return member, resolved
    return None, resolve_obj_by_qualname(path)


def check_is_backend(name: str, resolved: Any, class_path: str) -> None:
    """Refuse a class that vLLM cannot run as an attention backend (``collections.OrderedDict``
    registered for ``CPU_ATTN``), as a path naming a function is refused as "not a class".

    ``resolved`` is what attn_di resolved vLLM's member ``name`` to, attn_di-interface classes
    already wrapped (:func:`_as_vllm_backend`): a vLLM backend class passes; so does an object
    that is not a class (a test's mock, given as it is).

    Raises:
        BackendImportError: reason ``"not an attention backend"``, naming the member, the path,
            the closest backend class of the path's module (if any) and the fix.
    """
    from vllm.v1.attention.backend import AttentionBackend as VllmAttentionBackend

    if not isinstance(resolved, type) or issubclass(resolved, VllmAttentionBackend):
        return
    from attn_di.backend import AttentionBackend
    from attn_di.exceptions import BackendImportError, closest_name

    module_name, _, class_name = class_path.replace(":", ".").rpartition(".")
    module = sys.modules.get(module_name)
    backends = [
        attr
        for attr, value in sorted(vars(module).items() if module is not None else ())
        if not attr.startswith("_")
        and isinstance(value, type)
        and issubclass(value, (VllmAttentionBackend, AttentionBackend))
    ]
    suggestion = closest_name(class_name, backends)
    error = BackendImportError(
        name,
        class_path,
        BackendImportError.NOT_A_BACKEND,
        f"it names class {resolved.__module__}.{resolved.__qualname__}, which is neither a vLLM "
        "attention backend (vllm.v1.attention.backend.AttentionBackend) nor an attn_di one "
        "(attn_di.backend.AttentionBackend)",
        suggestion=suggestion,
    )
    if suggestion is not None:
        error.hint = f"did you mean {suggestion!r}? ({error.fixed_path()})"
    else:
        error.hint = (
            f"register an attention backend class for {name}: a vLLM backend such as "
            "attn_di.integrations.vllm.backends.CPU_ATTN, or a class written to "
            f"attn_di.backend.AttentionBackend; or let vLLM use its own backend: "
            f"AttentionBackendEnum.{name}.clear_override()"
        )
    raise error


def _class_path(side: Side, counterpart: Any, resolved: Any) -> str:
    """The path attn_di resolved ``counterpart`` from (the registration's, or the override's
    class as ``module.qualname``)."""
    try:
        return str(side.container().get_path(counterpart))
    except AttnDIError:  # an override given as an object without a path
        return f"{getattr(resolved, '__module__', '?')}.{getattr(resolved, '__qualname__', '?')}"


_announced: set[tuple[str, int, str]] = set()
_quiet = ContextVar("attn_di_vllm_quiet_announcements", default=False)


@contextmanager
def quiet_announcements() -> Iterator[None]:
    """Resolve without logging what vLLM's members resolve to (a check that may refuse)."""
    token = _quiet.set(True)
    try:
        yield
    finally:
        _quiet.reset(token)


def _announce(member: Enum, resolved: Any, source: str) -> None:
    """Log, once per member, class and source, what vLLM's member resolves to."""
    key = (member.name, id(resolved), source)
    if key in _announced or _quiet.get():
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
    prefix, suffix = "attention type ", " not supported"
    if reason.startswith(prefix) and reason.endswith(suffix):
        attn_type = reason[len(prefix) : -len(suffix)]
        if attn_type in ("decoder", "encoder_only"):
            return (
                f"register a backend that runs {attn_type} attention (attn_di's CPU_ATTN or "
                "TORCH_SDPA: attn_di.integrations.vllm.backends.CPU_ATTN)"
            )
        return f"attn_di's vLLM backends run decoder and encoder-only attention, not {attn_type}"
    return _FIXES.get(reason, "")


def check_engine_config(vllm_config: Any) -> None:
    """Resolve and check, before any worker starts, the backend vLLM will ask for.

    Only where attn_di holds a registration or an override for it (vLLM's own backends are
    left to vLLM). Asked for every attention type the model's layers ask for (decoder;
    encoder-only for a pooling model such as BERT; decoder and cross attention for an
    encoder-decoder model), with the model's head size, dtype, KV-cache dtype and block size;
    the per-layer features (sinks, windows) are checked again when the layers are built.

    Raises:
        BackendImportError: the registered path does not import, or names a class that is no
            attention backend.
        BackendRejectedError: an attn_di backend refuses the model's configuration.
    """
    try:
        configs, backend = _selector_configs(vllm_config)
    except Exception:  # vLLM's configuration object changed shape: leave it to the workers
        _logger.debug("attn_di: no start-up check of the attention backend", exc_info=True)
        return
    for config in configs:
        _check_one(vllm_config, config, backend)


def platform_choice(
    vllm_config: Any, config: Any, backend: Any
) -> tuple[str, list[tuple[Side, Enum, str]], tuple[Side, Enum] | None] | None:
    """What vLLM's platform answers for one selector config: ``(path, lookups, chosen)``,
    ``chosen`` the side and vLLM member that answered with ``path`` (None: no member did);
    None when the platform refuses (vLLM says so itself, later).

    Raises:
        AttnDIError: what attn_di raised while the platform chose.
    """
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    with set_current_vllm_config(vllm_config), _recording() as lookups:
        try:
            path = current_platform.get_attn_backend_cls(backend, attn_selector_config=config)
        except AttnDIError:
            raise
        except Exception:
            _logger.debug("attn_di: the platform chose no backend at start-up", exc_info=True)
            return None
    mine = [(side, member) for side, member, answered in lookups if answered == path]
    return path, lookups, mine[-1] if mine else None


def _check_one(vllm_config: Any, config: Any, backend: Any) -> None:
    """The start-up check for one of the model's attention types (its selector config)."""
    choice = platform_choice(vllm_config, config, backend)
    if choice is None:
        return
    path, lookups, chosen = choice
    if chosen is None or not chosen[0].overridden(chosen[1]):
        return
    member, backend_cls = resolve_backend(path, lookups)
    if member is not None:
        check_backend(member, backend_cls, config, "the engine's start-up check")


# The attention types of a model's layers, by vLLM's ModelConfig.attn_type: what the workers
# will ask the selector for (encoder-decoder models: the decoder's self-attention and its
# cross-attention; "hybrid" models: their attention layers are decoder layers).
_LAYER_ATTN_TYPES: dict[str, tuple[str, ...]] = {
    "decoder": ("decoder",),
    "hybrid": ("decoder",),
    "encoder_only": ("encoder_only",),
    "encoder": ("encoder",),
    "encoder_decoder": ("decoder", "encoder_decoder"),
    "attention_free": (),
}


def layer_attn_types(model_config: Any) -> tuple[str, ...]:
    """The attention types (vLLM's ``AttentionType`` values) that ``model_config``'s layers
    ask vLLM's selector for; decoder attention where vLLM does not say."""
    try:
        model_type = str(model_config.attn_type)
    except Exception:  # an older or newer ModelConfig: the decoder question, as before
        _logger.debug("attn_di: no attention type for the model", exc_info=True)
        return ("decoder",)
    return _LAYER_ATTN_TYPES.get(model_type, ("decoder",))


def _selector_configs(vllm_config: Any) -> tuple[list[Any], Any]:
    """vLLM's selector configurations for the model's (non-MLA) attention layers, one per
    attention type, and the backend vLLM's configuration asks for."""
    model_config = vllm_config.model_config
    if model_config is None or getattr(model_config, "use_mla", False):
        return [], None
    cache_config = vllm_config.cache_config
    block_size = cache_config.block_size if cache_config.user_specified_block_size else None
    configs = [
        selector.AttentionSelectorConfig(
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
            kv_cache_dtype=cache_config.cache_dtype,
            block_size=block_size,
            attn_type=attn_type,
        )
        for attn_type in layer_attn_types(model_config)
    ]
    return configs, vllm_config.attention_config.backend
