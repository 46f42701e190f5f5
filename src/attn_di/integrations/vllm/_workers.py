"""What the driver announces is what every worker runs: the check made before vLLM starts
processes of its own, and the environment Ray workers get.

vLLM runs attention in other processes than the one that builds the engine: one worker per
tensor- or pipeline-parallel rank (other processes even with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one engine core per data-parallel rank, and, by
default (``VLLM_ENABLE_V1_MULTIPROCESSING`` on, ``AsyncLLM``, the server), the engine core
itself. Those processes inherit the environment and nothing else: registrations reach them
through ``ATTN_DI_REGISTRATIONS`` and attn_di's ``vllm.general_plugins`` entry point (which
installs the bridge there); an override block, or a bridge installed by hand where vLLM's
processes will not load attn_di's plugin, does not.

:func:`check_reach` compares, for the member vLLM's platform will ask for, what this process
resolves (where attn_di holds something for it) with what those processes will resolve, and
raises :class:`~attn_di.exceptions.BackendNotPropagatedError` before any of them starts when
the two differ. :func:`install` runs it after ``EngineArgs.create_engine_config`` (parallel
ranks) and before vLLM's multiprocess engine client starts the engine core
(``MPClient.__init__``, the base of every multiprocess client).

Ray: vLLM's older Ray executor copies only environment variables with vLLM's prefixes into
its workers; :func:`install` adds ``ATTN_DI_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``
(vLLM's additive list), keeping what was there, and its undo removes only that entry.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from enum import Enum
from importlib import metadata
from typing import TYPE_CHECKING, Any, NoReturn

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.core_client import MPClient

from attn_di.exceptions import AttnDIError, BackendNotPropagatedError

if TYPE_CHECKING:
    from attn_di.integrations.vllm._bridge import Side

__all__ = [
    "ATTN_DI_PREFIX",
    "RAY_PREFIXES_ENV",
    "check_reach",
    "install",
    "processes_elsewhere",
]

RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
"""vLLM's comma-separated list of extra prefixes its Ray executor copies into workers."""
ATTN_DI_PREFIX = "ATTN_DI_"
"""attn_di's variables (``ATTN_DI_REGISTRATIONS``, ``ATTN_DI_PLUGINS``, its switches)."""

_REGISTRATIONS_ENV = "ATTN_DI_REGISTRATIONS"
_PLUGIN_GROUP = "vllm.general_plugins"
_PLUGIN_NAME = "attn_di"
_ENGINE_CORE = (
    "vLLM's engine core process (the multiprocess engine: VLLM_ENABLE_V1_MULTIPROCESSING "
    "on, AsyncLLM or the server)"
)
_logger = logging.getLogger(__name__)


def install() -> Callable[[], None]:
    """Check before vLLM starts processes of its own; let Ray copy attn_di's variables.

    Wraps ``EngineArgs.create_engine_config`` (after vLLM's own, :func:`check_reach` for the
    parallel ranks) and ``MPClient.__init__`` (before vLLM's own, for the engine core
    process), and appends ``ATTN_DI_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``.

    Returns:
        The function that puts the originals and the variable back.
    """
    original_create = vars(EngineArgs)["create_engine_config"]
    original_init = vars(MPClient)["__init__"]

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original_create(self, *args, **kwargs)
        processes = processes_elsewhere(config)
        if processes is not None:
            check_reach(config, processes)
        return config

    def mp_client_init(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[1] if len(args) > 1 else None)
        if vllm_config is not None:
            check_reach(vllm_config, processes_elsewhere(vllm_config) or _ENGINE_CORE)
        original_init(self, *args, **kwargs)

    create_engine_config.__doc__ = original_create.__doc__
    mp_client_init.__doc__ = original_init.__doc__
    EngineArgs.create_engine_config = create_engine_config
    MPClient.__init__ = mp_client_init
    undo_ray = _add_ray_prefix()

    def undo() -> None:
        undo_ray()
        MPClient.__init__ = original_init
        if vars(EngineArgs).get("create_engine_config") is create_engine_config:
            EngineArgs.create_engine_config = original_create

    return undo


