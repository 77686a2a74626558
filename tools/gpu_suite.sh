#!/usr/bin/env bash
# The whole GPU suite on one device machine in parallel groups (inside tools/device_session.sh,
# cwd the snapshot): each extension built once first (four builds at once), then one pytest
# process per group, all at once on the one GPU. The groups are correctness tests, not timings,
# so sharing the GPU changes nothing they assert. Why: run one after another they take more than
# one 600 s device call (the smaller files alone took ~410 s, one H100).
# LIMIT: seconds per group (default 420); SPLIT: groups of the smaller files (default 3).
# Logs: $OUT/suite_<group>.log; each group's pytest summary line last.
set -u
LIMIT=${LIMIT:-420}
OUT=${OUT:-/tmp/out}
for ext in "mkernel.jit:main_extension()" mkernel.attention_ext:SPEC \
  mkernel.taskgraph.kernel_ext:SPEC mkernel.rdma_ext:SPEC; do
  mod=${ext%%:*} spec=${ext#*:}
  python -c "import mkernel, mkernel.jit as j, $mod as m; j.load(m.$spec)" \
    >"$OUT/build_$mod.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/build_*.log
BIG="test_ring_attention_bwd_fused_gpu.py test_taskgraph_kernel_gpu.py test_sanitizers_gpu.py"
SPLIT=${SPLIT:-3}  # the other test files, dealt round robin into this many groups
declare -A GROUP=()
i=0
for f in tests/gpu/test_*.py; do
  case " $BIG " in *" ${f##*/} "*) continue ;; esac
  GROUP[rest$((i % SPLIT))]+="$f "
  i=$((i + 1))
done
GROUP+=(
  [taskgraph]="tests/gpu/test_taskgraph_kernel_gpu.py"
  [ring_bwd]="tests/gpu/test_ring_attention_bwd_fused_gpu.py"
  [memcheck]="tests/gpu/test_sanitizers_gpu.py -k memcheck"
  [racecheck]="tests/gpu/test_sanitizers_gpu.py -k racecheck"
  [synccheck]="tests/gpu/test_sanitizers_gpu.py -k synccheck"
)
for g in "${!GROUP[@]}"; do
  # shellcheck disable=SC2086  # the group's arguments split on purpose
  timeout "$LIMIT" python -m pytest -p no:cacheprovider -rfE ${GROUP[$g]} \
    >"$OUT/suite_$g.log" 2>&1 &
done
wait
for g in "${!GROUP[@]}"; do
  echo "suite $g: $(grep -E '(passed|failed|error)' "$OUT/suite_$g.log" | tail -n 1)"
done
