"""Fuzz CPU_ATTN's compiled ops with malformed arguments: they raise, they never crash.

Run as a script (``python -m tests.backends.op_fuzz --iterations N --seed S``), in a process of
its own: a memory error would kill it, and the test that starts it sees the signal.

Each round builds a valid call of ``torch.ops.attn_di.paged_attention``, ``write_kv_cache`` or
``write_and_attend`` (random heads, head size, block size, layout, ragged batch), then breaks one
to three things
about it (a shape, a dtype, a device, a stride, an index value) and calls the op. The call must
either raise (RuntimeError and the errors torch's dispatcher raises: TypeError,
NotImplementedError, ValueError, IndexError) or succeed; and whatever it does, it must not
write outside the tensors it was given. Every tensor the op may write lies inside a larger
buffer whose guard zones before and after hold a sentinel value, checked after each call.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SENTINEL = 1234.5
GUARD = 4096  # elements of guard zone on each side of a writable tensor
ACCEPTED = (RuntimeError, TypeError, NotImplementedError, ValueError, IndexError)
LAYOUTS = [(0, 1, 2, 3, 4), (1, 0, 2, 3, 4), (0, 1, 3, 2, 4), (1, 0, 3, 2, 4)]


@dataclass
class Guarded:
    """A tensor that lies inside a sentinel-filled buffer (``buffer[GUARD:-GUARD]``)."""

    buffer: torch.Tensor
    tensor: torch.Tensor

    def intact(self) -> bool:
        """Whether the guard zones still hold only the sentinel."""
        head, tail = self.buffer[:GUARD], self.buffer[-GUARD:]
        return bool((head == SENTINEL).all()) and bool((tail == SENTINEL).all())


def guarded(
    shape: tuple[int, ...], dtype: torch.dtype, order: tuple[int, ...] | None = None
) -> Guarded:
    """A tensor of ``shape`` (memory order ``order``, a stride order) between guard zones."""
    order = order or tuple(range(len(shape)))
    physical = tuple(shape[axis] for axis in order)
    numel = 1
    for size in physical:
        numel *= size
    buffer = torch.full((numel + 2 * GUARD,), SENTINEL, dtype=dtype)
    inner = buffer[GUARD : GUARD + numel].view(physical)
    inverse = tuple(order.index(axis) for axis in range(len(order)))
    return Guarded(buffer, inner.permute(inverse))


@dataclass
class Call:
    """One op call: positional arguments and the guarded tensors it may write."""

    op: str
    args: list[Any]
    guards: list[Guarded] = field(default_factory=list)


def valid_attention(rng: random.Random) -> Call:
    """A well-formed paged_attention call."""
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 3])
    heads, size = kv_heads * group, rng.choice([8, 16, 40, 64])
    block_size, num_blocks = rng.choice([1, 3, 16, 32]), rng.randint(1, 10)
    seqs = rng.randint(1, 4)
    seq_lens = [rng.randint(0, num_blocks * block_size) for _ in range(seqs)]
    q_lens = [rng.randint(0, min(s, 20)) for s in seq_lens]
    width = max(-(-s // block_size) for s in seq_lens) + rng.randint(0, 2)
    table = torch.tensor(
        [[rng.randrange(num_blocks) for _ in range(width)] for _ in range(seqs)], dtype=torch.int32
    )
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    tokens = starts[-1]
    cache = guarded((2, num_blocks, block_size, kv_heads, size), dtype, rng.choice(LAYOUTS))
    cache.tensor.normal_()
    out = guarded((tokens, heads, size), dtype)
    query = torch.randn(tokens, heads, size).to(dtype)
    args: list[Any] = [
        query,
        cache.tensor[0],
        cache.tensor[1],
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        out.tensor,
        size**-0.5,
        rng.choice([0, 0, 5]),
        rng.choice([0.0, 0.0, 20.0]),
        rng.choice([None, torch.rand(heads)]),
        rng.choice([None, torch.randn(heads)]),
    ]
    return Call("paged_attention", args, [cache, out])


def valid_write(rng: random.Random) -> Call:
    """A well-formed write_kv_cache call."""
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    kv_heads, size = rng.choice([1, 2, 3]), rng.choice([8, 40, 64])
    block_size, num_blocks = rng.choice([1, 3, 16]), rng.randint(1, 6)
    tokens = rng.randint(0, 12)
    cache = guarded((2, num_blocks, block_size, kv_heads, size), dtype, rng.choice(LAYOUTS))
    slots = [rng.choice([-1, rng.randrange(num_blocks * block_size)]) for _ in range(tokens)]
    args: list[Any] = [
        torch.randn(tokens, kv_heads, size).to(dtype),
        torch.randn(tokens, kv_heads, size).to(dtype),
        cache.tensor[0],
        cache.tensor[1],
        torch.tensor(slots, dtype=torch.int64),
    ]
    return Call("write_kv_cache", args, [cache])


def valid_one_call(rng: random.Random) -> Call:
    """A well-formed write_and_attend call: a paged_attention call's batch whose step keys and
    values (the first ``written`` of them, at random slots or -1) are written first."""
    attention = valid_attention(rng)
    query, key_cache, _, table, seq_lens, starts, out = attention.args[:7]
    cache = attention.guards[0]
    tokens, heads, size = out.shape
    kv_heads, num_slots = key_cache.shape[2], key_cache.shape[0] * key_cache.shape[1]
    output = guarded((tokens, heads * size), query.dtype)
    slots = [rng.choice([-1, rng.randrange(num_slots)]) for _ in range(tokens)]
    args: list[Any] = [
        query,
        torch.randn(tokens, kv_heads, size).to(query.dtype),
        torch.randn(tokens, kv_heads, size).to(query.dtype),
        cache.tensor,
        torch.tensor(slots, dtype=torch.int64),
        rng.randint(0, tokens),
        table,
        seq_lens,
        starts,
        output.tensor,
        *attention.args[7:12],
        True,
        heads,
        kv_heads,
        size,
    ]
    return Call("write_and_attend", args, [cache, output])


def _tensor_positions(call: Call) -> list[int]:
    return [i for i, arg in enumerate(call.args) if isinstance(arg, torch.Tensor)]


def _index_positions(call: Call) -> list[int]:
    return [i for i in _tensor_positions(call) if not call.args[i].is_floating_point()]


# -- mutations: each breaks one thing about a call --------------------------------------------
def shrink_rows(call: Call, rng: random.Random) -> None:
    """Fewer rows (or one more axis entry) in a tensor: out, query, key, an index."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    if tensor.dim() and tensor.shape[0]:
        call.args[i] = tensor[: rng.randrange(tensor.shape[0])]


