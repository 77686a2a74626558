"""A call that timed out leaves no result that looks valid (issue 33.2), on the GPU: calls are
asynchronous, so a silent rank's call returns at once; once its kernel has ended, every float
output of the call (the caller's ``out`` included; ring attention's out and lse; the MoE pair's y
and out) holds NaN (kernels/poison.cu runs after every fused launch), the next call on the world
raises CommTimeout naming rank, peer and signal before launching anything, and the call after it
is correct. A rank that is late within the deadline is not poisoned."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, gemm_inputs
from tests.test_moe import routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPS = {  # op: (rows of a per rank, per-rank result shape) at W = 3, N = 64, K = 16
    "gemm_rs": (3 * 64, (64, 64)),
    "ag_gemm": (64, (3 * 64, 64)),
    "gemm_ar": (3 * 64, (3 * 64, 64)),
}
OVERLAPS = ["intra_sm", "inter_sm"]


def _silent(overlap: str) -> mkernel.Schedule:
    return mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))


def _next_call_raises(world, call) -> mkernel.CommTimeout:
    with pytest.raises(mkernel.CommTimeout) as e:
        call()
    v = e.value
    assert v.peer == 1 and v.signal and f"rank {v.rank}" in str(v) and "peer 1" in str(v), str(v)
    return v


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_gemm_ops_timed_out_output_is_nan(op, overlap):
    W = 3
    rows, shape = OPS[op]
    a, b = (x.cuda() for x in gemm_inputs(W, rows, 64, 16, 7))
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.3)
    fn = getattr(mkernel, op)
    out = torch.randn(W, *shape, device="cuda").bfloat16()  # finite before the call
    fn(a, b, world=world, schedule=_silent(overlap), out=out)  # returns at once
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all(), f"{op}: the timed-out call's out is not all NaN"
    # the next call raises before it launches, naming the wait
    _next_call_raises(world, lambda: fn(a, b, world=world))
    good = fn(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap))
    assert_close_bf16(good, getattr(mkernel.reference, op)(a, b, world=world), op)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_ring_attention_timed_out_out_and_lse_are_nan(overlap):
    W, B, S, H, D = 3, 1, 3 * 64, 2, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(W, B, S // W, H, D, generator=g).bfloat16().cuda() for _ in range(3))
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.3)
    out, lse = mkernel.ring_attention(q, k, v, world, causal=True, schedule=_silent(overlap))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()
    _next_call_raises(world, lambda: mkernel.ring_attention(q, k, v, world, causal=True))
    out, lse = mkernel.ring_attention(q, k, v, world, causal=True)
    world.check()
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_moe_timed_out_rows_are_nan(overlap):
    W, T, E, k, H, N = 2, 20, 2, 2, 64, 128
    g = torch.Generator().manual_seed(4)
    x = torch.randn(W, T, H, generator=g).bfloat16().cuda()
    w1 = (torch.randn(W, E, H, N, generator=g) / H**0.5).bfloat16().cuda()
    ids = routing(W, T, E, k, "uniform", 1).cuda()  # rank 1's tokens feed rank 0's experts
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.3)
    res = mkernel.moe_dispatch_gemm(x, ids, w1, world, _silent(overlap))
    torch.cuda.synchronize()
    assert all(torch.isnan(y.float()).all() for y in res.y if y.numel()), "dispatch y"
    _next_call_raises(world, lambda: mkernel.moe_dispatch_gemm(x, ids, w1, world))
    res = mkernel.moe_dispatch_gemm(x, ids, w1, world)
    w2 = torch.randn(W, E, N, H, generator=g).bfloat16().cuda()
    weights = torch.rand(W, T, k, generator=g).cuda()
    out = mkernel.moe_gemm_combine(res.y, w2, res, weights, world, _silent(overlap))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all(), "combine out"
    _next_call_raises(world, lambda: mkernel.moe_gemm_combine(res.y, w2, res, weights, world))


def test_late_rank_within_the_deadline_is_not_poisoned():
    W = 3
    a, b = (x.cuda() for x in gemm_inputs(W, 3 * 64, 64, 16, 8))
    world = mkernel.World.emulated(W, device="cuda")
    late = mkernel.Schedule(faults=mkernel.Faults(delay_rank=2, delay_us=2000))
    for _ in range(3):
        out = mkernel.gemm_ar(a, b, world=world, schedule=late)
    world.check()
    assert_close_bf16(out, mkernel.reference.gemm_ar(a, b, world=world), "late rank")
