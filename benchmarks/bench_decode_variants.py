"""Micro-benchmark of pure-torch paged decode variants (the shape of bench_backends.py).

Run: ``python benchmarks/bench_decode_variants.py [--rounds N]``. Each variant runs once
per round, round-robin; medians in ms. Variants are checked against contiguous SDPA.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

B, H, HKV, D, L, BS = 8, 32, 8, 128, 2048, 16
G = H // HKV
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def setup(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    nblocks = B * L // BS
    cache = torch.randn((2, nblocks, BS, HKV, D), generator=gen).to(dtype)
    table = torch.randperm(nblocks, generator=gen).view(B, -1)
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    return {"cache": cache, "table": table, "q": q}


def flash_chunks(seqs_per_chunk: int, blocks_per_chunk: int, dtype: torch.dtype) -> Callable:
    """Gather whole blocks (one row per block) and run the flash kernel per chunk."""
    bufs: dict[str, torch.Tensor] = {}

    def fn(s: dict[str, torch.Tensor]) -> torch.Tensor:
        cache, table, q = s["cache"], s["table"], s["q"]
        kc = cache[0].view(cache.shape[1], -1)
        vc = cache[1].view(cache.shape[1], -1)
        nb = table.shape[1]
        n = seqs_per_chunk * blocks_per_chunk
        if "k" not in bufs:
            bufs["k"] = torch.empty(n, kc.shape[1], dtype=dtype)
            bufs["v"] = torch.empty(n, kc.shape[1], dtype=dtype)
        kb, vb = bufs["k"], bufs["v"]
        qf = q.view(B, HKV, G, D)
        outs, lses = [], []
        for b0 in range(0, B, seqs_per_chunk):
            row_outs, row_lses = [], []
            for c0 in range(0, nb, blocks_per_chunk):
                idx = table[b0 : b0 + seqs_per_chunk, c0 : c0 + blocks_per_chunk].reshape(-1)
                torch.index_select(kc, 0, idx, out=kb)
                torch.index_select(vc, 0, idx, out=vb)
                w = blocks_per_chunk * BS
                k = kb.view(seqs_per_chunk, w, HKV, D).transpose(1, 2)
                v = vb.view(seqs_per_chunk, w, HKV, D).transpose(1, 2)
                o, lse = FLASH(qf[b0 : b0 + seqs_per_chunk], k, v, scale=D**-0.5)
                row_outs.append(o)
                row_lses.append(lse)
            outs.append(torch.stack(row_outs))
            lses.append(torch.stack(row_lses))
        o = torch.cat(outs, 1).float()  # [C, B, HKV, G, D]
        lse = torch.cat(lses, 1).float().unsqueeze(-1)
        w = torch.softmax(lse, 0)
        return (o * w).sum(0).view(B, H, D)

    return fn


def bmm_two_pass(blocks_per_chunk: int, dtype: torch.dtype, upcast: bool) -> Callable:
    """Per sequence: gather K chunks, scores by bmm on strided views; softmax; same for V."""
    bufs: dict[str, torch.Tensor] = {}

    def fn(s: dict[str, torch.Tensor]) -> torch.Tensor:
        cache, table, q = s["cache"], s["table"], s["q"]
        kc = cache[0].view(cache.shape[1], -1)
        vc = cache[1].view(cache.shape[1], -1)
        nb = table.shape[1]
        n = blocks_per_chunk
        cdt = torch.float32 if upcast else dtype
        if "k" not in bufs:
            bufs["k"] = torch.empty(n, kc.shape[1], dtype=dtype)
            bufs["f"] = torch.empty(n, kc.shape[1], dtype=torch.float32)
            bufs["s"] = torch.empty(B, HKV, G, L, dtype=cdt)
            bufs["o"] = torch.empty(B, HKV, G, D, dtype=torch.float32)
        kb, fb, sc, out = bufs["k"], bufs["f"], bufs["s"], bufs["o"]
        qf = (q.view(B, HKV, G, D).to(cdt)) * (D**-0.5)
        w = n * BS
        for b in range(B):
            for c0 in range(0, nb, n):
                idx = table[b, c0 : c0 + n]
                torch.index_select(kc, 0, idx, out=kb)
                src = kb
                if upcast and dtype != torch.float32:
                    fb.copy_(kb)
                    src = fb
                k = src.view(w, HKV, D).permute(1, 2, 0)  # [HKV, D, w]
                torch.bmm(qf[b], k, out=sc[b, :, :, c0 * BS : c0 * BS + w])
        p = torch.softmax(sc.float(), -1).to(cdt)
        for b in range(B):
            first = True
            for c0 in range(0, nb, n):
                idx = table[b, c0 : c0 + n]
                torch.index_select(vc, 0, idx, out=kb)
                src = kb
                if upcast and dtype != torch.float32:
                    fb.copy_(kb)
                    src = fb
                v = src.view(w, HKV, D).transpose(0, 1)  # [HKV, w, D]
                pc = p[b, :, :, c0 * BS : c0 * BS + w]
                if first:
                    torch.bmm(pc, v, out=out[b]) if cdt == torch.float32 else out[b].copy_(
                        torch.bmm(pc, v)
                    )
                    first = False
                else:
                    if cdt == torch.float32:
                        out[b].baddbmm_(pc, v)
                    else:
                        out[b].add_(torch.bmm(pc, v))
        return out.view(B, H, D)

    return fn


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: object) -> torch.Tensor:
    """Contiguous SDPA with GQA folded (the peer)."""
    return F.scaled_dot_product_attention(q, k, v)


def floor(k: torch.Tensor, v: torch.Tensor, s: object) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over K and one over V."""
    return k.sum(), v.sum()


