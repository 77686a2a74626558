"""The MoE pair on W GPUs (issue 11's two-GPU benchmark):

  ``torchrun --nproc_per_node=2 -m mkernel.bench.moe``

DeepSeek-V3-like layer per rank: T = 4096 tokens, H = 7168, I = 2048, E = 256 experts in all
(E / W per rank), top-8, uniform and Zipf routing. Versions, timed interleaved in rounds
(mkernel.bench.tp.interleaved_dist_ms, the slowest rank's median), for the dispatch (+ first GEMM)
and the combine (second GEMM +):
- ``ours``: mkernel.moe_dispatch_gemm / moe_gemm_combine on the distributed world (the fused
  kernels: tokens and fp32 rows through symmetric memory, kernels/moe_*.cu);
- ``unfused``: the same exchanges with ``torch._grouped_mm`` (the unfused pair users write);
- ``gemm``: the grouped GEMM alone on this rank's rows; ``a2a``: the exchanges alone (a GEMM that
  does nothing); ideal = max(gemm, a2a).
Prints ours/unfused and ours/ideal per row and writes moe_w<W>_<date>.json. NOT yet run (written
when no two-GPU machine was lent).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mkernel
from mkernel.bench.baselines import moe_dist

from .plot import draw_run
from .timing import save, table
from .tp import interleaved_dist_ms

T, H, INTER, EXPERTS, K = 4096, 7168, 2048, 256, 8


def torch_gemm(a, w, offsets, out_dtype):
    out = torch._grouped_mm(a, w, offs=offsets[1:].contiguous())
    return out.to(out_dtype)


def no_gemm(a, w, offsets, out_dtype):
    return a.new_empty((a.shape[0], w.shape[-1]), dtype=out_dtype)


def route(W: int, rank: int, routing: str) -> torch.Tensor:
    """[T, K] distinct global expert ids, uniform or Zipf (weight 1 / (rank + 1)) popularity."""
    g = torch.Generator().manual_seed(1000 + rank)
    weights = torch.ones(EXPERTS)
    if routing == "zipf":
        weights = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64)
    return torch.multinomial(weights.expand(T, EXPERTS), K, generator=g).to(torch.int32)


def bench(world: mkernel.World, routing: str) -> list[dict]:
    W, E = world.size, EXPERTS // world.size
    dev = world.device
    x = torch.randn(T, H, device=dev).bfloat16()
    w1 = (torch.randn(E, H, INTER, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, INTER, H, device=dev) / INTER**0.5).bfloat16()
    ids = route(W, world.rank, routing).to(dev)
    weights = torch.rand(T, K, device=dev)
    d = mkernel.moe_dispatch_gemm(x, ids, w1, world)
    h = d.y[0]
    offs = d.expert_offsets[0]
    dispatch = {
        "ours": lambda: mkernel.moe_dispatch_gemm(x, ids, w1, world),
        "unfused": lambda: moe_dist.dispatch(x, ids, w1, world, torch_gemm),
        "gemm": lambda: mkernel.grouped_gemm(h, w1, offs),
        "a2a": lambda: moe_dist.dispatch(x, ids, w1, world, no_gemm),
    }
    combine = {
        "ours": lambda: mkernel.moe_gemm_combine(h, w2, d, weights, world),
        "unfused": lambda: moe_dist.combine(h, w2, d, weights, world, torch_gemm),
        "gemm": lambda: mkernel.grouped_gemm(h, w2, offs, out_dtype=torch.float32),
        "a2a": lambda: moe_dist.combine(h, w2, d, weights, world, no_gemm),
    }
    rows = []
    for op, fns in (("dispatch", dispatch), ("combine", combine)):
        ms = interleaved_dist_ms(fns)
        row: dict = {"op": op, "routing": routing, "W": W, "T": T, "H": H, "I": INTER, "E": EXPERTS}
        row["rows"] = int(offs[-1])
        row |= {f"{k}_ms": v for k, v in ms.items()}
        ideal = max(ms.get("gemm") or 0.0, ms.get("a2a") or 0.0)
        row["ideal_ms"] = ideal
        if ms.get("ours"):
            row["ours_over_unfused"] = ms["ours"] / ms["unfused"] if ms.get("unfused") else None
            row["ours_over_ideal"] = ms["ours"] / ideal if ideal else None
        rows.append(row)
    return rows


def main(plot: str | None = None) -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = mkernel.World.from_process_group()
    rows = [r for routing in ("uniform", "zipf") for r in bench(world, routing)]
    if world.rank == 0:
        cols = ["op", "routing", "rows", "ours_ms", "unfused_ms", "gemm_ms", "a2a_ms",
                "ours_over_unfused", "ours_over_ideal"]  # fmt: skip
        print(table(rows, cols))
        print("saved", save(f"moe_w{world.size}", rows))
        draw_run(f"moe_w{world.size}", rows, plot)
    dist.destroy_process_group()


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, torchrun=True, plot=True)
    main(args.plot)
