"""The conformance kit's driver for vLLM v1 attention backends: a backend is called as vLLM's
model runner calls it (vLLM 0.32's ``vllm/v1/attention/backend.py`` contract).

For each cell the driver builds what vLLM builds:

- a ``VllmConfig`` for the cell's dtype (a model config read from a one-file HF config in a
  temporary folder; nothing is downloaded);
- vLLM's own attention layer (``vllm.model_executor.layers.attention.Attention``) with
  ``attn_backend=`` the target, which constructs the impl with vLLM's positional arguments
  (sinks as the extra keyword vLLM's models pass) and registers itself where builders look
  for their layers; the encoder kinds go through vLLM's encoder-only wrapper of the backend
  (``create_encoder_only_attention_backend``: the same builder, ``causal=False``);
- the layer's KV-cache spec (``FullAttentionSpec`` with the cell's block size and window;
  ``EncoderOnlyAttentionSpec`` for the encoder kinds) passed through the backend's
  ``customize_spec``, and a cache made by vLLM's ``create_kv_cache_views`` over one int8
  buffer in the first layout the backend lists in ``supported_kv_cache_layouts()``;
- the metadata: the backend's builder ``get_builder_cls()(spec, [layer name], vllm_config,
  device)`` and its ``build(0, CommonAttentionMetadata(...), fast_build=False)`` each step;
- the step: ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` first when
  the backend says ``forward_includes_kv_cache_update = False``, then ``impl.forward(layer,
  query, key, value, kv_cache, metadata, output=[T, H, D])``. Padding tokens count in
  ``num_actual_tokens`` and have slot -1 (vLLM's ``PAD_SLOT_ID``), as vLLM pads.

The dirty cache: the whole buffer (every byte of every page, a packed interior included)
holds NaN, +Inf, -Inf and the dtype's largest values of both signs, cycling; except that,
vLLM's contract keeping them finite (``Capabilities.nan_tails`` is False), the pages of the
blocks the batch uses hold only the largest finite values of both signs in a
``finite_tails`` cell (every cache cell of the matrix but a few probes): vLLM's engine
allocates its KV cache zero-filled (``vllm/v1/worker/utils.py``) and zeroes new blocks only
for Mamba or mixed-precision caches (``KVCacheConfig.needs_kv_cache_zeroing``), so the
unwritten slots of a block in use hold zeros or an earlier request's keys and values, and
vLLM's CPU kernel weights the values of those slots by zero (``0 * NaN`` is NaN). The cached
prefixes are then written through the backend's own path (``do_kv_cache_update``; for a
backend whose ``forward`` writes the cache, a prefill step over the prefixes, as earlier steps
would have written them). A page's interior belongs to the backend (vLLM's CPU backend packs
it for its ISA), so :meth:`~attn_di.conformance.BoundBatch.cache` is None and the driver
checks what vLLM's contract does fix: ``forward`` of a backend with a separate update leaves
the cache byte for byte as the update left it, and a step changes no page that none of its
new tokens' slots maps to.

Declarations are vLLM's: ``supported_dtypes``, ``get_supported_head_sizes``,
``supports_block_size`` (``get_supported_kernel_block_sizes``), ``supports_attn_type``,
``supports_sliding_window``, ``supports_sink``, ``supports_batch_invariance`` and
``validate_configuration``'s reasons (through vLLM's ``AttentionSelectorConfig``, as vLLM's
platforms call it). vLLM has no class-level flag for ALiBi or the logits soft cap: an impl
refuses them when constructed, so the driver constructs one with each, once, and the
feature is declared when the impl accepts it. ``output=`` is always given in vLLM's contract
(the driver allocates it when the cell does not), so it is always declared.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from attn_di.conformance import BoundBatch, Capabilities, Driver
from attn_di.exceptions import InvalidBackendTypeError, InvalidInputError

__all__ = ["NAN_TAILS_REASON", "ONE_FORWARD_AT_A_TIME_REASON", "VLLM_BACKEND_BASE", "VllmDriver"]

VLLM_BACKEND_BASE = "vllm.v1.attention.backend:AttentionBackend"
"""The class path of vLLM's backend base class: the kit picks :class:`VllmDriver` for its
subclasses."""

_ENCODER_TYPES = ("encoder", "encoder_only")
_ATTN_TYPES = ("decoder", "encoder", "encoder_only")
_MAX_MODEL_LEN = 32768
_KEPT_LAYERS = 4
_PROBE_SOFTCAP = 2.0
_SPARE_PAGES = 8
"""Pages of garbage allocated past the cache's end: a backend that writes past it (a slot
out of range) writes there, where the driver sees it, not into the kit's own memory."""
_SPARE_ROWS = 4
"""Rows allocated past the end of the output the driver allocates, for the same reason."""

