#!/usr/bin/env bash
# Session-10 second GPU call (results under $OUT): the comparison table with comfy-kitchen and the
# cuda_graphs rows, the backward's seed rows, then the whole test suite on the GPU machine.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
export SOLATTN_REVISION=$(cat COMMIT 2>/dev/null)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cat COMMIT 2>/dev/null
timeout 260 python -m solattn bench --shapes peers --ratios 0.1 0.2 0 --tail --graphs \
  --backends dense triton sdpa comfy-kitchen --repeats 5 --warmup 2 --out "$OUT/peers" > "$OUT/peers.log" 2>&1
echo "peers rc=$?"; ls "$OUT/peers"
timeout 60 python benchmarks/bench_backward.py --quick --no-sweep --out "$OUT/backward_seed.md" > "$OUT/backward_seed.log" 2>&1
echo "backward rc=$?"
timeout ${TEST_S:-250} python -m pytest -q -p no:cacheprovider tests/ ${TEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
