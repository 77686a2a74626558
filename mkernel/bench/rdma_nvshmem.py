"""rdma_put through the nvshmem transport (issue 14) across GPUs, against message size.

``torchrun --nproc_per_node=2 -m mkernel.bench.rdma_nvshmem [--save]``: one process per GPU, each
GPU its own virtual node, every rank putting to the next node's rank (mkernel/rdma_nvshmem.py),
message sizes 4 KiB .. 64 MiB. Wall-clock per call to completion, the median of ITERS calls
after a warm-up, on rank 0 (every call ends with an NVSHMEM barrier on the stream and a
synchronize, so the figures include that round trip):

- latency_us: one put per rank (put-with-signal -> the receiver sees the signal);
- gbps: the message as PUTS tiles by POSTERS CTAs, W * size bytes per call over all ranks;
- copy_gbps: a device copy of the same bytes within the GPU, in the same rounds (for scale).

Between the GPUs of one host NVSHMEM moves the bytes over NVLink (P2P); NVLink stores of the same
GPUs are in ``mkernel.bench.p2p``. No network was measured. ``--save`` writes
rdma_nvshmem_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results) on rank 0.
"""

from __future__ import annotations

import argparse
import os

import torch

from . import require_gpu
from .rdma import interleaved_wall_us
from .timing import save, table

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
PUTS, POSTERS = 16, 8


def pattern(rank: int, size: int, device: torch.device) -> torch.Tensor:
    """Rank's message: bytes that differ between ranks and positions."""
    return ((torch.arange(size, device=device) * 7 + 31 * rank) % 251).to(torch.uint8)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    import mkernel
    from mkernel.rdma_nvshmem import NvshmemTransport

    ap = argparse.ArgumentParser(prog="python3 -m mkernel.bench.rdma_nvshmem", description=__doc__)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    require_gpu(__spec__.name, torchrun=True)
    dist.init_process_group("gloo")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    W = dist.get_world_size()
    world = mkernel.World.from_process_group(nodes=W)
    rows = []
    with NvshmemTransport(world) as nv:
        for size in SIZES:
            src = pattern(world.rank, size, world.device)
            copy_dst = torch.empty_like(src)
            puts = min(PUTS, size // 16)
            fns = {
                "latency": lambda src=src: nv.exchange(src, 1, receive="wait"),
                "stream": lambda src=src, p=puts: nv.exchange(
                    src, p, posters=min(POSTERS, p), receive="wait"
                ),
                "copy": lambda src=src, d=copy_dst: d.copy_(src),
            }
            us = interleaved_wall_us(fns)
            dst, _ = nv.exchange(src, puts, posters=min(POSTERS, puts), receive="wait")
            source = (world.rank - W // world.nodes) % W
            assert torch.equal(dst, pattern(source, size, world.device))  # the timed call is right
            rows.append(
                {
                    "bytes": size,
                    "latency_us": round(us["latency"], 1),
                    "gbps": round(W * size / us["stream"] / 1e3, 2),
                    "copy_gbps": round(size / us["copy"] / 1e3, 2),
                }
            )
    if world.rank == 0:
        print(table(rows, ["bytes", "latency_us", "gbps", "copy_gbps"]))
        if args.save:
            print("saved", save("rdma_nvshmem", rows))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
