"""The fused ring attention backward (kernels/ring_attention_backward.cu: the backward engine on
the persistent template, K/V blocks and fp32 dK/dV partials travelling the ring) in emulated worlds
on one GPU, against the fp64 autograd formula of tests/test_ring_attention_backward.py (its
tolerance, with P and dS rounded to bf16 as the engine's wgmma operands are). Both overlaps, W 1..4
(and 8 at one small shape), both layouts, causal or not, GQA, D 64 and 128, S_local off the
128-row K/V tile and the 64-row q tile; outputs are NaN-poisoned by the op, so an unwritten tile
fails; a silent rank times out naming the signal; a loop of 200 calls with changing inputs, each
within the formula's tolerance (the same inputs need not give the same bits: fp32 atomics); pads and
the accumulators (dq_acc, dkv_acc) back to zero after every call."""

from __future__ import annotations

import math
import time

import pytest
import torch

import mkernel
from mkernel import attention_ext
from tests.helpers import assert_pads_zero, assert_within
from tests.test_ring_attention_backward import _assert_grads, _exact, _inputs

pytestmark = pytest.mark.gpu
OVERLAPS = ("intra_sm", "inter_sm")


def _assert_workspace_zero(world) -> None:
    assert_pads_zero(world)
    for key, b in world._buffers.items():
        if "dkv_acc" in str(key) or "dq_acc" in str(key):
            assert not b.local.any(), f"{key} not back to zero"


def _run(W, B, S, heads, D, causal, layout, overlap, seed, scale=None, sms=None, world=None):
    world = world or mkernel.World.emulated(W, device="cuda")
    q, k, v, dout = _inputs(W, B, S, *heads, D=D, seed=seed)
    sched = mkernel.Schedule(overlap=overlap, sms=sms)
    qg, kg, vg, dg = (x.cuda() for x in (q, k, v, dout))
    out, lse = mkernel.ring_attention(qg, kg, vg, world, causal, scale, layout, sched)
    got = mkernel.ring_attention_backward(dg, qg, kg, vg, out, lse, world, causal, scale, layout,
                                          sched)  # fmt: skip
    torch.cuda.synchronize()
    world.check()
    s = 1 / math.sqrt(D) if scale is None else scale
    what = f"W={W} B={B} S={S} {heads} D={D} causal={causal} {layout} {overlap}"
    got = [g.cpu() for g in got]
    _assert_grads(got, q, k, v, dout, out.cpu(), lse.cpu(), causal, s, layout, what, p_bf16=True)
    _assert_workspace_zero(world)
    return world


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("S", "heads", "D"), [(130, (4, 2), 64), (78, (2, 2), 128)])
def test_one_rank_with_the_default_schedule_runs_the_engines(S, heads, D, layout, causal):
    """W = 1 and the default Schedule (ring_attention.solo_engine): no K/V block travels, so the
    forward, the backward and autograd are the attention engines' own launches. Within the
    formula; no plan built; out, lse, dk, dv bit for bit the engines' (dq is summed by fp32
    reduce-adds in arrival order: within the formula only); a Schedule that sets the overlap
    keeps the fused kernel (the tests above)."""
    world = _run(1, 1, S, heads, D, causal, layout, None, seed=S + D)  # against the formula
    assert not world._plans, "the fused kernel's plan was built"
    q, k, v, dout = (x.cuda() for x in _inputs(1, 1, S, *heads, D=D, seed=S))
    out, lse = mkernel.ring_attention(q, k, v, world, causal, None, layout)
    o1, l1 = mkernel.attention(q[0], k[0], v[0], causal)
    assert torch.equal(out[0], o1) and torch.equal(lse[0], l1)
    got = mkernel.ring_attention_backward(dout, q, k, v, out, lse, world, causal, None, layout)
    want = attention_ext.attention_backward(dout[0], q[0], k[0], v[0], o1, l1, causal)
    assert all(g.shape == q.shape[:1] + w.shape for g, w in zip(got, want, strict=True))
    assert torch.equal(got[1][0], want[1]) and torch.equal(got[2][0], want[2])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o2, _ = mkernel.ring_attention(*leaves, world, causal, None, layout)
    o2.backward(dout)
    assert torch.equal(leaves[1].grad, got[1]) and torch.equal(leaves[2].grad, got[2])
    torch.testing.assert_close(leaves[0].grad.float(), got[0].float(), atol=1e-2, rtol=1e-2)
    assert not world._plans


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_is_the_formula(overlap, W, layout, causal):
    _run(W, 1, 130, (4, 2), 64, causal, layout, overlap, seed=W, scale=0.3)


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize(
    ("W", "B", "S", "heads", "D"),
    [(2, 2, 256, (4, 1), 128), (3, 1, 200, (2, 2), 128), (2, 1, 2, (2, 1), 64),
     (4, 1, 70, (8, 2), 128), (8, 1, 36, (2, 1), 64)],
)  # fmt: skip
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fused_backward_shapes(overlap, W, B, S, heads, D, layout):
    _run(W, B, S, heads, D, True, layout, overlap, seed=S + D)
    _run(W, B, S, heads, D, False, layout, overlap, seed=S + D + 1)