NAN_TAILS_REASON = (
    "NaN or Inf in the unwritten slots of a block in use are outside vLLM's contract: its "
    "engine zero-fills the KV cache and reuses blocks with their stale, finite keys and values"
)
"""Why a cache cell with the kit's NaN tails is not declared (see the module docstring)."""


ONE_FORWARD_AT_A_TIME_REASON = (
    "two threads calling forward at once are outside vLLM's contract: a vLLM process runs one "
    "layer's forward at a time (vLLM's CPU op keeps one scratchpad per process, "
    "cpu_utils::ScratchPadManager, and gives wrong or non-finite outputs when two threads share it)"
)
"""Why the vLLM driver does not run the ``threads`` cells (reported as refused with this)."""


class VllmDriver(Driver):
    """Drives a vLLM v1 ``AttentionBackend`` subclass through vLLM's contract (see the module
    docstring).

    Args:
        backend_cls: the vLLM backend class (vLLM's own, a plugin's, attn_di's adapter).
        target: how the rerun commands name it.

    Raises:
        InvalidBackendTypeError: an MLA or sparse backend (their impls take latent KV
            through ``forward_mqa``/``forward_mha``, not the kit's batches).
    """

    name: ClassVar[str] = "vllm"

    @staticmethod
    def unused_slot_values(dtype: torch.dtype) -> list[float]:
        """What every byte of the cache holds before the prefixes are written, cycling: NaN,
        +Inf, -Inf and the dtype's largest values of both signs (the kit's dirty cache)."""
        largest = float(torch.finfo(dtype).max)
        return [math.nan, math.inf, -math.inf, largest, -largest]

    @staticmethod
    def finite_slot_values(dtype: torch.dtype) -> list[float]:
        """What every byte of a page the batch uses holds, cycling, in a ``finite_tails``
        cell: the dtype's largest values of both signs (a slot given any weight errs
        hugely; one weighted by zero does not)."""
        largest = float(torch.finfo(dtype).max)
        return [largest, -largest]

    def __init__(self, backend_cls: Any, target: str) -> None:
        super().__init__(backend_cls, target)
        if _ask(backend_cls, "is_mla", False) or _ask(backend_cls, "is_sparse", False):
            raise InvalidBackendTypeError(
                "target",
                backend_cls,
                "a vLLM backend of standard attention (not MLA, not sparse)",
                hint="the kit's batches are query/key/value heads; an MLA backend's impl "
                "takes latent KV (forward_mqa / forward_mha)",
            )
        self._lock = threading.RLock()
        self._configs: dict[torch.dtype, Any] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._names = itertools.count()
        self._layers: list[tuple[Any, str]] = []
        self._caps: Capabilities | None = None
        self._refused: dict[str, str] = {}

    @classmethod
    def accepts(cls, backend_cls: object) -> bool:
        """Subclasses of vLLM's ``AttentionBackend`` (vLLM already imported: a class that
        subclasses it has imported it)."""
        module = sys.modules.get(VLLM_BACKEND_BASE.split(":")[0])
        base = getattr(module, "AttentionBackend", None)
        return isinstance(backend_cls, type) and base is not None and issubclass(backend_cls, base)

    # -- declarations -------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """vLLM's class-level answers; ALiBi and the soft cap by constructing an impl with
        each (once per driver)."""
        if self._caps is not None:
            return self._caps
        from vllm.v1.attention.backend import AttentionType

        backend = self.backend_cls
        dtypes = tuple(_dtype_name(d) for d in backend.supported_dtypes)
        sizes = tuple(int(s) for s in backend.get_supported_head_sizes())
        attn_types = tuple(t for t in _ATTN_TYPES if backend.supports_attn_type(AttentionType(t)))
        probe_dtype = _first_dtype(backend)
        probe_head = 64 if not sizes or 64 in sizes else sizes[0]
        for feature, options in (
            ("alibi", {"alibi_slopes": [2.0 ** (-8.0 * h / 4) for h in range(1, 5)]}),
            ("softcap", {"logits_soft_cap": _PROBE_SOFTCAP}),
        ):
            try:
                self._layer(probe_dtype, 4, 4, probe_head, "decoder", **options)
            except Exception as error:  # the impl's refusal is its declaration
                self._refused[feature] = f"{type(error).__name__}: {error}".strip()
        self._caps = Capabilities(
            dtypes=dtypes,
            head_sizes=sizes or None,
            block_size_ok=lambda block_size: bool(backend.supports_block_size(block_size)),
            attn_types=attn_types,
            sliding_window=bool(_ask(backend, "supports_sliding_window", False)),
            softcap="softcap" not in self._refused,
            alibi="alibi" not in self._refused,
            sinks=bool(_ask(backend, "supports_sink", False)),
            output_buffer=True,
            batch_invariant=bool(_ask(backend, "supports_batch_invariance", False)),
            nan_tails=False,
        )
        return self._caps

    def reasons(self, case: Any) -> list[str]:
        """``validate_configuration``'s reasons for the cell (vLLM's selector config of it),
        then the impl's refusals of ALiBi and the soft cap."""
        from vllm.platforms import current_platform
        from vllm.v1.attention.selector import AttentionSelectorConfig

        caps = self.capabilities()
        selector = AttentionSelectorConfig(
            head_size=case.head_size,
            dtype=getattr(torch, case.dtype),
            kv_cache_dtype="auto",
            block_size=case.block_size if case.uses_cache else None,
            has_sink=case.sinks,
            attn_type=case.attn_type,
            has_sliding_window=case.window is not None,
        )
        reasons = list(
            self.backend_cls.validate_configuration(
                device_capability=current_platform.get_device_capability(),
                **selector._asdict(),
            )
        )
        if case.alibi and not caps.alibi:
            reasons.append(f"ALiBi refused by the impl ({self._refused['alibi']})")
        if case.softcap is not None and not caps.softcap:
            reasons.append(f"logits soft cap refused by the impl ({self._refused['softcap']})")
        if case.uses_cache and not case.finite_tails:
            reasons.append(NAN_TAILS_REASON)
        if case.check == "threads":
            reasons.append(ONE_FORWARD_AT_A_TIME_REASON)
        return reasons

    # -- one cell -----------------------------------------------------------------------

    def make_impl(self, problem: Any) -> Any:
        """vLLM's attention layer for the cell (its ``impl`` is the backend's impl); the
        layer itself is what the step passes as ``layer``."""
        layer = problem.layer
        return self._layer(
            problem.dtype,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_size,
            layer.attn_type,
            scale=layer.scale,
            alibi_slopes=layer.alibi_slopes,
            logits_soft_cap=layer.softcap,
            per_layer_sliding_window=layer.window,
            sinks=layer.sinks,
        )

    def bind(self, impl: Any, problem: Any) -> BoundBatch:
        """The cell's cache (vLLM's view, dirty, prefixes written through the backend) and
        its builder."""
        with self._vllm(problem.dtype) as config:
            self._register(config, impl)
            return _VllmBatch(self, config, impl, problem)

    def environment(self) -> dict[str, str]:
        """The kit's facts, plus vLLM's version and the backend's KV-cache layout."""
        import vllm

        facts = super().environment()
        facts["vllm"] = str(getattr(vllm, "__version__", "?"))
        facts["kv_cache_layout"] = _layout(self.backend_cls).name
        return facts

    # -- vLLM's objects -----------------------------------------------------------------

    @contextlib.contextmanager
    def _vllm(self, dtype: torch.dtype) -> Iterator[Any]:
        """The dtype's ``VllmConfig``, current (``set_current_vllm_config``), vLLM's loggers
        quiet (its INFO lines would land in ``--json`` output)."""
        from vllm.config import set_current_vllm_config

        with self._lock, _quiet(logging.WARNING):
            config = self._configs.get(dtype)
            if config is None:
                with _quiet(logging.ERROR):  # warnings about the stand-in model's config
                    config = self._configs[dtype] = self._make_config(dtype)
            with set_current_vllm_config(config):
                yield config

    def _make_config(self, dtype: torch.dtype) -> Any:
        from vllm.config import ModelConfig, VllmConfig

        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="attn-di-conform-")
            hf_config = {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "num_hidden_layers": 1,
                "intermediate_size": 512,
                "vocab_size": 256,
                "max_position_embeddings": _MAX_MODEL_LEN,
            }
            with open(f"{self._folder.name}/config.json", "w") as file:
                json.dump(hf_config, file)
        model = ModelConfig(
            model=self._folder.name,
            dtype=dtype,
            skip_tokenizer_init=True,
            max_model_len=_MAX_MODEL_LEN,
        )
        return VllmConfig(model_config=model)

    def _layer(
        self,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        attn_type: str,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
        **options: Any,
    ) -> Any:
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.attention.encoder_only_attention import (
            create_encoder_only_attention_backend,
        )
        from vllm.v1.attention.backend import AttentionType

        backend = self.backend_cls
        if attn_type in _ENCODER_TYPES:
            backend = create_encoder_only_attention_backend(backend)
        extra = {} if sinks is None else {"sinks": sinks}
        name = f"attn_di_conformance.{next(self._names)}"
        with self._vllm(dtype) as config, _default_dtype(dtype):
            layer = Attention(
                num_heads,
                head_size,
                head_size**-0.5 if scale is None else scale,
                num_kv_heads=num_kv_heads,
                prefix=name,
                attn_type=AttentionType(attn_type),
                attn_backend=backend,
                **options,
                **extra,
            )
            self._layers.append((config, name))
            self._forget_old_layers()
        return layer

    def _register(self, config: Any, layer: Any) -> None:
        """``layer`` where builders look for their layers (again, if it was forgotten)."""
        context = config.compilation_config.static_forward_context
        if context.get(layer.layer_name) is not layer:
            context[layer.layer_name] = layer
            self._layers.append((config, layer.layer_name))
            self._forget_old_layers()

    def _forget_old_layers(self) -> None:
        """Only the last few layers stay in vLLM's static forward context (one per cell)."""
        while len(self._layers) > _KEPT_LAYERS:
            config, name = self._layers.pop(0)
            config.compilation_config.static_forward_context.pop(name, None)


