"""One cell of the conformance matrix: :class:`Case` (what runs) and :class:`Outcome` (how
it ended). Nothing here imports torch.

A case is named by its id, which holds every axis value that differs from the default, so an
id alone rebuilds the case (:meth:`Case.from_id`): ``attn-di conform TARGET --case ID``
re-runs exactly that cell.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, fields, replace

from attn_di.exceptions import InvalidInputError, closest_name

__all__ = [
    "BAD_INPUTS",
    "CACHE_KINDS",
    "CHECKS",
    "DTYPES",
    "ENCODER_KINDS",
    "GQA",
    "KINDS",
    "Case",
    "Outcome",
]

DTYPES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The model dtypes of the matrix and their short names (in ids and features)."""

GQA: dict[str, tuple[int, int]] = {
    "gqa1": (4, 4),
    "gqa2": (4, 2),
    "gqa4": (8, 2),
    "gqa8": (16, 2),
    "mqa": (4, 1),
}
"""``(num_heads, num_kv_heads)`` of each grouping: query heads per KV head 1, 2, 4, 8, and
multi-query attention (one KV head)."""

CACHE_KINDS = ("prefill", "decode", "chunked", "mixed", "spec")
"""Batch kinds of decoder attention over the paged KV cache."""
ENCODER_KINDS = ("encoder", "encoder_only")
"""Batch kinds of bidirectional attention over the batch's own tokens (no cache):
``attn_type`` ``"encoder"`` and ``"encoder_only"``."""
KINDS = CACHE_KINDS + ENCODER_KINDS
"""Every batch kind: prefill (whole prompts), decode (one token over a cached context),
chunked (a chunk of a prompt over its cached prefix), mixed (prefill, chunked prefill and
decode sequences in one batch), spec (2-8 speculative tokens over a long context), and the
two encoder kinds."""

CHECKS = ("numerics", "determinism", "batch_invariance", "threads", "bad_input")
"""What a cell checks: the output against the reference (``numerics``, every cell does), the
same call twice bitwise equal, a request alone vs. among others, two threads at once, or a
malformed input refused with a typed error (run in a subprocess)."""

BAD_INPUTS = (
    "query_shape",
    "key_dtype",
    "kv_heads",
    "cache_shape",
    "slot_range",
    "block_range",
    "seq_lens_count",
    "output_shape",
)
"""The malformed inputs of ``bad_input`` cells: a query of the wrong head count, keys of
another dtype, keys with the wrong number of KV heads, a cache of the wrong head size, a
slot past the cache's end, a block number past the cache's end, ``seq_lens`` with an entry
too many, an ``output=`` buffer of the wrong shape."""

_CHECK_TOKENS = {
    "determinism": "determinism",
    "batch_invariance": "invariance",
    "threads": "threads",
}


