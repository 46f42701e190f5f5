"""CPU_ATTN's compiled ops are memory-safe on their own: bad arguments raise, never crash.

``torch.ops.attn_di.paged_attention`` and ``write_kv_cache`` are public: anyone can call them
with anything. Each op checks every shape, stride, dtype, device and index it relies on before
it touches memory. Crash-class cases run in a subprocess of their own (a segfault there fails
the test instead of killing the test run); so does the fuzzer (:mod:`tests.backends.op_fuzz`).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from attn_di.backends import _cpu_kernel
from attn_di.backends.cpu_attn import CPUAttentionImpl
from attn_di.exceptions import InvalidInputError
from tests.backends.reference import Options, make_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, name="_kernel")
def _kernel() -> None:
    """Skips where the kernel is unavailable (nothing compiled to check)."""
    status = _cpu_kernel.kernel_status()
    if not status.active:
        pytest.skip(f"CPU_ATTN's kernel: {status.describe()}")


def run_isolated(code: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (after loading the kernel) in a fresh interpreter; a crash is a non-zero
    return code (a negative one for a signal) rather than the end of the test session."""
    prelude = (
        "import torch\n"
        "from attn_di.backends import _cpu_kernel\n"
        "assert _cpu_kernel.kernel_status().active\n"
        "op = torch.ops.attn_di.paged_attention\n"
        "write = torch.ops.attn_di.write_kv_cache\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


CRASHES = {
    # each was a SIGSEGV, SIGFPE or an out-of-bounds write (then SIGABRT) before the checks
    "out-fewer-rows": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(40, 2, 64)
        out = torch.empty(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0, 1, 2]]), torch.tensor([40]), torch.tensor([0, 40]),
           out, 0.125, 0, 0.0)
        """,
        r"query_start_loc .* must lie in \[0, 1\] \(query has 40 rows, out 1\)",
    ),
    "block-size-0": (
        """
        kv = torch.randn(2, 4, 0, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([5]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"key_cache's block size \(axis 1\) must be > 0, got 0",
    ),
    "negative-query-start": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(4, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([1]), torch.tensor([-3, 1]),
           torch.empty(4, 2, 64), 0.125, 0, 0.0)
        """,
        r"query_start_loc .* must lie in \[0, 4\]",
    ),
    "decreasing-query-start": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(4, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0], [1]]), torch.tensor([3, 3]),
           torch.tensor([0, 3, 1]), torch.empty(4, 2, 64), 0.125, 0, 0.0)
        """,
        r"query_start_loc must not decrease, but entry 2 \(1\) < entry 1 \(3\)",
    ),
    "seq-len-past-block-table": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0, 1]]), torch.tensor([2**62]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"block_table has 2 columns, too few for seq_lens\[0\] = 4611686018427387904",
    ),
    "block-id-negative": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[-2]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"block_table\[0, 0\] = -2 is outside the cache's blocks \[0, 4\)",
    ),
    "index-on-meta": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]),
           torch.tensor([0, 1], device="meta"), torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"Meta|meta",
    ),
    "float-block-table": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0.5]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"block_table must be an int64 or int32 tensor .*, got Float",
    ),
    "sinks-too-short": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0, None, torch.zeros(1))
        """,
        r"sinks must be \[H\] = \[2\], got shape \[1\]",
    ),
    "write-slot-past-cache": (
        """
        kv = torch.zeros(2, 1, 4, 1, 8)
        write(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kv[0], kv[1], torch.tensor([0, 4]))
        """,
        r"slot_mapping\[1\] = 4 is outside the cache's 4 slots",
    ),
    "write-too-few-slots": (
        """
        kv = torch.zeros(2, 1, 4, 1, 8)
        write(torch.ones(3, 1, 8), torch.ones(3, 1, 8), kv[0], kv[1], torch.tensor([0, 1]))
        """,
        r"slot_mapping has 2 entries for 3 tokens",
    ),
    "write-expanded-cache": (
        """
        kv = torch.zeros(2, 1, 1, 1, 8).expand(2, 3, 4, 1, 8)
        write(torch.ones(1, 1, 8), torch.ones(1, 1, 8), kv[0], kv[1], torch.tensor([5]))
        """,
        r"a cache has slots that may share memory",
    ),
    "write-overlapping-rows": (  # no stride is 0, but each row overlaps the next one's half
        """
        buf = torch.zeros(2 * 2 * 16 * 32)
        kv = buf.as_strided((2, 2, 16, 1, 32), (1024, 256, 16, 32, 1))
        write(torch.ones(1, 1, 32), torch.ones(1, 1, 32), kv[0], kv[1], torch.tensor([0]))
        """,
        r"a cache has slots that may share memory \(key_cache strides \[256, 16, 32, 1\]",
    ),
    "out-heads-overlap": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 4, 64)
        out = torch.empty(1, 64 + 3).as_strided((1, 4, 64), (256, 1, 1))
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]),
           out, 0.125, 0, 0.0)
        """,
        r"out has elements that may share memory \(strides \[256, 1, 1\]",
    ),
    "unsigned-block-table": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]], dtype=torch.uint32), torch.tensor([3]),
           torch.tensor([0, 1]), torch.empty(1, 2, 64), 0.125, 0, 0.0)
        """,
        r"attn_di paged_attention: block_table must be an int64 or int32 tensor .*, got UInt32",
    ),
    "complex-alibi": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 0.0, torch.ones(2, dtype=torch.complex64))
        """,
        r"alibi_slopes must be real numbers, got ComplexFloat",
    ),
    "soft-cap-below-float32": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), 0.125, 0, 1e-300)
        """,
        r"soft_cap must be 0 \(none\) or a positive number at least float32's smallest normal",
    ),
    "scale-nan": (
        """
        kv = torch.randn(2, 4, 16, 1, 64)
        q = torch.randn(1, 2, 64)
        op(q, kv[0], kv[1], torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0, 1]),
           torch.empty(1, 2, 64), float("nan"), 0, 0.0)
        """,
        r"scale must be a finite float32, got nan",
    ),
}


@pytest.mark.parametrize("case", list(CRASHES))
def test_malformed_call_raises_naming_the_argument(case: str) -> None:
    """Each malformed call that used to crash the process raises a RuntimeError that names
    the offending argument, and the process lives on."""
    code, message = CRASHES[case]
    result = run_isolated(
        "import re\ntry:\n"
        + textwrap.indent(textwrap.dedent(code), "    ")
        + "except (RuntimeError, NotImplementedError) as error:\n"
        + f"    assert re.search({message!r}, str(error)), str(error)\n"
        + "    print('raised')\n"
        + "else:\n"
        + "    raise SystemExit('no error')\n"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "raised"


def test_nothing_is_written_when_a_later_slot_is_bad() -> None:
    """write_kv_cache checks every slot before it writes the first one."""
    kv_cache = torch.zeros(2, 1, 4, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 9"):
        torch.ops.attn_di.write_kv_cache(
            torch.ones(3, 1, 8), torch.ones(3, 1, 8), kv_cache[0], kv_cache[1],
            torch.tensor([0, 1, 9]),
        )  # fmt: skip
    assert not bool(kv_cache.any())


def test_fuzzed_calls_never_kill_the_process() -> None:
    """1500 calls with one to three things broken (shapes, dtypes, devices, strides, index
    values) raise or run, never crash, and never write outside the tensors given."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.backends.op_fuzz", "--iterations", "1500", "--seed", "7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    raised, ran = (int(part.split("=")[1]) for part in result.stdout.split())
    assert raised > 1000  # most calls are refused ...
    assert ran > 0  # ... and some mutations leave a valid call


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((2, 4, 0, 1, 64), r"has block size 0 \(axis 2\); it must be > 0"),
    ],
)
def test_forward_refuses_a_zero_block_size(shape: tuple[int, ...], message: str) -> None:
    """Through impl.forward a cache of block size 0 is an InvalidInputError (it was a bare
    ``RuntimeError: ZeroDivisionError``), before anything is written."""
    impl = CPUAttentionImpl(num_heads=2, head_size=64, scale=0.125, num_kv_heads=1)
    batch = make_batch(Options(2, 1, 64), [1], [1], 16, torch.float32)
    with pytest.raises(InvalidInputError, match=message):
        impl.forward(None, batch.query, batch.key, batch.value, torch.zeros(shape), batch.metadata)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, 4, 16, 1, 128)[..., ::2],
        lambda: torch.zeros(2, 4, 1, 1, 64).expand(2, 4, 16, 1, 64),
    ],
    ids=["strided-last-axis", "expanded"],
)
def test_forward_refuses_caches_whose_slots_share_memory_or_scatter_a_row(make: object) -> None:
    """A cache with a stride-0 axis (slots aliasing one another) or a non-contiguous head row
    is refused naming kv_cache and its strides; permuted buffers are fine (test_cache.py)."""
    impl = CPUAttentionImpl(num_heads=2, head_size=64, scale=0.125, num_kv_heads=1)
    batch = make_batch(Options(2, 1, 64), [1], [3], 16, torch.float32)
    kv_cache = make()  # type: ignore[operator]
    with pytest.raises(InvalidInputError, match=r"kv_cache: strides .* must be contiguous"):
        impl.forward(None, batch.query, batch.key, batch.value, kv_cache, batch.metadata)