class ImplCall:
    """CPU_ATTN's forward with a given decode chunk size, or with the decode path off."""

    def __init__(
        self, impl: Any, args: tuple[Any, ...], chunk_bytes: int, fast: bool, min_keys: int = 64
    ) -> None:
        self.impl, self.args, self.chunk_bytes, self.fast = impl, args, chunk_bytes, fast
        self.min_keys = min_keys

    def __call__(self, s: object) -> torch.Tensor:
        from attn_di.backends import cpu_attn

        saved = cpu_attn._DECODE_CHUNK_BYTES, cpu_attn._is_pure_decode, cpu_attn._DECODE_MIN_KEYS
        cpu_attn._DECODE_CHUNK_BYTES = self.chunk_bytes
        cpu_attn._DECODE_MIN_KEYS = self.min_keys
        if not self.fast:
            cpu_attn._is_pure_decode = lambda *a: False
        try:
            out: torch.Tensor = self.impl.forward(None, *self.args)
            return out
        finally:
            cpu_attn._DECODE_CHUNK_BYTES, cpu_attn._is_pure_decode, cpu_attn._DECODE_MIN_KEYS = (
                saved
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", default="")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()} load {os.getloadavg()[0]:.2f}")
    from attn_di.backend import AttentionMetadataBuilder
    from attn_di.backends.cpu_attn import CPUAttentionImpl

    for dtype in (torch.float32, torch.bfloat16):
        s = setup(dtype)
        cache, table, q = s["cache"], s["table"], s["q"]
        kcont = cache[0][table].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
        vcont = cache[1][table].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
        qf = q.view(B, HKV, G, D)
        ref = F.scaled_dot_product_attention(qf.double(), kcont.double(), vcont.double())
        ref = ref.view(B, H, D)
        impl = CPUAttentionImpl(H, D, D**-0.5, HKV)
        md = AttentionMetadataBuilder(BS).build([1] * B, [L] * B, table.int())
        outbuf = torch.empty(B, H * D, dtype=dtype)
        slots = md.slot_mapping.long()
        knew = cache[0].reshape(-1, HKV, D)[slots].clone()
        vnew = cache[1].reshape(-1, HKV, D)[slots].clone()

        variants: dict[str, Callable] = {
            "sdpa folded": functools.partial(sdpa, qf, kcont, vcont),
            "floor": functools.partial(floor, kcont, vcont),
            "impl general path": ImplCall(impl, (q, knew, vnew, cache, md, outbuf), 0, False),
        }
        for kib in (2048, 4096, 8192):
            for keys in (64, 256):
                variants[f"impl decode {kib} KiB {keys} keys"] = ImplCall(
                    impl, (q, knew, vnew, cache, md, outbuf), kib << 10, True, keys
                )
        for spc, bpc in ((8, 4), (4, 8), (2, 16)):
            variants[f"flash s{spc} b{bpc}"] = flash_chunks(spc, bpc, dtype)
        if args.only:
            variants = {
                k: v for k, v in variants.items() if any(o in k for o in args.only.split(","))
            }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for k, fn in variants.items():
            out = fn(s)
            if k != "floor":
                err = (out.double().reshape(B, H, D) - ref).abs().max().item()
                if err > 3e-2:
                    print(f"  {k}: max err {err:.2e}")
        for _ in range(args.rounds):
            for k, fn in variants.items():
                t = time.perf_counter()
                fn(s)
                times[k].append(time.perf_counter() - t)
        print(dtype, f"load {os.getloadavg()[0]:.2f}")
        base = statistics.median(times["sdpa folded"])
        for k, v in times.items():
            m = statistics.median(v)
            print(f"  {k:20s} {m * 1e3:8.2f} ms  {m / base:5.2f}x")


if __name__ == "__main__":
    main()