def grow_rows(call: Call, rng: random.Random) -> None:
    """More rows than the call's other arguments expect."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    if tensor.dim():
        call.args[i] = torch.cat([tensor, tensor[:1].expand(rng.randint(1, 3), *tensor.shape[1:])])


def wrong_rank(call: Call, rng: random.Random) -> None:
    """A tensor with an axis more or fewer."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    call.args[i] = tensor.reshape(-1) if tensor.dim() > 1 else tensor.unsqueeze(0)


def wrong_dtype(call: Call, rng: random.Random) -> None:
    """A tensor of another dtype (floats for indices, ints for data, bool, double)."""
    i = rng.choice(_tensor_positions(call))
    call.args[i] = call.args[i].to(
        rng.choice(
            [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool, torch.uint8]
        )
    )


def meta_device(call: Call, rng: random.Random) -> None:
    """A tensor without data (the meta device)."""
    i = rng.choice(_tensor_positions(call))
    call.args[i] = call.args[i].to("meta")


def bad_index_value(call: Call, rng: random.Random) -> None:
    """An index (block id, slot, length, start) negative, past the end or huge."""
    positions = _index_positions(call)
    if not positions:
        return
    i = rng.choice(positions)
    tensor = call.args[i].clone()
    if tensor.numel():
        value = rng.choice([-1, -(2**31), 2**31 - 1, 2**62, -(2**62), 10**6, 3])
        flat = tensor.reshape(-1)
        flat[rng.randrange(flat.numel())] = max(
            min(value, torch.iinfo(tensor.dtype).max), torch.iinfo(tensor.dtype).min
        )
        call.args[i] = tensor


def swap_index_values(call: Call, rng: random.Random) -> None:
    """Entries of an index tensor out of order (query_start_loc decreasing)."""
    positions = _index_positions(call)
    if positions:
        i = rng.choice(positions)
        call.args[i] = call.args[i].flip(-1) if call.args[i].dim() else call.args[i]


