"""The exponential offload experiment (``benchmarks/exp_offload.py``) on the GPU: checked against the
production kernel on small problems, then timed kernel only at H3 (B=1, T=37296, H=56, D=128,
bf16) next to the production kernel in paired rounds on the same plan.

    python benchmarks/diag/exp_offload_h3.py [check] [h3]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
import exp_offload  # noqa: E402
from plan_h3_fused import compare_kernels, h3_cases  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton import kernel as tk  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
#: variant name -> EXP_PACK
PACKS = {"MUFU only (control: the production loop)": 0, "1 of 8 on the FMA pipe": 8,
         "1 of 4": 4, "1 of 2": 2, "no exponential (diagnostic)": -1}


def launch(problem, plan, pack, tma=True):
    cfg = tb.KernelConfig(tma=tma)
    return tb.run_kernel(exp_offload.offload_loop, problem, plan, cfg, constexprs=exp_offload.constexprs(pack))


def check():
    """Every offload variant against the production kernel: ragged T, tail and not, a key bias with
    -inf (the unfolded path) and a row whose keys are all -inf (must return 0)."""
    ok = True
    for B, T, H, D in ((2, 1000, 3, 128), (1, 4056, 2, 64), (1, 300, 1, 128)):
        q, k, v = make_qkv(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=1)
        bias = torch.zeros(B, T, device=dev)
        bias[:, 5:70] = float("-inf")
        for kw in (dict(topk_ratio=0.3, tail=False), dict(tau=1.0, tail=True), dict(topk_ratio=0.5, key_bias=bias),
                   dict(topk_ratio=0.9, key_bias=torch.full((B, T), float("-inf"), device=dev))):
            problem = validate(q, k, v, **kw)
            plan = build_plan(problem)
            for tma in (False, True):
                base = tb.run_kernel(tk.sol_attn_fwd, problem, plan, tb.KernelConfig(tma=tma)).float()
                for name, pack in PACKS.items():
                    if pack < 0:
                        continue
                    out = launch(problem, plan, pack, tma).float()
                    err = rel_l2(out, base) if base.abs().sum() else float(out.abs().max())
                    good = torch.isfinite(out).all() and err < 2e-3 and (pack != 0 or err == 0)
                    ok &= bool(good)
                    label = ",".join(f"{a}" for a in kw if a != "key_bias") + (" bias" if "key_bias" in kw else "")
                    print(f"check B{B} T{T} H{H} D{D} {label} tma={tma} {name}: diff {err:.2e} "
                          f"{'ok' if good else 'FAILED'}", flush=True)
    print("check", "all ok" if ok else "FAILED")


def h3():
    for label, kw, problem, plan in h3_cases():
        flop = 4 * int(plan.kv_num_blocks.long().sum()) * 64 * 64 * problem.D
        ref = solattn.sol_attn(problem.q.float(), problem.k.float(), problem.v.float(), backend="sdpa", **kw)
        fns = {"production": lambda: tb.run_kernel(tk.sol_attn_fwd, problem, plan, tb.KernelConfig(tma=True))}
        for name, pack in PACKS.items():
            fns[name] = lambda pack=pack: launch(problem, plan, pack)
        compare_kernels(f"H3 {label}", fns, ref, "production", flop)
        del ref


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    steps = sys.argv[1:] or ["check", "h3"]
    if "check" in steps:
        check()
    if "h3" in steps:
        h3()
