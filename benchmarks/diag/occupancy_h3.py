"""Programs per SM for the attention kernel at H3 (B=1, T=37296, H=56, D=128, bf16), kernel only.

Nsight Compute at 52a8d3f (results/h200/session15/) found the production kernel (4 warps, 3
stages, TMA loads) at 148 registers and 115 KB of shared memory per program: 2 programs (8 warps)
per SM, limited by shared memory, with the tensor pipe 60 % busy and issue slots 43 % busy, so
the SM mostly waits on latency. Fewer pipeline stages free shared memory (1 stage: 49 KB) and a
register cap (``maxnreg``) frees registers, so more programs fit on an SM: 3 at 1 stage (registers
148 <= 170), 4 with ``maxnreg`` 128. Each setting is timed next to the production launch (same
plan, kernel only, same rounds), with its error against the fp32 definition and its registers,
spills and shared memory.

    python benchmarks/diag/occupancy_h3.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import compare_kernels, h3_cases  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton import kernel as tk  # noqa: E402

dev = torch.device("cuda")
#: name -> (num_stages, extra launch options)
SETTINGS = {"production (3 stages)": (3, {}), "2 stages": (2, {}), "1 stage": (1, {}),
            "1 stage, maxnreg 168": (1, {"maxnreg": 168}), "1 stage, maxnreg 128": (1, {"maxnreg": 128}),
            "2 stages, maxnreg 128": (2, {"maxnreg": 128})}


def config(stages: int) -> tb.KernelConfig:
    cfg = object.__new__(tb.KernelConfig)          # num_stages=1 is outside the shipped choices
    for field, value in dict(kv_per_iter=1, num_warps=4, num_stages=stages, tma=True).items():
        object.__setattr__(cfg, field, value)
    return cfg


def compiled_stats() -> list:
    rows = []
    for cache in tk.sol_attn_fwd.device_caches.values():
        for ck in cache[0].values():
            md = ck.metadata
            rows.append(f"stages {md.num_stages} maxnreg {getattr(md, 'maxnreg', None)}: regs {ck.n_regs}, "
                        f"spills {ck.n_spills}, shared {md.shared} B")
    return rows


def main():
    for label, kw, problem, plan in h3_cases():
        flop = 4 * int(plan.kv_num_blocks.long().sum()) * 64 * 64 * problem.D
        ref = solattn.sol_attn(problem.q.float(), problem.k.float(), problem.v.float(), backend="sdpa", **kw)
        fns = {}
        for name, (stages, opts) in SETTINGS.items():
            def fn(stages=stages, opts=opts):
                return tb.run_kernel(tk.sol_attn_fwd, problem, plan, config(stages), constexprs=opts)
            fns[name] = fn
        compare_kernels(f"H3 {label}", fns, ref, "production (3 stages)", flop)
        del ref
    print("\ncompiled variants:\n" + "\n".join(compiled_stats()))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    main()
