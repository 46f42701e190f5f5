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
        r"block_table must be an integer tensor, got Float",
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
        r"a cache has elements that share memory",
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
