"""Ring attention on W GPUs (issue 12's two-GPU benchmark), forward:

  ``torchrun --nproc_per_node=2 -m mkernel.bench.ring``

B = 1, H = 32 (GQA off), D = 128 bf16, S_local in {4096, 8192}; zigzag causal and contiguous full.
Versions, timed interleaved in rounds (mkernel.bench.tp.interleaved_dist_ms, the slowest rank's
median):
- ``ours``: mkernel.ring_attention on the distributed world (today unfused: NCCL-sent K/V blocks,
  our attention engine per block, lse merges: mkernel/ops/ring_attention_dist.py);
- ``unfused_cudnn``: the same ring with torch SDPA's cuDNN attention per block (the unfused
  recipe users copy: NCCL send/recv of K/V per step, cuDNN on the block, lse merge);
- ``compute``: our engine's per-step calls with no sends (the attention alone);
- ``traffic``: the W - 1 K/V exchanges alone;
and ideal = max(compute, traffic). Prints ours/unfused_cudnn and ours/ideal per row (< 1 beats the
unfused ring; 1.0 is ideal) and writes ring_w<W>_<date>.json. NOT yet run: written when no
two-GPU machine was lent; check the cuDNN block's lse convention against ours (max |out - ours|
is printed) the first time.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mkernel
from mkernel.ops import ring_attention_dist as rd

from .timing import save, table
from .tp import interleaved_dist_ms

B, H, D = 1, 32, 128
LAYOUTS = ("zigzag", "contiguous")  # zigzag is causal, contiguous full
CASES = [(S, layout, layout == "zigzag") for S in (4096, 8192) for layout in LAYOUTS]


def cudnn_block(q, k, v, causal: bool, scale: float):
    """The block contract (o fp32 [B, n, H, D], lse [B, H, n]) through SDPA's cuDNN kernel."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, 2).transpose(1, 2)
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qh, kh, vh, None, True, 0.0, causal, False, scale=scale
    )
    out, lse = res[0], res[1]
    return out.transpose(1, 2).float(), lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def flops(S: int, W: int, causal: bool) -> float:
    full = 4.0 * B * H * S * (W * S) * D  # this rank's queries against every key
    return full / 2 if causal else full


def bench_case(world: mkernel.World, S: int, layout: str, causal: bool) -> dict:
    W, zigzag, scale = world.size, layout == "zigzag", D**-0.5
    g = torch.Generator(device="cuda").manual_seed(world.rank)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16() for _ in range(3))
    ours_fwd, _ = rd.gpu_engines()
    kv = torch.stack([k, v]).contiguous()
    spare = torch.empty_like(kv)

    def traffic():
        for _ in range(W - 1):
            for w in rd._exchange(world, kv, spare):
                w.wait()

    fns = {
        "ours": lambda: mkernel.ring_attention(q, k, v, world, causal, None, layout),
        "unfused_cudnn": lambda: rd.forward(q, k, v, world, causal, scale, zigzag, cudnn_block),
        "compute": lambda: rd.forward(q, k, v, world, causal, scale, zigzag, ours_fwd, False),
        "traffic": traffic,
    }
    ours = fns["ours"]()[0].float()
    try:
        err = float((fns["unfused_cudnn"]()[0].float() - ours).abs().max())
    except RuntimeError as exc:  # no cuDNN attention in this torch build
        err = float("nan")
        fns.pop("unfused_cudnn")
        if world.rank == 0:
            print(f"unfused_cudnn unavailable: {exc}", flush=True)
    ms = interleaved_dist_ms(fns)
    row: dict = {"S_local": S, "layout": layout, "causal": causal, "W": W, "B": B, "H": H, "D": D}
    row |= {f"{k}_ms": v for k, v in ms.items()}
    row["max_abs_out_cudnn_vs_ours"] = err
    if ms.get("ours"):
        row["ours_tflops"] = flops(S, W, causal) / ms["ours"] / 1e9
        ideal = max(ms.get("compute") or 0.0, ms.get("traffic") or 0.0)
        row["ideal_ms"] = ideal
        row["ours_over_ideal"] = ms["ours"] / ideal if ideal else None
        if ms.get("unfused_cudnn"):
            row["ours_over_unfused"] = ms["ours"] / ms["unfused_cudnn"]
    return row


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = mkernel.World.from_process_group()
    rows = [bench_case(world, S, layout, causal) for S, layout, causal in CASES]
    if world.rank == 0:
        cols = ["S_local", "layout", "ours_ms", "unfused_cudnn_ms", "compute_ms", "traffic_ms",
                "ours_over_unfused", "ours_over_ideal", "max_abs_out_cudnn_vs_ours"]  # fmt: skip
        print(table(rows, cols))
        print("saved", save(f"ring_w{world.size}", rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