class Outcome(enum.StrEnum):
    """How a cell ended.

    ``PASS``, ``REFUSED`` and ``WORKS_UNDECLARED`` are conformant; the others fail the run.
    """

    PASS = "pass"
    """Declared, and the output is within tolerance of the float64 reference."""
    FAIL = "fail"
    """Declared, and wrong: beyond tolerance, non-finite, or an error raised."""
    REFUSED = "refused"
    """Not declared, and refused with a typed error (a skip, naming the backend's reason)."""
    WORKS_UNDECLARED = "works_undeclared"
    """Not declared, not refused, and correct ("works, not declared")."""
    FAIL_UNDECLARED = "fail_undeclared"
    """Not declared, not refused (or refused with an untyped error), and wrong."""
    CRASH = "crash"
    """The subprocess running the cell died (a ``bad_input`` cell: a segfault, an abort)."""

    @property
    def conformant(self) -> bool:
        """Whether this outcome lets the run pass."""
        return self in (Outcome.PASS, Outcome.REFUSED, Outcome.WORKS_UNDECLARED)


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a configuration and a batch, named by :attr:`id`.

    The batch itself (sequence lengths, random data) follows from the case and the run's seed
    (:meth:`data_seed`), so ``(id, seed)`` reproduces a cell exactly.

    Attributes:
        dtype: the model dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        kind: the batch kind, one of :data:`KINDS`.
        seq_len: the longest sequence of the batch, in tokens (cached prefix + query).
        head_size: D.
        gqa: a key of :data:`GQA` (query heads per KV head, or ``"mqa"``).
        block_size: tokens per KV-cache block (cache kinds; encoder kinds have 16, unused).
        window: the sliding window w (``q - w < k <= q``; ``|q - k| < w`` bidirectional), or None.
        softcap: the logits soft cap c (``c * tanh(s / c)``), or None.
        alibi: whether ALiBi slopes are set (``m_h * (k - q)`` added to the scores).
        sinks: whether per-head sink logits are set (in the softmax denominator only).
        table: ``"shuffled"`` (every sequence's blocks in a random order) or ``"shared"``
            (sequences share their first cached blocks, as prefix caching does; only where
            two sequences have a whole cached block); encoder kinds have ``"shuffled"``.
        output: whether ``forward`` is given an ``output=`` buffer.
        padded: whether padding tokens (slot -1, NaN inputs) follow the real ones.
        finite_tails: whether the unwritten slots of the blocks the batch uses (the tail of
            each sequence's last block) hold the dtype's largest finite values, of both
            signs, instead of the kit's NaN, Inf and huge values (blocks no sequence uses stay
            dirty with NaN and Inf): the convention of a contract whose engine keeps them
            finite (vLLM's zero-filled cache; :attr:`Capabilities.nan_tails`). Cache kinds
            only.
        check: one of :data:`CHECKS`.
        bad_input: for ``check="bad_input"``, one of :data:`BAD_INPUTS`.
    """

    dtype: str = "float32"
    kind: str = "decode"
    seq_len: int = 19
    head_size: int = 64
    gqa: str = "gqa1"
    block_size: int = 16
    window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    table: str = "shuffled"
    output: bool = False
    padded: bool = False
    finite_tails: bool = False
    check: str = "numerics"
    bad_input: str | None = None

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, tuple(DTYPES))
        _choice("kind", self.kind, KINDS)
        _choice("gqa", self.gqa, tuple(GQA))
        _choice("table", self.table, ("shuffled", "shared"))
        _choice("check", self.check, CHECKS)
        for name, most in _BOUNDS.items():
            value = int(getattr(self, name))
            if not 1 <= value <= most:
                raise InvalidInputError(
                    name,
                    f"must be between 1 and {most}, got {value}",
                    hint=f"the closest is {min(max(value, 1), most)}",
                )
        if self.window is not None and not 1 <= self.window <= _BOUNDS["seq_len"]:
            raise InvalidInputError(
                "window",
                f"must be between 1 and {_BOUNDS['seq_len']} or None, got {self.window}",
            )
        if self.softcap is not None and not self.softcap > 0:
            raise InvalidInputError("softcap", f"must be > 0 or None, got {self.softcap}")
        if (self.check == "bad_input") != (self.bad_input is not None):
            raise InvalidInputError(
                "bad_input", "is given exactly when check='bad_input'", hint="see BAD_INPUTS"
            )
        if self.bad_input is not None:
            _choice("bad_input", self.bad_input, BAD_INPUTS)
        if self.kind in ENCODER_KINDS:  # no cache: its block size and table do not exist
            object.__setattr__(self, "block_size", 16)
            object.__setattr__(self, "table", "shuffled")
            object.__setattr__(self, "finite_tails", False)

    # -- derived ------------------------------------------------------------------------

    @property
    def num_heads(self) -> int:
        """H, the query heads."""
        return GQA[self.gqa][0]

    @property
    def num_kv_heads(self) -> int:
        """H_kv, the key/value heads."""
        return GQA[self.gqa][1]

    @property
    def uses_cache(self) -> bool:
        """Whether the batch reads and writes the paged KV cache (decoder kinds)."""
        return self.kind in CACHE_KINDS

    @property
    def attn_type(self) -> str:
        """The layer's attention type: ``"decoder"``, ``"encoder"`` or ``"encoder_only"``."""
        return self.kind if self.kind in ENCODER_KINDS else "decoder"

    @property
    def causal(self) -> bool:
        """Whether queries see only keys at or before their own position."""
        return self.uses_cache

    @property
    def features(self) -> frozenset[str]:
        """The features this cell exercises, by which a failure is attributed.

        Among them: the dtype's short name (``"bf16"``), the batch kind (``"decode"``;
        ``"encoder"`` for both encoder kinds), ``"gqa"``/``"mqa"``, ``"window"``,
        ``"softcap"``, ``"alibi"``, ``"sinks"``, ``"shuffled_blocks"``/``"shared_blocks"`` and
        ``"dirty_cache"`` (every cache cell), ``"finite_tails"``, ``"long_context"``
        (4096 tokens or more), ``"odd_head_size"``, ``"output_arg"``, ``"padding"``, and the check
        (``"determinism"``, ``"batch_invariance"``, ``"threads"``, ``"bad_input"``).
        """
        found = {DTYPES[self.dtype], "encoder" if self.kind in ENCODER_KINDS else self.kind}
        if self.kind == "encoder_only":
            found.add("encoder_only")
        if self.gqa == "mqa":
            found.update(("mqa", "gqa"))
        elif self.gqa != "gqa1":
            found.add("gqa")
        if self.uses_cache:
            found.update((f"{self.table}_blocks", "dirty_cache"))
        optional = {
            "window": self.window is not None,
            "softcap": self.softcap is not None,
            "alibi": self.alibi,
            "sinks": self.sinks,
            "long_context": self.seq_len >= 4096,
            "odd_head_size": self.head_size % 2 == 1,
            "output_arg": self.output,
            "padding": self.padded,
            "finite_tails": self.finite_tails,
        }
        found.update(name for name, present in optional.items() if present)
        if self.check != "numerics":
            found.add(self.check)
        return frozenset(found)

    @property
    def id(self) -> str:
        """The readable, unique name of the cell: ``bf16-gqa4-decode-len150-window50-block16``.

        Tokens, in order: the dtype; ``h<D>`` unless 64; the grouping; the kind;
        ``len<n>``; ``window<w>``; ``softcap<c>``; ``alibi``; ``sinks``; ``block<b>`` (cache
        kinds); ``shared``; ``output``; ``padded``; ``finitetails``; the check (``determinism``,
        ``invariance``, ``threads``, ``bad_<what>``). :meth:`from_id` parses it back.
        """
        tokens = [DTYPES[self.dtype]]
        if self.head_size != 64:
            tokens.append(f"h{self.head_size}")
        tokens += [self.gqa, self.kind, f"len{self.seq_len}"]
        if self.window is not None:
            tokens.append(f"window{self.window}")
        if self.softcap is not None:
            tokens.append(f"softcap{self.softcap:g}")
        tokens += [name for name in ("alibi", "sinks") if getattr(self, name)]
        if self.uses_cache:
            tokens.append(f"block{self.block_size}")
            if self.table == "shared":
                tokens.append("shared")
        tokens += [name for name in ("output", "padded") if getattr(self, name)]
        if self.finite_tails:
            tokens.append("finitetails")
        if self.check in _CHECK_TOKENS:
            tokens.append(_CHECK_TOKENS[self.check])
        elif self.bad_input is not None:
            tokens.append(f"bad_{self.bad_input}")
        return "-".join(tokens)

    def __str__(self) -> str:
        return self.id

    @classmethod
    def from_id(cls, case_id: str) -> Case:
        """The case an :attr:`id` names.

        Raises:
            InvalidInputError: a token that is not one of the id's (with the closest one as
                a hint), or values out of range.
        """
        values: dict[str, object] = {}
        given: dict[str, str] = {}  # field -> the token that gave it
        short = {value: key for key, value in DTYPES.items()}
        checks = {value: key for key, value in _CHECK_TOKENS.items()}
        for token in case_id.strip().split("-"):
            number = token.lstrip("abcdefghijklmnopqrstuvwxyz_")
            prefix = token[: len(token) - len(number)]
            update: dict[str, object]
            if token in short:
                update = {"dtype": short[token]}
            elif token in GQA:
                update = {"gqa": token}
            elif token in KINDS:
                update = {"kind": token}
            elif token in ("alibi", "sinks", "output", "padded"):
                update = {token: True}
            elif token == "shared":
                update = {"table": "shared"}
            elif token == "finitetails":
                update = {"finite_tails": True}
            elif token in checks:
                update = {"check": checks[token]}
            elif token.startswith("bad_"):
                update = {"check": "bad_input", "bad_input": token.removeprefix("bad_")}
            elif prefix in _NUMBERED and number:
                field_name, convert = _NUMBERED[prefix]
                try:
                    update = {field_name: convert(number)}
                except ValueError:
                    raise _bad_token(case_id, token) from None
            else:
                raise _bad_token(case_id, token)
            for field_name in update:
                if field_name in given:
                    raise InvalidInputError(
                        "case id",
                        f"{case_id!r}: {given[field_name]!r} and {token!r} both give its "
                        f"{field_name}",
                        hint="an id names each axis once: keep one of them",
                    )
                given[field_name] = token
            values.update(update)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidInputError as error:  # a value out of range: name the id too
            raise InvalidInputError(
                "case id",
                f"{case_id!r}: {error.message()}",
                hint=error.hint or "ids look like bf16-gqa4-decode-len150-window50-block16",
            ) from None

    def data_seed(self, seed: int) -> int:
        """The seed of this cell's random batch: the run's ``seed`` mixed with the id."""
        return (int(seed) * 1_000_003 + zlib.crc32(self.id.encode())) % (2**63)

    def with_(self, **changes: object) -> Case:
        """A copy with some axis values changed (``dataclasses.replace``)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def axis_values(self) -> dict[str, object]:
        """``{axis: value}`` of every field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_BOUNDS: dict[str, int] = {"seq_len": 32768, "head_size": 1024, "block_size": 4096}
"""The largest sequence length, head size and block size a cell may have (the matrix's
longest sequence is 8192 tokens): a cell's batch stays within a few GiB."""

_NUMBERED: dict[str, tuple[str, type]] = {
    "h": ("head_size", int),
    "len": ("seq_len", int),
    "window": ("window", int),
    "softcap": ("softcap", float),
    "block": ("block_size", int),
}

_TOKENS = (
    *DTYPES.values(), *GQA, *KINDS, "alibi", "sinks", "output", "padded", "shared", "finitetails",
    *_CHECK_TOKENS.values(), *(f"bad_{name}" for name in BAD_INPUTS),
    "h64", "len19", "window8", "softcap2", "block16",
)  # fmt: skip


def _bad_token(case_id: str, token: str) -> InvalidInputError:
    close = closest_name(token, _TOKENS)
    return InvalidInputError(
        "case id",
        f"{case_id!r}: unknown token {token!r}",
        hint=(f"did you mean {close!r}? " if close else "")
        + "ids look like bf16-gqa4-decode-len150-window50-block16 (see `attn-di conform --help`)",
    )


def _choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = closest_name(str(value), choices)
        raise InvalidInputError(
            argument,
            f"{value!r} is not one of {', '.join(choices)}",
            hint=f"did you mean {close!r}?" if close else f"one of {', '.join(choices)}",
        )
