"""The fused ring attention kernel (kernels/ring_attention.cu: the attention engine on the
persistent template, K/V blocks pushed around the ring into W - 1 slots) in emulated worlds on one
GPU, against the fp64 formula of tests/test_ring_attention.py (its tolerance plus the bf16
rounding of P). Both overlaps, W 1..8, both layouts, causal or not, GQA, D 64 and 128, S_local
off the 128-row tile and chunks shorter than a tile; a silent rank times out naming the signal;
1000 calls in a loop; CUDA-graph replay with new inputs; pads back to zero after every call."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from tests.helpers import assert_pads_zero
from tests.test_ring_attention import _assert_attention, _inputs

pytestmark = pytest.mark.gpu
OVERLAPS = ("intra_sm", "inter_sm")


def _run(W, B, S, heads, D, causal, layout, overlap, seed, scale=None, sms=None, world=None):
    world = world or mkernel.World.emulated(W, device="cuda")
    q, k, v = _inputs(W, B, S, *heads, D=D, seed=seed)
    sched = mkernel.Schedule(overlap=overlap, sms=sms)
    out, lse = mkernel.ring_attention(q.cuda(), k.cuda(), v.cuda(), world, causal, scale, layout,
                                      sched)  # fmt: skip
    torch.cuda.synchronize()
    world.check()
    s = 1 / math.sqrt(D) if scale is None else scale
    what = f"W={W} B={B} S={S} {heads} D={D} causal={causal} {layout} {overlap}"
    _assert_attention(out.cpu(), lse.cpu(), q, k, v, causal, s, layout, what, p_bf16=True)
    assert_pads_zero(world)
    return world


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_ring_is_the_formula(overlap, W, layout, causal):
    _run(W, 1, 130, (4, 2), 64, causal, layout, overlap, seed=W, scale=0.3)


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize(
    ("W", "B", "S", "heads", "D"),
    [(2, 2, 256, (4, 1), 128), (3, 1, 384, (2, 2), 128), (2, 1, 2, (2, 1), 64),
     (4, 1, 70, (8, 2), 128), (2, 1, 1000, (2, 2), 64)],
)  # fmt: skip
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fused_ring_shapes(overlap, W, B, S, heads, D, layout):
    _run(W, B, S, heads, D, True, layout, overlap, seed=S + D)
    _run(W, B, S, heads, D, False, layout, overlap, seed=S + D + 1)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    W=st.integers(1, 5),
    B=st.integers(1, 2),
    S=st.integers(1, 300),
    heads=st.sampled_from([(4, 2), (4, 1), (2, 2), (1, 1), (6, 3)]),
    D=st.sampled_from([64, 128]),
    causal=st.booleans(),
    layout=st.sampled_from(["contiguous", "zigzag"]),
    overlap=st.sampled_from(OVERLAPS),
    sms=st.sampled_from([None, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_fused_ring_over_shapes(W, B, S, heads, D, causal, layout, overlap, sms, seed):
    if layout == "zigzag":
        S += S % 2  # zigzag needs an even S_local
    _run(W, B, S, heads, D, causal, layout, overlap, seed=seed, sms=sms)


def test_few_sms_per_rank_and_two_calls_on_one_world():
    world = _run(3, 1, 300, (2, 1), 64, True, "zigzag", "inter_sm", seed=1, sms=2)
    _run(3, 1, 300, (2, 1), 64, True, "zigzag", "inter_sm", seed=2, sms=2, world=world)
    _run(3, 1, 300, (2, 1), 64, True, "zigzag", "intra_sm", seed=3, sms=1, world=world)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_silent_rank_times_out_naming_landed_and_gpu_stays_usable(overlap):
    W = 3
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.5)
    q, k, v = (x.cuda() for x in _inputs(W, 1, 200, 2, 1, seed=9))
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    t0 = time.perf_counter()
    mkernel.ring_attention(q, k, v, world, True, None, "contiguous", bad)
    with pytest.raises(mkernel.CommTimeout) as e:
        world.check()
    assert time.perf_counter() - t0 < 10
    assert e.value.peer == 1 and "landed" in e.value.signal
    _run(W, 1, 200, (2, 1), 64, True, "contiguous", overlap, seed=9, world=world)


def test_loop_of_1000_calls_and_graph_replay():
    W = 2
    world = mkernel.World.emulated(W, device="cuda")
    q, k, v = _inputs(W, 1, 160, 2, 2, seed=11)
    qg, kg, vg = q.cuda(), k.cuda(), v.cuda()
    outs = [mkernel.ring_attention(qg, kg, vg, world, True, None, "zigzag") for _ in range(1000)]
    torch.cuda.synchronize()
    world.check()
    for out, lse in (outs[0], outs[-1]):
        _assert_attention(out.cpu(), lse.cpu(), q, k, v, True, 1 / 8, "zigzag", "loop",
                          p_bf16=True)  # fmt: skip
    assert all(torch.equal(o, outs[0][0]) for o, _ in outs[::97]), "not deterministic"
    assert_pads_zero(world)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mkernel.ring_attention(qg, kg, vg, world, True, None, "zigzag")
    for seed in (12, 13):
        q2, k2, v2 = _inputs(W, 1, 160, 2, 2, seed=seed)
        for dst, src in ((qg, q2), (kg, k2), (vg, v2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_attention(out.cpu(), lse.cpu(), q2, k2, v2, True, 1 / 8, "zigzag",
                          f"replay {seed}", p_bf16=True)  # fmt: skip
    world.check()
    assert_pads_zero(world)


def test_trace_records_every_task():
    world = mkernel.World.emulated(2, device="cuda")
    q, k, v = (x.cuda() for x in _inputs(2, 1, 256, 2, 1, seed=5))
    sched = mkernel.Schedule(overlap="inter_sm", trace=True)
    mkernel.ring_attention(q, k, v, world, True, None, "contiguous", sched)
    tl = world.last_timeline
    plan = next(p for p in world._plans.values() if p.op == "ring_attention")
    real = sum(
        plan.tiles[t.args[0]].rows > 0 for ts in plan.roles["compute"].tasks for t in ts
    ) + sum(len(ts) for ts in plan.roles["comm"].tasks)
    assert len(tl.spans) == real
