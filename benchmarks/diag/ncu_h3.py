"""Nsight Compute view of the fused plan and the attention kernel at H3 (B=1, T=37296, H=56, D=128,
bf16): run under ``ncu --profile-from-start off``; the profiled region (``cudaProfilerStart`` to
``Stop``) is one warm ``sol_attn`` call per mode given (tau 1 + tail, top-k 20 %), so ncu reports
the means, centroid, scores, select and attention kernels of exactly those calls.

    ncu --profile-from-start off --section SpeedOfLight ... python benchmarks/diag/ncu_h3.py [tau] [topk20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import MODES as H3_MODES  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402

#: command-line name -> sol_attn keywords, the modes of the other H3 diagnostics
MODES = dict(zip(("topk10", "topk20", "tau"), (kw for _, kw in H3_MODES)))

if __name__ == "__main__":
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    for name in sys.argv[1:] or ["tau"]:
        kw = MODES[name]
        with torch.no_grad():
            for _ in range(3):
                solattn.sol_attn(q, k, v, backend="triton", **kw)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            solattn.sol_attn(q, k, v, backend="triton", **kw)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        print(f"profiled {name}", flush=True)
