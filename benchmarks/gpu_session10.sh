#!/usr/bin/env bash
# Session-10 GPU checks in one device call (results under $OUT): the fused backward's table
# (bench_backward --no-sweep), the seed shape end to end (eager / cuda_graphs, pointer / TMA
# loads) with the H3 plan's profile, then the whole test suite on the GPU machine.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cat COMMIT 2>/dev/null
timeout 170 python benchmarks/bench_backward.py --no-sweep --out "$OUT/backward.md" > "$OUT/backward.log" 2>&1
tail -22 "$OUT/backward.md"
timeout 90 python benchmarks/diag/session10_seed.py > "$OUT/seed.txt" 2>&1
grep "^|" "$OUT/seed.txt"; grep "torch plan" "$OUT/seed.txt"
timeout ${TEST_S:-300} python -m pytest -q -p no:cacheprovider tests/ ${TEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
