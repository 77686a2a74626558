"""Distributed check of moe_dispatch_gemm and moe_gemm_combine (one process per rank: the fused
kernels, tokens and fp32 rows through symmetric memory). Every rank draws all ranks' inputs
from the same seed and checks its own y, src, expert_offsets and out against the emulated
reference (mkernel.reference, fp32 on the CPU); loops of calls with new routings, both overlaps;
a bad id on one rank makes every rank raise; the world works after it. Prints one line per check
on rank 0; exits non-zero on any failure. Processes sharing a GPU (gloo) work too:

  torchrun --nproc_per_node=2 tests/distributed/check_moe.py --loop 20
  CHECK=check_moe.py bash tests/distributed/run.sh 2 --sms 60 --loop 5   # one GPU
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mkernel  # noqa: E402
from tests.distributed._common import report, start  # noqa: E402
from tests.test_moe import routing  # noqa: E402


def check(world, W: int, rank: int, mode: str, seed: int, sched=None) -> tuple[bool, str]:
    T, E, k, H, inter = 96, 4, 2, 256, 128
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(W, T, H, generator=g).bfloat16()
    w1 = torch.randn(W, E, H, inter, generator=g).bfloat16()
    w2 = torch.randn(W, E, inter, H, generator=g).bfloat16()
    weights = torch.rand(W, T, k, generator=g)
    ids = routing(W, T, E, k, mode, seed)
    dev = world.device
    mine = x[rank].to(dev), ids[rank].to(dev), w1[rank].to(dev)
    d = mkernel.moe_dispatch_gemm(*mine, world, sched)
    out = mkernel.moe_gemm_combine(d.y[0], w2[rank].to(dev), d, weights[rank].to(dev), world, sched)
    world.check()
    emu = mkernel.World.emulated(W)
    ref = mkernel.reference.moe_dispatch_gemm(x, ids, w1, emu)
    ref_out = mkernel.reference.moe_gemm_combine(ref.y, w2, ref, weights, emu)
    same_rows = d.src[0].cpu().tolist() == ref.src[rank].tolist() and (
        d.expert_offsets[0].cpu().tolist() == ref.expert_offsets[rank].tolist()
    )
    has_rows = ref.rows[rank] > 0
    err_y = float((d.y[0].float().cpu() - ref.y[rank].float()).abs().max()) if has_rows else 0.0
    err_out = float((out.float().cpu() - ref_out[rank].float()).abs().max())
    scale_y = float(ref.y[rank].float().abs().max()) if has_rows else 1.0
    scale_out = float(ref_out[rank].float().abs().max()) or 1.0
    ok = same_rows and err_y <= 2e-2 * scale_y and err_out <= 2e-2 * scale_out
    return ok, f"rows={'ok' if same_rows else 'DIFFER'} y={err_y:.2e} out={err_out:.2e}"


def refused(world, W: int, rank: int) -> tuple[bool, str]:
    """The last rank passes an expert id outside [-1, E): every rank raises a ValueError before
    anything runs (the last names the id, the others the refusing rank); nobody waits."""
    T, E, k, H, inter = 8, 2, 2, 64, 64
    dev = world.device
    x = torch.randn(T, H).bfloat16().to(dev)
    w1 = torch.randn(E, H, inter).bfloat16().to(dev)
    ids = routing(W, T, E, k, "uniform", 0)[rank].to(dev)
    if rank == W - 1:
        ids[3, 1] = W * E + 5
    try:
        mkernel.moe_dispatch_gemm(x, ids, w1, world)
        return False, "no error"
    except ValueError as e:
        want = "outside [-1, E=" if rank == W - 1 else f"rank(s) [{W - 1}] refused"
        return want in str(e), str(e)[:120]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", type=int, default=10)
    p.add_argument("--sms", type=int, default=None, help="SMs per rank (processes sharing a GPU)")
    args = p.parse_args()
    world = start()
    W, rank = world.size, world.rank
    failures = 0
    for overlap in ("intra_sm", "inter_sm"):
        sched = mkernel.Schedule(overlap=overlap, sms=args.sms)
        for mode in ("uniform", "one_expert", "rank0", "none"):
            try:
                results = [check(world, W, rank, mode, s, sched) for s in range(args.loop)]
            except Exception as e:  # noqa: BLE001 - reported, counted, the run goes on
                results = [(False, repr(e)[:300])]
            ok = all(r[0] for r in results)
            line = f"moe W={W} {overlap} {mode} x{args.loop}: {results[-1][1]}"
            failures += report(world, ok, line)
    ok, detail = refused(world, W, rank)
    failures += report(
        world, ok, f"moe W={W} a bad id on rank {W - 1}: every rank raises: {detail}"
    )
    ok, detail = check(world, W, rank, "uniform", 99)
    failures += report(world, ok, f"moe W={W} a call after the refusal: {detail}")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
