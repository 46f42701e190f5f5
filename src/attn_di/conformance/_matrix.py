"""Which cells a run has: pairwise coverage of the declared values, single-axis edge cases,
probes of what is not declared, and the property checks; or the full product.

The pairwise cells cover every pair of values of two axes at least once (a greedy covering
array in the manner of AETG, Cohen et al. 1997; seeded, so a seed gives the same cells).
Their axis values are those the backend declares, so every pair is measured, not refused;
each value it does not declare gets one probe cell of its own, which must be refused (or
work). Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from attn_di.conformance._case import BAD_INPUTS, CACHE_KINDS, DTYPES, ENCODER_KINDS, GQA, Case
from attn_di.conformance._driver import Capabilities

__all__ = ["LENGTHS", "LONG", "Matrix", "build_matrix", "nan_tail_probes", "with_tails"]

LENGTHS = (1, 19, 150)
"""The pairwise cells' longest sequence, in tokens: one token, a few blocks, many blocks."""
LONG = 8192
"""The long-context edge cells' length."""
_HEAD_SIZES = (64, 128, 16, 7)
_BLOCK_SIZES = (16, 1, 5, 64, 256)
_BLOCK_PROBES = (1, 5, 8, 16, 32, 64, 128, 256)
_HEAD_PROBES = (7, 72, 64, 128, 256, 16)
_WINDOWS = (None, "one", "typical", "wide")
_MIN_LEN = {"chunked": 3, "mixed": 3, "spec": 12}


@dataclass(frozen=True)
class Axis:
    """One axis of the pairwise space: a field of :class:`Case` and its values."""

    name: str
    values: tuple[object, ...]


class Matrix:
    """The cells of one run, in order: pairwise (or, full, the product) first, then edges
    and probes, then the property checks. The full product is generated as it is iterated.

    Attributes:
        axes: the pairwise axes and their values.
        pairs: how many value pairs the pairwise cells cover (0 for the full product).
        size: how many cells there are.
    """

    def __init__(
        self,
        axes: tuple[Axis, ...],
        head: Sequence[Case],
        extra: Sequence[Case],
        *,
        pairs: int,
        full: bool,
        dtypes: Sequence[str] | None,
        finite_tails: bool = False,
    ) -> None:
        self.axes = axes
        self.pairs = pairs
        self.full = full
        self._finite_tails = finite_tails
        self._dtypes = None if dtypes is None else tuple(dtypes)
        self._head = tuple(head)
        self._extra = tuple(extra)
        product = full_size(axes) if full else len(self._head)
        self.size = product + len(self._extra)

    def __iter__(self) -> Iterator[Case]:
        head: Iterator[Case] = (
            (with_tails(to_case(row), self._finite_tails) for row in full_product(self.axes))
            if self.full
            else iter(self._head)
        )
        yield from head
        yield from self._extra

    def __len__(self) -> int:
        return self.size


def axes_for(caps: Capabilities, dtypes: Sequence[str] | None = None) -> tuple[Axis, ...]:
    """The pairwise axes: the declared values of every axis (and the lengths, windows, tables)."""
    declared_dtypes = tuple(d for d in DTYPES if d in caps.dtypes) or ("float32",)
    if dtypes is not None:
        declared_dtypes = tuple(d for d in declared_dtypes if d in dtypes) or tuple(dtypes)
    if caps.head_sizes is None:
        heads: tuple[int, ...] = _HEAD_SIZES
    else:
        ordered = sorted(set(caps.head_sizes), key=lambda s: (s != 64, s != 128, s))
        heads = tuple(ordered[:4])
    blocks = tuple(b for b in _BLOCK_SIZES if caps.block_size_ok(b))
    if not blocks:
        blocks = tuple(b for b in _BLOCK_PROBES if caps.block_size_ok(b))[:4] or (16,)
    kinds: tuple[str, ...] = CACHE_KINDS if "decoder" in caps.attn_types else ()
    kinds += tuple(k for k in ENCODER_KINDS if k in caps.attn_types)
    return (
        Axis("dtype", declared_dtypes),
        Axis("kind", kinds or ("decode",)),
        Axis("gqa", tuple(GQA)),
        Axis("head_size", heads),
        Axis("block_size", blocks),
        Axis("seq_len", LENGTHS),
        Axis("window", _WINDOWS if caps.sliding_window else (None,)),
        Axis("softcap", (None, 2.0) if caps.softcap else (None,)),
        Axis("alibi", (False, True) if caps.alibi else (False,)),
        Axis("sinks", (False, True) if caps.sinks else (False,)),
        Axis("table", ("shuffled", "shared")),
        Axis("output", (False, True) if caps.output_buffer else (False,)),
        Axis("padded", (False, True)),
    )


