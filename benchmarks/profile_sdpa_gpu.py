"""Kernel-level profile of the portable backend at the H3 shape on CUDA (where its time goes).

    PYTHONPATH=. python benchmarks/profile_sdpa_gpu.py
"""
import math
import time

import torch
from torch.profiler import ProfilerActivity, profile

from solattn.routing import build_plan
from solattn.validation import validate
from solattn.backends.sdpa import sdpa_forward

B, T, H, D = 1, 37296, 56, 128
g = torch.Generator(device="cuda").manual_seed(0)
n = math.ceil(T / 64)
q, k, v = (((torch.randn(B, T, H, D, device="cuda", generator=g) * 0.5
             + torch.randn(B, n, H, D, device="cuda", generator=g).repeat_interleave(64, 1)[:, :T])
            * D ** -0.25).bfloat16() for _ in range(3))
for tail in (False, True):
    p = validate(q, k, v, topk_ratio=0.1, tail=tail)
    plan = build_plan(p)
    sdpa_forward(p, plan)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sdpa_forward(p, plan)
    torch.cuda.synchronize()
    print(f"tail={tail} wall {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sdpa_forward(p, plan)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
# index_select from a strided storage view vs a contiguous table
tab = k.reshape(B * T * H, D)
idx = torch.randint(0, tab.shape[0], (8_000_000,), device="cuda")
strided = torch.as_strided(k, (tab.shape[0], D), (D, 1))
for name, t in (("contiguous", tab), ("as_strided", strided)):
    out = torch.empty(idx.numel(), D, device="cuda", dtype=t.dtype)
    for _ in range(3):
        torch.index_select(t, 0, idx, out=out)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.index_select(t, 0, idx, out=out)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    print(f"index_select {name}: {dt * 1e3:.2f} ms, {2 * out.numel() * 2 / dt / 1e9:.0f} GB/s", flush=True)
