"""The ping-pong Gluon kernel (``benchmarks/kernel_pingpong.py``) against the production kernel.

``check``: small shapes against the fp32 definition (sdpa backend): T cut by the block, an odd
number of query blocks (a lone last block), B = 2, tail on and off, the coarse branch, D = 64 and
128, top-k and tau. Each case prints its error and the production kernel's; a case fails when the
ping-pong error exceeds twice the production's plus 1e-3, or anything is not finite.

``h3``: H3 (B=1, T=37296, H=56, D=128, bf16), the three goal modes, kernel only, same plan, paired
rounds: production (3-stage TMA) and the variants in ``TIMED``, with errors against the fp32
definition, TFLOP/s on the listed blocks, and the difference from the production output (the
diagnostics that skip the value loads have no meaningful error).

    python benchmarks/diag/pingpong_h3.py check h3
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_pingpong as kp  # noqa: E402
import solattn  # noqa: E402
from plan_h3_fused import compare_kernels, h3_cases  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
PROD = tb.KernelConfig(num_warps=4, num_stages=3, tma=True)
#: name -> kp.launch keywords (``slots`` key-block slots per consumer, ``v_slots`` value-block slots)
VARIANTS = {
    "ping-pong, 1 block/step, 2+2 slots": dict(slots=2, per_step=1, pingpong=True),
    "no turns, 1 block/step, 2+2 slots": dict(slots=2, per_step=1, pingpong=False),
    "ping-pong, 2 blocks/step, 2+4 slots": dict(slots=2, v_slots=4, per_step=2, pingpong=True),
    "no turns, 2 blocks/step, 2+4 slots": dict(slots=2, v_slots=4, per_step=2, pingpong=False),
    "ping-pong, 2 blocks/step, 3+3 slots": dict(slots=3, per_step=2, pingpong=True),
    # written after the session-16 runs, not yet run on a GPU: query tiles in registers, deeper rings
    "ping-pong, 2 blocks/step, q in registers, 3+4 slots": dict(slots=3, v_slots=4, per_step=2, pingpong=True,
                                                                q_in_regs=True),
    "no turns, 1 block/step, q in registers, 3+4 slots": dict(slots=3, v_slots=4, per_step=1, pingpong=False,
                                                              q_in_regs=True),
}
#: what ``check`` runs (6afb789 checked both 1-block variants; 529035a the 2-block ones with one ring size)
CHECKED = ("ping-pong, 1 block/step, 2+2 slots", "ping-pong, 2 blocks/step, 2+4 slots",
           "ping-pong, 2 blocks/step, q in registers, 3+4 slots", "no turns, 1 block/step, q in registers, 3+4 slots")
#: what ``h3`` times. Earlier runs: 2 blocks per step with one 3-slot ring for keys and values and a
#: producer that waited for each consumer's value slot before the other consumer's keys, 0.57-0.62x
#: (529035a); skipping the value loads (half the bytes), 2.9-4.8 % faster (6afb789).
TIMED = dict(VARIANTS)


def check() -> bool:
    ok = True
    cases = [  # (B, T, H, D, kwargs)
        (1, 1000, 2, 128, dict(topk_ratio=0.3, tail=False)),
        (1, 1000, 2, 128, dict(topk_ratio=0.3, tail=True)),
        (2, 900, 3, 128, dict(tau=1.0, tail=True)),
        (2, 1024, 2, 128, dict(topk_ratio=0.5, tail=True, coarse=True)),
        (1, 4056, 4, 128, dict(topk_ratio=0.1, tail=False)),
        (2, 4056, 4, 128, dict(tau=1.0, tail=True)),
        (1, 1000, 2, 64, dict(topk_ratio=0.3, tail=True)),
        (1, 64, 1, 128, dict(topk_ratio=0.99, tail=False)),
        (1, 130, 1, 128, dict(topk_ratio=0.99, tail=False)),
        (1, 1000, 2, 128, dict(topk_ratio=0.2, tail=True, sink_blocks=(0, 2))),
    ]
    print("| B, T, H, D | config | variant | err | production err | diff to production | |")
    print("|---|---|---|---|---|---|---|")
    checked = {name: VARIANTS[name] for name in CHECKED}
    for B, T, H, D, kw in cases:
        kw = dict(kw)
        gate = None
        if kw.pop("coarse", False):
            gate = torch.rand(B, T, H, D, device=dev, dtype=torch.bfloat16)
        q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=1)
        problem = validate(q, k, v, coarse_gate=gate, **kw)
        plan = build_plan(problem)
        ref = solattn.sol_attn(q.float(), k.float(), v.float(),
                               coarse_gate=None if gate is None else gate.float(), backend="sdpa", **kw)
        prod = tb.run_kernel(_prod_kernel(), problem, plan, PROD).float()
        ep = rel_l2(prod, ref)
        for name, opts in checked.items():
            out = kp.launch(problem, plan, **opts).float()
            e, d = rel_l2(out, ref), rel_l2(out, prod)
            good = bool(torch.isfinite(out).all()) and e <= 2 * ep + 1e-3
            ok &= good
            print(f"| {B}, {T}, {H}, {D} | {kw}{' coarse' if gate is not None else ''} | {name} | {e:.3e} | "
                  f"{ep:.3e} | {d:.1e} | {'ok' if good else 'FAIL'}", flush=True)
    return ok


def _prod_kernel():
    from solattn.backends.triton import kernel as tk
    return tk.sol_attn_fwd


def h3():
    for label, kw, problem, plan in h3_cases():
        pairs = int(plan.kv_num_blocks.long().sum())
        flop = 4 * pairs * 64 * 64 * problem.D
        kv_bytes = pairs * 64 * problem.D * 2 * 2          # a key and a value tile per listed block
        ref = solattn.sol_attn(problem.q.float(), problem.k.float(), problem.v.float(), backend="sdpa", **kw)
        fns = {"production (3-stage TMA)": lambda: tb.run_kernel(_prod_kernel(), problem, plan, PROD)}
        for name, opts in TIMED.items():
            fns[name] = lambda opts=opts: kp.launch(problem, plan, **opts)

        def kv_rate(name, ms):
            moved = kv_bytes // (1 if TIMED.get(name, {}).get("load_v", True) else 2)
            return f"{moved / ms / 1e9:.2f}"
        compare_kernels(f"H3 {label}", fns, ref, "production (3-stage TMA)", flop,
                        columns=[("key/value TB/s", kv_rate)])
        del ref


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(),
          open("COMMIT").read().strip() if Path("COMMIT").exists() else "", flush=True)
    steps = sys.argv[1:] or ["check", "h3"]
    if "check" in steps and not check():
        print("check FAILED: h3 not timed")
        sys.exit(1)
    if "h3" in steps:
        h3()
