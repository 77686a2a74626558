"""Small launches of every fused op for compute-sanitizer (the GPU test flow runs it under memcheck,
racecheck and synccheck; each must report 0 errors):

    compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu/sanitize_ops.py

Emulated worlds of W = 2 and 3 on one GPU (and W = 1 for the ring backward, whose engine stores
dk and dv itself there), both overlaps, shapes with remainder tiles (ring attention, forward and
backward: a partial q tile in each zigzag chunk; MoE: tiles past an expert's rows); each result
is checked against the reference, so a launch that the tool perturbs still has to be right."""

from __future__ import annotations

import dataclasses
import sys

import torch

import mkernel
from mkernel.runtime import registry
from tests.gpu.test_moe_fused_gpu import run as moe_layer
from tests.helpers import assert_close_bf16
from tests.test_ring_attention import _assert_attention
from tests.test_ring_attention_backward import _assert_grads
from tests.test_ring_attention_backward import _inputs as _bwd_inputs


def main(only: list[str]) -> int:
    """``only``: op names to run (default: every op with a kernel)."""
    g = torch.Generator().manual_seed(0)
    for W in (1, 2, 3):
        world = mkernel.World.emulated(W, device="cuda", timeout_s=20.0)
        for overlap in ("intra_sm", "inter_sm"):
            sched = mkernel.Schedule(overlap=overlap, sms=4, tile="128x128x64")
            for op in [op for op in registry.device_names() if not only or op in only]:
                if W == 1 and op != "ring_attention_backward":
                    continue
                if op == "ring_attention":
                    ring(world, sched, g)
                    print(f"ok {op} W={W} {overlap}", flush=True)
                    continue
                if op == "ring_attention_backward":
                    ring_backward(world, sched)
                    print(f"ok {op} W={W} {overlap}", flush=True)
                    continue
                if op.startswith("moe_"):  # both MoE ops: dispatch -> relu -> combine, checked
                    if op == "moe_dispatch_gemm":
                        moe_layer(W, 37, 2, 2, "uniform", 3, overlap=overlap, sms=4, world=world)
                        print(f"ok moe (both ops) W={W} {overlap}", flush=True)
                    continue
                rows = 72 if op in ("ag_gemm", "all_gather") else 72 * W  # per-rank rows of a
                a = torch.randn(W, rows, 40, generator=g).bfloat16().cuda()
                b = torch.randn(W, 40, 136, generator=g).bfloat16().cuda()
                args = (a,) if op == "all_gather" else (a, b)
                ref = getattr(mkernel.reference, op)(*args, world)
                # ag_gemm inter_sm also pushes by TMA (its comm CTAs' BulkRing)
                tma = op == "ag_gemm" and overlap == "inter_sm"
                for transfer in ("stores", "tma") if tma else (None,):
                    s = dataclasses.replace(sched, transfer=transfer)
                    out = getattr(mkernel, op)(*args, world, s)
                    torch.cuda.synchronize()
                    assert_close_bf16(out, ref, f"{op} W={W} {transfer}")
                    print(f"ok {op} W={W} {overlap} {transfer or ''}", flush=True)
    return 0


def ring(world: mkernel.World, sched: mkernel.Schedule, g: torch.Generator) -> None:
    """Ring attention, causal zigzag (two chunks, a partial q tile) and full, GQA."""
    W = world.size
    q = torch.randn(W, 1, 140, 4, 64, generator=g).bfloat16().cuda()
    k = torch.randn(W, 1, 140, 2, 64, generator=g).bfloat16().cuda()
    v = torch.randn(W, 1, 140, 2, 64, generator=g).bfloat16().cuda()
    for causal, layout in ((True, "zigzag"), (False, "contiguous")):
        out, lse = mkernel.ring_attention(q, k, v, world, causal, None, layout, sched)
        torch.cuda.synchronize()
        what = f"ring_attention W={W} {layout}"
        x = (t.cpu() for t in (out, lse, q, k, v))
        _assert_attention(*x, causal, 1 / 8, layout, what, p_bf16=True)


def ring_backward(world: mkernel.World, sched: mkernel.Schedule) -> None:
    """Ring attention backward, causal zigzag (two chunks, partial q and K/V tiles), full, and
    causal contiguous (the last rank's engine stores its dk, dv), GQA, against the fp64 formula."""
    W = world.size
    q, k, v, dout = _bwd_inputs(W, 1, 140, 4, 2, D=64, seed=W)
    qg, kg, vg, dg = (x.cuda() for x in (q, k, v, dout))
    for causal, layout in ((True, "zigzag"), (False, "contiguous"), (True, "contiguous")):
        out, lse = mkernel.ring_attention(qg, kg, vg, world, causal, None, layout, sched)
        got = mkernel.ring_attention_backward(dg, qg, kg, vg, out, lse, world, causal, None,
                                              layout, sched)  # fmt: skip
        torch.cuda.synchronize()
        what = f"ring_attention_backward W={W} {layout}"
        got = [x.cpu() for x in got]
        _assert_grads(got, q, k, v, dout, out.cpu(), lse.cpu(), causal, 1 / 8, layout, what,
                      p_bf16=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
