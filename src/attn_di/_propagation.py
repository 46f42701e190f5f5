"""Registrations across processes, through the ``ATTN_DI_REGISTRATIONS`` environment variable.

The mechanism: :func:`propagate_registrations` exports the default container's registrations
(``container.export_registrations()``, ``{member name: dotted path}``) as JSON into
``os.environ["ATTN_DI_REGISTRATIONS"]``. Every process started afterwards inherits the
variable, and ``import attn_di`` there applies it to the default container
(:func:`apply_inherited_registrations`: one ``json.loads`` and one container, only when the
variable is set). Nothing has to run in the child beyond importing attn_di, which happens
anyway when a pickled member, a backend class or a function using attn_di arrives there.
Applying at import (rather than when the default container is first used) means runtime
members exist before anything in the child unpickles or names them.

That covers ``multiprocessing`` spawn children, ``subprocess`` and Ray workers
(:func:`ray_runtime_env` puts the variable in a Ray ``runtime_env``).

Automatic propagation (on by default): every registration, clear, runtime member and
``use_container()`` enter/exit of the default container rewrites the variable, so children
started at any later time inherit what is registered, with no call at all. A class that
cannot be exported is left out with an :class:`~attn_di.exceptions.UnexportableBackendWarning`
naming it. :func:`set_auto_propagation` (or ``ATTN_DI_AUTO_PROPAGATE=0`` at start-up) turns
it off; while a :func:`propagate_registrations` handle is active, its snapshot is the one in
the variable. Test isolation (``isolated_backends``, the pytest fixtures) turns it off for
the block. Limits:

- :func:`propagate_registrations` is a snapshot: with automatic propagation off,
  registrations made after the call do not reach processes started later until it is
  called again;
- the forkserver process is started once, with the environment of that moment: call
  :func:`propagate_registrations` before the first forkserver child starts, or pass
  ``initializer=handle.initializer, initargs=handle.initargs`` to a pool;
- registrations only: override blocks are scoped to their process and never exported,
  except those entered with ``override(..., propagate=True)`` (automatic propagation on),
  which are in the variable while they are active;
- a class with no importable path (defined in a function) cannot be exported:
  :class:`~attn_di.exceptions.UnexportableBackendError`, naming it, and nothing is written;
- paths are imported lazily in the child: a path that does not import there fails on first
  resolution with :class:`~attn_di.exceptions.BackendImportError`;
- the value is limited by the OS (about 128 KiB for one variable on Linux).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from attn_di._container import BackendContainer, warn_unexportable
from attn_di._default import get_container
from attn_di._env import Switch
from attn_di._state import (
    DEFAULT,
    PROPAGATION,
    REGISTRY_LOCK,
    on_registrations_changed,
    user_stacklevel,
)
from attn_di.exceptions import (
    AttnDIError,
    InvalidBackendTypeError,
    RegistrationsEnvError,
    UnexportableBackendError,
    UnexportableBackendWarning,
)

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "AUTO_ENV",
    "AUTO_SWITCH",
    "PLUGINS_ENV",
    "REGISTRATIONS_ENV",
    "VLLM_REGISTRY",
    "PropagatedRegistrations",
    "apply_inherited_registrations",
    "apply_snapshot",
    "auto_propagation_enabled",
    "propagate_registrations",
    "propagation_refusal",
    "ray_runtime_env",
    "read_auto_switch",
    "set_auto_propagation",
    "swap_auto_propagation",
    "vllm_registrations",
]

REGISTRATIONS_ENV = "ATTN_DI_REGISTRATIONS"
"""The environment variable carrying ``{member name: dotted path}`` as JSON."""

PLUGINS_ENV = "ATTN_DI_PLUGINS"
"""The plugin allowlist (see :func:`attn_di.load_plugins`); passed on to Ray workers."""

AUTO_ENV = "ATTN_DI_AUTO_PROPAGATE"
"""Read at ``import attn_di``: ``0``, ``false``, ``off`` or ``no`` turn automatic propagation
off (any case); anything but an on/off spelling makes the import refuse it."""
AUTO_SWITCH = Switch(
    AUTO_ENV,
    default=True,
    on="propagate every registration",
    off="only propagate_registrations() does",
)

_auto = [True]


def read_auto_switch() -> None:
    """Set automatic propagation from ``ATTN_DI_AUTO_PROPAGATE`` (``import attn_di`` does).

    Raises:
        EnvSwitchError: the variable holds something other than on/off.
    """
    _auto[0] = AUTO_SWITCH.read()


AUTO_LIMIT = 100_000
"""The largest snapshot (in bytes) automatic propagation writes: Linux refuses to start a
process whose environment holds a variable over 128 KiB."""
_warned_too_large: list[bool] = []


def set_auto_propagation(enabled: bool) -> bool:
    """Turn the automatic propagation of the default container's registrations on or off.

    On, ``ATTN_DI_REGISTRATIONS`` follows every registration, clear and runtime member at
    once (turning it on writes it now); off, it is left as it is, and only
    :func:`propagate_registrations` writes it.

    Returns:
        The previous setting (to restore it).

    Raises:
        InvalidBackendTypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise InvalidBackendTypeError("enabled", enabled, "True or False")
    previous = swap_auto_propagation(enabled)
    if enabled:
        before = os.environ.get(REGISTRATIONS_ENV)
        try:
            _refresh(None)
        except BaseException:  # a warning turned into an error: as before the call
            swap_auto_propagation(previous)
            if before is None:
                os.environ.pop(REGISTRATIONS_ENV, None)
            else:
                os.environ[REGISTRATIONS_ENV] = before
            raise
    return previous


