"""Ring attention on W GPUs (issues 12 and 13: the two-GPU benchmarks), forward and backward:

  ``torchrun --nproc_per_node=2 -m mkernel.bench.ring``

B = 1, H = 32 (GQA off), D = 128 bf16, S_local in {4096, 8192}; zigzag causal and contiguous full.
Versions, timed interleaved in rounds (mkernel.bench.tp.interleaved_dist_ms, the slowest rank's
median):
- ``ours``: mkernel.ring_attention on the distributed world (the fused kernel);
- ``unfused_cudnn``: the same ring with torch SDPA's cuDNN attention per block (the unfused
  recipe users copy: NCCL send/recv of K/V per step, cuDNN on the block, lse merge);
- ``compute``: our engine's per-step calls with no sends (the attention alone: the unfused ring of
  mkernel/bench/baselines/ring_dist.py, NCCL-sent K/V blocks, our engine per block, lse merges,
  with its sends off);
- ``traffic``: the W - 1 K/V exchanges alone;
and ideal = max(compute, traffic). The backward rows (``pass="bwd"``) time the same four:
``ours`` = mkernel.ring_attention_backward (our backward engine per block, fp32 dK / dV
accumulators travelling the ring), ``unfused_cudnn`` = the same ring with SDPA's cuDNN backward per
block (given the global out and lse of the query rows, as the unfused recipes do),
``compute`` = no sends, ``traffic`` = the K/V exchanges and the W passes of the fp32 accumulators.
Prints ours/unfused_cudnn and ours/ideal per row (< 1 beats the unfused ring; 1.0 is ideal) and
writes ring_w<W>_<date>.json. NOT yet run on two GPUs; the cuDNN block functions are checked
against our engines on one GPU by tests/gpu/test_ring_bench_blocks_gpu.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mkernel
from mkernel.bench.baselines import ring_dist as rd

from .plot import draw_run
from .timing import save, table
from .tp import interleaved_dist_ms

B, H, D = 1, 32, 128
LAYOUTS = ("zigzag", "contiguous")  # zigzag is causal, contiguous full
CASES = [(S, layout, layout == "zigzag") for S in (4096, 8192) for layout in LAYOUTS]


def _expanded(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, n, Hkv, D] -> [B, Hkv * group, n, D]: each K/V head repeated for the query heads that
    share it (SDPA's cuDNN kernels take no GQA), heads first."""
    return x.repeat_interleave(group, 2).transpose(1, 2)


def _group_sum(xh: torch.Tensor, group: int) -> torch.Tensor:
    """A gradient of an ``_expanded`` tensor back to [B, n, Hkv, D] fp32: summed over each group."""
    B, Hq, n, D = xh.shape
    return xh.transpose(1, 2).float().reshape(B, n, Hq // group, group, D).sum(3)


def cudnn_block(q, k, v, causal: bool, scale: float):
    """The block contract (o fp32 [B, n, H, D], lse [B, H, n]) through SDPA's cuDNN kernel."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _expanded(k, group), _expanded(v, group)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qh, kh, vh, None, True, 0.0, causal, False, scale=scale
    )
    out, lse = res[0], res[1]
    return out.transpose(1, 2).float(), lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def cudnn_bwd_block(dout, q, k, v, lse, delta, causal, scale, dq32, dk32, dv32, *, out):
    """The backward block contract (ring_dist.BwdBlock: dq32 += dq; dk32, dv32 = dk, dv,
    fp32, GQA summed over each group) through SDPA's cuDNN backward, which computes delta itself
    from ``out``: the GLOBAL out of these query rows (``backward(..., pass_out=True)``), with the
    global lse, so each block's P and dS are the final ones."""
    B, Sq, Hq, _ = q.shape
    Sk, group = k.shape[1], Hq // k.shape[2]
    qh, oh, gh = (x.transpose(1, 2) for x in (q, out, dout))
    kh, vh = _expanded(k, group), _expanded(v, group)
    dqh, dkh, dvh = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        gh, qh, kh, vh, oh, lse.reshape(B, Hq, Sq, 1), None, None, None, None, None, Sq, Sk,
        0.0, causal, scale=scale,
    )  # fmt: skip
    dq32 += dqh.transpose(1, 2).float()
    dk32.copy_(_group_sum(dkh, group))
    dv32.copy_(_group_sum(dvh, group))


def flops(S: int, W: int, causal: bool) -> float:
    full = 4.0 * B * H * S * (W * S) * D  # this rank's queries against every key
    return full / 2 if causal else full


def bench_case(world: mkernel.World, S: int, layout: str, causal: bool, bwd: bool) -> dict:
    W, zigzag, scale = world.size, layout == "zigzag", D**-0.5
    g = torch.Generator(device="cuda").manual_seed(world.rank)
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16() for _ in "qkvd")
    ours_fwd, ours_bwd = rd.gpu_engines()
    kv = torch.stack([k, v]).contiguous()
    spare = torch.empty_like(kv)
    if bwd:  # the fp32 accumulators' passes (the forward rows need no such buffers)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
        dkv_spare = torch.empty_like(dkv)

    def traffic():
        for _ in range(W - 1):
            for w in rd._exchange(world, kv, spare):
                w.wait()
        for _ in range(W) if bwd else ():  # the backward's accumulators: W passes, fp32
            for w in rd._exchange(world, dkv, dkv_spare):
                w.wait()

    if bwd:
        out, lse = mkernel.ring_attention(q, k, v, world, causal, None, layout)
        args = (dout, q, k, v, out, lse, None, world, causal, scale, zigzag)
        fns = {
            "ours": lambda: mkernel.ring_attention_backward(
                dout, q, k, v, out, lse, world, causal, None, layout
            ),
            "unfused_cudnn": lambda: rd.backward(*args, cudnn_bwd_block, pass_out=True),
            "compute": lambda: rd.backward(*args, ours_bwd, move=False),
            "traffic": traffic,
        }
    else:
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
    row: dict = {"pass": "bwd" if bwd else "fwd", "S_local": S, "layout": layout}
    row |= {"causal": causal, "W": W, "B": B, "H": H, "D": D}
    row |= {f"{k}_ms": v for k, v in ms.items()}
    row["max_abs_first_grad_or_out_cudnn_vs_ours"] = err
    if ms.get("ours"):
        row["ours_tflops"] = flops(S, W, causal) * (2.5 if bwd else 1.0) / ms["ours"] / 1e9
        ideal = max(ms.get("compute") or 0.0, ms.get("traffic") or 0.0)
        row["ideal_ms"] = ideal
        row["ours_over_ideal"] = ms["ours"] / ideal if ideal else None
        if ms.get("unfused_cudnn"):
            row["ours_over_unfused"] = ms["ours"] / ms["unfused_cudnn"]
    return row


def main(plot: str | None = None) -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = mkernel.World.from_process_group()
    rows = [bench_case(world, *case, bwd) for bwd in (False, True) for case in CASES]
    if world.rank == 0:
        cols = ["pass", "S_local", "layout", "ours_ms", "unfused_cudnn_ms", "compute_ms",
                "traffic_ms", "ours_over_unfused", "ours_over_ideal",
                "max_abs_first_grad_or_out_cudnn_vs_ours"]  # fmt: skip
        print(table(rows, cols))
        print("saved", save(f"ring_w{world.size}", rows))
        draw_run(f"ring_w{world.size}", rows, plot)
    dist.destroy_process_group()


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, torchrun=True, plot=True)
    main(args.plot)
