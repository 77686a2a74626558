"""The nvshmem transport of rdma_put across GPUs, one process per GPU (launch with torchrun; needs
the nvidia-nvshmem-cu13 wheel and one GPU per process):

  torchrun --nproc_per_node=2 tests/distributed/check_rdma_nvshmem.py --loop 200

The ranks are split into W virtual nodes (one per GPU by default, ``--nodes``), so every put
crosses a node. Every rank draws every rank's row from the same seeds, so each checks what landed
from its source without communication: random sizes, tile counts, poster CTAs, both signal ops,
both receive modes, poisoned outputs; then ``--loop`` calls of one shape. Prints one line per check
on rank 0 and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mkernel  # noqa: E402
from mkernel.rdma_nvshmem import NvshmemTransport  # noqa: E402


def row(rank: int, seed: int, n: int, dev: torch.device) -> torch.Tensor:
    """Rank's row of call ``seed``: int32 values unique to (rank, seed, position)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-(2**30), 2**30, (n,), generator=g, dtype=torch.int32).to(dev)


def one_call(
    nv: NvshmemTransport, seed: int, n: int, puts: int, posters: int, op: str, receive: str
) -> str | None:
    W, N, r = nv.world_size, nv.nodes, nv.rank
    src_rank = (r - W // N) % W
    src = row(r, seed, n, nv.device)
    out = torch.full_like(src, -7) if receive == "copy" else None  # poison: unwritten tiles show
    dst, out = nv.exchange(src, puts, posters=posters, op=op, receive=receive, out=out)
    want = row(src_rank, seed, n, nv.device)
    if not torch.equal(dst, want):
        return f"dst differs from rank {src_rank}'s row ({(dst != want).sum().item()} ints)"
    if receive == "copy" and not torch.equal(out, want):
        return f"out differs from rank {src_rank}'s row ({(out != want).sum().item()} ints)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--loop", type=int, default=200)
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--nodes", type=int, default=0, help="virtual nodes (default: one per rank)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    # NOTE: modulo the GPUs: with fewer GPUs than processes several PEs share one, which NVSHMEM
    # may refuse (multiple PEs per GPU); untried
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    W = dist.get_world_size()
    world = mkernel.World.from_process_group(nodes=args.nodes or W)
    failures = 0

    def report(what: str, err: str | None) -> None:
        nonlocal failures
        failures += err is not None
        if world.rank == 0 or err is not None:
            tail = f": {err}" if err else ""
            print(f"{'FAIL' if err else 'ok  '} rank {world.rank} {what}{tail}", flush=True)

    with NvshmemTransport(world) as nv:
        rng = random.Random(0)  # the same cases on every rank
        for case in range(args.cases):
            puts = rng.choice([1, 2, 3, 8, 16, 64])
            posters = rng.randint(1, min(puts, 8))
            n = puts * 4 * rng.randint(1, 4096)  # ints: tiles of a multiple of 16 bytes
            op, receive = rng.choice(["set", "add"]), rng.choice(["copy", "wait"])
            what = f"case {case}: {n * 4} bytes, {puts} puts, {posters} posters, {op}, {receive}"
            report(what, one_call(nv, case, n, puts, posters, op, receive))
        t0 = time.perf_counter()
        err = None
        for i in range(args.loop):
            err = one_call(nv, 10_000 + i, 1 << 16, 16, 4, "set", "copy")
            if err:
                break
        ms = (time.perf_counter() - t0) * 1e3 / max(1, args.loop)
        report(f"loop of {args.loop} calls (256 KiB, 16 puts; {ms:.2f} ms per call)", err)
    total = torch.tensor([failures])
    dist.all_reduce(total)
    if world.rank == 0:
        print(f"{'FAILED' if total.item() else 'PASSED'}: {total.item()} failures", flush=True)
    dist.destroy_process_group()
    return 1 if total.item() else 0


if __name__ == "__main__":
    sys.exit(main())
