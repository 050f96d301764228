"""Where one ``video_sparse_attn`` call's GPU time goes at H3's size (the geometry of
``vsa_h3.py``, exempt prefix, sparsity 0.9): the torch profiler's kernel table of one call, then
its GPU timeline (each kernel's start and end from the first kernel's start, the idle gaps between
kernels, and the call's wall time between CUDA events), to find time that no kernel accounts for.

    python benchmarks/diag/vsa_profile.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402

GRID, PREFIX, H, D = (16, 48, 48), [432], 56, 128


def main():
    T = sum(PREFIX) + GRID[0] * GRID[1] * GRID[2]
    q, k, v = make_qkv(1, T, H, D, dtype=torch.bfloat16, device="cuda", seed=0)

    def call():
        return solattn.video_sparse_attn(q, k, v, GRID, sparsity=0.9, prefix_len=PREFIX, backend="triton")

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    total = 0.0
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 1e3, e.count, e.key[:90]))
            total += t / 1e3
    print(f"one call, GPU kernels {total:.2f} ms in all")
    for t, c, name in sorted(rows, reverse=True)[:12]:
        print(f"| {name} | {t:.3f} ms | x{c} |")
    timeline(call, prof)
    neighbours(call, q, k, v)


def timeline(call, prof):
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    if not kernels:
        print("no CUDA kernels in the profile")
        return
    t0 = kernels[0].time_range.start
    print("\n## GPU timeline of that call (ms from the first kernel's start)")
    prev_end = t0
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        gap = (start - prev_end) / 1e3
        print(f"  {(start - t0) / 1e3:8.3f} - {(end - t0) / 1e3:8.3f}  gap {gap:6.3f}  {e.name[:70]}")
        prev_end = max(prev_end, end)
    span = (prev_end - t0) / 1e3
    print(f"first kernel start to last kernel end: {span:.3f} ms")
    walls = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
    walls.sort()
    print(f"one call between CUDA events (10 calls, synchronised before each): median {walls[5]:.3f} ms, "
          f"min {walls[0]:.3f} ms")


def neighbours(call, q, k, v):
    """The same call timed alone, after a dense SDPA call, and in vsa_h3.py's rotation (dense, this
    call, the call with the torch plan), with the caching allocator's device allocations
    (cudaMalloc calls) counted during the timed calls: time no kernel accounts for."""
    import time
    from unittest import mock

    import torch.nn.functional as F

    from solattn.routing import fused

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def dense():
        return F.scaled_dot_product_attention(qt, kt, vt)

    def torch_plan():
        with mock.patch.object(fused, "fused_plan_usable", lambda problem: False):
            return call()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    del out
    print(f"\nhost time to enqueue one call: {host:.3f} ms")
    for label, before in (("alone", ()), ("after dense SDPA", (dense,)), ("vsa_h3 rotation", (dense, torch_plan))):
        times, allocs = [], 0
        for _ in range(10):
            for fn in before:
                fn()
            torch.cuda.synchronize()
            n0 = torch.cuda.memory_stats().get("num_device_alloc", 0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            allocs += torch.cuda.memory_stats().get("num_device_alloc", 0) - n0
            times.append(start.elapsed_time(end))
        times.sort()
        print(f"{label}: median {times[5]:.3f} ms (min {times[0]:.3f}, max {times[-1]:.3f}); "
              f"device allocations during the 10 timed calls: {allocs}")


if __name__ == "__main__":
    main()
