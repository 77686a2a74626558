#!/usr/bin/env bash
# Issue 36's A/B of TaskGraph kernel variants on the device machine (inside
# tools/device_session.sh, cwd the snapshot): the snapshot as committed (head) and the snapshot
# with each macro setting of VARIANTS (space-separated, each NAME=VALUE[,NAME=VALUE..]; default
# the weight ring on: MK_TG_WEIGHT_RING=1; MK_TG_THREAD_FENCE=0 the other knob,
# kernels/taskgraph.cuh), built in parallel, then one process per tree
# alternating in ROUNDS rounds (tools/taskgraph_time.py). Prints per case the min-max ms of each
# tree, and each tree's max error against the fp32 step (BACKOFF="256 0": also those
# Schedule(backoff_ns=) per case, tools/taskgraph_time.py). TESTS=1: first the TaskGraph GPU tests
# in each variant tree (tests/gpu/test_taskgraph_kernel_gpu.py; the head's run in the suite);
# SANITIZE=1: memcheck, racecheck and synccheck over tests/gpu/sanitize_taskgraph.py there too
# (tests and sanitizers of every tree run at once). ROUNDS=0: no timing.
set -u
ROUNDS=${ROUNDS:-3}
VARIANTS=${VARIANTS:-MK_TG_WEIGHT_RING=1}
T=$PWD/tools/taskgraph_time.py
declare -A TREE=([head]=$PWD)
ORDER=(head)
for v in $VARIANTS; do  # a variant: NAME=VALUE[,NAME=VALUE...]
  dir=/tmp/v_${v//[=,]/_}
  rm -rf "$dir" && cp -r "$PWD" "$dir"
  for nv in ${v//,/ }; do
    name=${nv%%=*} val=${nv#*=}
    sed -i "s/^#define $name .*/#define $name $val/" "$dir/kernels/taskgraph.cuh"
    grep -q "^#define $name $val" "$dir/kernels/taskgraph.cuh" || { echo "no macro $name"; exit 2; }
  done
  TREE[$v]=$dir
  ORDER+=("$v")
done
for t in "${ORDER[@]}"; do
  (cd "${TREE[$t]}" && WARM=1 PYTHONPATH=${TREE[$t]} timeout 300 python "$T" "$t" \
    >"$OUT/warm_${t//[=,]/_}.log" 2>&1; echo "warm $t rc=$?") &
done
wait
grep -h "^ERR" "$OUT"/warm_*.log
if [ "${TESTS:-0}" = 1 ]; then
  for t in "${ORDER[@]:1}"; do
    (cd "${TREE[$t]}" && PYTHONPATH=${TREE[$t]} timeout 300 python -m pytest -q -x \
      tests/gpu/test_taskgraph_kernel_gpu.py >"$OUT/tests_${t//[=,]/_}.log" 2>&1
     echo "tests $t rc=$?: $(tail -n 1 "$OUT/tests_${t//[=,]/_}.log")") &
  done
  wait
fi
if [ "${SANITIZE:-0}" = 1 ]; then  # compute-sanitizer over tests/gpu/sanitize_taskgraph.py
  for t in "${ORDER[@]:1}"; do
    for tool in memcheck racecheck synccheck; do
      (cd "${TREE[$t]}" && PYTHONPATH=${TREE[$t]} timeout 300 compute-sanitizer --tool $tool \
        --error-exitcode 9 --print-limit 5 python tests/gpu/sanitize_taskgraph.py \
        >"$OUT/san_${tool}_${t//[=,]/_}.log" 2>&1
       echo "sanitize $tool $t rc=$?: $(grep -h "ERROR SUMMARY\|hazards displayed" \
         "$OUT/san_${tool}_${t//[=,]/_}.log" | tail -n 1)") &
    done
  done
  wait  # the trees and tools at once: correctness runs, sharing the GPU changes nothing they check
fi
for r in $(seq "$ROUNDS"); do
  for t in "${ORDER[@]}"; do
    (cd "${TREE[$t]}" && PYTHONPATH=${TREE[$t]} timeout 180 python "$T" "$t" 1 2>&1 |
      grep -E "^(TAG|ERR) ")
  done
done | tee "$OUT/ab_taskgraph.txt"
grep "^ERR" "$OUT/ab_taskgraph.txt" | sort -u  # each tree's error per case, against fp32
python "$PWD/tools/ab_table.py" "$OUT/ab_taskgraph.txt" "${ORDER[@]}"
