"""The attention backward engine (primitives/attention/bwd_engine.cuh) and ring_attention_backward
on the GPU: gradients against fp64 autograd of the formula (tests/test_ring_attention_backward.py's
``_exact``, with its tolerance plus the bf16 rounding of P and dS, the engine's wgmma operands).
mkernel.attention differentiable on CUDA (D 64 / 128, causal or not, GQA / MQA, B 1-2, S off the
tiles); ring_attention_backward in emulated worlds W 1..8, both layouts, and with lse's gradient;
the launch-level contract (S_q != S_kv, kv tiles no query sees, NaN-poisoned bf16 outputs, the
fp32 accumulate mode); a loop of 300 calls with changing inputs; CUDA-graph replay; bad input
named before launch."""

from __future__ import annotations

import math

import pytest
import torch

import mkernel
from mkernel import attention_ext
from tests.test_ring_attention_backward import _assert_grads, _inputs

pytestmark = pytest.mark.gpu


def _grads_of_attention(q, k, v, dout, causal, scale=None):
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out, lse = mkernel.attention(*leaves, causal=causal, scale=scale)
    out.backward(dout.cuda())
    return [x.grad for x in leaves], out.detach(), lse.detach()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("B", "S", "heads"),
    [(1, 1, (2, 2)), (2, 77, (4, 1)), (1, 200, (8, 2)), (1, 513, (2, 2)), (1, 384, (2, 1))],
)
def test_attention_backward_is_the_formula(D, causal, B, S, heads):
    q, k, v, dout = _inputs(1, B, S, *heads, D=D, seed=S + D + B)
    grads, out, lse = _grads_of_attention(q[0], k[0], v[0], dout[0], causal)
    got = [g.cpu()[None] for g in grads]
    assert all(g.dtype == torch.bfloat16 for g in got)
    what = f"attention D={D} B={B} S={S} {heads} causal={causal}"
    args = (out.cpu()[None], lse.cpu()[None], causal, 1 / math.sqrt(D), "contiguous", what)
    _assert_grads(got, q, k, v, dout, *args, p_bf16=True)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_backward_in_emulated_worlds(W, layout, causal):
    world = mkernel.World.emulated(W, device="cuda")
    q, k, v, dout = _inputs(W, 1, 130, 4, 2, D=64, seed=W)
    qc, kc, vc, dc = (x.cuda() for x in (q, k, v, dout))
    out, lse = mkernel.ring_attention(qc, kc, vc, world, causal, 0.3, layout)
    got = mkernel.ring_attention_backward(dc, qc, kc, vc, out, lse, world, causal, 0.3, layout)
    got = [g.cpu() for g in got]
    what = f"W={W} {layout} causal={causal}"
    _assert_grads(got, q, k, v, dout, out.cpu(), lse.cpu(), causal, 0.3, layout, what, p_bf16=True)


@pytest.mark.parametrize("W", [1, 3])  # 1: the engines alone (ring_attention.solo_engine)
def test_ring_autograd_with_the_gradient_of_lse_d128(W):
    layout = "zigzag"
    world = mkernel.World.emulated(W, device="cuda")
    q, k, v, dout = _inputs(W, 2, 96, 4, 1, D=128, seed=11)
    dlse = torch.randn(W, 2, 4, 96, generator=torch.Generator().manual_seed(2))
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out, lse = mkernel.ring_attention(*leaves, world, causal=True, layout=layout)
    torch.autograd.backward((out, lse), (dout.cuda(), dlse.cuda()))
    got = [x.grad.cpu() for x in leaves]
    args = (out.detach().cpu(), lse.detach().cpu(), True, 1 / math.sqrt(128), layout, "dlse")
    _assert_grads(got, q, k, v, dout, *args, dlse, p_bf16=True)