def _compatible(values: dict[str, object], defaults: dict[str, object]) -> bool:
    """Whether a (partial) assignment names a real cell (no vacuous combination)."""
    kind = values.get("kind")
    length = values.get("seq_len")
    if kind in _MIN_LEN and length == 1:
        return False
    if kind in ENCODER_KINDS:
        for axis in ("block_size", "table"):
            if axis in values and values[axis] != defaults[axis]:
                return False
    if values.get("table") == "shared":
        if kind in ("prefill", *ENCODER_KINDS) or length == 1:
            return False
        block = values.get("block_size")
        if isinstance(block, int) and block > max(LENGTHS) - 20:
            return False
        if isinstance(block, int) and isinstance(length, int) and block > length - 4:
            return False
    return True


def pairwise(
    axes: Sequence[Axis], seed: int, candidates: int = 12
) -> tuple[list[dict[str, object]], int]:
    """Assignments covering every compatible pair of values of two axes; and the pair count.

    Greedy: each new cell starts from an uncovered pair and fills the other axes, in a random
    order, with the value covering the most uncovered pairs (ties broken at random); of
    ``candidates`` such cells the best is kept.
    """
    defaults = {axis.name: axis.values[0] for axis in axes}
    uncovered: set[tuple[str, object, str, object]] = set()
    for first, second in itertools.combinations(axes, 2):
        for a, b in itertools.product(first.values, second.values):
            if _compatible({first.name: a, second.name: b}, defaults):
                uncovered.add((first.name, _key(a), second.name, _key(b)))
    total = len(uncovered)
    rng = random.Random(seed)
    order = [axis.name for axis in axes]
    by_name = {axis.name: axis for axis in axes}
    rows: list[dict[str, object]] = []
    while uncovered:
        best: dict[str, object] | None = None
        best_gain = -1
        start = sorted(uncovered, key=repr)
        for _ in range(candidates):
            first_name, a, second_name, b = rng.choice(start)
            row: dict[str, object] = {
                first_name: _value(by_name[first_name], a),
                second_name: _value(by_name[second_name], b),
            }
            rest = [name for name in order if name not in row]
            rng.shuffle(rest)
            for name in rest:
                scored = []
                for value in by_name[name].values:
                    trial = {**row, name: value}
                    if not _compatible(trial, defaults):
                        continue
                    gain = sum(_pair(name, value, other, row[other]) in uncovered for other in row)
                    scored.append((gain, rng.random(), value))
                if not scored:
                    scored = [(0, 0.0, defaults[name])]
                row[name] = max(scored, key=lambda item: (item[0], item[1]))[2]
            gain = len(_pairs_of(row) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        if best is None or best_gain <= 0:
            break  # only incompatible pairs are left
        uncovered -= _pairs_of(best)
        rows.append(best)
    return rows, total


def _key(value: object) -> object:
    return ("none",) if value is None else value


def _value(axis: Axis, key: object) -> object:
    for value in axis.values:
        if _key(value) == key:
            return value
    raise KeyError(key)


def _pair(a_name: str, a: object, b_name: str, b: object) -> tuple[str, object, str, object]:
    first, second = sorted([(a_name, _key(a)), (b_name, _key(b))], key=lambda x: _AXIS_ORDER[x[0]])
    return (first[0], first[1], second[0], second[1])


_AXIS_ORDER = {
    name: i
    for i, name in enumerate(
        ("dtype", "kind", "gqa", "head_size", "block_size", "seq_len", "window", "softcap",
         "alibi", "sinks", "table", "output", "padded")
    )
}  # fmt: skip


def _pairs_of(row: dict[str, object]) -> set[tuple[str, object, str, object]]:
    names = sorted(row, key=lambda n: _AXIS_ORDER[n])
    return {(a, _key(row[a]), b, _key(row[b])) for a, b in itertools.combinations(names, 2)}


def to_case(row: dict[str, object]) -> Case:
    """The cell of an assignment: windows made concrete for its length, lengths raised to
    what the kind needs, cache-only axes at their defaults for encoder kinds."""
    values = dict(row)
    kind = str(values.get("kind", "decode"))
    length = max(int(values.get("seq_len", 19)), _MIN_LEN.get(kind, 1))  # type: ignore[call-overload]
    values["seq_len"] = length
    window = values.get("window")
    if window == "one":
        values["window"] = 1
    elif window == "typical":
        values["window"] = max(2, length // 3)
    elif window == "wide":
        values["window"] = length + 5
    if kind in ENCODER_KINDS:
        values["block_size"] = 16
        values["table"] = "shuffled"
    return Case(**values)  # type: ignore[arg-type]


def with_tails(case: Case, finite: bool) -> Case:
    """``case`` with finite tails when ``finite`` and it has a cache (else unchanged)."""
    return case.with_(finite_tails=True) if finite and case.uses_cache else case


def nan_tail_probes(axes: Sequence[Axis]) -> list[Case]:
    """For a contract that keeps the unwritten slots of used blocks finite
    (:attr:`Capabilities.nan_tails` False): cells with the kit's NaN tails, which that
    contract does not declare: a decode and a mixed batch of the edge cells' baseline."""
    axis = {a.name: a.values for a in axes}
    if "decode" not in axis["kind"]:
        return []
    dtypes = axis["dtype"]
    low = "bfloat16" if "bfloat16" in dtypes else str(dtypes[0])
    block = 16 if 16 in axis["block_size"] else int(axis["block_size"][0])  # type: ignore[call-overload]
    head = 64 if 64 in axis["head_size"] else int(axis["head_size"][0])  # type: ignore[call-overload]
    base = Case(dtype=low, kind="decode", gqa="gqa2", head_size=head, block_size=block, seq_len=40)
    return [base, base.with_(kind="mixed", dtype=str(dtypes[0]))]


def edge_cases(caps: Capabilities, axes: Sequence[Axis]) -> list[Case]:
    """Single-axis edges from a baseline (each alone), the long-context cells, and one probe
    per value the backend does not declare (which must be refused or work)."""
    axis = {a.name: a.values for a in axes}
    dtypes = axis["dtype"]
    low = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    block = 16 if 16 in axis["block_size"] else int(axis["block_size"][0])  # type: ignore[call-overload]
    head = 64 if 64 in axis["head_size"] else int(axis["head_size"][0])  # type: ignore[call-overload]
    kinds = axis["kind"]
    cache = "decode" in kinds
    base = Case(dtype=str(low), kind="decode" if cache else str(kinds[0]), gqa="gqa2",
                head_size=head, block_size=block, seq_len=40)  # fmt: skip
    edges: list[Case] = []
    for dtype in dtypes:
        edges.append(base.with_(dtype=dtype, kind="mixed" if cache else base.kind))
    if cache:
        edges += [
            base.with_(kind="prefill", seq_len=1),
            base.with_(kind="decode", seq_len=1),
            base.with_(kind="mixed", gqa="gqa8"),
            base.with_(kind="mixed", gqa="mqa"),
        ]
        for size in (min(axis["block_size"]), max(axis["block_size"])):  # type: ignore[type-var]
            edges.append(base.with_(kind="mixed", block_size=size, seq_len=300))
        # long contexts: decode, speculative and chunked over 8k tokens, a 1k prefill
        for dtype in dict.fromkeys((low, dtypes[0])):
            edges.append(base.with_(dtype=dtype, kind="decode", seq_len=LONG, block_size=block))
        edges += [
            base.with_(kind="spec", seq_len=LONG),
            base.with_(kind="chunked", seq_len=LONG // 2),
            base.with_(kind="prefill", seq_len=1024, gqa="gqa1"),
        ]
        if caps.sliding_window:
            edges += [
                base.with_(kind="mixed", window=1),
                base.with_(kind="mixed", window=40),  # exactly the sequence
                base.with_(kind="chunked", seq_len=LONG // 2, window=500),
                base.with_(kind="decode", seq_len=LONG, window=1000),
            ]
        if caps.sinks:
            edges.append(base.with_(kind="decode", seq_len=LONG // 2, sinks=True))
        if caps.alibi:
            edges.append(base.with_(kind="chunked", seq_len=LONG // 4, alibi=True))
        if caps.softcap:
            edges.append(base.with_(kind="prefill", seq_len=300, softcap=2.0))
    for size in axis["head_size"]:
        if size != head:
            edges.append(base.with_(kind="mixed" if cache else base.kind, head_size=size))
    edges += _probes(caps, base, cache)
    return edges


def _probes(caps: Capabilities, base: Case, cache: bool) -> list[Case]:
    """One cell per undeclared value: dtypes, head sizes, block sizes, attention types,
    features, ``output=``."""
    probes: list[Case] = []
    for dtype in DTYPES:
        if dtype not in caps.dtypes:
            probes.append(base.with_(dtype=dtype))
    if caps.head_sizes is not None:
        odd = next((s for s in _HEAD_PROBES if s not in caps.head_sizes), None)
        if odd is not None:
            probes.append(base.with_(head_size=odd))
    if cache:
        refused = [b for b in _BLOCK_PROBES if not caps.block_size_ok(b)]
        if refused:
            probes.append(base.with_(block_size=refused[0]))
    else:
        probes.append(base.with_(kind="decode"))
    if "decoder" in caps.attn_types:
        for kind in ENCODER_KINDS:
            if kind not in caps.attn_types:
                probes.append(base.with_(kind=kind, block_size=16))
    flags: dict[str, tuple[bool, dict[str, object]]] = {
        "window": (caps.sliding_window, {"window": 8}),
        "softcap": (caps.softcap, {"softcap": 2.0}),
        "alibi": (caps.alibi, {"alibi": True}),
        "sinks": (caps.sinks, {"sinks": True}),
        "output": (caps.output_buffer, {"output": True}),
    }
    for supported, change in flags.values():
        if not supported:
            probes.append(base.with_(**change))
    return probes


def property_cases(axes: Sequence[Axis]) -> list[Case]:
    """Determinism and batch invariance per dtype, two threads at once, and every malformed
    input (those in a subprocess)."""
    axis = {a.name: a.values for a in axes}
    dtypes = axis["dtype"]
    kinds = axis["kind"]
    kind = "mixed" if "mixed" in kinds else str(kinds[0])
    block = 16 if 16 in axis["block_size"] else int(axis["block_size"][0])  # type: ignore[call-overload]
    head = 64 if 64 in axis["head_size"] else int(axis["head_size"][0])  # type: ignore[call-overload]
    base = Case(
        dtype=str(dtypes[0]), kind=kind, gqa="gqa2", head_size=head, block_size=block, seq_len=60
    )
    found: list[Case] = []
    for dtype in dtypes:
        found.append(base.with_(dtype=dtype, check="determinism"))
        found.append(base.with_(dtype=dtype, check="batch_invariance"))
    found.append(base.with_(check="threads"))
    found.append(base.with_(dtype=dtypes[-1], kind=kinds[0], check="threads"))
    bad = base.with_(kind="mixed") if "mixed" in kinds else base
    for what in BAD_INPUTS:
        if not bad.uses_cache and what in ("slot_range", "block_range", "cache_shape"):
            continue
        found.append(bad.with_(check="bad_input", bad_input=what))
    return found


def build_matrix(
    caps: Capabilities,
    *,
    seed: int = 0,
    full: bool = False,
    dtypes: Sequence[str] | None = None,
) -> Matrix:
    """The cells of a run over a backend that declares ``caps``.

    Args:
        caps: the backend's declarations.
        seed: picks the pairwise cells (and, through each case, its data).
        full: the whole product of the pairwise axes instead of pairwise cells.
        dtypes: only cells of these dtypes (canonical names).

    Returns:
        The :class:`Matrix`; ids are unique.
    """
    axes = axes_for(caps, dtypes)
    head: list[Case] = []
    pairs = 0
    if not full:
        rows, pairs = pairwise(axes, seed)
        head = [to_case(row) for row in rows]
    extra = edge_cases(caps, axes) + property_cases(axes)
    finite = not caps.nan_tails
    if finite:
        head = [with_tails(case, True) for case in head]
        extra = [with_tails(case, True) for case in extra] + nan_tail_probes(axes)
    if dtypes is not None:
        extra = [case for case in extra if case.dtype in dtypes]
    unique_head = list({case.id: case for case in head}.values())
    taken = {case.id for case in unique_head}
    unique_extra = [
        case
        for case in {case.id: case for case in extra}.values()
        if case.id not in taken and not (full and _in_product(case, axes, finite))
    ]
    return Matrix(
        tuple(axes),
        unique_head,
        unique_extra,
        pairs=pairs,
        full=full,
        dtypes=dtypes,
        finite_tails=finite,
    )


def _in_product(case: Case, axes: Sequence[Axis], finite_tails: bool = False) -> bool:
    """Whether the full product already has ``case`` (same id)."""
    if case.check != "numerics" or case.seq_len not in LENGTHS:
        return False
    if case.uses_cache and case.finite_tails != finite_tails:
        return False
    for axis in axes:
        if axis.name in ("window", "seq_len"):
            continue
        if getattr(case, axis.name) not in axis.values:
            return False
    return case.window is None or case.window in (1, max(2, case.seq_len // 3), case.seq_len + 5)


def full_product(axes: Sequence[Axis]) -> Iterator[dict[str, object]]:
    """Every compatible assignment of the pairwise axes (the ``--full`` matrix)."""
    defaults = {axis.name: axis.values[0] for axis in axes}
    names = [axis.name for axis in axes]
    for values in itertools.product(*(axis.values for axis in axes)):
        row = dict(zip(names, values, strict=True))
        if _compatible(row, defaults):
            yield row


def full_size(axes: Sequence[Axis]) -> int:
    """How many cells :func:`full_product` yields (counted, not built: closed form over the
    compatibility rules would be fragile)."""
    return sum(1 for _ in full_product(axes)) if _product(axes) <= 5_000_000 else _product(axes)


def _product(axes: Sequence[Axis]) -> int:
    return math.prod(len(axis.values) for axis in axes)
