#!/usr/bin/env bash
# The GPU check of a solattn checkout: the test suite and the benchmarks, in steps of under
# 10 minutes each, with no network access needed.
#
#   bash benchmarks/gpu_check.sh tests       # the default run's tests and every GPU test (slow or not), in
#                                            # one run: about 210 s on an H200 host's 16 cores with
#                                            # pytest-xdist (a .whl/xdist folder or an installed one)
#   bash benchmarks/gpu_check.sh tests-a     # first half of the test files: the default run's tests and
#                                            # every GPU test (slow or not)
#   bash benchmarks/gpu_check.sh tests-b     # second half
#   bash benchmarks/gpu_check.sh tests-slow  # the slow CPU-only tests (CI runs them too)
#   bash benchmarks/gpu_check.sh bench-a     # benchmarks: peers (comfy-kitchen), plan, coarse
#   bash benchmarks/gpu_check.sh bench-b     # benchmarks: backward, vsa (FastVideo)
#   bash benchmarks/gpu_check.sh distributed # benchmarks: distributed, on 2 GPUs or more
#
# Several steps may be given to one call. Results go under $OUT (default ./gpu-check): test logs
# as results/<device>/tests-a.log and tests-b.log, benchmarks as results/<device>/<name>.md
# (benchmarks/run.py), so copying $OUT/results over benchmarks/results keeps the latest.
# The commit recorded is $SOLATTN_REVISION, else the checkout's git HEAD (a copied tree without
# .git should be given SOLATTN_REVISION=<commit>).
# Optional packages are found in git-ignored folders of the checkout, put on PYTHONPATH when
# present: .whl/ck (comfy-kitchen, the peers benchmark and its tests) and .whl/fv
# (fastvideo_kernel, the vsa benchmark's FastVideo rows) and .whl/xdist (pytest-xdist and execnet).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check}
for extra in "$ROOT/.whl/ck" "$ROOT/.whl/fv" "$ROOT/.whl/xdist"; do
  [ -d "$extra" ] && PYTHONPATH=$extra${PYTHONPATH:+:$PYTHONPATH}
done
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${SOLATTN_REVISION:-}" ]; then
  SOLATTN_REVISION=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
export SOLATTN_REVISION
PY=${PYTHON:-python}
DEVICE=$($PY - <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from run import device_folder
print(device_folder())
EOF
)
[ -n "$DEVICE" ] || { echo "cannot import torch with $PY" >&2; exit 2; }
RESULTS=$OUT/results/$DEVICE
mkdir -p "$RESULTS"
echo "solattn $SOLATTN_REVISION on $DEVICE; results under $RESULTS"

# the test files, split in two halves of about equal time on a GPU host
TESTS_A="tests/backends/test_backends.py tests/backends/triton/test_triton_backend.py
         tests/backends/triton/test_triton_backward.py tests/backends/triton/test_fused_plan.py
         tests/backends/reference/test_reference.py tests/backends/test_own_backward.py tests/op/test_compile.py
         tests/op/test_graphs.py tests/op/test_validation.py tests/op/test_plan.py tests/routing/test_routing.py
         tests/test_readme.py"
TESTS_B=$(find tests -name "test_*.py" | sort | grep -v -x -F -f <(echo "$TESTS_A" | tr ' ' '\n' | grep .))

# pytest-xdist when importable: one worker per core
XDIST=()
$PY -c "import xdist" 2>/dev/null && XDIST=(-n "$($PY -c 'import os; print(os.cpu_count())')")

run_tests() {   # name, marker expression, files...
  local name=$1 markers=$2; shift 2
  local log=$RESULTS/$name.log
  { echo "# solattn $SOLATTN_REVISION, $(date -u '+%Y-%m-%d %H:%M') UTC"
    echo "# command: bash benchmarks/gpu_check.sh $name"
    echo "# python -m pytest -q -p no:cacheprovider ${XDIST[*]} -m '$markers' --durations=15 $*"
    $PY -c "import torch, sys; print('# torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', 'python', sys.version.split()[0])"
  } > "$log"
  timeout ${TEST_S:-560} $PY -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "$markers" --durations=15 "$@" >> "$log" 2>&1
  local rc=$?
  echo "# exit status $rc" >> "$log"
  tail -5 "$log"
  return $rc
}

bench() {   # names...
  timeout ${BENCH_S:-560} $PY benchmarks/run.py "$@" --results "$OUT/results"
}

status=0
for step in "$@"; do
  case $step in
    tests) run_tests tests "not slow or gpu" tests/ || status=1 ;;
    tests-a) run_tests tests-a "not slow or gpu" $TESTS_A || status=1 ;;
    tests-b) run_tests tests-b "not slow or gpu" $TESTS_B || status=1 ;;
    tests-slow) run_tests tests-slow "slow and not gpu" tests/ || status=1 ;;
    bench-a) bench peers plan coarse || status=1 ;;
    bench-b) bench backward vsa || status=1 ;;
    distributed) bench distributed --nproc "$($PY -c 'import torch; print(torch.cuda.device_count())')" || status=1 ;;
    *) echo "unknown step '$step'; allowed: tests tests-a tests-b tests-slow bench-a bench-b distributed" >&2; exit 2 ;;
  esac
done
exit $status
