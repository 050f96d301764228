#!/usr/bin/env bash
# One GPU session's checks, in one call of the device tool (results under $OUT):
#   gpu_tests.log   the whole test suite on the GPU machine
#   checks.log      `solattn info`, the sdpa mask diagnosis, VSA on triton vs sdpa with a gate
#   h200quick/      benchmarks/bench_h200.py --quick (kernel correctness, H3 and seed timings)
#   (python -m solattn bench --shapes h3 seed --tail runs in a second call: one call is 10 minutes at most)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
export SOLATTN_REVISION=$(cat COMMIT 2>/dev/null)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/h200quick"
cat COMMIT 2>/dev/null
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python -m solattn info
  python benchmarks/diag/issue9_gpu.py
  python - <<'PY'
import torch, solattn
torch.manual_seed(0)
segs, grid, H, D = [77, 40], (8, 16, 16), 4, 128
T = sum(segs) + grid[0] * grid[1] * grid[2]
q, k, v, g = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
outs = {b: solattn.video_sparse_attn(q, k, v, grid, sparsity=0.9, gate=g, prefix_len=segs, backend=b)
        for b in ("triton", "sdpa")}
a, b = outs["triton"].double(), outs["sdpa"].double()
print("VSA triton vs sdpa (segments [77, 40], grid 8x16x16, gate, bf16): rel L2",
      ((a - b).norm() / b.norm()).item())
PY
} > "$OUT/checks.log" 2>&1
timeout 330 python -m pytest -q -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
timeout 200 python benchmarks/bench_h200.py --quick --variants --out "$OUT/h200quick" --budget-s 150 2>&1 | tail -25
