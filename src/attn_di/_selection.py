"""Automatic backend selection with a reason for every rejection, and forced choices.

Precedence (first that is set wins): the ``backend=`` argument, then the innermost
``with force_backend(...)`` of this thread / asyncio task, then the ``ATTN_DI_BACKEND``
environment variable, then automatic selection over the container's candidate policy.
``None``/``"auto"`` at any level means "not set here". A backend asked for explicitly is used
on every device if it validates, and raises :class:`BackendRejectedError` if not: never a
silent fallback.

Each candidate is resolved through the container (so registrations and overrides are what
is validated) and asked ``validate_configuration(...)`` with vLLM's keyword arguments; an
import failure is a rejection reason, not a crash.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from attn_di import _state
from attn_di._device import Device, parse_device
from attn_di._enum import AttentionBackendEnum, parse_backend_name
from attn_di.exceptions import (
    AttnDIError,
    BackendImportError,
    BackendRejectedError,
    InvalidBackendTypeError,
    InvalidInputError,
    NoValidBackendError,
    closest_name,
)

if TYPE_CHECKING:
    from attn_di._container import BackendContainer

__all__ = [
    "ENV_BACKEND",
    "AttentionSelectorConfig",
    "Selection",
    "canonical_dtype",
    "default_candidates",
    "force_backend",
    "select_backend",
    "shared_selection",
]

ENV_BACKEND = "ATTN_DI_BACKEND"
_IMPORT_FAILURE = "cannot be used here"
logger = logging.getLogger("attn_di")

_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}  # fmt: skip
_ATTN_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")
_FORCED: ContextVar[AttentionBackendEnum | None] = ContextVar("attn_di_forced", default=None)

E = AttentionBackendEnum


def canonical_dtype(dtype: object) -> str:
    """The canonical name of a dtype given as a torch dtype or a name ("bf16", "torch.half").

    Raises:
        InvalidInputError: an unknown dtype (a ValueError), listing the valid names and
            suggesting one: the only name it is a prefix of (``bfloat`` -> ``bfloat16``, where
            spelling distance alone would say ``float32``), else the closest spelling.
    """
    text = str(dtype).strip().lower().removeprefix("torch.")
    if text in _DTYPES:
        return _DTYPES[text]
    names = sorted(set(_DTYPES.values()))
    by_prefix = {_DTYPES[alias] for alias in _DTYPES if text and alias.startswith(text)}
    close = closest_name(text, _DTYPES)
    if len(by_prefix) == 1:
        suggestion: str | None = by_prefix.pop()
    else:
        suggestion = _DTYPES[close.lower()] if close else None
    raise InvalidInputError(
        "dtype",
        f"unknown dtype {dtype!r}; valid: {', '.join(names)}",
        hint=f"did you mean {suggestion!r}?" if suggestion else "e.g. 'bfloat16'",
    )


def _positive_int(name: str, value: object, example: str) -> int:
    """``value`` as a positive int: ints, numpy ints and digit strings (config files, env)."""
    number: int | None = None
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    elif not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            number = None
    if number is None or number <= 0:
        raise InvalidInputError(
            name, f"must be a positive int, got {value!r}", hint=f"e.g. {example}"
        )
    return number


def _flag(name: str, value: object) -> bool:
    """A bool, also from "true"/"false"/"1"/"0" (config files, env)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", "none", ""):
        return False
    raise InvalidInputError(name, f"expected a bool, got {value!r}", hint="True or False")


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """What a model layer needs from its attention backend (hashable; the selection cache key).

    Attributes:
        head_size: per-head hidden size, e.g. 128.
        dtype: activation dtype, stored by canonical name ("bfloat16"); a torch dtype or any
            alias ("bf16", "half", "torch.float16") is accepted.
        kv_cache_dtype: "auto" (same as dtype) or a cache dtype name such as "fp8".
        block_size: KV-cache block size in tokens; None = any.
        use_mla: multi-head latent attention (DeepSeek-style).
        has_sink: the layer has attention sinks.
        use_sparse: sparse (MLA) attention.
        attn_type: "decoder", "encoder", "encoder_only" or "encoder_decoder".

    Raises:
        InvalidInputError: a non-positive head_size or block_size, an unknown dtype or attn_type.
    """

    head_size: int
    dtype: Any
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    attn_type: str = "decoder"

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_size", _positive_int("head_size", self.head_size, "128"))
        if self.block_size is not None:
            block_size = _positive_int("block_size", self.block_size, "16, or None for any")
            object.__setattr__(self, "block_size", block_size)
        for name in ("use_mla", "has_sink", "use_sparse"):
            object.__setattr__(self, name, _flag(name, getattr(self, name)))
        attn_type = str(self.attn_type).strip().lower()
        if attn_type not in _ATTN_TYPES:
            close = closest_name(attn_type, _ATTN_TYPES)
            raise InvalidInputError(
                "attn_type",
                f"unknown attention type {self.attn_type!r}; valid: {', '.join(_ATTN_TYPES)}",
                hint=f"did you mean {close.lower()!r}?" if close else "e.g. 'decoder'",
            )
        object.__setattr__(self, "attn_type", attn_type)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        kv_cache_dtype = "auto" if self.kv_cache_dtype is None else self.kv_cache_dtype
        object.__setattr__(self, "kv_cache_dtype", str(kv_cache_dtype).strip().lower())

    def validation_kwargs(self, device: Device) -> dict[str, Any]:
        """The keyword arguments of vLLM's ``validate_configuration`` for this config.

        ``dtype`` becomes a torch dtype when torch is installed (vLLM's backends compare torch
        dtypes); ``device_capability`` is a ``DeviceCapability`` on GPUs and None on the CPU.
        """
        return {
            "head_size": self.head_size,
            "dtype": _torch_dtype(self.dtype),
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": self.block_size,
            "use_mla": self.use_mla,
            "has_sink": self.has_sink,
            "use_sparse": self.use_sparse,
            "device_capability": _capability(device),
            "attn_type": self.attn_type,
        }


