"""Kernel-level profile of the portable backend (where its time goes), at the H3 shape on CUDA.

    PYTHONPATH=. python benchmarks/profile_sdpa_gpu.py [--device cuda] [--shapes h3] [--ratio 0.1]

Inputs, timing and the achieved TFLOP/s use ``solattn.bench``'s helpers, so the figures compare
with ``python -m solattn bench``. The profiler table lists the device's kernels sorted by time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from solattn.routing import build_plan
from solattn.validation import validate
from solattn.backends.sdpa import sdpa_forward
from solattn.bench import ProblemArgParser, flop_count, log, make_inputs, synchronize, time_calls


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = ProblemArgParser("benchmarks/profile_sdpa_gpu.py", __doc__.split("\n\n")[0], shapes=("h3",))
    ap.add_argument("--repeats", type=int, default=5, help="timed calls before profiling, median (default 5)")
    ap.add_argument("--gather-rows", type=int, default=8_000_000,
                    help="rows gathered by the index_select comparison (default 8e6; 0 skips it)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    dev = args.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sort_by = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    for shape in args.shapes:
        q, k, v = make_inputs(shape, torch.bfloat16, dev)
        for tail in (False, True):
            p = validate(q, k, v, topk_ratio=args.ratio, tail=tail)
            plan = build_plan(p)
            ms = statistics.median(time_calls(lambda: sdpa_forward(p, plan), dev, args.repeats, warmup=1))
            tflops = flop_count(shape, int(plan.kv_num_blocks.sum().item())) / ms / 1e9
            log(f"{'x'.join(map(str, shape))} tail={tail}: sdpa backend {ms:.1f} ms (plan given), "
                f"{tflops:.3g} TFLOP/s on the kept blocks")
            with profile(activities=activities) as prof:
                sdpa_forward(p, plan)
                synchronize(dev)
            print(prof.key_averages().table(sort_by=sort_by, row_limit=12, max_name_column_width=60), flush=True)
        if args.gather_rows:
            # index_select from a strided storage view against a contiguous table
            B, T, H, D = shape
            tab = k.reshape(B * T * H, D)
            idx = torch.randint(0, tab.shape[0], (args.gather_rows,), device=dev)
            strided = torch.as_strided(k, (tab.shape[0], D), (D, 1))
            for name, t in (("contiguous", tab), ("as_strided", strided)):
                out = torch.empty(idx.numel(), D, device=dev, dtype=t.dtype)
                ms = statistics.median(time_calls(lambda: torch.index_select(t, 0, idx, out=out), dev, 10,
                                                  warmup=3))
                log(f"index_select {name}: {ms:.2f} ms, {2 * out.numel() * t.element_size() / ms / 1e6:.0f} GB/s")
        del q, k, v


if __name__ == "__main__":
    main()
