"""``PagedCache``: a ``transformers.Cache`` that keeps each layer's keys and values in the
attention backend's own paged layout (vLLM's block tables and slot mappings).

How it meets transformers: every attention layer calls ``cache.update(key, value, layer_idx)``
right before its attention function. The paged cache stores nothing there: it starts a new
step when a layer comes round again, hands the new keys/values back unchanged and leaves a
note (:data:`PENDING`) that the attention function picks up. The attention function then asks
the cache for the step's :class:`StepBatch` (block table, slot mapping, built once per step for
all layers) and the layer's cache tensor, and the backend's impl writes the new keys/values
through ``slot_mapping`` and reads the history through ``block_table``.

Sequences are the rows of the batch; padding tokens (a 2-D ``attention_mask`` of 0) take no
cache slot, so a left-padded row's positions start at 0 on its first real token.
"""

from __future__ import annotations

import math
import re
import threading
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache, PretrainedConfig
from transformers.cache_utils import CacheLayerMixin

from attn_di._selection import _positive_int, canonical_dtype
from attn_di.exceptions import (
    InvalidBackendTypeError,
    InvalidInputError,
    UnsupportedFeatureError,
)
from attn_di.integrations.transformers._scope import (
    ModelCall,
    close_step,
    hold_hook_path,
    model_call,
    open_step,
    running,
    watch,
)

if TYPE_CHECKING:
    from attn_di.backend import AttentionMetadata

__all__ = [
    "MAX_BLOCK_SIZE",
    "PENDING",
    "PagedCache",
    "StepBatch",
    "is_attn_di_name",
    "transformers_name",
]

MAX_BLOCK_SIZE = 65536
"""The largest ``block_size`` a :class:`PagedCache` accepts (tokens per block)."""

PENDING: ContextVar[tuple[PagedCache, int] | None] = ContextVar(
    "attn_di_paged_pending", default=None
)
"""``(cache, layer_idx)`` of the last ``PagedCache.update`` in this thread, until the attention
function of that layer takes it."""


def is_attn_di_name(name: object) -> bool:
    """Whether ``name`` is one of attn_di's transformers attention names (``attn_di[:MEMBER]``)."""
    return isinstance(name, str) and (name == "attn_di" or name.startswith("attn_di:"))


_TRANSFORMERS_WORDS = re.compile(r"flash|sdpa|flex_attention")


def transformers_name(member_name: str) -> str:
    """The transformers name of the member named ``member_name`` (exactly): ``"attn_di:"``
    and the name, so members that differ only by case (``MY_X``, ``my_x``) get names of their
    own. transformers reads a lowercase ``flash``, ``sdpa`` or ``flex_attention`` anywhere in
    an implementation name as a request for its own implementation of that kind, so a ``.``
    follows the first letter of each (``my_flash`` -> ``"attn_di:my_f.lash"``); a member name
    holds no ``.``, so the names stay one per member."""
    escaped = _TRANSFORMERS_WORDS.sub(lambda word: f"{word[0][0]}.{word[0][1:]}", member_name)
    return f"attn_di:{escaped}"


@dataclass
class StepBatch:
    """One forward step of a :class:`PagedCache`: which tokens are real, and their cache slots.

    Attributes:
        step: the cache's step counter when this was built.
        batch_size: B, rows of the model's batch.
        query_len: q, columns of the step's padded query window.
        batch_index: ``[N]`` int64 row of each real query token, or None when all B * q are real.
        column_index: ``[N]`` int64 column (in the query window) of each real query token.
        query_lens: ``[B]`` real new tokens per row.
        seq_lens: ``[B]`` real tokens per row after this step (cached prefix included).
        block_table: ``[B, max_blocks]`` int32 cache block numbers of each row.
        metadata: the backend metadata of this step, one per builder class.
    """

    step: int
    batch_size: int
    query_len: int
    batch_index: torch.Tensor | None
    column_index: torch.Tensor | None
    query_lens: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    metadata: dict[type[Any], AttentionMetadata] = field(default_factory=dict)

    def metadata_for(self, backend_cls: Any, block_size: int) -> AttentionMetadata:
        """The step's metadata built by ``backend_cls``'s builder (built once per builder class)."""
        builder_cls = backend_cls.get_builder_cls()
        metadata = self.metadata.get(builder_cls)
        if metadata is None:
            builder = builder_cls(block_size)
            metadata = builder.build(self.query_lens, self.seq_lens, self.block_table)
            self.metadata[builder_cls] = metadata
        return metadata