class NamedTupleConfig(Protocol):
    """A selector config as a NamedTuple (vLLM's ``AttentionSelectorConfig`` is one)."""

    @property
    def _fields(self) -> tuple[str, ...]: ...

    def _asdict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_backend`.

    Attributes:
        backend: the chosen member.
        backend_cls: its class, as resolved by the container (registrations and overrides apply).
        path: the class path it resolved from.
        rejected: ``{member: [reasons]}`` for every candidate tried and refused, in order.
        origin: "backend= argument", "force_backend()", "ATTN_DI_BACKEND" or "auto".
        config: the configuration selected for.
        device: the device selected for.
    """

    backend: AttentionBackendEnum
    backend_cls: type[Any]
    path: str
    rejected: dict[AttentionBackendEnum, list[str]] = field(default_factory=dict)
    origin: str = "auto"
    config: AttentionSelectorConfig | None = None
    device: Device | None = None


def default_candidates(
    device: Device, config: AttentionSelectorConfig
) -> list[AttentionBackendEnum]:
    """attn_di's candidate policy: members in priority order for a device and configuration.

    CUDA follows vLLM's ``CudaPlatform`` (capability major 10 prefers FlashInfer; MLA and
    sparse MLA have their own lists); ROCm: the AITER backends, then ROCm/Triton; CPU:
    CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION. Replace it per container with
    ``container.candidates.override(providers.Callable(my_policy))`` or a fixed list with
    ``providers.Object([...])``.
    """
    if device.kind == "cpu":
        return [E.CPU_ATTN, E.TORCH_SDPA, E.FLEX_ATTENTION]
    if device.kind == "rocm":
        if config.use_mla:
            return [E.ROCM_AITER_MLA, E.TRITON_MLA]
        return [E.ROCM_AITER_FA, E.ROCM_AITER_UNIFIED_ATTN, E.ROCM_ATTN, E.TRITON_ATTN]
    blackwell = device.capability is not None and device.capability[0] == 10
    if config.use_mla:
        if config.use_sparse:
            return [E.FLASHMLA_SPARSE]
        if blackwell:
            return [E.FLASHINFER_MLA, E.CUTLASS_MLA, E.FLASH_ATTN_MLA, E.FLASHMLA, E.TRITON_MLA]
        return [E.FLASH_ATTN_MLA, E.FLASHMLA, E.FLASHINFER_MLA, E.TRITON_MLA]
    if blackwell:
        return [E.FLASHINFER, E.FLASH_ATTN, E.TRITON_ATTN, E.FLEX_ATTENTION]
    return [E.FLASH_ATTN, E.FLASHINFER, E.TRITON_ATTN, E.FLEX_ATTENTION]


@contextmanager
def force_backend(
    backend: AttentionBackendEnum | str | None,
) -> Iterator[AttentionBackendEnum | None]:
    """Force a backend for selections in this thread / asyncio task until the block ends.

    Blocks nest (the innermost wins); ``None`` or ``"auto"`` lifts an outer force for the block.
    Names are parsed case-insensitively.

    Raises:
        UnknownBackendError: an unknown name.
    """
    member = parse_backend_name(backend)
    token = _FORCED.set(member)
    try:
        yield member
    finally:
        _FORCED.reset(token)


def select_backend(
    config: AttentionSelectorConfig | Mapping[str, Any] | NamedTupleConfig,
    *,
    device: str | Device | None = None,
    backend: AttentionBackendEnum | str | None = None,
    container: BackendContainer | None = None,
) -> Selection:
    """Choose the attention backend for ``config`` on ``device``.

    Args:
        config: what the layer needs: an :class:`AttentionSelectorConfig`, or a mapping of its
            fields (``{"head_size": 128, "dtype": "bfloat16"}``, optionally with ``device`` and
            ``backend``, which the keyword arguments override), or a NamedTuple of them (vLLM's
            selector config is one), read as the mapping ``config._asdict()``; its fields
            attn_di does not model are ignored while False or None, refused when set.
        device: "cpu", "cuda", "cuda:9.0", "rocm"; None detects it through torch.
        backend: an explicit choice (member or name, case-insensitive); None/"auto" = not set.
        container: where candidates are resolved; the default container if None.

    Returns:
        The :class:`Selection`; cached per inputs and registry state, never stale.

    Raises:
        BackendRejectedError: an explicitly asked-for backend refuses the configuration.
        NoValidBackendError: no candidate accepts it (every candidate with its reasons).
        UnknownBackendError: an unknown backend name (also from ``ATTN_DI_BACKEND``).
        InvalidInputError: a malformed device, a mapping with unknown or missing fields, or
            a NamedTuple with missing fields or an unmodelled field set (True, a value).
        InvalidBackendTypeError: ``config`` is neither a config, a mapping nor a NamedTuple.
    """
    return _copy(shared_selection(config, device=device, backend=backend, container=container))


def shared_selection(
    config: AttentionSelectorConfig | Mapping[str, Any] | NamedTupleConfig,
    *,
    device: str | Device | None = None,
    backend: AttentionBackendEnum | str | None = None,
    container: BackendContainer | None = None,
) -> Selection:
    """:func:`select_backend`'s answer itself, as its cache holds it: read it, never change it.

    For attn_di's own per-call paths (the transformers attention function runs it for every
    layer of every step), which only read the result; callers that may change ``rejected``
    take :func:`select_backend`'s copy. Arguments, errors: see :func:`select_backend`.
    """
    if not isinstance(config, AttentionSelectorConfig):
        config, mapped_device, mapped_backend = _config_from(config)
        device = device if device is not None else mapped_device
        backend = backend if backend is not None else mapped_backend
    target = container if container is not None else _state.DEFAULT.get()
    parsed_device = parse_device(device)
    requested, origin = _requested(backend)
    # A custom policy (the candidates provider overridden) can change without any signal
    # attn_di sees: such selections are not cached.
    cacheable = not target.candidates.overridden
    key = (
        config,
        parsed_device,
        requested,
        origin,
        target._serial,
        _state.GENERATION[0],
        _state.LOCAL_LAYERS.get(),
    )
    cached = _cache_get(key) if cacheable else None
    if cached is not None:
        return cached
    if requested is not None:
        selection = _select_requested(target, config, parsed_device, requested, origin)
    else:
        selection = _select_auto(target, config, parsed_device)
    # An import failure can heal (a package installed meanwhile): not cached either.
    if cacheable and not any(
        _IMPORT_FAILURE in r for rs in selection.rejected.values() for r in rs
    ):
        _cache_put(key, selection)
    return selection


def select_from_settings(container: BackendContainer, settings: dict[str, Any]) -> Selection:
    """:func:`select_backend` from a flat mapping (the container's ``attention`` Configuration).

    Keys: the :class:`AttentionSelectorConfig` fields, plus optional ``device`` and ``backend``.

    Raises:
        InvalidInputError: a missing head_size/dtype or an unknown key.
    """
    return select_backend(dict(settings or {}), container=container)


# -- internals ------------------------------------------------------------------------
def _config_from(values: object) -> tuple[AttentionSelectorConfig, Any, Any]:
    """``(config, device, backend)`` from a mapping of the config's fields, plus optional
    ``device`` and ``backend`` keys (None when absent); a NamedTuple is read as its
    ``_asdict()``, under the same rules, except that fields attn_di does not model are
    ignored while they ask for nothing (None, or False as the modelled flags read it: vLLM's
    config has flags attn_di does not model).

    Raises:
        InvalidBackendTypeError: neither a mapping nor a NamedTuple.
        InvalidInputError: unknown keys (fields), or head_size / dtype missing.
    """
    named_tuple: str | None = None  # the NamedTuple's class name, for messages
    if _is_named_tuple(values):
        given, named_tuple = dict(values._asdict()), type(values).__name__
    elif isinstance(values, Mapping):
        given = dict(values)
    else:
        raise InvalidBackendTypeError(
            "config",
            values,
            "an AttentionSelectorConfig, a mapping of its fields or a NamedTuple of them",
            hint='select_backend(AttentionSelectorConfig(head_size=128, dtype="bfloat16"))',
        )
    device = given.pop("device", None)
    backend = given.pop("backend", None)
    fields = set(AttentionSelectorConfig.__dataclass_fields__)
    unknown = sorted(str(key) for key in set(given) - fields)
    if named_tuple:
        # Another project's config (vLLM's carries use_mm_prefix, use_per_head_quant_scales,
        # use_non_causal): its field names are not typos. A flag attn_di does not model is
        # harmless while it asks for nothing (False or None); one that is set is refused.
        for name in [name for name in unknown if _asks_nothing(name, given[name])]:
            del given[name]
        unknown = [name for name in unknown if name in given]
    if unknown:
        valid = sorted(fields | {"device", "backend"})
        if named_tuple:  # fields of another project's config, not typos: no "did you mean"
            asked = ", ".join(f"{name}={given[name]!r}" for name in unknown)
            raise InvalidInputError(
                f"config ({named_tuple})",
                f"asks for {asked}, which attn_di does not model (it models: {', '.join(valid)})",
                hint="attn_di cannot check that a backend honours these; leave them False "
                "(or None), or select with the fields it models (a mapping or an "
                "AttentionSelectorConfig of them)",
            )
        close = closest_name(unknown[0], valid)
        raise InvalidInputError(
            "attention settings",
            f"unknown keys {unknown}; valid: {', '.join(valid)}",
            hint=f"did you mean {close.lower()!r}?" if close else None,
        )
    missing = [name for name in ("head_size", "dtype") if given.get(name) is None]
    if missing and named_tuple:
        raise InvalidInputError(
            f"config ({named_tuple})",
            f"missing {', '.join(missing)}",
            hint='give the NamedTuple a head_size (e.g. 128) and a dtype (e.g. "bfloat16")',
        )
    if missing:
        raise InvalidInputError(
            "attention settings",
            f"missing {', '.join(missing)}",
            hint='set them first, e.g. container.attention.from_dict({"head_size": 128, '
            '"dtype": "bfloat16"})',
        )
    return AttentionSelectorConfig(**given), device, backend


def _asks_nothing(name: str, value: object) -> bool:
    """Whether an unmodelled field's ``value`` asks for nothing: None, or False as the
    modelled flags read it (``False``, ``0``, ``"false"``, NumPy's ``False_``)."""
    if value is None:
        return True
    try:
        return not _flag(name, value)
    except InvalidInputError:
        return False


def _is_named_tuple(values: object) -> TypeGuard[NamedTupleConfig]:
    """``values`` has a NamedTuple's ``_fields`` and ``_asdict()`` (a namedtuple or a
    ``typing.NamedTuple`` class, vLLM's selector config among them)."""
    fields = getattr(values, "_fields", None)
    return isinstance(fields, tuple) and callable(getattr(values, "_asdict", None))


def _requested(
    backend: AttentionBackendEnum | str | None,
) -> tuple[AttentionBackendEnum | None, str]:
    explicit = parse_backend_name(backend)
    if explicit is not None:
        return explicit, "backend= argument"
    forced = _FORCED.get()
    if forced is not None:
        return forced, "force_backend()"
    env = os.environ.get(ENV_BACKEND)
    if env is not None:
        try:
            from_env = parse_backend_name(env)
        except AttnDIError as exc:
            exc.add_note(f"(read from the environment variable {ENV_BACKEND}={env!r})")
            exc.hint = (
                f"the name comes from the environment variable {ENV_BACKEND}={env!r}: fix or "
                f"unset it" + (f"; {exc.hint}" if exc.hint else "")
            )
            raise
        if from_env is not None:
            return from_env, ENV_BACKEND
    return None, "auto"


def _select_requested(
    container: BackendContainer,
    config: AttentionSelectorConfig,
    device: Device,
    member: AttentionBackendEnum,
    origin: str,
) -> Selection:
    backend_cls, reasons = _check(container, member, config, device)
    if backend_cls is None:
        logger.debug("forced backend %s (%s) rejected: %s", member.name, origin, reasons)
        error = BackendRejectedError(member.name, reasons, origin, config, str(device))
        try:  # an import failure: its own error says what to fix (the closest class name)
            container.backend(member)
        except BackendImportError as exc:
            if exc.suggestion:
                error.hint = f"{exc.hint} ({exc.fixed_path()})"
            raise error from exc
        except AttnDIError as exc:
            raise error from exc
        raise error
    logger.debug("selected %s (%s) for %r on %s", member.name, origin, config, device)
    return Selection(member, backend_cls, container.get_path(member), {}, origin, config, device)


def _select_auto(
    container: BackendContainer, config: AttentionSelectorConfig, device: Device
) -> Selection:
    candidates = _candidates(container, config, device)
    rejected: dict[AttentionBackendEnum, list[str]] = {}
    for member in candidates:
        backend_cls, reasons = _check(container, member, config, device)
        if backend_cls is not None:
            for refused, why in rejected.items():
                logger.debug("rejected %s: %s", refused.name, "; ".join(why))
            logger.debug("selected %s for %r on %s", member.name, config, device)
            return Selection(
                member, backend_cls, container.get_path(member), rejected, "auto", config, device
            )
        rejected[member] = reasons
    logger.debug("no valid backend for %r on %s: %s", config, device, rejected)
    raise NoValidBackendError(
        config, str(device), {member.name: reasons for member, reasons in rejected.items()}
    )


def _candidates(
    container: BackendContainer, config: AttentionSelectorConfig, device: Device
) -> list[AttentionBackendEnum]:
    """The policy's candidates as members (names are parsed), or a typed error naming it."""
    policy = container.candidates
    try:
        candidates = policy(device, config)
        return [_as_member(candidate) for candidate in candidates]
    except AttnDIError:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a policy never ends the host
        raise InvalidInputError(
            "candidate policy",
            f"{policy!r} failed for {device}: {type(exc).__name__}: {exc}",
            hint="a policy is called as policy(device, config) and returns backend members or "
            "names in priority order",
        ) from exc


def _as_member(candidate: object) -> AttentionBackendEnum:
    member = parse_backend_name(candidate)
    if member is None:
        raise InvalidInputError(
            "candidate policy", f"returned {candidate!r}, not a backend", hint="return members"
        )
    return member


def _copy(selection: Selection) -> Selection:
    """A copy whose ``rejected`` the caller may change without touching the cache."""
    rejected = {member: list(reasons) for member, reasons in selection.rejected.items()}
    return dataclasses.replace(selection, rejected=rejected)


def _check(
    container: BackendContainer,
    member: AttentionBackendEnum,
    config: AttentionSelectorConfig,
    device: Device,
) -> tuple[type[Any] | None, list[str]]:
    try:
        backend_cls = container.backend(member)
    except AttnDIError as exc:
        return None, [f"{_IMPORT_FAILURE}: {exc.message()}"]
    validate: Callable[..., Sequence[str]] | None = getattr(
        backend_cls, "validate_configuration", None
    )
    if validate is None:
        return None, ["the class has no validate_configuration()"]
    try:
        found = validate(**config.validation_kwargs(device))
        reasons = [found] if isinstance(found, str) else [str(reason) for reason in found]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken backend (SystemExit too) is a rejection
        return None, [f"validate_configuration raised {type(exc).__name__}: {exc}"]
    return (None, reasons) if reasons else (backend_cls, [])


def _torch_dtype(name: str) -> Any:
    try:
        import torch
    except ImportError:
        return name
    return getattr(torch, name)


def _capability(device: Device) -> Any:
    if device.capability is None:
        return None
    from attn_di.backend import DeviceCapability

    return DeviceCapability(*device.capability)


_cache: OrderedDict[tuple[Any, ...], Selection] = OrderedDict()
_cache_lock = threading.Lock()
_CACHE_SIZE = 256


def _cache_get(key: tuple[Any, ...]) -> Selection | None:
    with _cache_lock:
        selection = _cache.get(key)
        if selection is not None:
            _cache.move_to_end(key)
        return selection


def _cache_put(key: tuple[Any, ...], selection: Selection) -> None:
    with _cache_lock:
        _cache[key] = selection
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
