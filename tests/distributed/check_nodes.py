"""gemm_rs, ag_gemm and gemm_ar in a distributed world of several nodes (issue 14), one process per
rank: within a node data moves over NVLink, across nodes only by NVSHMEM puts (the nvshmem
transport: kernels/<op>_nodes.cu built into _mkernel_nvshmem, buffers on NVSHMEM's heap).

  torchrun --nproc_per_node=4 tests/distributed/check_nodes.py --nodes 2 --loop 200

Processes may share a GPU (LOCAL_RANK modulo the GPUs; NVSHMEM allows several PEs per GPU), so the
whole path runs with one GPU too. Every rank draws every rank's inputs from the same seeds and
checks its own result against the fp32 reference (no communication): random shapes (remainder
rows and columns), both overlaps, poisoned outputs, the world's signal pads back to zero after
each call, a loop of asynchronous calls, and a straggler rank. One line per check on rank 0;
exits non-zero on any failure.
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
from mkernel import rdma_nvshmem  # noqa: E402
from tests.distributed._common import report  # noqa: E402
from tests.helpers import assert_close_bf16, poisoned  # noqa: E402

OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


def operands(op: str, W: int, rows: int, n: int, k: int, seed: int):
    """Every rank's operands in the emulated convention (leading rank dim), on the CPU, and the
    per-rank result shape: ``rows`` rows per rank's a (gemm_rs: W * rows), ``k`` its columns."""
    g = torch.Generator().manual_seed(seed)
    m = rows if op != "gemm_rs" else W * rows
    a = torch.randn(W, m, k, generator=g).bfloat16()
    b = torch.randn(W, k, n, generator=g).bfloat16()
    shape = {"gemm_rs": (rows, n), "ag_gemm": (W * rows, n), "gemm_ar": (m, n)}[op]
    return a, b, shape


def one_call(world, op: str, rows: int, n: int, k: int, seed: int, sched) -> None:
    """One checked call: raises on a wrong result or a pad left raised."""
    W, r = world.size, world.rank
    a, b, shape = operands(op, W, rows, n, k, seed)
    want = getattr(mkernel.reference, op)(a, b, world=mkernel.World.emulated(W))[r]
    out = poisoned(shape, world.device)
    got = getattr(mkernel, op)(
        a[r].to(world.device), b[r].to(world.device), world=world, schedule=sched, out=out
    )
    world.check()
    assert_close_bf16(got.cpu(), want, f"{op} rank {r} rows={rows} n={n} k={k}")
    torch.cuda.synchronize()
    for key, pad in world.signal_pads().items():
        if pad.any():
            raise AssertionError(f"signal pad {key} left raised after {op}")


def loop(world, op: str, sched, calls: int) -> None:
    """``calls`` asynchronous calls on the same operands, then one check of the last result (into
    a poisoned output)."""
    W, r = world.size, world.rank
    a, b, shape = operands(op, W, 128, 256, 128, 7)
    la, lb = a[r].to(world.device), b[r].to(world.device)
    world.sync_checks = False
    try:
        for i in range(calls):
            last = poisoned(shape, world.device) if i == calls - 1 else None
            out = getattr(mkernel, op)(la, lb, world=world, schedule=sched, out=last)
        world.check()
    finally:
        world.sync_checks = True
    want = getattr(mkernel.reference, op)(a, b, world=mkernel.World.emulated(W))[r]
    assert_close_bf16(out.cpu(), want, f"{op} loop")


def silent_rank(world, op: str, overlap: str) -> None:
    """Rank W - 1 raises nothing: some rank's wait times out (CommTimeout naming rank, peer and
    signal); after world.reset() on every rank the next call is right."""
    W, r = world.size, world.rank
    a, b, _ = operands(op, W, 128, 256, 64, 9)
    quiet = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=W - 1))
    timed_out, other = 0, None
    # NOTE: whatever this rank's call does, every rank goes on to the collectives below in step
    try:
        getattr(mkernel, op)(
            a[r].to(world.device), b[r].to(world.device), world=world, schedule=quiet
        )
        world.check()
    except mkernel.CommTimeout as e:
        timed_out = int(f"rank {e.rank}" in str(e) and bool(e.signal))
    except Exception as e:  # noqa: BLE001 - raised after the collectives
        other = e
    _trace(world, f"{op} silent call: timed_out={timed_out} other={other!r}")
    world.reset()
    _trace(world, f"{op} reset done")
    flag = torch.tensor([timed_out])
    dist.all_reduce(flag)
    if other is not None:
        raise other
    assert flag.item() > 0, "no rank timed out with a silent rank"
    one_call(world, op, 128, 256, 64, 9, mkernel.Schedule(overlap=overlap))


