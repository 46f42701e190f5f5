"""Drivers: how the kit calls a backend. :class:`Driver` is the contract; attn_di's interface
(:class:`~attn_di.backend.AttentionBackend` classes and anything shaped like them) has
:class:`InterfaceDriver`. A driver for another contract (vLLM's v1 backends) subclasses
:class:`Driver` and is made known with :func:`register_driver`.

A driver answers three questions about a cell: what the backend declares
(:meth:`Driver.capabilities`, :meth:`Driver.reasons`), how to make the layer's impl
(:meth:`Driver.make_impl`), and how to hand it the cell's batch in the backend's own cache
layout and metadata (:meth:`Driver.bind`, a :class:`BoundBatch`). The kit makes the batch
(random data, a dirty paged cache in the logical layout ``[2, num_blocks, block_size, H_kv,
D]``), the reference and the verdict.
"""

from __future__ import annotations

import abc
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from attn_di.backend import AttentionType, dtype_name, validate_backend_configuration
from attn_di.exceptions import InvalidInputError

if TYPE_CHECKING:
    import torch

    from attn_di.conformance._case import Case
    from attn_di.conformance._problem import Problem

__all__ = [
    "BoundBatch",
    "Capabilities",
    "Driver",
    "InterfaceDriver",
    "driver_classes",
    "register_driver",
]


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares, axis by axis: the kit explores declared values in its pairwise
    cells and probes each undeclared one once, expecting a refusal.

    Attributes:
        dtypes: model dtypes, canonical names (``"bfloat16"``).
        head_sizes: the declared head sizes, or None for any.
        block_size_ok: whether a KV-cache block size is accepted.
        attn_types: attention types (``"decoder"``, ``"encoder"``, ``"encoder_only"``, ...).
        sliding_window, softcap, alibi, sinks: whether each layer option is supported.
        output_buffer: whether ``forward`` takes an ``output=`` buffer.
        batch_invariant: whether the backend declares bitwise batch invariance.
        nan_tails: whether the unwritten slots of the blocks a batch uses (past each
            sequence's length in its last block) may hold NaN and Inf, as the kit's dirty
            cache has them. False where the contract keeps them finite (vLLM's engine
            zero-fills its cache and reuses blocks with their stale, finite keys and
            values): the matrix's cache cells then have :attr:`Case.finite_tails`, and a
            few cells with the kit's NaN tails probe what the backend does with them.
    """

    dtypes: tuple[str, ...]
    head_sizes: tuple[int, ...] | None
    block_size_ok: Callable[[int], bool]
    attn_types: tuple[str, ...]
    sliding_window: bool
    softcap: bool
    alibi: bool
    sinks: bool
    output_buffer: bool = True
    batch_invariant: bool = False
    nan_tails: bool = True


class BoundBatch(abc.ABC):
    """One cell's batch handed to one impl: the cache in the backend's layout and metadata.

    Every call of :meth:`forward` starts from the cache as the kit wrote it (keys and
    values of the cached prefixes, garbage everywhere else), so two calls are the same call.
    """

    @abc.abstractmethod
    def forward(self, output: torch.Tensor | None) -> torch.Tensor:
        """Run the impl's ``forward`` on the batch.

        Args:
            output: None, or an ``[N, H * D]`` buffer (padding rows included) to write into.

        Returns:
            ``[N, H * D]``: what the backend's caller reads (``output`` where given).
        """

    @abc.abstractmethod
    def cache(self) -> torch.Tensor | None:
        """The cache after the last :meth:`forward`, viewed in the logical layout
        ``[2, num_blocks, block_size, H_kv, D]`` (None without a cache)."""

    @abc.abstractmethod
    def forward_malformed(self, what: str) -> torch.Tensor:
        """``forward`` with one input malformed (one of :data:`~attn_di.conformance.BAD_INPUTS`);
        a conformant backend raises a typed error."""

    def cache_problem(self) -> str | None:
        """What the driver itself found wrong with the last :meth:`forward`'s cache write, for
        a cache :meth:`cache` cannot show in the logical layout (a block interior private to
        the backend, as vLLM's CPU backend packs it); None when it found nothing. The kit
        reports it as it reports its own comparison of :meth:`cache`."""
        return None


class Driver(abc.ABC):
    """The kit's view of one backend class through one contract.

    Args:
        backend_cls: the backend class.
        target: how the rerun commands name it (a member name or a class path).

    Attributes:
        name: the contract's name, shown in reports (``"attn_di"``).
    """

    name: ClassVar[str] = "attn_di"

    def __init__(self, backend_cls: Any, target: str) -> None:
        self.backend_cls = backend_cls
        self.target = target

    @classmethod
    @abc.abstractmethod
    def accepts(cls, backend_cls: object) -> bool:
        """Whether this driver can drive ``backend_cls``."""

    @property
    def backend_name(self) -> str:
        """The backend's ``get_name()`` (its class name if that fails)."""
        try:
            return str(self.backend_cls.get_name())
        except Exception:  # a broken get_name is the kit's finding, not its crash
            return str(getattr(self.backend_cls, "__name__", self.backend_cls))

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What the backend declares (the matrix's axis values follow from it)."""

    @abc.abstractmethod
    def reasons(self, case: Case) -> list[str]:
        """Why the backend does not declare ``case`` (its own words); empty when it does."""

    @abc.abstractmethod
    def make_impl(self, problem: Problem) -> Any:
        """The layer's impl for the cell's options (raises when the backend refuses them)."""

    @abc.abstractmethod
    def bind(self, impl: Any, problem: Problem) -> BoundBatch:
        """The cell's batch in the backend's cache layout and metadata, for ``impl``."""

    def subprocess_env(self) -> dict[str, str]:
        """Environment variables the subprocess of the ``bad_input`` cells needs to run the
        backend as this process does (none by default)."""
        return {}

    def environment(self) -> dict[str, str]:
        """Facts about the run shown in reports (torch version, CPU, threads, kernel path)."""
        import platform

        import torch

        facts = {
            "torch": str(torch.__version__),
            "cpu": platform.processor() or platform.machine(),
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "threads": str(torch.get_num_threads()),
        }
        return facts


_DRIVERS: list[tuple[type[Driver] | str, tuple[str, ...]]] = []
_DRIVERS_LOCK = threading.Lock()


def register_driver(driver: type[Driver] | str, *, bases: Sequence[str] = ()) -> None:
    """Make a driver known to target resolution; later registrations are tried first.

    Args:
        driver: a :class:`Driver` subclass, or its class path (imported when a target is
            first resolved, so registering costs no import).
        bases: class paths (``"pkg.mod:Cls"``); when given, the driver is imported and asked
            only for targets with one of them among their bases (their MRO), compared by
            name, so a driver for another framework's contract costs nothing, and needs
            nothing installed, for every other target.
    """
    entry = (driver, tuple(bases))
    with _DRIVERS_LOCK:
        if entry not in _DRIVERS:
            _DRIVERS.append(entry)


def driver_classes(backend_cls: object = None) -> list[type[Driver]]:
    """The registered drivers, most recent first, then :class:`InterfaceDriver`.

    Args:
        backend_cls: when given, drivers registered with ``bases`` that are not among its
            bases are left out (and not imported).
    """
    from attn_di._paths import import_class_path

    with _DRIVERS_LOCK:
        registered = list(_DRIVERS)
    mro = {
        f"{klass.__module__}:{klass.__qualname__}" for klass in getattr(backend_cls, "__mro__", ())
    }
    found: list[type[Driver]] = []
    for driver, bases in reversed(registered):
        if bases and backend_cls is not None and not mro.intersection(bases):
            continue
        found.append(import_class_path(driver, "driver") if isinstance(driver, str) else driver)
    return [*found, InterfaceDriver]


# vLLM's v1 backends: driven through vLLM's own contract (attn_di.integrations.vllm), imported
# only for a subclass of vLLM's AttentionBackend (so only where vLLM is installed).
register_driver(
    "attn_di.integrations.vllm._conformance:VllmDriver",
    bases=("vllm.v1.attention.backend:AttentionBackend",),
)


# -- attn_di's interface ---------------------------------------------------------------------

_BLOCK_PROBE = 16


class InterfaceDriver(Driver):
    """Drives a backend through attn_di's interface (:mod:`attn_di.backend`): class methods
    for what it declares, ``get_impl_cls()(num_heads, head_size, scale, ...)``,
    ``get_builder_cls()(block_size).build(...)``, the cache of ``get_kv_cache_shape`` laid
    out in ``get_kv_cache_stride_order``, and ``impl.forward(layer, query, key, value,
    kv_cache, attn_metadata, output=)``."""

    name: ClassVar[str] = "attn_di"

    @classmethod
    def accepts(cls, backend_cls: object) -> bool:
        """Any class with the interface's class methods (``AttentionBackendProtocol``)."""
        from attn_di.backend import AttentionBackendProtocol

        return isinstance(backend_cls, type) and isinstance(backend_cls, AttentionBackendProtocol)

    def _impl_flag(self, name: str) -> bool:
        try:
            impl_cls = self.backend_cls.get_impl_cls()
        except Exception:
            return False
        return bool(getattr(impl_cls, name, False))

    def capabilities(self) -> Capabilities:
        """From ``supported_dtypes``, ``get_supported_head_sizes``, ``supports_block_size``,
        ``supported_attn_types``, ``supports_sliding_window``, ``supports_sink``, the impl's
        ``supports_alibi`` / ``supports_logits_soft_cap``, ``accept_output_buffer``, and
        ``validate_configuration(use_batch_invariant=True)``."""
        backend = self.backend_cls
        sizes = tuple(int(s) for s in _call(backend, "get_supported_head_sizes", []))
        supports_block = getattr(backend, "supports_block_size", None)

        def block_size_ok(block_size: int) -> bool:
            return bool(supports_block(block_size)) if supports_block is not None else True

        window = _call(
            backend, "supports_sliding_window", self._impl_flag("supports_sliding_window")
        )
        invariant = False
        if "use_batch_invariant" in _keywords(backend.validate_configuration):
            head = sizes[0] if sizes else 64
            dtypes = [dtype_name(d) for d in backend.supported_dtypes]
            invariant = not backend.validate_configuration(
                head_size=head, dtype=dtypes[0] if dtypes else "float32", kv_cache_dtype="auto",
                block_size=None, use_mla=False, has_sink=False, use_sparse=False,
                device_capability=None, use_batch_invariant=True,
            )  # fmt: skip
        return Capabilities(
            dtypes=tuple(dtype_name(d) for d in backend.supported_dtypes),
            head_sizes=sizes or None,
            block_size_ok=block_size_ok,
            attn_types=tuple(str(AttentionType(t).value) for t in backend.supported_attn_types)
            if hasattr(backend, "supported_attn_types")
            else ("decoder",),
            sliding_window=bool(window),
            softcap=self._impl_flag("supports_logits_soft_cap"),
            alibi=self._impl_flag("supports_alibi"),
            sinks=bool(_call(backend, "supports_sink", False)),
            output_buffer=bool(getattr(backend, "accept_output_buffer", True)),
            batch_invariant=bool(invariant),
        )

    def reasons(self, case: Case) -> list[str]:
        """``validate_configuration``'s reasons (with ``has_sliding_window`` where it takes it,
        else ``supports_sliding_window``), then the impl's flags for ALiBi and soft cap, then
        ``accept_output_buffer`` for ``output=``."""
        backend = self.backend_cls
        extra: dict[str, Any] = {}
        keywords = _keywords(backend.validate_configuration)
        if "has_sliding_window" in keywords:
            extra["has_sliding_window"] = case.window is not None
        reasons = list(
            validate_backend_configuration(
                backend, head_size=case.head_size, dtype=case.dtype, kv_cache_dtype="auto",
                block_size=case.block_size if case.uses_cache else None, use_mla=False,
                has_sink=case.sinks, use_sparse=False, device_capability=None,
                attn_type=case.attn_type,
            )
            if not extra
            else backend.validate_configuration(
                head_size=case.head_size, dtype=case.dtype, kv_cache_dtype="auto",
                block_size=case.block_size if case.uses_cache else None, use_mla=False,
                has_sink=case.sinks, use_sparse=False, device_capability=None,
                attn_type=case.attn_type, **extra,
            )
        )  # fmt: skip
        caps = self.capabilities()
        if (
            case.window is not None
            and "has_sliding_window" not in keywords
            and not caps.sliding_window
        ):
            reasons.append("sliding window not supported")
        if case.alibi and not caps.alibi:
            reasons.append("ALiBi not supported (the impl's supports_alibi is False)")
        if case.softcap is not None and not caps.softcap:
            reasons.append(
                "logits soft cap not supported (the impl's supports_logits_soft_cap is False)"
            )
        if case.output and not caps.output_buffer:
            reasons.append("output= not accepted (accept_output_buffer is False)")
        return reasons

    def make_impl(self, problem: Problem) -> Any:
        """``get_impl_cls()(**options)`` by keyword: num_heads, head_size, scale, num_kv_heads,
        alibi_slopes, sliding_window, kv_cache_dtype ``"auto"``, logits_soft_cap, attn_type,
        sinks."""
        layer = problem.layer
        impl_cls = self.backend_cls.get_impl_cls()
        return impl_cls(
            num_heads=layer.num_heads,
            head_size=layer.head_size,
            scale=layer.scale,
            num_kv_heads=layer.num_kv_heads,
            alibi_slopes=layer.alibi_slopes,
            sliding_window=layer.window,
            kv_cache_dtype="auto",
            logits_soft_cap=layer.softcap,
            attn_type=layer.attn_type,
            sinks=layer.sinks,
        )

    def bind(self, impl: Any, problem: Problem) -> BoundBatch:
        """The cache allocated in the backend's shape and stride order, the metadata from its
        builder; padding tokens get slot -1."""
        return _InterfaceBatch(self.backend_cls, impl, problem)

    def subprocess_env(self) -> dict[str, str]:
        """``ATTN_DI_CPU_KERNEL=0`` where attn_di's CPU_ATTN kernel is off in this process
        (``pure_torch()`` is per process), so CPU_ATTN and its subclasses take the same path."""
        import sys

        if "attn_di.backends._cpu_kernel" in sys.modules:
            from attn_di.backends import _cpu_kernel

            if _cpu_kernel.paged_attention_op() is None:
                return {_cpu_kernel.ENV_SWITCH: "0"}
        return {}

    def _is_cpu_attn(self) -> bool:
        return any(
            klass.__module__ == "attn_di.backends.cpu_attn"
            for klass in getattr(self.backend_cls, "__mro__", ())
        )

    def environment(self) -> dict[str, str]:
        """Driver facts, plus CPU_ATTN's kernel path when the backend is attn_di's CPU_ATTN."""
        facts = super().environment()
        if self._is_cpu_attn():
            from attn_di.backends import _cpu_kernel

            facts["cpu_attn"] = (
                _cpu_kernel.kernel_status().describe()
                if _cpu_kernel.paged_attention_op() is not None
                else "pure torch"
            )
        return facts


class _InterfaceBatch(BoundBatch):
    def __init__(self, backend_cls: Any, impl: Any, problem: Problem) -> None:
        import torch

        self.impl = impl
        self.problem = problem
        self._initial: torch.Tensor | None = None
        self._cache: torch.Tensor
        if problem.cache is None:
            self._cache = torch.empty(0, dtype=problem.dtype)
        else:
            logical = problem.cache
            num_blocks, block_size, kv_heads, head_size = logical.shape[1:]
            shape = tuple(
                int(n)
                for n in backend_cls.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
            )
            if shape != tuple(logical.shape):
                raise InvalidInputError(
                    "get_kv_cache_shape",
                    f"returned {shape}; attn_di's interface lays the cache out as "
                    "[2, num_blocks, block_size, num_kv_heads, head_size] = "
                    f"{tuple(logical.shape)}",
                    hint="drive a backend of another layout with its own driver "
                    "(attn_di.conformance.register_driver)",
                )
            order = tuple(_call(backend_cls, "get_kv_cache_stride_order", tuple(range(5))))
            buffer = torch.empty(tuple(shape[axis] for axis in order), dtype=logical.dtype)
            inverse = tuple(order.index(axis) for axis in range(5))
            self._cache = buffer.permute(inverse)
            self._initial = logical
        builder = backend_cls.get_builder_cls()(problem.block_size)
        self.metadata = builder.build(
            problem.query_lens,
            problem.seq_lens,
            problem.block_table,
            causal=problem.causal,
        )
        if problem.pad:
            padding = torch.full((problem.pad,), -1, dtype=self.metadata.slot_mapping.dtype)
            self.metadata.slot_mapping = torch.cat([self.metadata.slot_mapping, padding])

    def _reset(self) -> None:
        if self._initial is not None:
            self._cache.copy_(self._initial)

    def forward(self, output: torch.Tensor | None) -> torch.Tensor:
        self._reset()
        problem = self.problem
        result = self.impl.forward(
            None, problem.query, problem.key, problem.value, self._cache, self.metadata,
            output=output,
        )  # fmt: skip
        return output if output is not None else result

    def cache(self) -> torch.Tensor | None:
        return self._cache if self._initial is not None else None

    def forward_malformed(self, what: str) -> torch.Tensor:
        import copy

        import torch

        self._reset()
        problem = self.problem
        query, key, value, kv_cache = problem.query, problem.key, problem.value, self._cache
        metadata = copy.copy(self.metadata)
        output = None
        if what == "query_shape":
            query = torch.cat([query, query[:, :1]], dim=1)
        elif what == "key_dtype":
            other = torch.float16 if key.dtype != torch.float16 else torch.float32
            key = key.to(other)
        elif what == "kv_heads":
            key = torch.cat([key, key[:, :1]], dim=1)
            value = torch.cat([value, value[:, :1]], dim=1)
        elif what == "cache_shape":
            kv_cache = torch.zeros(
                (*kv_cache.shape[:-1], kv_cache.shape[-1] + 1), dtype=kv_cache.dtype
            )
        elif what == "slot_range":
            slots = metadata.slot_mapping.clone()
            slots[0] = kv_cache.shape[1] * kv_cache.shape[2] + 3
            metadata.slot_mapping = slots
        elif what == "block_range":
            table = metadata.block_table.clone()
            table[0, 0] = kv_cache.shape[1] + 5
            metadata.block_table = table
        elif what == "seq_lens_count":
            metadata.seq_lens = torch.cat([metadata.seq_lens, metadata.seq_lens[:1]])
        elif what == "output_shape":
            output = torch.empty(
                query.shape[0], query.shape[1] * query.shape[2] + 1, dtype=query.dtype
            )
        else:
            raise InvalidInputError("bad_input", f"unknown malformation {what!r}")
        result = self.impl.forward(None, query, key, value, kv_cache, metadata, output=output)
        return result  # type: ignore[no-any-return]


def _call(owner: Any, method: str, default: Any) -> Any:
    function = getattr(owner, method, None)
    if function is None:
        return default
    return function()


def _keywords(function: Callable[..., Any]) -> Sequence[str]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()