def _reference_batch(q_len: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """``(query, kv_cache, block_table, seq_lens, query_start_loc)`` of one sequence (4/2
    heads of 32, block size 16), its cache NaN outside the slots it covers."""
    generator = torch.Generator().manual_seed(3)
    blocks = -(-seq_len // 16)
    kv_cache = torch.full((2, blocks + 2, 16, 2, 32), float("nan"))
    table = torch.arange(1, blocks + 1).unsqueeze(0)
    written = torch.randn(2, seq_len, 2, 32, generator=generator)
    for position in range(seq_len):
        kv_cache[:, 1 + position // 16, position % 16] = written[:, position]
    query = torch.randn(q_len, 4, 32, generator=generator)
    return query, kv_cache, table, torch.tensor([seq_len]), torch.tensor([0, q_len])


def _op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: torch.Tensor,
    window: int,
) -> torch.Tensor:
    out = torch.zeros_like(query)
    torch.ops.attn_di.paged_attention(
        query, kv_cache[0], kv_cache[1], table, seq_lens, starts, out, 32**-0.5, window, 0.0
    )
    return out


@pytest.mark.parametrize("q_len", [1, 4, 40], ids=["decode", "chunked-decode", "prefill"])
@pytest.mark.parametrize("window", [40, 2**40, 2**62, 2**63 - 1])
def test_a_window_as_long_as_every_sequence_is_no_window(q_len: int, window: int) -> None:
    """A sliding window at least the longest sequence hides nothing, on every path: near
    int64's limit the visibility arithmetic overflowed (rows saw wrong keys)."""
    query, kv_cache, table, seq_lens, starts = _reference_batch(q_len, 40)
    expected = _op(query, kv_cache, table, seq_lens, starts, 0)
    assert bool(torch.isfinite(expected).all())
    torch.testing.assert_close(_op(query, kv_cache, table, seq_lens, starts, window), expected)


def test_an_expanded_block_table_is_read_not_copied_whole() -> None:
    """An expanded int32 block table of 2**40 columns (a view of 8 bytes) is read through
    its strides, only the columns the sequences use: copying it whole took terabytes; one of
    2**40 rows is refused for its row count without being copied."""
    query, kv_cache, table, seq_lens, starts = _reference_batch(4, 40)
    expected = _op(query, kv_cache, table, seq_lens, starts, 0)
    assert int(table[0, 0]) == 1
    for wide in (
        torch.ones(1, 1, dtype=torch.int32).expand(1, 2**40),  # every column is block 1
        torch.ones(1, 1, dtype=torch.int64).expand(1, 2**40),
    ):
        single = _reference_batch(4, 16)
        got = _op(single[0], kv_cache, wide, torch.tensor([16]), single[4], 0)
        narrow = _op(single[0], kv_cache, table[:, :1], torch.tensor([16]), single[4], 0)
        torch.testing.assert_close(got, narrow)
    strided = torch.stack([table[0], table[0]], 1).T[:1]  # int64, columns 2 apart
    torch.testing.assert_close(_op(query, kv_cache, strided, seq_lens, starts, 0), expected)
    tall = torch.ones(1, 1, dtype=torch.int32).expand(2**40, 1)  # 2**40 rows for 1 sequence
    with pytest.raises(RuntimeError, match=r"block_table must be \[B, max_blocks\] with B = 1"):
        _op(query, kv_cache, tall, seq_lens, starts, 0)  # refused, not copied first


def test_an_empty_out_of_any_strides_is_accepted() -> None:
    """An ``out`` with no elements has none to share memory, whatever its strides (Python's
    checks say the same): an empty batch runs and writes nothing."""
    kv_cache = torch.zeros(2, 4, 16, 1, 64)
    out = torch.zeros(1, 1, 64).expand(0, 2, 64)  # stride 0 on an axis of 2, but empty
    torch.ops.attn_di.paged_attention(
        torch.zeros(0, 2, 64), kv_cache[0], kv_cache[1], torch.zeros(0, 1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), out, 0.125, 0, 0.0,
    )  # fmt: skip
    assert out.shape == (0, 2, 64)


def _sharing_cases() -> dict[str, tuple[object, str]]:
    """``{case: (call, message)}``: each call passes the op a tensor it writes that shares
    memory with another argument (every pair of the kind: out against each argument the
    paged-attention op reads; a cache against the other cache and what the write reads)."""
    query, kv_cache, table, seq_lens, starts = _reference_batch(200, 200)
    op, write = torch.ops.attn_di.paged_attention, torch.ops.attn_di.write_kv_cache
    rows = int(query.shape[0])

    def attend(**replace: torch.Tensor) -> None:
        arguments = {
            "query": query, "key_cache": kv_cache[0], "value_cache": kv_cache[1],
            "block_table": table, "seq_lens": seq_lens, "query_start_loc": starts,
            "out": torch.zeros_like(query), "sinks": None,
        }  # fmt: skip
        arguments.update(replace)
        op(
            arguments["query"], arguments["key_cache"], arguments["value_cache"],
            arguments["block_table"], arguments["seq_lens"], arguments["query_start_loc"],
            arguments["out"], 32**-0.5, 0, 0.0, None, arguments["sinks"],
        )  # fmt: skip

    def shifted() -> None:  # out the query's buffer shifted by one row (several tiles)
        buffer = torch.zeros(rows + 1, 4, 32)
        buffer[1:] = query
        attend(query=buffer[1:], out=buffer[:rows])

    def out_holding(name: str, tensor: torch.Tensor) -> Callable[[], None]:
        def call() -> None:
            out = torch.zeros_like(query)
            inside = out.view(-1).view(tensor.dtype)[: tensor.numel()].view_as(tensor)
            inside.copy_(tensor)
            attend(out=out, **{name: inside})

        return call

    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    slots = torch.tensor([0, 1, 2])
    caches = kv_cache.clone()

    def write_with(name: str) -> Callable[[], None]:
        def call() -> None:
            inside = caches[0].view(-1)[: key.numel()].view_as(key)
            arguments = {"key": key, "value": value, "slot_mapping": slots}
            if name == "slot_mapping":
                arguments[name] = caches[0].view(-1).view(torch.int64)[:3]
                arguments[name].copy_(slots)
            else:
                inside.copy_(arguments[name])
                arguments[name] = inside
            write(
                arguments["key"],
                arguments["value"],
                caches[0],
                caches[1],
                arguments["slot_mapping"],
            )

        return call

    return {
        "out-over-query-by-a-row": (shifted, r"out shares memory with query, which the op reads"),
        "out-over-key-cache": (
            lambda: attend(out=kv_cache.view(-1)[: query.numel()].view_as(query)),
            r"out shares memory with key_cache",
        ),
        "block-table-in-out": (
            out_holding("block_table", table),
            r"out shares memory with block_table",
        ),
        "seq-lens-in-out": (out_holding("seq_lens", seq_lens), r"out shares memory with seq_lens"),
        "query-start-in-out": (
            out_holding("query_start_loc", starts),
            r"out shares memory with query_start_loc",
        ),
        "sinks-in-out": (out_holding("sinks", torch.randn(4)), r"out shares memory with sinks"),
        "write-one-cache-twice": (
            lambda: write(key, value, caches[0], caches[0], slots),
            r"key_cache shares memory with value_cache, which the op writes too",
        ),
        "write-key-in-cache": (write_with("key"), r"key_cache shares memory with key"),
        "write-value-in-cache": (write_with("value"), r"key_cache shares memory with value"),
        "write-slots-in-cache": (
            write_with("slot_mapping"),
            r"key_cache shares memory with slot_mapping",
        ),
    }


SHARING = [
    "out-over-query-by-a-row", "out-over-key-cache", "block-table-in-out", "seq-lens-in-out",
    "query-start-in-out", "sinks-in-out", "write-one-cache-twice", "write-key-in-cache",
    "write-value-in-cache", "write-slots-in-cache",
]  # fmt: skip
"""The cases of :func:`_sharing_cases` (made there once the kernel is loaded)."""


@pytest.mark.parametrize("case", SHARING)
def test_an_op_refuses_a_written_tensor_that_shares_memory(case: str) -> None:
    """Called directly, each op refuses (RuntimeError naming both) a tensor it writes that
    shares memory with another argument: ``out`` over the query shifted by a row silently
    got wrong rows from the prefill kernel."""
    call, message = _sharing_cases()[case]
    with pytest.raises(RuntimeError, match=message):
        call()  # type: ignore[operator]


def test_disjoint_views_of_one_buffer_are_accepted_by_the_ops() -> None:
    """vLLM's blocks-outermost cache (key and value planes interleaved block by block) is
    written, and an ``out`` interleaved with the query rows in one buffer is attended into:
    the same results as separate buffers."""
    query, kv_cache, table, seq_lens, starts = _reference_batch(200, 200)
    expected = _op(query, kv_cache, table, seq_lens, starts, 0)
    both = torch.zeros(200, 2, 4, 32)
    both[:, 0] = query
    torch.ops.attn_di.paged_attention(
        both[:, 0], kv_cache[0], kv_cache[1], table, seq_lens, starts, both[:, 1], 32**-0.5, 0, 0.0
    )
    torch.testing.assert_close(both[:, 1], expected)
    blocks_outermost = torch.zeros(4, 2, 16, 2, 32)
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    torch.ops.attn_di.write_kv_cache(
        key, value, blocks_outermost[:, 0], blocks_outermost[:, 1], torch.tensor([0, 17, 40])
    )
    assert torch.equal(blocks_outermost[1, 0, 1], key[1])
    assert torch.equal(blocks_outermost[2, 1, 8], value[2])
