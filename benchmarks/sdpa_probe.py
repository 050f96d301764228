"""bench_flex_cpu.py's probe: single SDPA calls shaped as the sdpa backend's, against the dense call."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def probe_lines(args, log) -> list:
    """Single SDPA calls shaped as the sdpa backend's (items of 64 query rows against ``c`` kept key
    blocks; as heads; as 32-row items sharing stride-0 keys, ``SdpaTuning(query_rows=32)``; with
    an fp32 mask, as with the tail) and the dense call, all threads and one; ``log(str)`` reports
    progress."""
    dt, D, H, T = getattr(torch, args.dtype), args.D, args.H, args.T
    c = max(1, round(0.1 * T / 64) + 2)          # ~ top-k 10 % plus the forced neighbours
    L = c * 64
    nr = max(1, (32 << 20) // (2 * L * D * torch.finfo(dt).bits // 8))     # a 32 MB chunk of k and v
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(nr, 1, n, D, generator=g).to(dt) for n in (64, L, L))
    mask = torch.zeros(nr, 1, 1, L)
    qd, kd, vd = (torch.randn(1, H, T, D, generator=g).to(dt) for _ in range(3))
    flops = 4.0 * nr * 64 * L * D
    q32, k32, v32 = q.view(nr, 2, 32, D), k.expand(nr, 2, L, D), v.expand(nr, 2, L, D)
    cases = {f"items ({nr}, 1, 64, {D}) x ({nr}, 1, {L}, {D})": (lambda: F.scaled_dot_product_attention(q, k, v), flops),
             "the same as heads (1, nr, ...)": (lambda: F.scaled_dot_product_attention(
                 q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)), flops),
             f"32-row items ({nr}, 2, 32, {D}), stride-0 keys": (lambda: F.scaled_dot_product_attention(
                 q32, k32, v32), flops),
             "items with an fp32 mask (nr, 1, 1, L)": (lambda: F.scaled_dot_product_attention(
                 q, k, v, attn_mask=mask), flops),
             f"dense (1, {H}, {T}, {D})": (lambda: F.scaled_dot_product_attention(qd, kd, vd), 4.0 * H * T * T * D)}
    lines = ["## probe: the sdpa backend's SDPA call shapes against dense SDPA", "",
             f"{args.dtype}, one 32 MB chunk of the sdpa backend at ~top-k 10 % of T={T} ({c} key blocks per "
             "query block), and the dense call. Median of 3 calls after one.", "",
             "| call | threads | ms | GFLOP/s |", "|---|---|---|---|"]
    threads = torch.get_num_threads()
    for nt in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(nt)
        try:
            for label, (fn, fl) in cases.items():
                if nt == 1 and label.startswith("dense") and T > 4096:
                    continue                              # seconds on one thread, says nothing new
                fn()
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                ms = statistics.median(ts) * 1e3
                lines.append(f"| {label} | {nt} | {ms:.2f} | {fl / ms / 1e6:.0f} |")
                log(f"  probe {label}, {nt} threads: {ms:.2f} ms")
        finally:
            torch.set_num_threads(threads)
    return lines + [""]
