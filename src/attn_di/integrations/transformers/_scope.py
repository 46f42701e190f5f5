"""The model call a :class:`PagedCache` step belongs to, and the signal that it returned.

A step is one forward of the model: every decoder layer writes the step's keys and values
and advances nothing on its own. The cache begins the step at its first layer's ``update``,
and commits it only when the forward of the model that called it returns; a step whose
forward ended any other way (an exception anywhere, ``KeyboardInterrupt`` between layers)
is rolled back before the cache is read again.

Which forward: the outermost ``transformers.PreTrainedModel`` whose call is on the stack when
the step begins (``LlamaForCausalLM``, not ``LlamaModel`` inside it: the step ends after
``lm_head``), found by :func:`model_call` from torch's ``Module._call_impl`` frames.

When it returns: a forward hook of that model (:func:`watch`, registered at its first step
on a cache; deep copies carry it). torch reads a module's hooks when its call starts, and
skips them all for a module that had none; so that the first forward of every model object
that steps a cache is seen ending too (the model the cache was made for, a second model of
the same weights, a copy made before the first step), a no-op global forward pre-hook is
held (:func:`hold_hook_path`) for as long as a cache lives. torch then takes its hook path
for every module meanwhile: one call of the no-op per module call.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from attn_di.integrations.transformers._paged_cache import PagedCache

__all__ = [
    "ModelCall",
    "close_step",
    "hold_hook_path",
    "model_call",
    "open_step",
    "running",
    "watch",
]

_CALL_IMPL = torch.nn.Module._call_impl.__code__
# The caches with a step begun and not yet committed or rolled back (threads stepping their
# own caches on one model change it at once: under the lock).
_OPEN: weakref.WeakSet[PagedCache] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


def open_step(cache: PagedCache) -> None:
    """Note that ``cache`` has a step open (its model's forward hook will look)."""
    with _OPEN_LOCK:
        _OPEN.add(cache)


def close_step(cache: PagedCache) -> None:
    """Note that ``cache``'s step is committed or rolled back."""
    with _OPEN_LOCK:
        _OPEN.discard(cache)


@dataclass(frozen=True, eq=False)
class ModelCall:
    """One running call of a model.

    Attributes:
        model: the outermost transformers model on the stack.
        frame: its ``Module._call_impl`` frame (identifies this call among its calls).
        thread: the thread running it.
        hooked: whether torch runs the model's forward hooks when this call returns (the
            call started on torch's hook path).
    """

    model: PreTrainedModel
    frame: FrameType
    thread: int
    hooked: bool


def model_call() -> ModelCall | None:
    """The outermost transformers model call running in this thread, or None (a cache driven
    by hand, or through a compiled module)."""
    found: ModelCall | None = None
    callee: FrameType | None = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, PreTrainedModel):
                # On the hook path _call_impl runs its nested ``inner``; else the forward.
                hooked = callee is not None and callee.f_code.co_name == "inner"
                found = ModelCall(module, frame, threading.get_ident(), hooked)
        callee, frame = frame, frame.f_back
    return found


def running(call: ModelCall) -> bool:
    """Whether ``call`` is still on its thread's stack."""
    if call.thread == threading.get_ident():
        frame: FrameType | None = sys._getframe(1)
    else:
        frame = sys._current_frames().get(call.thread)
    while frame is not None:
        if frame is call.frame:
            return True
        frame = frame.f_back
    return False


def watch(model: PreTrainedModel) -> None:
    """Give ``model`` the forward hook that commits the steps begun in its calls (once)."""
    if _committed not in model._forward_hooks.values():
        model.register_forward_hook(_committed)


def hold_hook_path() -> Callable[[], None]:
    """Keep torch on its hook path for every module until the returned function is called
    (idempotent; :class:`PagedCache` calls it when garbage collected)."""
    with _hook_path_lock:
        _hook_path[0] += 1
        if _hook_path[1] is None:
            _hook_path[1] = torch.nn.modules.module.register_module_forward_pre_hook(_no_op)
    released = [False]

    def release() -> None:
        handle = None
        with _hook_path_lock:
            if released[0]:
                return
            released[0] = True
            _hook_path[0] -= 1
            if _hook_path[0] == 0:
                handle, _hook_path[1] = _hook_path[1], None
        if handle is not None:
            handle.remove()

    return release


_hook_path: list[Any] = [0, None]  # caches holding it, the global hook's handle
# Reentrant: a garbage collection inside a locked block may finalize a cache, which releases.
_hook_path_lock = threading.RLock()


def _no_op(module: torch.nn.Module, args: Any) -> None:
    """The global pre-hook whose presence alone puts torch on its hook path."""


def _committed(module: torch.nn.Module, args: Any, output: Any) -> None:
    """The model's forward returned: commit the steps begun in this very call."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    with _OPEN_LOCK:
        caches = list(_OPEN)
    for cache in caches:
        call = cache.open_call
        if call is not None and call.model is module and call.frame is frame:
            cache.commit_step()
