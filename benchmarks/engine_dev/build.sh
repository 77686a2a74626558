#!/usr/bin/env bash
# Build the GEMM engine's dev module (nvcc + pybind11, no torch headers), cached by content hash.
#   benchmarks/engine_dev/build.sh [cache_dir]      (default: <repo>/.mkcache/engine_dev)
# Prints the directory holding mk_gemm_dev*.so on its last line; writes ptxas.log beside it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${1:-$ROOT/.mkcache/engine_dev}
PY=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FLAGS="-std=c++17 -O3 -Xcompiler -fPIC ${MK_GEMM_DEV_FLAGS:--DMK_GEMM_EXPERIMENTS}"
PYINC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PBINC=$($PY -c "import pybind11; print(pybind11.get_include())")
SUFFIX=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
SRCS="kernels/gemm.cu kernels/gemm_args.h kernels/gemm_binding.cpp benchmarks/engine_dev/dev_module.cpp
      primitives/gemm/*.cuh primitives/host/tensor_map.h"
KEY=$(cd "$ROOT" && { cat $SRCS; echo "$ARCH $FLAGS $SUFFIX"; $NVCC --version | tail -1; } | sha1sum | cut -c1-16)
DIR=$CACHE/$KEY
if [ -f "$DIR/mk_gemm_dev$SUFFIX" ]; then echo "cached: $DIR" >&2; echo "$DIR"; exit 0; fi
TMP=$(mktemp -d "$CACHE.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$CACHE"; mktemp -d "$CACHE/../tmp.XXXXXX"; })
cd "$ROOT"
$NVCC $ARCH $FLAGS -Xptxas -v -c kernels/gemm.cu -o "$TMP/gemm.o" 2> "$TMP/ptxas.log" &
$NVCC $FLAGS -I"$PYINC" -I"$PBINC" -c kernels/gemm_binding.cpp -o "$TMP/gemm_binding.o" &
$NVCC $FLAGS -I"$PYINC" -I"$PBINC" -c benchmarks/engine_dev/dev_module.cpp -o "$TMP/dev_module.o" &
wait %1 || { cat "$TMP/ptxas.log" >&2; exit 1; }
wait %2 && wait %3
$NVCC -shared -Xcompiler -fPIC -o "$TMP/mk_gemm_dev$SUFFIX" "$TMP/gemm.o" "$TMP/gemm_binding.o" \
  "$TMP/dev_module.o"
mkdir -p "$CACHE"
rm -rf "$DIR"; mv "$TMP" "$DIR"   # atomic publish of a complete build
echo "built: $DIR" >&2
echo "$DIR"
