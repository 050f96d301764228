"""Seed-shape end-to-end times of ``sol_attn`` on the GPU (B=2, T=4056, H=16, D=128, bf16):
eager (plain calls skip the custom op), with pointer or TMA loads, and inside
``solattn.cuda_graphs()`` when present; plus the host time per call and where the torch plan's
GPU time goes at H3.

    python benchmarks/diag/session10_seed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")


def med(fn, n=100, warm=5):
    return statistics.median(time_calls(fn, dev, n, warm))


def host_us(fn, n=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def seed():
    q, k, v = make_qkv(2, 4056, 16, 128, dtype=torch.bfloat16, device=dev, seed=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dense = med(lambda: F.scaled_dot_product_attention(qt, kt, vt))
    print(f"dense SDPA e2e {dense:.3f} ms")
    graphs = getattr(solattn, "cuda_graphs", None)
    print("| mode | loads | e2e ms | vs dense | host us/call | rel L2 vs fp32 reference |")
    print("|---|---|---|---|---|---|")
    for label, kw in (("top-k 10 %", dict(topk_ratio=0.1, tail=False)), ("tau 1 + tail", dict(tau=1.0, tail=True))):
        ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
        for loads, threshold in (("pointer", 1 << 30), ("TMA", 0)):
            old = tb.TMA_MIN_PROGRAMS
            tb.TMA_MIN_PROGRAMS = threshold
            try:
                def call():
                    return solattn.sol_attn(q, k, v, backend="triton", **kw)
                with torch.no_grad():
                    e = rel_l2(call().float(), ref)
                    t = med(call)
                    h = host_us(call)
                print(f"| {label} eager | {loads} | {t:.3f} | {dense / t:.2f}x | {h:.0f} | {e:.1e} |", flush=True)
                if graphs is not None:
                    with torch.no_grad(), graphs() as cache:
                        for _ in range(3):
                            out = call()
                        e = rel_l2(out.float(), ref)
                        t = med(call)
                        h = host_us(call)
                        st = cache.stats
                    print(f"| {label} cuda_graphs | {loads} | {t:.3f} | {dense / t:.2f}x | {h:.0f} | {e:.1e} | {st}",
                          flush=True)
            finally:
                tb.TMA_MIN_PROGRAMS = old


def h3_plan_profile():
    from torch.profiler import ProfilerActivity, profile
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    for kw in (dict(topk_ratio=0.1, tail=False), dict(tau=1.0, tail=True)):
        problem = validate(q, k, v, **kw)
        print(f"H3 {kw}: torch plan {med(lambda: build_plan(problem), 10, 2):.2f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            build_plan(problem)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    seed()
    h3_plan_profile()
