"""Where the portable backend's time goes on a GPU, for whichever solattn is on PYTHONPATH.

    PYTHONPATH=<checkout> python benchmarks/diag/sdpa_profile_versions.py [--shape 1 37296 56 128]

Uses only the public API (``solattn.sol_attn(..., backend="sdpa")``) and its own inputs, so two
versions of the package can be compared in one session: it prints the median time of each
configuration and the profiler's ten most expensive device kernels with their call counts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import solattn


def inputs(B, T, H, D, seed=0):
    """Block-structured q, k, v (block means spread, as the benchmark's inputs) in bf16 on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = (T + 63) // 64
    out = []
    for _ in range(3):
        base = torch.randn(B, n, 1, H, D, device="cuda", generator=g) * 2.0 / D ** 0.25
        x = (base.expand(B, n, 64, H, D).reshape(B, n * 64, H, D)[:, :T]
             + torch.randn(B, T, H, D, device="cuda", generator=g))
        out.append(x.to(torch.bfloat16))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 37296, 56, 128])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    q, k, v = inputs(*args.shape)
    print("solattn from", solattn.__file__, flush=True)
    for ratio, tail in ((0.1, False), (0.2, False), (0.1, True)):
        def call():
            return solattn.sol_attn(q, k, v, topk_ratio=ratio, tail=tail, backend="sdpa")
        call()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"ratio {ratio} tail {tail}: {statistics.median(times):.1f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
