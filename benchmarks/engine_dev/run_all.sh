#!/usr/bin/env bash
# One device call: build (cached in .mkcache), SASS/spill check, correctness tests, benchmark.
#   benchmarks/engine_dev/run_all.sh [--quick]      logs and results under $OUT (or ./out)
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
OUT=${OUT:-$ROOT/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
DIR=$(benchmarks/engine_dev/build.sh 2> "$OUT/build.log" | tail -1) || { cat "$OUT/build.log"; exit 1; }
cp "$DIR/ptxas.log" "$OUT/"
benchmarks/engine_dev/check_sass.sh "$DIR" 2>&1 | tee "$OUT/sass_check.txt"
cd benchmarks/engine_dev
timeout 30 python3 -c "
import sys, torch; sys.argv=['x','$DIR']
from common import *; mk=load_module('$DIR')
A=torch.randn(128,64,device='cuda').bfloat16(); B=torch.randn(64,256,device='cuda').bfloat16()
C=torch.full((128,256),float('nan'),device='cuda',dtype=torch.bfloat16)
launch(mk,A,B,C,128,256,64,config=0); torch.cuda.synchronize()
print('smoke rel err', ((C.float()-A.float()@B.float()).norm()/(A.float()@B.float()).norm()).item())
" 2>&1 || { echo "SMOKE FAILED (hang or crash)"; exit 1; }
timeout 80 python3 test_gemm.py "$DIR" $1 2>&1 | tee "$OUT/test.log" | grep -v "^PASS"
timeout 100 python3 bench_gemm.py "$DIR" --json "$OUT/results.json" --variants $2 2>&1 | tee "$OUT/bench.log" | tail -12
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv
if [ -z "$1" ] && command -v compute-sanitizer >/dev/null; then
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 sanitize_cases.py "$DIR" 2>&1 | tail -4
fi
cd "$ROOT" && tar czf "$OUT/mkcache.tgz" .mkcache/engine_dev 2>/dev/null