def shared_transport(world) -> None:
    """rdma_put's test exchange through a transport of its own, in the process whose world over
    nodes already runs NVSHMEM (they share it), and the ops still right after it is closed."""
    W, r = world.size, world.rank
    src_rank = (r - W // world.nodes) % W
    row = lambda q: torch.arange(4096, dtype=torch.int32) * (q + 1)  # noqa: E731
    with rdma_nvshmem.NvshmemTransport(world) as nv:
        out = torch.full((4096,), -7, dtype=torch.int32, device=world.device)
        _, got = nv.exchange(row(r).to(world.device), 4, posters=2, out=out)
        assert torch.equal(got.cpu(), row(src_rank)), "exchange: wrong row"
    one_call(world, "gemm_rs", 64, 128, 64, 3, mkernel.Schedule())


def _trace(world, what: str) -> None:
    if os.environ.get("CHECK_NODES_TRACE"):
        print(f"[rank {world.rank} {time.strftime('%X')}] {what}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--shapes", type=int, default=3, help="random shapes per op and overlap")
    ap.add_argument("--loop", type=int, default=100)
    ap.add_argument("--sms", type=int, default=None, help="SMs per rank (processes sharing a GPU)")
    ap.add_argument("--dump-after", type=float, default=0, help="dump stacks and exit (hangs)")
    args = ap.parse_args()
    if args.dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)
    gpus, size = torch.cuda.device_count(), int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    dist.init_process_group("gloo" if gpus < size else "nccl")
    world = mkernel.World.from_process_group(nodes=args.nodes, timeout_s=10.0)
    world.sync_checks = True
    W, failed = world.size, False

    def check(what: str, f, *f_args) -> None:
        nonlocal failed
        try:
            f(*f_args)
            ok, detail = True, ""
        except Exception as e:  # noqa: BLE001 - reported, counted, and the run goes on
            ok, detail = False, f": {repr(e)[:400]}"
        failed |= report(world, ok, f"W={W} nodes={args.nodes} {what}{detail}")

    rng = random.Random(0)  # the same shapes on every rank
    for op in args.ops.split(","):
        for overlap in ("intra_sm", "inter_sm"):
            sched = mkernel.Schedule(overlap=overlap, sms=args.sms)
            for i in range(args.shapes):
                rows, n, k = rng.randint(1, 300), 8 * rng.randint(1, 80), 8 * rng.randint(1, 64)
                what = f"{op} {overlap} rows={rows} n={n} k={k}"
                check(what, one_call, world, op, rows, n, k, 100 + i, sched)

            t0 = time.perf_counter()
            check(f"{op} {overlap} loop x{args.loop}", loop, world, op, sched, args.loop)
            if world.rank == 0:
                print(f"     {(time.perf_counter() - t0) / args.loop * 1e3:.2f} ms per call")
            late = mkernel.Schedule(
                overlap=overlap,
                sms=args.sms,
                faults=mkernel.Faults(delay_rank=W - 1, delay_us=300),
            )
            check(
                f"{op} {overlap} straggler rank {W - 1}",
                one_call,
                world,
                op,
                200,
                264,
                136,
                5,
                late,
            )
    # a world of its own with a short deadline (it shares the process's NVSHMEM)
    short = mkernel.World.from_process_group(nodes=args.nodes, timeout_s=1.0)
    short.sync_checks = True
    for op in args.ops.split(","):
        check(
            f"{op} silent rank {W - 1}: CommTimeout, reset, next call right",
            silent_rank,
            short,
            op,
            "inter_sm",
        )
    check("rdma exchange on a second transport of the process, then an op", shared_transport, world)
    dist.barrier()
    rdma_nvshmem.shutdown()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
