"""The scores GEMM's head dims per step (``fused._fused_plan`` tuning ``scores_bk``) at the seed
shape (B=2, T=4056, H=16, D=128: 32 programs of 64 x 64 tiles) and at H3 (5600 programs): plan time
and per-kernel GPU times for 32 and 128 dims per step, top-k 10 % and tau 1 + tail (session 19).

    python benchmarks/diag/scores_bk.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_h3_fused import differing_rows, kernel_table, med  # noqa: E402
from solattn.routing import build_plan, fused  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402
from solattn.validation import validate  # noqa: E402

dev = torch.device("cuda")

if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), open("COMMIT").read().strip() if Path("COMMIT").exists() else "")
    for shape in ((2, 4056, 16), (1, 37296, 56)):
        q, k, v = make_qkv(*shape, 128, dtype=torch.bfloat16, device=dev, seed=0)
        for label, kw in (("top-k 10 %", dict(topk_ratio=0.1, tail=False)), ("tau 1 + tail", dict(tau=1.0, tail=True))):
            problem = validate(q, k, v, **kw)
            with torch.no_grad():
                want = build_plan(problem)
                for bk in (32, 64, 128):
                    tuning = {"scores_bk": bk}
                    got = fused._fused_plan(problem, tuning)
                    t = med(lambda: fused._fused_plan(problem, tuning), 30, 5)
                    print(f"{shape} {label} scores_bk={bk}: plan {t:.3f} ms, rows differing {differing_rows(got, want)}; "
                          f"{kernel_table(lambda: fused._fused_plan(problem, tuning))}", flush=True)
