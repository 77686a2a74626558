"""What the distributed checks share: this process's World (its GPU chosen before NCCL starts;
gloo when processes share a GPU),
one PASS / FAIL line per check that every rank agrees on (a failure on any rank fails the line)
(check_ring_attention.py, check_moe.py), and a relative error (those and check_ops.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mkernel


def start() -> mkernel.World:
    """This process's World: NCCL with a GPU per process; with fewer GPUs than processes they
    share them (run.sh: symmetric memory allows it, NCCL does not), joined by gloo."""
    gpus, size = torch.cuda.device_count(), int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    dist.init_process_group("gloo" if gpus < size else "nccl")
    return mkernel.World.from_process_group()


def report(world: mkernel.World, ok: bool, line: str) -> bool:
    """Prints ``PASS line`` / ``FAIL line`` on rank 0; True when any rank failed."""
    gloo = dist.get_backend() == "gloo"
    flag = torch.tensor([int(not ok)], device="cpu" if gloo else world.device)
    dist.all_reduce(flag)
    failed = flag.item() > 0
    if world.rank == 0:
        print(f"{'FAIL' if failed else 'PASS'} {line}", flush=True)
    return failed


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (on the CPU, in fp32)."""
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