def processes_elsewhere(vllm_config: Any) -> str | None:
    """The processes other than the engine core that run the model's attention, in words
    (``"the 2 worker processes of tensor_parallel_size=2"``), or None when the engine core
    runs it itself (one rank, vLLM's in-process executor).

    An executor vLLM does not name (a class of the user's) is not judged: None.
    """
    parallel = vllm_config.parallel_config
    sizes = {
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
    }
    data_parallel = int(parallel.data_parallel_size)
    executor = parallel.distributed_executor_backend
    found = []
    if data_parallel > 1:
        found.append(
            f"the {data_parallel} engine core processes of data_parallel_size={data_parallel}"
        )
    ranks = sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]
    if executor in ("mp", "ray") or (ranks > 1 and executor is None):
        named = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
        how = named or f"vLLM's {executor} executor (distributed_executor_backend={executor!r})"
        workers = "worker process" if ranks == 1 else f"{ranks} worker processes"
        found.append(f"the {workers} of {how}")
    return " and ".join(found) or None


def check_reach(vllm_config: Any, processes: str) -> None:
    """Refuse an engine whose other processes would run another backend than this process
    resolves for the member vLLM's platform asks for.

    Only where attn_di holds something for that member (a registration or an override):
    vLLM's own backends are vLLM's to start. ``processes`` names where attention runs.

    Raises:
        BackendNotPropagatedError: an override block (not entered with ``propagate=True``),
            a registration ``ATTN_DI_REGISTRATIONS`` does not carry, or a bridge that vLLM's
            processes will not install (``VLLM_PLUGINS`` without ``attn_di``,
            ``ATTN_DI_VLLM_BRIDGE=0``, no entry point); names the member, what it resolves
            to here, the processes, the reason and the fix.
        EnvSwitchError: ``ATTN_DI_VLLM_BRIDGE`` holds something other than on/off.
    """
    chosen = _chosen_member(vllm_config)
    if chosen is None:
        return
    side, member = chosen
    if not side.overridden(member):
        return
    container = side.container()
    counterpart = side.counterpart(member)
    here = str(container.get_path(counterpart))
    source = str(container.source(counterpart))
    vllm_own = f"vLLM's own {member.value or member.name}"
    bridge = _bridge_missing()
    if bridge is not None:
        reason, hint = bridge
        _refuse(
            vllm_config,
            BackendNotPropagatedError(member.name, here, source, processes, reason, vllm_own, hint),
        )
    key = ("mamba:" if side.mamba else "") + member.name
    there = _inherited().get(key)
    if there == here:
        return
    _refuse(
        vllm_config,
        BackendNotPropagatedError(
            member.name, here, source, processes, _why_not(source, there), there or vllm_own
        ),
    )


def _refuse(vllm_config: Any, error: BackendNotPropagatedError) -> NoReturn:
    """Raise ``error``, unless this process's own start-up check refuses the backend first
    (a path that does not import here, a backend refusing the model): that error is the one
    to fix, wherever the backend would run. The check runs without announcing the backend."""
    from attn_di.integrations.vllm._selector import check_engine_config, quiet_announcements

    with quiet_announcements():
        check_engine_config(vllm_config)
    raise error


def _chosen_member(vllm_config: Any) -> tuple[Side, Enum] | None:
    """The side and vLLM member whose path vLLM's platform answers with for the model's
    attention (as the start-up check asks), or None where that cannot be told."""
    from attn_di.integrations.vllm._selector import _selector_configs, platform_choice

    try:
        configs, backend = _selector_configs(vllm_config)
    except Exception:  # vLLM's configuration object changed shape: nothing to check
        _logger.debug("attn_di: no check of the worker processes' backend", exc_info=True)
        return None
    if not configs:  # MLA or attention-free: no attention backend to compare
        return None
    config = configs[0]  # vLLM-CPU answers CPU_ATTN for every attention type
    try:
        choice = platform_choice(vllm_config, config, backend)
    except AttnDIError:  # the start-up check raises it, after this check
        return None
    return None if choice is None else choice[2]


