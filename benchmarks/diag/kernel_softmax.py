"""Candidates for a cheaper key loop in the triton backend's kernel, timed at H3 on a GPU.

At 64-row tiles the kernel's loop is math-bound (about 440-490 TFLOP/s on an H200): the tensor
cores wait for the softmax between QK^T and PV. ``benchmarks/kernel_variants.py``'s
``CANDIDATES`` are loops built from the production kernel's pieces (what each changes, and the
candidates measured before, are listed there). For top-k 10 %, 20 % and tau 1 + tail at
B=1, T=37296, H=56, D=128, bf16 (the inputs of ``plan_h3_fused.py``), each candidate is timed
next to the production kernel (same plan, kernel only), with its error against the fp32
definition and its difference from the production kernel's output.

    python benchmarks/diag/kernel_softmax.py [--stages 3 2] [--names kv2 ...]
    python benchmarks/diag/kernel_softmax.py --dry-run     # tiny shape, CPU interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    ap.add_argument("--names", nargs="+", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import solattn
    from kernel_variants import CANDIDATES, run_candidate
    from solattn.backends.triton import KernelConfig
    from solattn.backends.triton import backend as tb
    from solattn.bench.timing import time_calls
    from solattn.routing import build_plan
    from solattn.testing import make_qkv, rel_l2
    from solattn.validation import validate

    dev = torch.device("cpu" if args.dry_run else "cuda")
    B, T, H, D = (1, 300, 2, 32) if args.dry_run else (1, 37296, 56, 128)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    names = args.names or list(CANDIDATES)
    q, k, v = make_qkv(B, T, H, D, dtype=dtype, device=dev, seed=0)

    def med(fn, n=20, warm=3):
        return statistics.median(time_calls(fn, dev, n, warm))

    if dev.type == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__)
    print(f"B={B} T={T} H={H} D={D} {dtype}; ms = median of 20 calls (kernel only, plan built before)")
    for label, kw in (("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
                      ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
                      ("tau 1 + tail", dict(tau=1.0, tail=True))):
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            plan = build_plan(problem)
            flop = 4 * int(plan.kv_num_blocks.long().sum()) * 64 * 64 * D
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
            base_out = tb.launch(problem, plan).float()
            t_base = med(lambda: tb.launch(problem, plan))
            print(f"\n## {label}: {flop / 1e12:.2f} TFLOP on kept blocks")
            print("| kernel | stages | ms | TFLOP/s | speed-up | err vs fp32 | diff vs production |")
            print("|---|---|---|---|---|---|---|")
            print(f"| production | 3 | {t_base:.3f} | {flop / t_base / 1e9:.0f} | 1.000 | "
                  f"{rel_l2(base_out, ref):.2e} | 0 |", flush=True)
            for stages in args.stages:
                cfg = KernelConfig(1, 4, stages, tma=not args.dry_run)
                for name in names:
                    try:
                        out = run_candidate(name, problem, plan, cfg).float()
                        t = med(lambda: run_candidate(name, problem, plan, cfg))
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"| {name} | {stages} | failed: {type(exc).__name__}: {str(exc)[:200]} |||||", flush=True)
                        continue
                    print(f"| {name} | {stages} | {t:.3f} | {flop / t / 1e9:.0f} | {t_base / t:.3f} | "
                          f"{rel_l2(out, ref):.2e} | {rel_l2(out, base_out):.1e} |", flush=True)
            del ref


if __name__ == "__main__":
    main()