def swap_auto_propagation(enabled: bool) -> bool:
    """Set automatic propagation without writing the variable now; returns the previous
    setting (for test isolation, which restores the environment itself)."""
    previous = _auto[0]
    _auto[0] = enabled
    return previous


def auto_propagation_enabled() -> bool:
    """Whether registrations reach worker processes automatically
    (see :func:`set_auto_propagation`)."""
    return _auto[0]


def propagate_registrations(container: BackendContainer | None = None) -> PropagatedRegistrations:
    """Write the registrations into ``ATTN_DI_REGISTRATIONS`` for processes started from now on.

    ``import attn_di`` in a child process (multiprocessing spawn or forkserver, subprocess)
    applies them to its default container. The variable stays set until the returned
    handle is restored (``with propagate_registrations(): ...`` restores on exit).

    Args:
        container: whose registrations to export; the default container if None.

    Returns:
        The handle: its ``snapshot``, and ``initializer`` / ``initargs`` for process pools.

    Raises:
        UnexportableBackendError: a registered class with no importable path (named in
            the message); nothing is written.
    """
    snapshot = (container if container is not None else get_container()).export_registrations()
    handle = PropagatedRegistrations(snapshot)
    handle.apply()
    return handle


def ray_runtime_env(
    runtime_env: Mapping[str, Any] | None = None, *, container: BackendContainer | None = None
) -> dict[str, Any]:
    """A Ray ``runtime_env`` whose workers resolve this process's registrations.

    ``ray.init(runtime_env=ray_runtime_env())`` for every task and actor of the job, or
    ``task.options(runtime_env=ray_runtime_env())`` for some. The registrations travel in
    ``env_vars`` (``ATTN_DI_REGISTRATIONS``, and ``ATTN_DI_PLUGINS`` when set here) and are
    applied when the worker imports attn_di. Ray itself is not imported.

    vLLM's own registrations (vLLM's ``register_backend``) made before attn_di's vLLM bridge
    is installed are in the snapshot too, where attn_di holds no registration for the member
    (attn_di's wins, as when the bridge is installed): this runtime_env never hides them
    from Ray workers. vLLM is not imported here; only an already imported registry is read.

    Args:
        runtime_env: a runtime_env to extend (copied, not changed); its other keys and
            ``env_vars`` are kept, attn_di's variables replace any of the same name.
        container: whose registrations to export; the default container if None.

    Raises:
        UnexportableBackendError: a registered class with no importable path, or one defined
            in the driver script (``__main__``), which Ray workers cannot import.
        InvalidBackendTypeError: ``runtime_env`` is not a mapping.
    """
    if runtime_env is not None and not isinstance(runtime_env, Mapping):
        raise InvalidBackendTypeError(
            "runtime_env", runtime_env, "a mapping (a Ray runtime_env dict) or None"
        )
    snapshot = (container if container is not None else get_container()).export_registrations()
    for name, class_path in vllm_registrations().items():
        snapshot.setdefault(name, class_path)
    for name, class_path in snapshot.items():
        if class_path.startswith(("__main__.", "__main__:", "__mp_main__.")):
            raise UnexportableBackendError(
                name,
                class_path,
                "lives in the driver's __main__ module, which Ray workers do not import "
                "(spawn children re-import it, Ray does not)",
            )
    extended = dict(runtime_env or {})
    env_vars = dict(extended.get("env_vars") or {})
    env_vars[REGISTRATIONS_ENV] = encode_snapshot(snapshot)
    allowlist = os.environ.get(PLUGINS_ENV)
    if allowlist is not None:
        env_vars[PLUGINS_ENV] = allowlist
    extended["env_vars"] = env_vars
    return extended