def test_few_sms_per_rank_and_calls_on_one_world():
    world = _run(3, 1, 150, (2, 1), 64, True, "zigzag", "inter_sm", seed=1, sms=2)
    _run(3, 1, 150, (2, 1), 64, True, "zigzag", "intra_sm", seed=2, sms=1, world=world)
    _run(3, 1, 150, (2, 1), 128, False, "contiguous", "intra_sm", seed=3, world=world)


def test_autograd_runs_the_fused_backward():
    W, layout = 2, "zigzag"
    world = mkernel.World.emulated(W, device="cuda")
    q, k, v, dout = _inputs(W, 1, 96, 4, 2, D=64, seed=21)
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out, lse = mkernel.ring_attention(*leaves, world, True, None, layout)
    out.backward(dout.cuda())
    got = [x.grad.cpu() for x in leaves]
    _assert_grads(got, q, k, v, dout, out.detach().cpu(), lse.detach().cpu(), True, 1 / 8, layout,
                  "autograd", p_bf16=True)  # fmt: skip
    _assert_workspace_zero(world)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_silent_rank_times_out_naming_the_signal_and_gpu_stays_usable(overlap):
    W = 3
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.5)
    q, k, v, dout = (x.cuda() for x in _inputs(W, 1, 200, 2, 1, seed=9))
    out, lse = mkernel.ring_attention(q, k, v, world, True, None, "contiguous")
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    t0 = time.perf_counter()
    mkernel.ring_attention_backward(dout, q, k, v, out, lse, world, True, None, "contiguous", bad)
    with pytest.raises(mkernel.CommTimeout) as e:
        world.check()
    assert time.perf_counter() - t0 < 10
    # the root wait reports first: a K/V block (or rank 1's own prep) that never landed
    assert e.value.peer == 1 and e.value.signal.startswith("landed"), e.value
    _run(W, 1, 200, (2, 1), 64, True, "contiguous", overlap, seed=9, world=world)


def test_loop_of_calls_with_changing_inputs_is_stable():
    """200 calls, the inputs changing every call (4 sets in turn): every call's results within the
    fp64 formula's tolerance. dK, dV and dQ are sums of fp32 red.add / TMA reduce-adds whose order
    differs between calls, so the same inputs need not give the same bits: the test prints how many
    calls did, and the largest difference to the first call on the same inputs."""
    W, S, layout = 2, 160, "zigzag"
    world = mkernel.World.emulated(W, device="cuda")
    inputs, exact = [], []
    for seed in range(4):
        q, k, v, dout = _inputs(W, 1, S, 2, 2, seed=30 + seed)
        qg, kg, vg, dg = (x.cuda() for x in (q, k, v, dout))
        out, lse = mkernel.ring_attention(qg, kg, vg, world, True, None, layout)
        inputs.append((dg, qg, kg, vg, out, lse))
        exact.append(_exact(q, k, v, dout, out.cpu(), lse.cpu(), True, 1 / 8, layout, p_bf16=True))
    results = [mkernel.ring_attention_backward(*inputs[i % 4], world, True, None, layout)
               for i in range(200)]  # fmt: skip
    torch.cuda.synchronize()
    world.check()
    same, worst = 0, 0.0
    for i, got in enumerate(results):
        for name, g, (x, tol) in zip("dq dk dv".split(), got, exact[i % 4], strict=True):
            assert_within(g.cpu(), x, tol, f"call {i}: {name}")
        first = results[i % 4]
        same += all(torch.equal(a, b) for a, b in zip(got, first, strict=True))
        worst = max(
            worst,
            *((a.float() - b.float()).abs().max().item() for a, b in zip(got, first, strict=True)),
        )
    print(f"{same} of {len(results)} calls gave the bits of the first call on their inputs; "
          f"largest difference {worst:.3g}")  # fmt: skip
    _assert_workspace_zero(world)


def test_graph_replay_with_new_inputs():
    """The fused backward captured once (forward outside the graph) and replayed over new dout, q,
    k, v and their forward's out and lse, copied into the captured tensors: each replay's grads
    within the formula's tolerance; pads and accumulators back to zero."""
    W, S, layout = 2, 160, "zigzag"
    world = mkernel.World.emulated(W, device="cuda")
    q, k, v, dout = _inputs(W, 1, S, 2, 2, seed=40)
    qg, kg, vg, dg = (x.cuda() for x in (q, k, v, dout))
    out, lse = mkernel.ring_attention(qg, kg, vg, world, True, None, layout)
    mkernel.ring_attention_backward(dg, qg, kg, vg, out, lse, world, True, None, layout)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = mkernel.ring_attention_backward(dg, qg, kg, vg, out, lse, world, True, None, layout)
    for seed in (41, 42):
        q2, k2, v2, d2 = _inputs(W, 1, S, 2, 2, seed=seed)
        o2, l2 = mkernel.ring_attention(q2.cuda(), k2.cuda(), v2.cuda(), world, True, None, layout)
        for dst, src in ((qg, q2), (kg, k2), (vg, v2), (dg, d2), (out, o2), (lse, l2)):
            dst.copy_(src)
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        world.check()
        got = [g.cpu() for g in grads]
        _assert_grads(got, q2, k2, v2, d2, o2.cpu(), l2.cpu(), True, 1 / 8, layout,
                      f"replay {seed}", p_bf16=True)  # fmt: skip
    _assert_workspace_zero(world)
