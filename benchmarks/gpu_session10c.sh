#!/usr/bin/env bash
# Session-10 third GPU call: the CUDA-graph tests alone (verbose), the seed-shape comparison with
# the cuda_graphs rows, then the test files after test_graphs.py (the second call ran out of time there).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
export SOLATTN_REVISION=$(cat COMMIT 2>/dev/null)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cat COMMIT 2>/dev/null
timeout 100 python -m pytest -v -p no:cacheprovider --tb=short -s tests/test_graphs.py -k cuda > "$OUT/graph_tests.log" 2>&1
echo "graph tests rc=$?"; grep -E "PASSED|FAILED|Error|error" "$OUT/graph_tests.log" | head -30
timeout 90 python -m solattn bench --shapes 2,4056,16,128 --ratios 0.1 0 --tail --graphs \
  --backends dense triton comfy-kitchen --repeats 10 --warmup 2 --out "$OUT/peers_seed" > "$OUT/peers_seed.log" 2>&1
echo "peers rc=$?"; grep -E "^\[.*\]   " "$OUT/peers_seed.log" | tail -20
timeout 200 python -m pytest -q -p no:cacheprovider --tb=short tests/test_memory.py tests/test_readme.py \
  tests/test_reference.py tests/test_routing.py tests/test_triton_backend.py tests/test_triton_backward.py \
  tests/test_validation.py tests/test_video.py > "$OUT/gpu_tests_rest.log" 2>&1
tail -6 "$OUT/gpu_tests_rest.log"
