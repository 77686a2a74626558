#!/usr/bin/env bash
# ours vs cuBLAS under ncu at the base clock (durations then compare cycles, not power states):
# SpeedOfLight + the wgmma pipe's utilisation, one launch each per target shape. Output under $OUT.
#   OUT=out bash benchmarks/engine_dev/ncu_sol.sh
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
OUT=${OUT:-$ROOT/out}; mkdir -p "$OUT"
D=$(bash benchmarks/engine_dev/build.sh | tail -1) || exit 1
ncu --query-metrics 2>/dev/null | grep -i "pipe_tensor" | head -8
cd benchmarks/engine_dev
M="--metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
K="-k regex:gemm_kernel|nvjet"
timeout 400 ncu --clock-control base --section SpeedOfLight $M $K python3 ncu_sol.py "$D" \
  > "$OUT/ncu.txt" 2>&1 ||
  timeout 400 ncu --clock-control base --section SpeedOfLight $K python3 ncu_sol.py "$D" \
    > "$OUT/ncu.txt" 2>&1
grep -E "gemm_kernel|nvjet|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|gmma|ERR" \
  "$OUT/ncu.txt" | cut -c1-140