VLLM_REGISTRY = "vllm.v1.attention.backends.registry"
"""vLLM's backend registry module: its ``_ATTN_OVERRIDES`` / ``_MAMBA_ATTN_OVERRIDES`` dicts
hold vLLM's own registrations (``{member: class path}``) until attn_di's bridge is installed."""


def vllm_registrations() -> dict[str, str]:
    """vLLM's own registrations, as snapshot entries (``"CPU_ATTN"``, ``"mamba:MAMBA2"``).

    Read only where vLLM's registry is imported already (vLLM is never imported here); while
    attn_di's bridge is installed these dicts are views of attn_di's registrations, which the
    snapshot has anyway.
    """
    registry = sys.modules.get(VLLM_REGISTRY)
    if registry is None:
        return {}
    found: dict[str, str] = {}
    for attribute, prefix in (("_ATTN_OVERRIDES", ""), ("_MAMBA_ATTN_OVERRIDES", "mamba:")):
        overrides = getattr(registry, attribute, None)
        if type(overrides) is not dict:  # the bridge's views of attn_di's: in the snapshot
            continue
        for member, class_path in list(overrides.items()):
            name = getattr(member, "name", None)
            if isinstance(name, str) and isinstance(class_path, str) and class_path:
                found[prefix + name] = class_path
    return found


def propagation_refusal(container: object) -> str | None:
    """Why a change of ``container`` would not be written to ``ATTN_DI_REGISTRATIONS`` now
    (automatic propagation off, an explicit handle's snapshot in place, not the default
    container), or None when it would (asked by ``override(..., propagate=True)``)."""
    if not _auto[0]:
        return (
            "would not be written to ATTN_DI_REGISTRATIONS: automatic propagation is off "
            "(set_auto_propagation(False), ATTN_DI_AUTO_PROPAGATE=0, or a test's isolation)"
        )
    if _active_handles:
        return (
            "would not be written to ATTN_DI_REGISTRATIONS: a propagate_registrations() "
            "handle's snapshot is in place until it is restored"
        )
    if container is not DEFAULT.current:
        return (
            "would not be written to ATTN_DI_REGISTRATIONS: only the default container's "
            "(attn_di.get_container()) changes reach new processes"
        )
    return None


PROPAGATION.refusal = propagation_refusal


# Handles whose snapshot is in os.environ, oldest first, and the value before the first one.
_active_handles: list[PropagatedRegistrations] = []
_baseline: list[str | None] = [None]


class PropagatedRegistrations:
    """The registrations written to ``ATTN_DI_REGISTRATIONS``, until :meth:`restore`.

    Attributes:
        snapshot: ``{member name: dotted path}`` as exported.
        environ: ``{"ATTN_DI_REGISTRATIONS": json}``, for an explicit ``env=`` of a child.
        initializer: :func:`apply_snapshot`, picklable; with :attr:`initargs`, for
            ``multiprocessing.Pool`` / ``ProcessPoolExecutor`` (e.g. with a forkserver
            started before the registrations were made).
        initargs: ``(snapshot,)``.
    """

    initializer: Callable[[Mapping[str, str]], None]

    def __init__(self, snapshot: dict[str, str]) -> None:
        self.snapshot = snapshot
        self.environ = {REGISTRATIONS_ENV: encode_snapshot(snapshot)}
        self.initializer = apply_snapshot
        self.initargs = (snapshot,)
        self._active = False

    @property
    def active(self) -> bool:
        """True while the variable holds this snapshot (until restored)."""
        return self._active

    def apply(self) -> None:
        """Write the variable (done by :func:`propagate_registrations`)."""
        if not _active_handles:
            _baseline[0] = os.environ.get(REGISTRATIONS_ENV)
        _active_handles.append(self)
        os.environ.update(self.environ)
        self._active = True

    def restore(self) -> None:
        """Remove this snapshot: the variable then holds the newest handle still active, or the
        value it had before the first one (unset if none). Any restore order works; no-op if
        already restored."""
        if not self._active:
            return
        self._active = False
        _active_handles.remove(self)
        if _active_handles:
            os.environ.update(_active_handles[-1].environ)
        elif _baseline[0] is None:
            os.environ.pop(REGISTRATIONS_ENV, None)
        else:
            os.environ[REGISTRATIONS_ENV] = _baseline[0]
        _refresh(None)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return f"<PropagatedRegistrations {state}: {self.snapshot}>"