def odd_strides(call: Call, rng: random.Random) -> None:
    """A transposed last axis, a stride of 0, or a sliced view."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    kind = rng.choice(["transpose", "expand", "slice"])
    if kind == "transpose" and tensor.dim() >= 2:
        call.args[i] = tensor.transpose(-1, -2)
    elif kind == "expand" and tensor.dim() >= 1 and tensor.shape[0]:
        call.args[i] = tensor[:1].expand(tensor.shape)
    elif tensor.dim() >= 1 and tensor.shape[-1] > 1:
        call.args[i] = tensor[..., ::2]


def zero_axis(call: Call, rng: random.Random) -> None:
    """A tensor with one axis of size 0 (a block size of 0, no heads, no blocks)."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    if tensor.dim():
        axis = rng.randrange(tensor.dim())
        call.args[i] = tensor.narrow(axis, 0, 0)


def math_bit(call: Call, rng: random.Random) -> None:
    """A tensor with a math bit: a negative view of its own memory (an op that wrote through it
    would touch the guarded buffer), one of its values (float32: the imaginary part of a
    conjugated complex64 tensor), or a zero tensor (no memory)."""
    i = rng.choice(_tensor_positions(call))
    tensor = call.args[i]
    kind = rng.choice(["own memory", "complex", "zero"])
    if kind == "own memory" and tensor.is_floating_point():
        call.args[i] = torch._neg_view(tensor)  # the guarded memory itself, negated
    elif kind == "complex" and tensor.dtype == torch.float32 and tensor.device.type == "cpu":
        call.args[i] = torch.complex(torch.zeros_like(tensor), -tensor).conj().imag
    else:
        call.args[i] = torch._efficientzerotensor(tensor.shape, dtype=tensor.dtype)


def bad_scalar(call: Call, rng: random.Random) -> None:
    """A scalar option out of range (scale, window, soft cap) or an optional tensor misshapen;
    for write_and_attend also the rows to write or the layer's head counts and size."""
    if call.op == "write_kv_cache":
        return
    first = 7 if call.op == "paged_attention" else 10  # the scale's position
    if call.op == "write_and_attend" and rng.random() < 0.4:
        slot = rng.choice([5, 16, 17, 18])  # written, heads, kv_heads, head_size
        call.args[slot] = rng.choice([-1, 0, 1, 3, call.args[slot] + 1, 2**40])
        return
    slot = rng.choice(range(first, first + 5))
    if slot == first:
        call.args[slot] = rng.choice([float("nan"), float("inf"), -1.0, 0.0])
    elif slot == first + 1:
        call.args[slot] = rng.choice([-5, 2**62, 1])
    elif slot == first + 2:
        call.args[slot] = rng.choice([float("nan"), -3.0, float("inf")])
    else:
        call.args[slot] = rng.choice(
            [torch.rand(1), torch.rand(100), torch.rand(2, 2), torch.rand(3).to("meta")]
        )


MUTATIONS: list[Callable[[Call, random.Random], None]] = [
    shrink_rows,
    grow_rows,
    wrong_rank,
    wrong_dtype,
    meta_device,
    bad_index_value,
    swap_index_values,
    odd_strides,
    zero_axis,
    math_bit,
    bad_scalar,
]


def fuzz(iterations: int, seed: int) -> dict[str, int]:
    """Run ``iterations`` malformed calls; raise AssertionError if one writes out of bounds."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ops = {
        "paged_attention": torch.ops.attn_di.paged_attention,
        "write_kv_cache": torch.ops.attn_di.write_kv_cache,
        "write_and_attend": torch.ops.attn_di.write_and_attend,
    }
    makers = [valid_attention, valid_write, valid_one_call]
    counts = {"raised": 0, "ran": 0}
    for round_ in range(iterations):
        call = rng.choices(makers, weights=[0.45, 0.25, 0.3])[0](rng)
        for mutation in rng.sample(MUTATIONS, rng.randint(1, 3)):
            with contextlib.suppress(*ACCEPTED):  # a mutation that does not apply here
                mutation(call, rng)
        try:
            ops[call.op](*call.args)
            counts["ran"] += 1
        except ACCEPTED:
            counts["raised"] += 1
        for guard in call.guards:
            assert guard.intact(), f"round {round_} ({call.op}) wrote outside its tensors"
    return counts


def main(argv: list[str] | None = None) -> int:
    """Load the kernel, fuzz, print ``raised=R ran=N``; exit 0 (or die, which the test sees)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    from attn_di.backends import _cpu_kernel

    status = _cpu_kernel.kernel_status()
    if not status.active:
        print(f"kernel unavailable: {status.describe()}")
        return 3
    torch.set_num_threads(2)
    counts = fuzz(options.iterations, options.seed)
    print(f"raised={counts['raised']} ran={counts['ran']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
