"""Host cost of an eager ``sol_attn`` call at the seed shape (B=2, T=4056, H=16, D=128, bf16,
triton backend) on a GPU: GPU-event time per call, host time per call (calls issued back to back,
one sync at the end), and where the host time goes (cProfile of 300 calls).

At a036e4b on the H200 (results/h200/session13/a036e4b/seed_eager.txt): 0.65 / 0.61 ms per call at
top-k 10 % (that run with the tail on, ``validate``'s default; the script now takes
``plan_h3_fused.MODES``, top-k without it) / tau 1 + tail, of which the host issues a call in 0.54 / 0.41 ms; Triton's launcher
(``JITFunction.run``, argument specialisation) is the largest host item, then ``torch.empty``.

    python benchmarks/diag/seed_eager.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import solattn  # noqa: E402
from plan_h3_fused import MODES, host_profile  # noqa: E402
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402

dev = torch.device("cuda")
q, k, v = make_qkv(2, 4056, 16, 128, dtype=torch.bfloat16, device=dev, seed=0)
print(torch.__version__, torch.cuda.get_device_name())
import triton  # noqa: E402
print("triton", triton.__version__)
for label, kw in (MODES[0], MODES[2]):
    def call():
        return solattn.sol_attn(q, k, v, backend="triton", **kw)
    with torch.no_grad():
        for _ in range(20):
            call()
        gpu = statistics.median(time_calls(call, dev, 100, 10))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            call()
        host = (time.perf_counter() - t0) / 300 * 1e3
        torch.cuda.synchronize()
        prof = host_profile(call, top=22)
    print(f"\n## seed {label} eager: {gpu:.3f} ms per call (events), host {host:.3f} ms per call issued\n{prof}",
          flush=True)
