"""Experimental key loops on the GPU (``benchmarks/exp_offload.py``: part of the exponentials on the
FMA pipe; ``benchmarks/kernel_qreg.py``: the query tile as a register operand): each checked
against the production kernel on small problems, then timed kernel only at H3 (B=1, T=37296, H=56,
D=128, bf16) next to the production kernel in paired rounds on the same plan.

    python benchmarks/diag/loop_variants_h3.py [check] [h3] [--only NAME ...]
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
import kernel_qreg  # noqa: E402
import kernel_tree  # noqa: E402
from plan_h3_fused import compare_kernels, h3_cases  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton import kernel as tk  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")
#: variant name -> (kernel, launch constexprs, whether its output is meant to match the production kernel's):
#: exp-control is exp_offload's loop with the production exponential (must match bit for bit), exp-1ofN
#: takes one of every N terms on the FMA pipe, exp-none drops the exponential (wrong output by design),
#: qreg passes the query tile through an identity product so that Q K^T takes it from registers, tree
#: halves the row max and sum over adjacent columns first
VARIANTS = {"exp-control": (exp_offload.offload_loop, exp_offload.constexprs(0), True),
            "exp-1of8": (exp_offload.offload_loop, exp_offload.constexprs(8), True),
            "exp-1of4": (exp_offload.offload_loop, exp_offload.constexprs(4), True),
            "exp-1of2": (exp_offload.offload_loop, exp_offload.constexprs(2), True),
            "exp-none": (exp_offload.offload_loop, exp_offload.constexprs(-1), False),
            "qreg": (kernel_qreg.qreg_loop, {}, True),
            "tree": (kernel_tree.tree_loop, {}, True)}


def launch(problem, plan, name, tma=True):
    kernel, constexprs, _ = VARIANTS[name]
    return tb.run_kernel(kernel, problem, plan, tb.KernelConfig(tma=tma), constexprs=constexprs)


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
                for name, (_, _, matches) in VARIANTS.items():
                    if not matches:
                        continue
                    out = launch(problem, plan, name, tma).float()
                    err = rel_l2(out, base) if base.abs().sum() else float(out.abs().max())
                    good = torch.isfinite(out).all() and err < 2e-3 and ("control" not in name or err == 0)
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
        for name in VARIANTS:
            fns[name] = lambda name=name: launch(problem, plan, name)
        compare_kernels(f"H3 {label}", fns, ref, "production", flop)
        del ref


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    args = sys.argv[1:]
    if "--only" in args:
        keep = args[args.index("--only") + 1:]
        args = args[:args.index("--only")]
        VARIANTS = {name: VARIANTS[name] for name in keep}
    steps = args or ["check", "h3"]
    if "check" in steps:
        check()
    if "h3" in steps:
        h3()