def apply_snapshot(snapshot: Mapping[str, str]) -> None:
    """Apply an exported snapshot to the default container (a pool ``initializer``).

    Idempotent: members that already exist (e.g. created from the environment at import)
    are registered again with the same path.
    """
    get_container().apply_registrations(snapshot)


def apply_inherited_registrations() -> None:
    """Apply ``ATTN_DI_REGISTRATIONS``, if set and not empty, to the default container.

    Called once by ``import attn_di``.

    Raises:
        RegistrationsEnvError: the value is not a JSON object of names to class paths, or a
            name or path in it is refused; nothing is applied.
    """
    encoded = os.environ.get(REGISTRATIONS_ENV)
    if not encoded:
        return
    try:
        snapshot = json.loads(encoded)
    except ValueError as error:
        raise RegistrationsEnvError(REGISTRATIONS_ENV, encoded, f"not JSON ({error})") from error
    except RecursionError as error:
        reason = "nested too deeply to be a snapshot (expected a flat JSON object)"
        raise RegistrationsEnvError(REGISTRATIONS_ENV, encoded[:200], reason) from error
    if not isinstance(snapshot, dict):
        reason = f"expected a JSON object {{name: class path}}, got {type(snapshot).__name__}"
        raise RegistrationsEnvError(REGISTRATIONS_ENV, encoded, reason)
    try:
        get_container().apply_registrations(snapshot)
    except BaseException as error:
        # Creating the default container rewrote the variable (automatic propagation): a
        # refused value stays as it was inherited, for every later import to refuse too.
        os.environ[REGISTRATIONS_ENV] = encoded
        if isinstance(error, AttnDIError):
            raise RegistrationsEnvError(REGISTRATIONS_ENV, encoded, error.message()) from error
        raise


def encode_snapshot(snapshot: Mapping[str, str]) -> str:
    """The compact JSON text of a snapshot (keys sorted: equal snapshots, equal values)."""
    return json.dumps(dict(snapshot), sort_keys=True, separators=(",", ":"))


def _refresh(container: object) -> None:
    """Write the default container's registrations into the environment (automatic mode).

    Called after every change (see :func:`attn_di._state.on_registrations_changed`): changes
    of another container than the default are ignored; an explicit handle, while active, wins.
    """
    if not _auto[0] or _active_handles:
        return
    default = DEFAULT.current
    if default is None or (container is not None and container is not default):
        return
    # Export and write together (the last writer has the newest state), warn after: a warning
    # an error filter turns into an exception never leaves the variable stale.
    with REGISTRY_LOCK:
        snapshot, skipped = default._export(strict=False)
        encoded = encode_snapshot(snapshot) if snapshot else ""
        too_large = len(encoded) > AUTO_LIMIT
        if too_large:
            # Past the OS limit on one variable, every subprocess would fail to start.
            os.environ.pop(REGISTRATIONS_ENV, None)
        elif encoded:
            os.environ[REGISTRATIONS_ENV] = encoded
        else:
            os.environ.pop(REGISTRATIONS_ENV, None)
    warn_unexportable(skipped)
    if too_large and not _warned_too_large:
        warnings.warn(
            f"{REGISTRATIONS_ENV} would hold {len(encoded)} bytes of registrations "
            f"(over {AUTO_LIMIT}): worker processes no longer inherit them; hand "
            "workers export_registrations() yourself (a pool initializer)",
            UnexportableBackendWarning,
            stacklevel=user_stacklevel(),
        )
        _warned_too_large.append(True)


on_registrations_changed(_refresh)
