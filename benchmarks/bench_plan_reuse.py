"""Route once, run many: ``sol_attn`` with a caller's plan (``plan=solattn.plan(...)``) against
the same call routing itself, and against dense SDPA, forward only.

    python benchmarks/bench_plan_reuse.py --out DIR             # a CUDA GPU (triton): H3, B=1 T=37296 H=56 D=128
    python benchmarks/bench_plan_reuse.py --small --out DIR     # a CPU (the automatic backend): T=8192 H=8 D=64

The plan is built once from other values of v (as a layer that shares another's layout would);
the timed calls then hold its selection and compute their tail, coarse and centring terms from
their own tensors. Per row: median ms over rotating rounds (``solattn.bench.timing``), the ratio
to dense SDPA and to the self-routing call, the error of the plan's call against the
self-routing call on the same tensors (the same selection: the two agree to rounding) and the
two-number model (FLOPs, bytes of the fused model) of the kept blocks. Writes bench_plan_reuse.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
from solattn.bench.models import bytes_moved, flop_count  # noqa: E402
from solattn.bench.timing import paired_rounds  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2  # noqa: E402

#: (routing keywords, tail, gate) per row
CASES = [(dict(topk_ratio=0.1), False, False), (dict(topk_ratio=0.1), True, False),
         (dict(topk_ratio=0.1), False, True), (dict(tau=1.0), True, False)]


def run(shape, device: torch.device, backend, rounds: int):
    B, T, H, D = shape
    q, k, v = block_structured_qkv(B, T, H, D, dtype=torch.bfloat16, device=device, seed=0)
    v_other = torch.randn(v.shape, generator=torch.Generator().manual_seed(9)).to(v.dtype).to(device)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype).to(device) * 0.5
    dense = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    rows = []
    for routing, tail, gated in CASES:
        kw = dict(routing, tail=tail, coarse_gate=gate if gated else None, backend=backend)
        with torch.no_grad():
            p = solattn.plan(q, k, v_other, **kw)
            fns = {"dense": lambda: dense(qt, kt, vt),
                   "routes itself": lambda: solattn.sol_attn(q, k, v, **kw),
                   "given plan": lambda: solattn.sol_attn(q, k, v, **kw, plan=p),
                   "plan() alone": lambda: solattn.plan(q, k, v, **kw)}
            times = paired_rounds(fns, device, rounds=rounds, warmup=2)
            err = rel_l2(solattn.sol_attn(q, k, v, **kw, plan=p).float(), solattn.sol_attn(q, k, v, **kw).float())
        med = {name: statistics.median(t) for name, t in times.items()}
        kept = int(p.kv_num_blocks.sum())
        label = (", ".join(f"{a}={b}" for a, b in routing.items()) + f", tail {'on' if tail else 'off'}"
                 + (", gate" if gated else ""))
        rows.append((label, med, err, kept, flop_count(shape, kept), bytes_moved(shape, 2, kept, "fused")))
        print(label, {n: round(m, 3) for n, m in med.items()}, f"err {err:.2e}", flush=True)
    return rows


def markdown(rows, shape, device: torch.device, backend, rounds: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    B, T, H, D = shape
    lines = ["# solattn bench: a caller's plan (route once, run many)", "",
             f"- device: {name}; torch {torch.__version__}; backend: {backend or 'automatic'}; "
             f"B={B} T={T} H={H} D={D} bf16, block-structured inputs",
             f"- median ms of {rounds} rotating rounds after 2 warm-up calls (L2 flushed before each GPU call); "
             "the plan was built from another v; error: relative L2 of the plan's call against the "
             "self-routing call on the same tensors (same selection)",
             "- GFLOP and GB: the kept blocks' `4 P 64^2 D` and the fused model's bytes (solattn.bench.models)", "",
             "| call | dense ms | routes itself ms | given plan ms | plan() ms | given / itself | given vs dense "
             "| error | kept pairs | GFLOP | GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, med, err, kept, flops, nbytes in rows:
        lines.append(f"| {label} | {med['dense']:.3f} | {med['routes itself']:.3f} | {med['given plan']:.3f} | "
                     f"{med['plan() alone']:.3f} | {med['given plan'] / med['routes itself']:.2f}x | "
                     f"{med['dense'] / med['given plan']:.2f}x | {err:.1e} | {kept} | {flops / 1e9:.4g} | "
                     f"{nbytes / 1e9:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for bench_plan_reuse.md")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (median)")
    ap.add_argument("--small", action="store_true", help="B=1 T=8192 H=8 D=64 (a CPU size)")
    args = ap.parse_args(argv)
    device = solattn.best_device()
    cuda = device.type == "cuda"
    shape = (1, 8192, 8, 64) if args.small or not cuda else (1, 37296, 56, 128)
    backend = "triton" if cuda else None
    rows = run(shape, device, backend, args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_plan_reuse.md"), "w") as f:
        f.write(markdown(rows, shape, device, backend, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
