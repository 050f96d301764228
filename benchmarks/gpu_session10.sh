#!/usr/bin/env bash
# Session-10 GPU checks, as named steps run in the order given (results under $OUT); one device
# call is 10 minutes at most, so a call runs a few steps:
#   backward    bench_backward.py --no-sweep (the H3 and seed tables)
#   seed        diag/session10_seed.py: seed shape end to end (eager / cuda_graphs, pointer / TMA), H3 plan profile
#   peers       python -m solattn bench --shapes peers ... --graphs (needs comfy-kitchen on PYTHONPATH)
#   peers_seed  the same at the seed shape only
#   graph_tests pytest tests/test_graphs.py -k cuda -v
#   tests       the whole test suite ($TEST_ARGS appended, $TEST_S seconds at most)
#   tests_x     the same in 8 processes (pytest-xdist on PYTHONPATH, e.g. unzipped wheels carried in
#               .whl/xdist: pip download pytest-xdist execnet; about 5 minutes on the H200 host)
#   plan_h3     diag/plan_h3_fused.py h3 seed: fused vs torch plan and end to end at H3, the seed in graphs
#   timeline    diag/select_cost.py timeline: the GPU timeline of one sol_attn call per mode at H3
#   e2e         diag/e2e_h3.py: sol_attn against dense at H3, one synchronised call and calls queued back
#               to back, with the host's issue time (session 19; about 2 minutes)
#   host_parts  diag/host_parts.py: host time of each Triton launch in one sol_attn call and of a few
#               primitives, at H3 and the seed shape (session 20; about a minute)
#   select_cost diag/select_cost.py: fused-plan launch sweep and e2e GPU timeline at H3
#   seed_eager  diag/seed_eager.py: host cost of eager seed-shape calls (cProfile)
#   pingpong    diag/pingpong_h3.py check h3: the ping-pong Gluon kernel (kernel_pingpong.py) against the
#               production kernel, checked on small shapes, then timed at H3 (sessions 16-17; about 5 minutes,
#               needs Triton 3.6)
#   vsa         diag/vsa_h3.py: video_sparse_attn at H3's size with the fused (VSA rule) and the torch plan
#               (session 17; about 2 minutes)
#   vsa_profile diag/vsa_profile.py: one video_sparse_attn call's kernels and GPU timeline at H3's size
#   stalls      Nsight Compute's per-instruction warp-stall samples of the attention kernel at H3 top-k 20 %
#               (diag/ncu_h3.py under ncu, then diag/stall_table.py; session 18)
#   (loops: diag/loop_variants_h3.py, session 18's experimental key loops, in the history at 9d73bec)
#   flex        diag/flex_exact_branch.py at H3's size (T=37248, a multiple of 64): FlexAttention with the
#               plan as block mask against the sdpa backend's gathers, top-k 10 % and 20 %
# e.g.  OUT=$OUT EXTRA_PYTHONPATH=$PWD/.whl/ck:$PWD/.whl/xdist bash benchmarks/gpu_session10.sh tests_x backward
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
export SOLATTN_REVISION=$(cat COMMIT 2>/dev/null)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cat COMMIT 2>/dev/null
PEERS="--ratios 0.1 0 --tail --graphs --backends dense triton comfy-kitchen"
for step in "$@"; do
  case $step in
    backward) timeout ${BACKWARD_S:-230} python benchmarks/bench_backward.py --no-sweep --out "$OUT/backward.md" > "$OUT/backward.log" 2>&1
              tail -22 "$OUT/backward.md" ;;
    seed) timeout 90 python benchmarks/diag/session10_seed.py > "$OUT/seed.txt" 2>&1
          grep "^|" "$OUT/seed.txt"; grep "torch plan" "$OUT/seed.txt" ;;
    peers) timeout 400 python -m solattn bench --shapes peers --ratios 0.2 $PEERS --repeats 5 --warmup 2 \
             --out "$OUT/peers" > "$OUT/peers.log" 2>&1; echo "peers rc=$?" ;;
    peers_seed) timeout 90 python -m solattn bench --shapes 2,4056,16,128 $PEERS --repeats 10 --warmup 2 \
                  --out "$OUT/peers_seed" > "$OUT/peers_seed.log" 2>&1; echo "peers_seed rc=$?"
                grep -E "^\[.*\]   " "$OUT/peers_seed.log" | tail -20 ;;
    graph_tests) timeout 100 python -m pytest -v -p no:cacheprovider --tb=short -s tests/test_graphs.py -k cuda \
                   > "$OUT/graph_tests.log" 2>&1; echo "graph tests rc=$?"; grep -E "PASSED|FAILED" "$OUT/graph_tests.log" ;;
    tests) timeout ${TEST_S:-300} python -m pytest -q -p no:cacheprovider tests/ ${TEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
           tail -4 "$OUT/gpu_tests.log" ;;
    tests_x) timeout ${TEST_S:-420} python -m pytest -q -p no:cacheprovider -n 8 --durations=10 tests/ ${TEST_ARGS:-} \
               > "$OUT/gpu_tests.log" 2>&1
             tail -4 "$OUT/gpu_tests.log" ;;
    plan_h3) timeout 200 python benchmarks/diag/plan_h3_fused.py h3 seed > "$OUT/plan_h3.txt" 2>&1
             grep -E "^##|^fused|^kernel|^dense|^seed|^H3" "$OUT/plan_h3.txt" | cut -c1-420 ;;
    e2e) timeout 200 python benchmarks/diag/e2e_h3.py host > "$OUT/e2e.txt" 2>&1
         grep -E "^\|" "$OUT/e2e.txt" ;;
    host_parts) timeout 200 python benchmarks/diag/host_parts.py funcs > "$OUT/host_parts.txt" 2>&1; cat "$OUT/host_parts.txt" ;;
    timeline) timeout 120 python benchmarks/diag/select_cost.py timeline > "$OUT/timeline.txt" 2>&1
              grep -E "^##|start" "$OUT/timeline.txt" | cut -c1-160 ;;
    select_cost) timeout 240 python benchmarks/diag/select_cost.py > "$OUT/select_cost.txt" 2>&1
                 grep -E "^##|plan|failed|start" "$OUT/select_cost.txt" | cut -c1-260 ;;
    seed_eager) timeout 90 python benchmarks/diag/seed_eager.py > "$OUT/seed_eager.txt" 2>&1
                head -60 "$OUT/seed_eager.txt" | cut -c1-160 ;;
    pingpong) timeout 400 python benchmarks/diag/pingpong_h3.py check h3 > "$OUT/pingpong.txt" 2>&1
              echo "pingpong rc=$?"; grep -c " ok$" "$OUT/pingpong.txt"; grep -E "^##|^\| (production|ping|no turns|diag)" "$OUT/pingpong.txt" ;;
    vsa) timeout 300 python benchmarks/diag/vsa_h3.py > "$OUT/vsa_h3.txt" 2>&1; echo "vsa rc=$?"
         grep -E "^##|^\|" "$OUT/vsa_h3.txt" | cut -c1-400 ;;
    vsa_profile) timeout 120 python benchmarks/diag/vsa_profile.py > "$OUT/vsa_profile.txt" 2>&1; echo "vsa_profile rc=$?"
                 cut -c1-160 "$OUT/vsa_profile.txt" | grep -v Warn | head -60 ;;
    stalls) timeout 300 ncu --profile-from-start off -k regex:sol_attn_fwd --section SourceCounters \
              --section WarpStateStats --import-source no -f -o "$OUT/stalls" python benchmarks/diag/ncu_h3.py topk20 \
              > "$OUT/stalls.log" 2>&1; echo "ncu rc=$?"
            ncu -i "$OUT/stalls.ncu-rep" --page source --csv --print-source sass > "$OUT/stalls.csv" 2> "$OUT/stalls.err"
            python benchmarks/diag/stall_table.py "$OUT/stalls.csv" 40 > "$OUT/stalls.txt" 2>&1
            head -70 "$OUT/stalls.txt" | cut -c1-200 ;;
    flex) for r in 0.1 0.2; do
            timeout 150 python benchmarks/diag/flex_exact_branch.py --T 37248 --H 56 --ratio $r --repeats 5 \
              >> "$OUT/flex.txt" 2>&1
          done
          grep -E "^device|^flex|^exact" "$OUT/flex.txt" ;;
    *) echo "unknown step '$step'; allowed: backward seed peers peers_seed graph_tests tests tests_x plan_h3 host_parts timeline select_cost seed_eager pingpong vsa vsa_profile stalls flex" >&2; exit 2 ;;
  esac
done
