#!/usr/bin/env bash
# Distributed-world checks. With fewer GPUs than processes, the processes share GPU 0: symmetric
# memory then needs TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, and spin-waiting kernels of two
# processes run at once only under MPS, so this starts the MPS daemon (and stops it after).
# Usage: bash tests/distributed/run.sh NPROC [check_ops.py args...]
#        CHECK=check_moe.py bash tests/distributed/run.sh NPROC [its args...]  (another check)
set -u
NPROC=${1:-2}
shift || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
MPS=0
if [ "$GPUS" -lt "$NPROC" ]; then
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  if command -v nvidia-cuda-mps-control >/dev/null; then
    nvidia-cuda-mps-control -d && MPS=1
  fi
fi
python3 -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  "$(dirname "$0")/${CHECK:-check_ops.py}" "$@"
rc=$?
if [ "$MPS" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
exit $rc
