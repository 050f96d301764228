"""Feasibility of a gather-free portable path: the exact branch of ``sol_attn`` through PyTorch's
FlexAttention with the routing plan as its block mask.

The ``sdpa`` backend copies each query block's kept key and value blocks into tensors of their own
before calling SDPA: memory traffic that grows with the kept FLOPs (the bench's byte model gives
about 0.05 GB per GFLOP), which bounds it on devices with modest bandwidth (an Intel Arc A770
has 560 GB/s). FlexAttention skips unselected blocks inside one kernel and reads each key block
from the inputs; the plan's ``kv_num_blocks`` / ``kv_indices`` are already the form
``BlockMask.from_kv_blocks`` takes. This script checks that the two agree on the exact branch
(top-k, no tail: the tail would join through the returned log-sum-exp) and times both, on the
best device present (FlexAttention needs ``torch.compile`` on it). An earlier report from an Intel
Arc A770 had ``flex_attention`` under ``torch.compile`` run out of resources there (a dense
2x16x4056x128 problem, the torch of that time): whether it runs on XPU today is the open question. Passing the blocks as "full"
(``full_kv_num_blocks``) instead failed in torch 2.13's CPU code generation ("'kv_indices' was not
declared"), so they go as partial blocks under the default keep-all ``mask_mod``.

    python benchmarks/diag/flex_exact_branch.py [--T 8192] [--H 16] [--ratio 0.1] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import rel_l2  # noqa: E402
from solattn.validation import BLOCK, validate  # noqa: E402


def timed(fn, device, repeats):
    return statistics.median(time_calls(fn, device, repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.T % BLOCK:
        raise SystemExit(f"--T received {args.T}; allowed: a multiple of {BLOCK} (ragged blocks need a mask_mod)")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.B, args.T, args.H, args.D, generator=g).to(device, torch.bfloat16)
               for _ in range(3))
    problem = validate(q, k, v, topk_ratio=args.ratio, tail=False)
    with torch.no_grad():
        plan = build_plan(problem)
        # every selected block is whole (T a multiple of 64, no block_len), so the default mask_mod
        # (keep all) serves; BlockMask takes the number of key blocks from the indices' width: n wide
        idx = torch.nn.functional.pad(plan.kv_indices, (0, problem.n - plan.kv_indices.shape[-1]))
        mask = BlockMask.from_kv_blocks(plan.kv_num_blocks, idx, BLOCK_SIZE=BLOCK, seq_lengths=(args.T, args.T))
        flex = torch.compile(flex_attention, dynamic=False)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run_flex():
            return flex(qt, kt, vt, block_mask=mask, scale=problem.scale).transpose(1, 2)

        def run_sdpa():
            return solattn.sol_attn(q, k, v, topk_ratio=args.ratio, tail=False, backend="sdpa")

        t0 = time.perf_counter()
        got = run_flex()
        compile_s = time.perf_counter() - t0
        want = run_sdpa()
        ref = solattn.sol_attn(q.float(), k.float(), v.float(), topk_ratio=args.ratio, tail=False, backend="sdpa")
        print(f"device {device}, torch {torch.__version__}, B={args.B} T={args.T} H={args.H} D={args.D} bf16, "
              f"top-k {args.ratio}, kept {plan.dense_mask().float().mean().item():.3f}")
        print(f"flex first call (compile) {compile_s:.1f} s; rel. L2 vs sdpa backend on fp32 copies: "
              f"flex {rel_l2(got.float(), ref):.2e}, sdpa backend {rel_l2(want.float(), ref):.2e}")
        t_flex = timed(run_flex, device, args.repeats)
        t_sdpa = timed(run_sdpa, device, args.repeats)
        t_plan = timed(lambda: build_plan(problem), device, args.repeats)
        print(f"exact branch: flex {t_flex:.1f} ms (+ plan {t_plan:.1f} ms), sdpa backend {t_sdpa:.1f} ms "
              f"(plan included), median of {args.repeats}")


if __name__ == "__main__":
    main()