def _formula(q, k, v, dout, causal, scale):
    """fp64 autograd of top-left-causal attention with S_q != S_kv (GQA by repeat), on the
    inputs' device."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    Q, K, V = leaves
    group = Q.shape[2] // K.shape[2]
    K, V = K.repeat_interleave(group, 2), V.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K) * scale
    if causal:
        i = torch.arange(s.shape[2], device=s.device)[:, None]
        j = torch.arange(s.shape[3], device=s.device)[None, :]
        s = s.masked_fill(j > i, -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), V)
    return torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("D", [64, 128])
def test_launch_contract_unequal_lengths_unseen_tiles_and_accumulate(D, variant):
    g = torch.Generator().manual_seed(D)
    B, S_q, S_kv, Hq, Hkv = 1, 70, 300, 4, 2
    q, dout = (torch.randn(B, S_q, Hq, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, S_kv, Hkv, D, generator=g).bfloat16() for _ in range(2))
    scale = 0.2
    qc, kc, vc, dc = (x.cuda() for x in (q, k, v, dout))
    out, lse = attention_ext.attention_forward(qc, kc, vc, True, scale)
    delta = attention_ext.delta_of(dc, out)
    want = _formula(q, k, v, dout, True, scale)
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk = torch.full(k.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    dv = torch.full_like(dk, float("nan"))
    attention_ext.attention_backward_into(
        dc, qc, kc, vc, lse, delta, True, scale, dq, dk, dv, variant=variant
    )
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
        got = got.float().cpu()
        assert not got.isnan().any(), f"{name}: an unwritten row"
        err = (got.double() - w).abs().max() / w.abs().max()
        assert err < 2e-2, f"{name}: max error {err:.3g} of max |grad|"
    # keys 70.. are after every query: zero gradients, stored
    assert not dk[:, 70:].float().any() and not dv[:, 70:].float().any()
    # fp32 accumulate: dk32 = prior + grad
    prior = torch.randn(k.shape, generator=g).cuda()
    dk32, dv32 = prior.clone(), prior.clone()
    dq.zero_()
    attention_ext.attention_backward_into(
        dc, qc, kc, vc, lse, delta, True, scale, dq, dk32, dv32, accumulate=True, variant=variant
    )
    torch.testing.assert_close(dk32 - prior, dk.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dv32 - prior, dv.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("S", [1, 64, 77, 200])
def test_prep_kernel_packs_the_rows_that_rows_of_makes(S):
    """attention_backward's prep kernel writes variant 0's packed rows itself (lse * log2 e, delta,
    the last q tile padded with +inf / 0); rows_of is the torch statement of that layout."""
    q, k, v, dout = (x[0].cuda() for x in _inputs(1, 2, S, 4, 2, D=64, seed=S))
    out, lse = attention_ext.attention_forward(q, k, v, True)
    lse[0, 1, 0] = -math.inf  # a row that saw nothing: its P must come out 0, not inf
    ext = attention_ext.load()
    delta = torch.full(lse.shape, math.nan, device="cuda")
    dq = torch.empty(q.shape, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = attention_ext._backward_args(
        ext, dout, q, k, v, lse, delta, True, 0.125, dq, dk, dv, False
    )
    args.out = out.data_ptr()
    rows = torch.full((2, 4, -(-S // 64), 2, 64), math.nan, device="cuda")  # poisoned
    args.rows = rows.data_ptr()
    attention_ext._launch(ext, "launch_attention_bwd_prep", args, q.device)
    torch.testing.assert_close(delta, attention_ext.delta_of(dout, out), rtol=1e-5, atol=1e-5)
    assert not dq.any(), "the prep kernel zeroes dq"
    torch.testing.assert_close(rows, attention_ext.rows_of(lse, delta), rtol=1e-6, atol=0)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_variant_1_lanes_stage_rows_agrees_with_variant_0(D, causal):
    q, k, v, dout = (x[0].cuda() for x in _inputs(1, 2, 333, 4, 2, D=D, seed=D + causal))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    want = attention_ext.attention_backward(dout, q, k, v, out, lse, causal)
    got = attention_ext.attention_backward(dout, q, k, v, out, lse, causal, variant=1)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2, msg=name)


def test_loop_of_300_calls_with_changing_inputs():
    sets = []
    for seed in range(3):
        q, k, v, dout = (x[0].cuda() for x in _inputs(1, 1, 300, 4, 2, D=128, seed=seed))
        out, lse = attention_ext.attention_forward(q, k, v, True)
        want = [x.float() for x in attention_ext.attention_backward(dout, q, k, v, out, lse, True)]
        sets.append(((dout, q, k, v, out, lse), want))
    for i in range(300):
        args, want = sets[i % 3]
        got = attention_ext.attention_backward(*args, True)
        if i % 10 == 0 or i >= 297:
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b, atol=1e-2, rtol=1e-2)
    torch.cuda.synchronize()


def test_cuda_graph_replay_with_new_inputs():
    attention_ext.load()
    q, k, v, dout = (x[0].cuda() for x in _inputs(1, 2, 160, 4, 4, D=64, seed=5))
    out, lse = attention_ext.attention_forward(q, k, v, False)
    static = [t.clone() for t in (dout, q, k, v, out, lse)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_ext.attention_backward(*static, False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = attention_ext.attention_backward(*static, False)
    for seed in (6, 7):
        q2, k2, v2, d2 = (x[0].cuda() for x in _inputs(1, 2, 160, 4, 4, D=64, seed=seed))
        o2, l2 = attention_ext.attention_forward(q2, k2, v2, False)
        for dst, src in zip(static, (d2, q2, k2, v2, o2, l2), strict=True):
            dst.copy_(src)
        graph.replay()
        want = attention_ext.attention_backward(d2, q2, k2, v2, o2, l2, False)
        for a, b in zip(grads, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_bad_input_is_named_before_launch():
    q, k, v, dout = (x[0].cuda() for x in _inputs(1, 1, 64, 4, 2, D=64, seed=1))
    out, lse = attention_ext.attention_forward(q, k, v, False)
    with pytest.raises(ValueError, match="shapes do not match"):
        attention_ext.attention_backward(dout[:, :32].contiguous(), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse"):
        attention_ext.attention_backward(dout, q, k, v, out, lse[:, :2].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        attention_ext.attention_backward(dout.transpose(1, 2), q, k, v, out, lse)
    q96 = torch.randn(1, 64, 4, 96, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="head dim"):
        kv96 = q96[:, :, :2].contiguous()
        attention_ext.attention_backward(q96, q96, kv96, kv96, q96, lse)
    dq = torch.zeros(q.shape, device="cuda")
    with pytest.raises(ValueError, match="accumulate"):
        delta = attention_ext.delta_of(dout, out)
        attention_ext.attention_backward_into(
            dout, q, k, v, lse, delta, False, 0.1, dq, torch.empty_like(k), torch.empty_like(v),
            accumulate=True,
        )  # fmt: skip
    world = mkernel.World.emulated(2, device="cuda")
    with pytest.raises(ValueError):
        qq, kk, vv, dd = (x.cuda() for x in _inputs(2, 1, 9, 2, 1, D=64, seed=1))
        o, ls = mkernel.ring_attention(qq, kk, vv, world, True, None, "contiguous")
        mkernel.ring_attention_backward(dd, qq, kk, vv, o, ls, world, True, None, "zigzag")
