"""Distributed check of ring_attention and its backward (one process per GPU): both are fused
kernels (kernels/ring_attention.cu, kernels/ring_attention_backward.cu; K/V and the dK / dV
partials through symmetric memory), the backward through autograd.
Every rank draws all
ranks' inputs from the same seed and checks its own out, lse, dq, dk, dv against the emulated
reference (fp32, mkernel.reference) within bf16 rounding; then a loop of calls with new inputs.
Prints one line per check on rank 0 and exits non-zero on any failure. NOTE: NCCL needs one GPU
per process (two processes cannot share a GPU here, unlike tests/distributed/check_ops.py).

  torchrun --nproc_per_node=2 tests/distributed/check_ring_attention.py --loop 100
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
from tests.distributed._common import rel_err, report, start  # noqa: E402


def check(world, W: int, rank: int, layout: str, causal: bool, seed: int) -> tuple[bool, str]:
    g = torch.Generator().manual_seed(seed)
    B, S, Hq, Hkv, D = 1, 256, 4, 2, 128
    q, dout = (torch.randn(W, B, S, Hq, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(W, B, S, Hkv, D, generator=g).bfloat16() for _ in range(2))
    dev = world.device
    leaves = [x[rank].to(dev).requires_grad_() for x in (q, k, v)]
    out, lse = mkernel.ring_attention(*leaves, world, causal, None, layout)
    out.backward(dout[rank].to(dev))
    emu = mkernel.World.emulated(W)
    want_out, want_lse = mkernel.reference.ring_attention(q, k, v, emu, causal, None, layout)
    want_grads = mkernel.reference.ring_attention_backward(
        dout, q, k, v, want_out, want_lse, emu, causal, None, layout
    )
    names = ("dq", "dk", "dv")
    errs = {
        "out": rel_err(out.detach(), want_out[rank]),
        "lse": rel_err(lse.detach(), want_lse[rank]),
        **{n: rel_err(x.grad, w[rank]) for n, x, w in zip(names, leaves, want_grads, strict=True)},
    }
    ok = all(e < 2e-2 for e in errs.values())
    return ok, " ".join(f"{n}={e:.1e}" for n, e in errs.items())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", type=int, default=20)
    args = p.parse_args()
    world = start()
    W, rank = world.size, world.rank
    failures = 0
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            results = [check(world, W, rank, layout, causal, seed) for seed in range(args.loop)]
            ok = all(r[0] for r in results)
            line = f"ring_attention W={W} {layout} causal={causal} x{args.loop}: {results[-1][1]}"
            failures += report(world, ok, line)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