def _bridge_missing() -> tuple[str, str] | None:
    """Why vLLM's processes will not install attn_di's bridge (reason, fix), or None."""
    from attn_di.integrations.vllm._bridge import BRIDGE_ENV, BRIDGE_SWITCH

    allowlist = os.environ.get("VLLM_PLUGINS")
    if allowlist is not None and _PLUGIN_NAME not in allowlist.split(","):
        return (
            f"VLLM_PLUGINS={allowlist!r} does not name attn_di, so vLLM's processes do not "
            "load attn_di's plugin and its bridge is installed only here",
            f"add attn_di to the list (VLLM_PLUGINS={_PLUGIN_NAME},{allowlist}) or unset "
            "VLLM_PLUGINS",
        )
    if not BRIDGE_SWITCH.read():
        return (
            f"{BRIDGE_ENV}={os.environ.get(BRIDGE_ENV)!r} keeps attn_di's plugin from "
            "installing the bridge in vLLM's processes",
            f"unset {BRIDGE_ENV} (or set it to 1) before the engine starts",
        )
    if not metadata.entry_points(group=_PLUGIN_GROUP, name=_PLUGIN_NAME):
        return (
            f"no {_PLUGIN_GROUP!r} entry point named {_PLUGIN_NAME!r} is installed (attn_di "
            "is importable here but not installed as a distribution), so vLLM's processes "
            "never install the bridge",
            "install attn_di into vLLM's environment (in attn_di's clone: pip install "
            "--no-deps -e .)",
        )
    return None


def _inherited() -> dict[str, str]:
    """What processes started now inherit in ``ATTN_DI_REGISTRATIONS`` (empty if unset or
    unreadable: then they refuse it themselves, naming it)."""
    try:
        snapshot = json.loads(os.environ.get(_REGISTRATIONS_ENV) or "{}")
    except ValueError:
        return {}
    return snapshot if isinstance(snapshot, dict) else {}


def _why_not(source: str, there: str | None) -> str:
    """Why the other processes would resolve something else, from where this one's comes."""
    if source == "override":
        return (
            "an override block holds only in the process that entered it (unless entered "
            "with propagate=True)"
        )
    if source == "local override":
        return "a local override block holds only in its own thread or task of this process"
    if source == "di override":
        return "dependency-injector's own provider override holds only in this process"
    if there is None:
        return (
            f"{_REGISTRATIONS_ENV} does not carry it (automatic propagation is off, or the "
            "class has no importable path)"
        )
    return (
        f"{_REGISTRATIONS_ENV} carries {there} for it (a propagate_registrations() snapshot "
        "made before the registration?)"
    )


def _add_ray_prefix() -> Callable[[], None]:
    """Append ``ATTN_DI_`` to vLLM's extra Ray prefixes; returns the undo, which removes
    only that entry (and the variable, where attn_di created it and nothing else is left)."""
    before = os.environ.get(RAY_PREFIXES_ENV)
    entries = [entry.strip() for entry in (before or "").split(",") if entry.strip()]
    if ATTN_DI_PREFIX in entries:
        return lambda: None
    os.environ[RAY_PREFIXES_ENV] = ",".join([*entries, ATTN_DI_PREFIX])

    def undo() -> None:
        current = os.environ.get(RAY_PREFIXES_ENV)
        if current is None:
            return
        kept = [e for e in current.split(",") if e.strip() and e.strip() != ATTN_DI_PREFIX]
        if kept or before is not None:
            os.environ[RAY_PREFIXES_ENV] = ",".join(kept)
        else:
            os.environ.pop(RAY_PREFIXES_ENV, None)

    return undo
