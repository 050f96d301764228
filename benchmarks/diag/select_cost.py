"""The fused plan's launch parameters at H3 (B=1, T=37296, H=56, D=128, bf16) on a GPU, after the
scores moved into their own tiled GEMM (``scores_kernel``): plan time, per-kernel GPU times and
selection against the torch plan for each setting; then the GPU timeline of one end-to-end
``sol_attn`` call (kernel starts and gaps, host latency before the first kernel).

The ablations that led here (a copy of the select kernel with parts switched off, at a036e4b:
scores pass 0.43 ms, bisection 0.29 ms, scatter 0.09 ms of a 1.55 ms plan at top-k 10 %) are in
``results/h200/session13/a036e4b/select_cost.txt``; their code is in the history at a036e4b.

    python benchmarks/diag/select_cost.py [sweep] [timeline]        # default: both
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import MODES, differing_rows, kernel_table, med  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.routing import build_plan, fused  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
#: launch settings (``fused._fused_plan`` tuning keys, "key=value ..."). Sweeps at 2c916fc, 045cf55
#: and d3f0c89 (results/h200/session13/; the first two ran their top-k rows with the tail, validate's
#: default) kept 64 x 64 score tiles in 4 warps and the select kernel's 16 rows, 4 warps, bj 32, rb 8;
#: (rb 4 since session 14: 0.03 ms faster than 8 in three runs; centroid_bd 32: 0.01-0.05 ms faster than 128);
#: three probes per bisection pass (+0.13 ms), key tiles looped in one scores program (+0.08-0.11 ms)
#: and selecting a bisection tile's whole rows at once (+0.13 ms) lost and were removed.
#: session 19: the bisection in its own kernel (kth_kernel, one warp per program by default): rows
#: per program and warps
#: (134c0ec: "kth_rb=1" / "2" / "4", "kth_rb=4 kth_warps=2", "kth_rb=8 kth_warps=2" / "4",
#: "kth_rb=1 kth_warps=2", "kth_rb=16 kth_warps=4"; one row in one warp kept); then the scores GEMM
#: over BK head dims per step, pipelined
TOPK = ["", "scores_bk=32", "scores_bk=32 scores_stages=3", "scores_bk=64 scores_stages=2",
        "scores_bk=32 scores_stages=2 scores_warps=8", "scores_bk=32 scores_tile=128 scores_warps=8",
        "scores_bk=16 scores_stages=4", "scores_tile=32 scores_bk=32 scores_stages=3"]
#: the pooled-terms kernel (session 15): rows per program, key blocks per chunk, warps, stages; at 133d104
#: (default 64 rows, 8 warps) 16 rows in 4 warps took 0.33 ms, 32 rows 0.41, 64 rows 0.63-0.75, 128 rows 0.69
#: (session 15 swept "pool_bj=32", "pool_bi=16 pool_bj=64", "pool_bi=16 pool_warps=2" / "8",
#: "pool_bi=16 pool_stages=2", "pool_bi=32 pool_bj=16 pool_warps=4", "pool_bi=32 pool_warps=8",
#: "pool_bi=64 pool_bj=32 pool_warps=8": results/h200/session15/3fd1bbc/select_cost.txt)
TAU = [""]


def sweep(q, k, v):
    for label, kw in MODES:
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            want = build_plan(problem)
            # with a tail: the output's error against the definition (fp32 sdpa) with each plan
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw) if problem.tail else None
            print(f"\n## {label}", flush=True)
            for case in (TOPK if "topk_ratio" in kw else TAU):
                tuning = {key: int(val) if val.isdigit() else val for key, val in (kv.split("=") for kv in case.split())}
                try:
                    got = fused._fused_plan(problem, tuning)
                    same = differing_rows(got, want)
                    err = ""
                    if ref is not None:
                        err = (f", tail_value rel {rel_l2(got.tail_value, want.tail_value):.1e}, output error "
                               f"{rel_l2(tb.launch(problem, got).float(), ref):.3e}")
                    t = med(lambda: fused._fused_plan(problem, tuning))
                    kt = kernel_table(lambda: fused._fused_plan(problem, tuning))
                    print(f"  {case or 'default':32s} plan {t:.3f} ms, rows differing {same}{err}; {kt}", flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"  {case or 'default':32s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def timeline(q, k, v):
    from torch.profiler import ProfilerActivity, profile
    for label, kw in MODES:
        def call():
            return solattn.sol_attn(q, k, v, backend="triton", **kw)
        with torch.no_grad():
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
        cpu0 = min(e.time_range.start for e in prof.events() if e.device_type.name == "CPU")
        print(f"\n## timeline {label} (us from the first host event)", flush=True)
        end = None
        for e in sorted(events, key=lambda e: e.time_range.start):
            gap = "" if end is None else f" gap {e.time_range.start - end:7.1f}"
            print(f"  start {e.time_range.start - cpu0:9.1f} dur {e.time_range.elapsed_us():9.1f}{gap}  {e.name[:60]}")
            end = e.time_range.end


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    what = sys.argv[1:] or ["sweep", "timeline"]
    if "sweep" in what:
        sweep(q, k, v)
    if "timeline" in what:
        timeline(q, k, v)