class _PagedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's entry in ``PagedCache.layers`` (transformers inspects these).

    The tensors live in the owning :class:`PagedCache`; this object only answers the
    questions transformers asks of a layer.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: PagedCache, layer_idx: int, is_sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = weakref.ref(owner)  # no cycle: a cache is freed as soon as unused
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.is_initialized = True

    @property
    def owner(self) -> PagedCache:
        """The :class:`PagedCache` this layer belongs to."""
        owner = self._owner()
        if owner is None:
            raise ReferenceError("the PagedCache of this layer no longer exists")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the owner allocates on the first attention call."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Delegates to :meth:`PagedCache.update`."""
        return self.owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the padded 2-D mask: every column seen plus the query."""
        return self.owner.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        """Columns of the padded batch seen so far."""
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        """-1: the cache grows (or is bounded by blocks, not by a length)."""
        return -1

    def reset(self) -> None:
        """Nothing per layer: :meth:`PagedCache.reset` frees the blocks."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: see :meth:`PagedCache.reorder_cache`."""
        self.owner.reorder_cache(beam_idx)


class PagedCache(Cache):
    """A paged KV cache in the attention backend's layout, for ``model.generate`` and ``forward``.

    Each decoder layer gets one tensor of ``backend_cls.get_kv_cache_shape(num_blocks,
    block_size, num_kv_heads, head_size)`` (attn_di's backends: ``[2, num_blocks, block_size,
    H_kv, D]``, vLLM's FlashAttention layout), allocated with ``torch.empty`` on the layer's
    first call, as a server would. Each row of the batch is a sequence with its own list of
    blocks, taken from a free list as it grows and given back by :meth:`reset`.

    Pass it as the model's cache argument (``cache=`` in transformers 5) of a model loaded
    with an attn_di attention implementation (``attn_implementation="attn_di"``)::

        cache = PagedCache(model.config)
        model.generate(**inputs, cache=cache, max_new_tokens=32)

    Args:
        config: the model's config (``model.config``); the decoder's layer count, KV heads,
            head size and layer types are read from it.
        block_size: tokens per cache block (16 by default, vLLM's default).
        num_blocks: blocks per layer; None (the default) starts small and doubles the pool
            whenever a step needs more blocks than are free.
        dtype: the cache dtype (a ``torch.dtype`` or a name such as ``"bfloat16"``/``"bf16"``);
            it must be the model's compute dtype. None (the default): the dtype of the first
            keys it is given.
        device: the cache device (``torch.device`` or a name such as ``"cpu"``); None: the
            device of the first keys it is given.
        fill_value: None (the default) allocates uninitialised memory (``torch.empty``);
            a number fills new blocks with it, e.g. ``float("nan")`` in tests, to prove
            that slots a sequence does not cover never reach the output.

    Raises:
        InvalidInputError: a ``block_size`` or ``num_blocks`` that is not a positive int (or a
            ``block_size`` over :data:`MAX_BLOCK_SIZE`, or one that does not divide the
            ``attention_chunk_size`` of a model with chunked layers), a config without
            ``num_hidden_layers`` / ``num_attention_heads``, an unknown or non-float
            ``dtype``, a ``device`` torch cannot parse or allocate on, a non-numeric
            ``fill_value``.
        InvalidBackendTypeError: ``config`` is not a transformers config (e.g. the model, or a
            dict).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fill_value: float | None = None,
    ) -> None:
        layout = _Layout.of(config)
        self.config = config
        self.block_size = _positive_int("block_size", block_size, "block_size=16")
        if self.block_size > MAX_BLOCK_SIZE:
            raise InvalidInputError(
                "block_size",
                f"{self.block_size} tokens per block is more than {MAX_BLOCK_SIZE}: every "
                "sequence takes at least one block in every layer",
                hint="use a small block_size such as 16 (vLLM's default); the pool grows in blocks",
            )
        chunk = layout.chunk_size
        if chunk is not None and chunk % self.block_size:
            divisor = max(d for d in range(1, self.block_size + 1) if chunk % d == 0)
            raise InvalidInputError(
                "block_size",
                f"{self.block_size} does not divide the model's attention_chunk_size {chunk}: "
                "a chunked layer reads each chunk from the start of a block",
                hint=f"use a block_size that divides {chunk}, e.g. "
                f"PagedCache(config, block_size={divisor})",
            )
        self._fixed_blocks = (
            None
            if num_blocks is None
            else _positive_int("num_blocks", num_blocks, "num_blocks=1024")
        )
        self.num_kv_heads: int = layout.num_kv_heads
        self.head_size: int = layout.head_size
        self.dtype = _dtype(dtype)
        self.device = _device(device)
        self.fill_value = _fill_value(fill_value)
        layers = [_PagedLayer(self, index, sliding) for index, sliding in enumerate(layout.sliding)]
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self._layout = layout
        self._kv_caches: dict[int, torch.Tensor] = {}
        self._layout_cls: Any = None
        self._compatible: set[Any] = set()
        self._capacity = 0
        self._free: list[int] = []
        self._tables: list[list[int]] = []
        self._seq_lens: list[int] = []
        self._columns = 0
        self._step = 0
        self._updated: set[int] = set()
        self._batch: StepBatch | None = None
        # What the attention function worked out once for all layers of the current step
        # (emptied when a step starts).
        self.step_memo: dict[str, Any] = {}
        # (columns, seq_lens, blocks per sequence, pool size) before the current step, for
        # abandon_step and for readers in other threads while the step runs.
        self._before: tuple[int, list[int], list[int], int] = (0, [], [], 0)
        # The model call of the step begun and not yet committed (see _scope), or None.
        self._open: ModelCall | None = None
        # While the cache lives, torch runs module hooks: the return of the first forward of
        # any model that steps it is seen (see _scope).
        weakref.finalize(self, hold_hook_path())

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, transformers' prompt-reuse pattern; ``copy.copy``; an
        unpickled cache) holds torch's hook path as the cache it was made from does."""
        self.__dict__.update(state)
        weakref.finalize(self, hold_hook_path())

    # -- what transformers calls -----------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Note the layer's new keys/values for its attention function; return them unchanged.

        Args:
            key_states: ``[B, H_kv, q, D]`` the step's new keys.
            value_states: ``[B, H_kv, q, D]`` the step's new values.
            layer_idx: the calling layer.

        Returns:
            ``(key_states, value_states)``, unchanged: the backend writes them into the cache.

        Raises:
            InvalidInputError: the model does not use an attn_di attention implementation
                (another implementation would see only the new keys).
        """
        if layer_idx in self._updated or not self._updated:
            self._begin_step(int(key_states.shape[2]))
        self._updated.add(layer_idx)
        PENDING.set((self, layer_idx))
        return key_states, value_states

    def _begin_step(self, columns: int) -> None:
        """Begin a step: the first layer of a model forward (or a later pass of the same
        forward over the layers, which stays part of that forward's step).

        The step is committed when the forward of the model that called it returns
        (:meth:`commit_step`, from the model's forward hook), and rolled back otherwise: at
        once when attention fails, else before the cache is next read or stepped.

        Raises:
            InvalidInputError: the calling model is not on an attn_di attention
                implementation, or lays its KV cache out otherwise than the model this cache
                was built for, or another thread is in a step of this cache. Nothing changes.
        """
        call = model_call()
        self._settle(call)
        model = call.model if call is not None else None
        self._check_caller(model)
        if self._open is None or call is None or self._open.frame is not call.frame:
            self._before = (
                self._columns,
                list(self._seq_lens),
                [len(t) for t in self._tables],
                self._capacity,
            )
            if call is not None:
                watch(call.model)
                if call.hooked:  # its return will be seen: commit then
                    self._open = call
                    open_step(self)
        self.step_memo = {}
        self._updated.clear()
        self._step += 1
        self._columns += columns

    def _check_caller(self, model: Any) -> None:
        """Refuse a step for ``model`` (None: not known, this cache's config is used) when it
        is not on an attn_di attention implementation or has another KV layout."""
        config = getattr(model, "config", None) if model is not None else self.config
        config = config if isinstance(config, PretrainedConfig) else self.config
        name = getattr(config, "_attn_implementation", None)
        if not is_attn_di_name(name):
            raise InvalidInputError(
                "cache",
                f"PagedCache needs an attn_di attention implementation; the model uses {name!r}",
                hint="call attn_di.integrations.transformers.register() and load the model "
                'with attn_implementation="attn_di" (or model.set_attn_implementation('
                '"attn_di"))',
            )
        if config is not self.config:
            theirs = _Layout.of(config)
            if theirs != self._layout:
                raise InvalidInputError(
                    "cache",
                    f"was built for another model: {self._layout.describe()}, but "
                    f"{type(model).__name__} has {theirs.describe()}",
                    hint="make one PagedCache per model: PagedCache(model.config)",
                )

    def _settle(self, call: ModelCall | None = None) -> None:
        """Roll back a begun step whose model call is over without having returned (it
        raised, or was interrupted); ``call`` is the call beginning a step now, if any.

        Raises:
            InvalidInputError: the step is running in another thread.
        """
        open_call = self._open
        if open_call is None:
            return
        if call is not None and open_call.frame is call.frame:
            return  # the same forward: a later pass over the layers
        if running(open_call):
            if open_call.thread == threading.get_ident():
                return  # read from inside the forward (a layer or hook asking)
            raise InvalidInputError(
                "cache",
                "is in the middle of a step in another thread",
                hint="give each thread (each batch of sequences) its own PagedCache",
            )
        self._roll_back()

    @property
    def open_call(self) -> ModelCall | None:
        """The model call of the step begun and not yet committed, or None."""
        return self._open

    def commit_step(self) -> None:
        """Keep the current step: the forward of the model that began it has returned
        (called by that model's forward hook)."""
        self._open = None
        close_step(self)
        self._updated.clear()
        self._forget_pending()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the padded batch seen so far (transformers slices ``input_ids`` with it)."""
        if self._open is not None:
            self._settle()
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(columns seen + query_length, 0)``: the 2-D padding mask covers every column.

        transformers asks this before the step's first layer runs, with the step's query length.

        Raises:
            InvalidInputError: the step brings no new tokens while the cache holds sequences:
                ``generate`` was given a new prompt no longer than the columns the cache has
                seen (it keeps only the input columns past them), so the cache needs
                :meth:`reset` first.
        """
        if self._open is not None:
            self._settle()
        if query_length == 0 and self._columns:
            raise InvalidInputError(
                "cache",
                f"holds {len(self._seq_lens)} sequences over {self._columns} columns and the "
                "input adds no column past them (a new prompt on a used cache?)",
                hint="call cache.reset() (or use a new PagedCache) before a new prompt; "
                "a PagedCache continues the sequences it holds",
            )
        return self._columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no maximum length."""
        return -1

    def reset(self) -> None:
        """Free every sequence's blocks (the tensors are kept, as a server keeps its pool)."""
        self._open = None
        close_step(self)
        self._forget_pending()
        self._free = list(range(self._capacity - 1, -1, -1))
        self._tables = []
        self._seq_lens = []
        self._columns = 0
        self._updated.clear()
        self._batch = None

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: rolling back tokens (assisted generation) is not implemented.

        Raises:
            UnsupportedFeatureError: always.
        """
        raise _unsupported("crop (assisted or speculative generation)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: beam search would need copy-on-write blocks.

        Raises:
            UnsupportedFeatureError: always.
        """
        raise _unsupported("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: repeating the rows of a filled cache would need copy-on-write blocks.

        (``generate``'s ``num_return_sequences > 1`` does not come here: it repeats the
        prompts before the first step, so each returned sequence is a row of its own.)

        Raises:
            UnsupportedFeatureError: always.
        """
        raise _unsupported("batch_repeat_interleave (repeating the rows of a filled cache)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: see :meth:`batch_repeat_interleave`.

        Raises:
            UnsupportedFeatureError: always.
        """
        raise _unsupported("batch_select_indices")

    # -- what attn_di's attention function calls -------------------------------------
    def step_batch(self, valid: torch.Tensor | None, batch_size: int, query_len: int) -> StepBatch:
        """The current step's :class:`StepBatch`, allocating blocks on the step's first call.

        Args:
            valid: ``[B, q]`` bool, which query columns are real tokens (None: all).
            batch_size: B.
            query_len: q.

        Returns:
            The step's batch (the same object for every layer of the step).

        Raises:
            InvalidInputError: the batch size changed without :meth:`reset`, or a fixed
                ``num_blocks`` is exhausted (nothing is allocated then).
        """
        batch = self._batch
        if batch is not None and batch.step == self._step:
            return batch
        if self._seq_lens and len(self._seq_lens) != batch_size:
            raise InvalidInputError(
                "cache",
                f"holds {len(self._seq_lens)} sequences but the batch has {batch_size} rows",
                hint="call cache.reset() (or use a new PagedCache) before a new prompt",
            )
        if valid is None:
            query_lens = [query_len] * batch_size
            batch_index = column_index = None
        else:
            query_lens = [int(n) for n in valid.sum(dim=1).tolist()]
            if sum(query_lens) == batch_size * query_len:
                batch_index = column_index = None
            else:
                batch_index, column_index = valid.nonzero(as_tuple=True)
        previous = self._seq_lens or [0] * batch_size
        seq_lens = [p + q for p, q in zip(previous, query_lens, strict=True)]
        tables = self._allocate(seq_lens)
        width = max(1, max(len(table) for table in tables))
        rows = [table + [table[-1] if table else 0] * (width - len(table)) for table in tables]
        with torch.inference_mode(False):  # versioned: backends remember checking it
            block_table = torch.tensor(rows, dtype=torch.int32)
        self._seq_lens = seq_lens
        batch = StepBatch(
            self._step,
            batch_size,
            query_len,
            batch_index,
            column_index,
            query_lens,
            seq_lens,
            block_table,
        )
        self._batch = batch
        return batch

    def abandon_step(self) -> None:
        """Undo the current step after a failure: lengths, columns and blocks as before it.

        The attention function calls this when any layer of the step fails; a step whose
        forward fails elsewhere (an MLP, a hook, ``KeyboardInterrupt`` between layers) is
        undone the same way before the cache is next read or stepped. So a failed forward
        leaves the cache as it found it (blocks taken for the step go back to the free
        list; a pool that grew stays grown). Keys a layer already wrote land in slots past
        every sequence's length, which no later step reads before overwriting them.
        """
        self._roll_back()

    def _roll_back(self) -> None:
        self._open = None
        close_step(self)
        self._forget_pending()
        columns, seq_lens, counts, _ = self._before
        if len(counts) != len(self._tables):  # the step started the sequences
            counts = [0] * len(self._tables)
        for table, count in zip(self._tables, counts, strict=True):
            while len(table) > count:
                self._free.append(table.pop())
        if not seq_lens:
            self._tables = []
        self._columns = columns
        self._seq_lens = list(seq_lens)
        self._updated.clear()
        self._batch = None

    def _forget_pending(self) -> None:
        """Drop this thread's note of a layer of this cache waiting for its attention."""
        pending = PENDING.get()
        if pending is not None and pending[0] is self:
            PENDING.set(None)

    def kv_cache(
        self, layer_idx: int, backend_cls: Any, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Layer ``layer_idx``'s cache tensor in ``backend_cls``'s layout (allocated on first use).

        Raises:
            InvalidInputError: ``backend_cls`` lays the cache out differently from the backend
                that allocated it (the attention was swapped to an incompatible backend), or
                the cache's dtype or device is not the keys' (``dtype``, ``device``).
        """
        if backend_cls not in self._compatible:
            self._check_layout(backend_cls)
        kv_cache = self._kv_caches.get(layer_idx)
        if kv_cache is None:
            shape = backend_cls.get_kv_cache_shape(
                self._capacity, self.block_size, self.num_kv_heads, self.head_size
            )
            kv_cache = self._new_tensor(shape, self.dtype or dtype, self.device or device)
            self._kv_caches[layer_idx] = kv_cache
        if kv_cache.dtype != dtype:
            name = str(dtype).removeprefix("torch.")
            raise InvalidInputError(
                "dtype",
                f"the PagedCache holds {str(kv_cache.dtype).removeprefix('torch.')} but the "
                f"model's keys are {name}",
                hint=f"make the cache in the model's dtype: PagedCache(model.config, "
                f'dtype="{name}"), or dtype=None (the default) to follow the model',
            )
        if kv_cache.device != torch.device(device):
            raise InvalidInputError(
                "device",
                f"the PagedCache is on {kv_cache.device} but the model's keys are on {device}",
                hint="make the cache on the model's device: PagedCache(model.config, "
                f'device="{device}"), or device=None (the default) to follow the model',
            )
        return kv_cache

    # -- introspection ---------------------------------------------------------------
    # These read the committed state: from another thread while a step runs (a monitor, a
    # logger, a debugger), the state before that step, without touching the step.
    @property
    def num_blocks(self) -> int:
        """Blocks in each layer's pool now."""
        return self._committed().capacity

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return self._committed().free

    @property
    def block_tables(self) -> list[list[int]]:
        """Each sequence's block numbers, in position order (a copy)."""
        return self._committed().block_tables

    @property
    def seq_lens(self) -> list[int]:
        """Real (unpadded) tokens cached per sequence (a copy)."""
        return self._committed().seq_lens

    def __repr__(self) -> str:
        """The pool and the lengths (the committed state); never raises."""
        head = f"PagedCache(layers={len(self.layers)}, block_size={self.block_size}"
        try:
            state = self._committed()
        except Exception as error:  # a repr is for debugging: say why instead of raising
            return f"{head}, state unreadable: {type(error).__name__}: {error})"
        return (
            f"{head}, blocks={state.capacity - state.free}/{state.capacity} used, "
            f"seq_lens={state.seq_lens})"
        )

    def _committed(self) -> _Committed:
        """The state as readers see it: the state before a step another thread is in the
        middle of, else the state now (after rolling back a failed step)."""
        open_call = self._open
        if (
            open_call is not None
            and open_call.thread != threading.get_ident()
            and running(open_call)
        ):
            _, seq_lens, counts, capacity = self._before  # set before the step was opened
            tables = self._tables  # only grows during a step: its first `count` are the old
            if len(counts) != len(tables):
                counts, tables = [], []
            old = [list(table[:count]) for table, count in zip(tables, counts, strict=True)]
            return _Committed(list(seq_lens), old, capacity - sum(counts), capacity)
        self._settle()
        return _Committed(
            list(self._seq_lens),
            [list(table) for table in self._tables],
            len(self._free),
            self._capacity,
        )

    # -- internals -------------------------------------------------------------------
    def _allocate(self, seq_lens: list[int]) -> list[list[int]]:
        """Grow each sequence's block list to hold ``seq_lens`` tokens; all or nothing."""
        tables = self._tables or [[] for _ in seq_lens]
        wanted = [
            max(0, math.ceil(n / self.block_size) - len(table))
            for n, table in zip(seq_lens, tables, strict=True)
        ]
        needed = sum(wanted)
        if needed > len(self._free):
            self._grow(self._capacity + needed - len(self._free))
        for table, count in zip(tables, wanted, strict=True):
            for _ in range(count):
                table.append(self._free.pop())
        self._tables = tables
        return tables

    def _grow(self, at_least: int) -> None:
        """Enlarge every layer's pool to ``at_least`` blocks or more (copying the used ones)."""
        if self._fixed_blocks is not None:
            if at_least > self._fixed_blocks:
                raise InvalidInputError(
                    "num_blocks",
                    f"the cache is out of blocks: the step needs {at_least} of "
                    f"num_blocks={self._fixed_blocks} ({len(self._free)} free)",
                    hint="raise num_blocks, or pass num_blocks=None to grow on demand",
                )
            capacity = self._fixed_blocks
        else:
            capacity = max(at_least, 2 * self._capacity, 16)
        if self._kv_caches:
            axis = self._block_axis()
            for layer_idx, old in self._kv_caches.items():
                shape = list(old.shape)
                shape[axis] = capacity
                new = self._new_tensor(shape, old.dtype, old.device)
                new.narrow(axis, 0, self._capacity).copy_(old)
                self._kv_caches[layer_idx] = new
        self._free = list(range(capacity - 1, self._capacity - 1, -1)) + self._free
        self._capacity = capacity

    def _new_tensor(
        self, shape: Any, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        if self.fill_value is not None:
            tensor.fill_(self.fill_value)
        return tensor

    def _block_axis(self) -> int:
        """The axis of the cache tensor that counts blocks, found from the layout itself."""
        one = self._layout_cls.get_kv_cache_shape(
            1, self.block_size, self.num_kv_heads, self.head_size
        )
        two = self._layout_cls.get_kv_cache_shape(
            2, self.block_size, self.num_kv_heads, self.head_size
        )
        return next(axis for axis, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)

    def _check_layout(self, backend_cls: Any) -> None:
        if self._layout_cls is None:
            self._layout_cls = backend_cls
        elif backend_cls is not self._layout_cls:
            sizes = (3, self.block_size, self.num_kv_heads, self.head_size)
            mine = tuple(self._layout_cls.get_kv_cache_shape(*sizes))
            theirs = tuple(backend_cls.get_kv_cache_shape(*sizes))
            if mine != theirs:
                raise InvalidInputError(
                    "cache",
                    f"was laid out by {self._layout_cls.get_name()} {mine} but "
                    f"{backend_cls.get_name()} expects {theirs}",
                    hint="keep one layout for a cache's life: call cache.reset() and use a new "
                    "PagedCache after swapping to a backend with another KV layout",
                )
        self._compatible.add(backend_cls)


@dataclass(frozen=True)
class _Committed:
    """A cache's committed state, as :class:`PagedCache`'s introspection reports it."""

    seq_lens: list[int]
    block_tables: list[list[int]]
    free: int
    capacity: int


@dataclass(frozen=True)
class _Layout:
    """What a cache's tensors and layers depend on in a model's config."""

    num_kv_heads: int
    head_size: int
    sliding: tuple[bool, ...]  # per decoder layer: sliding-window (or chunked) attention
    chunk_size: int | None = None  # attention_chunk_size, when a layer is chunked

    @classmethod
    def of(cls, config: object) -> _Layout:
        """The layout of a model config (its decoder's).

        Raises:
            InvalidBackendTypeError: not a transformers config.
            InvalidInputError: no ``num_hidden_layers`` / ``num_attention_heads``.
        """
        text_config = _text_config(config)
        num_layers = getattr(text_config, "num_hidden_layers", None)
        num_heads = getattr(text_config, "num_attention_heads", None)
        if not isinstance(num_layers, int) or not isinstance(num_heads, int):
            raise InvalidInputError(
                "config",
                f"{type(config).__name__} has no num_hidden_layers/num_attention_heads",
                hint="pass the decoder model's config, e.g. PagedCache(model.config)",
            )
        kinds = getattr(text_config, "layer_types", None)
        chunk = getattr(text_config, "attention_chunk_size", None)
        if not kinds:  # transformers: every layer slides, else every layer is chunked, else full
            every = "full_attention"
            if getattr(text_config, "sliding_window", None) is None and chunk is not None:
                every = "chunked_attention"
            kinds = [every] * num_layers
        return cls(
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
            head_size=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // num_heads,
            sliding=tuple(kind in ("sliding_attention", "chunked_attention") for kind in kinds),
            chunk_size=chunk if isinstance(chunk, int) and "chunked_attention" in kinds else None,
        )

    def describe(self) -> str:
        """``"2 layers of 2 KV heads of size 8"`` (and how many slide)."""
        sliding = sum(self.sliding)
        return (
            f"{len(self.sliding)} layers of {self.num_kv_heads} KV heads of size "
            f"{self.head_size}" + (f" ({sliding} sliding-window)" if sliding else "")
        )


def _unsupported(feature: str) -> UnsupportedFeatureError:
    error = UnsupportedFeatureError("PagedCache", feature)
    error.hint = (
        "use greedy or sampling generation with PagedCache, or transformers' DynamicCache "
        "(the attn_di attention functions work on it too)"
    )
    return error


def _text_config(config: object) -> Any:
    """The decoder config of ``config``, refusing what is not a transformers config."""
    if not isinstance(config, PretrainedConfig):
        model_hint = (
            "pass the model's config, PagedCache(model.config), not the model"
            if isinstance(getattr(config, "config", None), PretrainedConfig)
            else "pass the model's config: PagedCache(model.config)"
        )
        raise InvalidBackendTypeError(
            "config", config, "a transformers PretrainedConfig (model.config)", hint=model_hint
        )
    return config.get_text_config(decoder=True)


def _dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` as a torch float dtype (names as :func:`canonical_dtype` takes them), or None."""
    if dtype is None:
        return None
    if not isinstance(dtype, (str, torch.dtype)):
        raise InvalidBackendTypeError(
            "dtype", dtype, 'a torch dtype or a name such as "bfloat16"', hint="e.g. dtype=None"
        )
    result: torch.dtype = getattr(torch, canonical_dtype(dtype))
    return result


def _device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` torch can allocate on, or None."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise InvalidBackendTypeError(
            "device", device, 'a torch.device or a name such as "cpu"', hint="e.g. device=None"
        )
    available = ["cpu"] + [kind for kind in ("cuda", "xpu", "mps") if _accelerator_available(kind)]
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise InvalidInputError(
            "device",
            f"cannot allocate on {device!r} ({str(exc).splitlines()[0]}); available here: "
            f"{', '.join(available)}",
            hint="pass device=None (the default) to follow the model's keys, or one of "
            + ", ".join(repr(kind) for kind in available),
        ) from None
    return parsed


def _accelerator_available(kind: str) -> bool:
    module = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _fill_value(value: object) -> float | None:
    """``value`` as a float (NaN and infinities allowed), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidBackendTypeError(
            "fill_value",
            value,
            "a number or None",
            hint='e.g. fill_value=float("nan") to prove unused slots are never read',
        )
    return float(value)