class _VllmBatch(BoundBatch):
    """One cell's step on one vLLM layer (see the module docstring)."""

    def __init__(self, driver: VllmDriver, config: Any, layer: Any, problem: Any) -> None:
        from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, FullAttentionSpec

        self.driver = driver
        self.config = config
        self.layer = layer
        self.impl = layer.impl
        self.problem = problem
        self.backend = layer.attn_backend
        self.encoder = problem.layer.attn_type in _ENCODER_TYPES
        self.separate_update = not bool(self.backend.forward_includes_kv_cache_update)
        options = problem.layer
        dtype = problem.dtype
        if self.encoder:
            spec = EncoderOnlyAttentionSpec(
                block_size=problem.block_size,
                num_kv_heads=options.num_kv_heads,
                head_size=options.head_size,
                dtype=dtype,
            )
        else:
            spec = FullAttentionSpec(
                block_size=problem.block_size,
                num_kv_heads=options.num_kv_heads,
                head_size=options.head_size,
                dtype=dtype,
                sliding_window=options.window,
            )
        self.spec = self.backend.customize_spec(spec)
        self.builder = self.backend.get_builder_cls()(
            self.spec, [layer.layer_name], config, torch.device("cpu")
        )
        self._problem_found: str | None = None
        self.raw: torch.Tensor | None = None
        self._past_end = torch.empty(0, dtype=torch.int8)
        self._past_end_initial = self._past_end
        self.kv_cache = torch.empty(0, dtype=dtype)
        self._initial: torch.Tensor | None = None
        if problem.cache is not None:
            self._allocate()
            self._write_prefixes()
            assert self.raw is not None
            self._initial = self.raw.clone()

    # -- the cache ----------------------------------------------------------------------

    def _allocate(self) -> None:
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

        problem = self.problem
        num_blocks = int(problem.cache.shape[1])
        page = int(self.spec.page_size_bytes)
        storage = torch.empty(page * (num_blocks + _SPARE_PAGES), dtype=torch.int8)
        self.raw = storage[: page * num_blocks]
        self._past_end = storage[page * num_blocks :]
        _fill(self._past_end.view(problem.dtype), self.driver.unused_slot_values(problem.dtype))
        self._past_end_initial = self._past_end.clone()
        tensor = KVCacheTensor(
            size=page * num_blocks,
            layers=[self.layer.layer_name],
            layer_stride=page * num_blocks,
            block_stride=page,
        )
        (self.kv_cache,) = create_kv_cache_views(
            self.raw, self.spec, num_blocks, _layout(self.backend), tensor
        )
        _fill(self.raw.view(problem.dtype), self.driver.unused_slot_values(problem.dtype))
        if problem.case.finite_tails:
            pages = self.raw.view(num_blocks, page).view(problem.dtype)
            for block in _used_blocks(problem):
                _fill(pages[block], self.driver.finite_slot_values(problem.dtype))

    def _write_prefixes(self) -> None:
        """The cached prefixes, written as vLLM's earlier steps would have: through
        ``do_kv_cache_update``, or a prefill step over them where ``forward`` writes."""
        problem = self.problem
        rows = [i for i, s in enumerate(problem.sequences) if s.prefix_len > 0]
        if not rows:
            return
        keys = torch.cat([problem.sequences[i].prefix_keys for i in rows])
        values = torch.cat([problem.sequences[i].prefix_values for i in rows])
        slots = torch.cat([self._slots(i, 0, problem.sequences[i].prefix_len) for i in rows])
        if self.separate_update:
            self.impl.do_kv_cache_update(self.layer, keys, values, self.kv_cache, slots)
            return
        lengths = [problem.sequences[i].prefix_len for i in rows]
        query = torch.zeros(
            (int(keys.shape[0]), problem.layer.num_heads, problem.layer.head_size),
            dtype=problem.dtype,
        )
        table = problem.block_table[rows]
        metadata = self._build(lengths, lengths, table, slots, int(keys.shape[0]), causal=True)
        output = torch.empty(query.shape, dtype=problem.dtype)
        self.impl.forward(self.layer, query, keys, values, self.kv_cache, metadata, output=output)

    def _slots(self, row: int, start: int, stop: int) -> torch.Tensor:
        problem = self.problem
        positions = torch.arange(start, stop)
        block_size: int = problem.block_size
        table: torch.Tensor = problem.block_table
        blocks = table[row, positions // block_size].long()
        return blocks * block_size + positions % block_size

    # -- a step -------------------------------------------------------------------------

    def _build(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        *,
        causal: bool,
    ) -> Any:
        """The backend's metadata of a step, from vLLM's ``CommonAttentionMetadata``."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        starts = [0, *itertools.accumulate(query_lens)]
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        positions = [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=False)]
        padding = num_tokens - starts[-1]
        positions.append(torch.zeros(padding, dtype=torch.long))
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc.clone(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(query_lens),
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            causal=causal,
            positions=torch.cat(positions),
        )
        with self.driver._vllm(self.problem.dtype):
            return self.builder.build(0, common, fast_build=False)

    def _step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's block table and slot mapping (padding slots -1)."""
        problem = self.problem
        count = int(problem.query.shape[0])
        if problem.block_table is None:  # encoder kinds: the builder fills the slots
            table = torch.zeros((len(problem.query_lens), 1), dtype=torch.int32)
            return table, torch.full((count,), -1, dtype=torch.long)
        slots = torch.full((count,), -1, dtype=torch.long)
        slots[: problem.num_tokens] = problem.slots
        return problem.block_table.clone(), slots

    def forward(self, output: torch.Tensor | None) -> torch.Tensor:
        problem = self.problem
        table, slots = self._step_inputs()
        return self._step(problem.query, problem.key, problem.value, table, slots, output)

    def _step(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        table: torch.Tensor,
        slots: torch.Tensor,
        output: torch.Tensor | None,
        *,
        kv_cache: torch.Tensor | None = None,
        seq_lens: list[int] | None = None,
        out_view: torch.Tensor | None = None,
    ) -> torch.Tensor:
        problem = self.problem
        self._problem_found = None
        if self.raw is not None and self._initial is not None:
            self.raw.copy_(self._initial)
            self._past_end.copy_(self._past_end_initial)
        count = int(query.shape[0])
        layer = problem.layer
        metadata = self._build(
            problem.query_lens,
            problem.seq_lens if seq_lens is None else seq_lens,
            table,
            slots,
            count,
            causal=problem.causal,
        )
        if output is None:  # rows to spare past the end: see _SPARE_PAGES
            output = torch.full(
                (count + _SPARE_ROWS, layer.num_heads * layer.head_size),
                math.nan,
                dtype=problem.dtype,
            )[:count]
        view = out_view if out_view is not None else output.view(count, layer.num_heads, -1)
        cache = self.kv_cache if kv_cache is None else kv_cache
        if self.separate_update:
            self.impl.do_kv_cache_update(self.layer, key, value, cache, slots)
        updated = self.raw.clone() if self.raw is not None and self.separate_update else None
        self.impl.forward(self.layer, query, key, value, cache, metadata, output=view)
        if kv_cache is None:
            self._problem_found = self._check_cache(updated)
        return output

    def _check_cache(self, updated: torch.Tensor | None) -> str | None:
        """What vLLM's contract fixes about the cache after a step (module docstring)."""
        if self.raw is None or self._initial is None:
            return None
        if not torch.equal(self._past_end, self._past_end_initial):
            changed = int((self._past_end != self._past_end_initial).sum())
            return f"the step wrote {changed} byte(s) past the end of the KV cache"
        if updated is not None and not torch.equal(self.raw, updated):
            changed = int((self.raw != updated).sum())
            return (
                f"forward changed {changed} byte(s) of the KV cache; the backend declares "
                "forward_includes_kv_cache_update = False, so only do_kv_cache_update may "
                "write it"
            )
        problem = self.problem
        pages = _changed_pages(self.kv_cache, self._initial_view())
        allowed = set((problem.slots // problem.block_size).tolist())
        stray = sorted(set(pages) - allowed)
        if stray:
            return (
                f"the step changed {len(stray)} page(s) of the KV cache that no new token's "
                f"slot maps to (first: block {stray[0]})"
            )
        return None

    def _initial_view(self) -> torch.Tensor:
        """The initial cache, viewed as :attr:`kv_cache` views the buffer."""
        assert self._initial is not None
        offset = self.kv_cache.storage_offset() * self.kv_cache.element_size()
        source = self._initial.view(self.kv_cache.dtype)
        return source.as_strided(
            self.kv_cache.shape,
            self.kv_cache.stride(),
            offset // self.kv_cache.element_size(),
        )

    def cache(self) -> torch.Tensor | None:
        """None: a page's interior is the backend's own (:meth:`cache_problem` checks what
        vLLM's contract fixes)."""
        return None

    def cache_problem(self) -> str | None:
        return self._problem_found

    def forward_malformed(self, what: str) -> torch.Tensor:
        """One input malformed, handed to the backend as vLLM would hand it."""
        problem = self.problem
        query, key, value = problem.query, problem.key, problem.value
        table, slots = self._step_inputs()
        count = int(query.shape[0])
        layer = problem.layer
        extra: dict[str, Any] = {}
        if what == "query_shape":
            query = torch.cat([query, query[:, :1]], dim=1)
        elif what == "key_dtype":
            other = torch.float16 if key.dtype != torch.float16 else torch.float32
            key = key.to(other)
        elif what == "kv_heads":
            key = torch.cat([key, key[:, :1]], dim=1)
            value = torch.cat([value, value[:, :1]], dim=1)
        elif what == "cache_shape":
            shape = list(self.kv_cache.shape) if self.kv_cache.dim() == 4 else [4, 1, 16, 2]
            shape[-1] += 2
            extra["kv_cache"] = torch.zeros(shape, dtype=problem.dtype)
        elif what == "slot_range":
            slots[0] = int(self.kv_cache.shape[0]) * problem.block_size + 3
        elif what == "block_range":
            table[0, 0] = int(self.kv_cache.shape[0]) + 5
        elif what == "seq_lens_count":
            extra["seq_lens"] = [*problem.seq_lens, problem.seq_lens[0]]
        elif what == "output_shape":
            extra["out_view"] = torch.empty(
                (count, layer.num_heads, layer.head_size + 1), dtype=problem.dtype
            )
        else:
            raise InvalidInputError("bad_input", f"unknown malformation {what!r}")
        return self._step(query, key, value, table, slots, None, **extra)


# -- helpers -------------------------------------------------------------------------------


def _fill(flat: torch.Tensor, values: list[float]) -> None:
    """``flat`` (one dimension) cycling through ``values``."""
    pattern = torch.tensor(values, dtype=flat.dtype)
    flat.copy_(pattern.repeat(flat.numel() // len(values) + 1)[: flat.numel()])


def _used_blocks(problem: Any) -> list[int]:
    """The blocks the batch's sequences use (their block-table columns up to their length)."""
    block_size: int = problem.block_size
    used: set[int] = set()
    for row, length in enumerate(problem.seq_lens):
        count = -(-int(length) // block_size)
        used.update(int(b) for b in problem.block_table[row, :count])
    return sorted(used)


def _ask(owner: Any, method: str, default: Any) -> Any:
    function = getattr(owner, method, None)
    return default if function is None else function()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _first_dtype(backend: Any) -> torch.dtype:
    dtypes: list[torch.dtype] = list(backend.supported_dtypes)
    return torch.float32 if torch.float32 in dtypes or not dtypes else dtypes[0]


def _layout(backend: Any) -> Any:
    """The KV-cache layout vLLM would pick for a worker running only ``backend``."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    return get_supported_kv_cache_layouts([backend])[0]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _changed_pages(after: torch.Tensor, before: torch.Tensor) -> list[int]:
    """Blocks (axis 0) where any element differs bit for bit (NaN-safe)."""
    bits = _BITS[after.element_size()]
    differs = after.view(bits) != before.view(bits)
    return [int(i) for i in differs.reshape(differs.shape[0], -1).any(dim=1).nonzero().flatten()]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """vLLM's layer takes the model dtype from ``torch.get_default_dtype()``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _quiet(level: int) -> Iterator[None]:
    """vLLM's logger at ``level`` at least (it writes to stdout by default)."""
    logger = logging.getLogger("vllm")
    previous = logger.level
    logger.setLevel(max(previous, level))
    try:
        yield
    finally:
        logger.setLevel(previous)
