#!/usr/bin/env bash
# The open issues' multi-GPU items, as device_session.sh steps (one process per GPU, torchrun), so a
# lent multi-GPU machine is used in two calls of the device tool (each under its 600 s limit):
#   bash tools/multi_gpu.sh checks [NPROC]    correctness: the fused ops, ring attention (forward,
#                                             backward, autograd), the MoE pair, the nvshmem
#                                             transport of rdma_put and the fused ops over nodes
#                                             through it; loops, stragglers
#   bash tools/multi_gpu.sh benches [NPROC]   bench.p2p, bench.tp, bench.ring, bench.moe,
#                                             bench.rdma_nvshmem, bench.tp over one node per GPU
#                                             (JSON to $OUT)
# NPROC defaults to every GPU of the machine. NVLink multicast stays off (device_session.sh sets it).
set -u
what=${1:?checks or benches}
n=${2:-$(nvidia-smi -L | wc -l)}
run="torchrun --standalone --nproc_per_node=$n"
case $what in
  checks)
    exec bash tools/device_session.sh \
      "$run tests/distributed/check_ops.py --loop 200" \
      "$run tests/distributed/check_moe.py --loop 5" \
      "$run tests/distributed/check_ring_attention.py --loop 5" \
      "$run tests/distributed/check_rdma_nvshmem.py --loop 200" \
      "$run tests/distributed/check_nodes.py --nodes $n --loop 200"
    ;;
  benches)
    exec bash tools/device_session.sh \
      "$run -m mkernel.bench.p2p" \
      "$run -m mkernel.bench.tp" \
      "$run -m mkernel.bench.ring" \
      "$run -m mkernel.bench.moe" \
      "$run -m mkernel.bench.rdma_nvshmem --save" \
      "MKERNEL_TP_NODES=$n $run -m mkernel.bench.tp"
    ;;
  *) echo "usage: bash tools/multi_gpu.sh checks|benches [NPROC]" >&2; exit 2 ;;
esac
