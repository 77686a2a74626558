"""mkernel.attention and ring_attention on the GPU: the attention engine (one launch for attention,
the unfused per-block path with lse merges for ring attention in emulated worlds) against the
fp64 formula of tests/test_ring_attention.py, with its tolerance plus the bf16 rounding of the
probabilities before P @ V (the engine's wgmma operands). W in 1..8, both layouts, causal or not,
GQA / MQA, D 64 and 128, S_local off the 128-row tile; bad input named before launch; a loop of
1000 calls; CUDA-graph replay with new inputs."""

from __future__ import annotations

import math

import pytest
import torch

import mkernel
from tests.test_ring_attention import _assert_attention, _inputs

pytestmark = pytest.mark.gpu


def _gpu(*xs):
    return [x.cuda() for x in xs]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("S", "heads"), [(1, (2, 2)), (77, (4, 1)), (200, (8, 2)), (513, (2, 2))])
def test_attention_is_the_formula(D, causal, S, heads):
    q, k, v = _inputs(1, 2, S, *heads, D=D, seed=S + D)
    out, lse = mkernel.attention(*_gpu(q[0], k[0], v[0]), causal=causal)
    assert out.is_cuda and lse.is_cuda
    _assert_attention(
        out.cpu()[None], lse.cpu()[None], q, k, v, causal, 1 / math.sqrt(D), "contiguous",
        f"attention D={D} S={S} {heads} causal={causal}", p_bf16=True,
    )  # fmt: skip


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_in_emulated_worlds(W, layout, causal):
    world = mkernel.World.emulated(W, device="cuda")
    S, heads, D = 130, (4, 2), 64
    q, k, v = _inputs(W, 1, S, *heads, D=D, seed=W)
    scale = 0.3
    out, lse = mkernel.ring_attention(*_gpu(q, k, v), world, causal, scale, layout)
    _assert_attention(
        out.cpu(), lse.cpu(), q, k, v, causal, scale, layout, f"W={W} {layout}", p_bf16=True
    )


def test_ring_attention_head_dim_128_batch_2_mqa():
    world = mkernel.World.emulated(3, device="cuda")
    q, k, v = _inputs(3, 2, 256, 4, 1, D=128, seed=7)
    out, lse = mkernel.ring_attention(*_gpu(q, k, v), world, True, None, "zigzag")
    _assert_attention(
        out.cpu(), lse.cpu(), q, k, v, True, 1 / math.sqrt(128), "zigzag", "D=128", p_bf16=True
    )


def test_bad_input_is_named_before_launch():
    q, k, v = _gpu(*_inputs(1, 1, 64, 2, 2))
    with pytest.raises(ValueError, match="D \\(last dim"):
        mkernel.attention(q[0, ..., :32].contiguous(), k[0, ..., :32].contiguous(),
                          v[0, ..., :32].contiguous())  # fmt: skip
    q3, k3, v3 = _gpu(*_inputs(1, 1, 64, 2, 3))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        mkernel.attention(q3[0], k3[0], v3[0])
    world = mkernel.World.emulated(2, device="cuda")
    q2, k2, v2 = _gpu(*_inputs(2, 1, 63, 2, 2))
    with pytest.raises(ValueError, match="zigzag"):
        mkernel.ring_attention(q2, k2, v2, world, True, None, "zigzag")
    with pytest.raises(ValueError, match="scale must be a positive"):
        mkernel.attention(q[0], k[0], v[0], scale=-1.0)


def test_loop_of_1000_calls():
    q, k, v = _inputs(1, 1, 96, 2, 1, seed=3)
    qg, kg, vg = _gpu(q[0], k[0], v[0])
    outs = [mkernel.attention(qg, kg, vg, causal=True) for _ in range(1000)]
    torch.cuda.synchronize()
    for out, lse in (outs[0], outs[-1]):
        _assert_attention(out.cpu()[None], lse.cpu()[None], q, k, v, True, 1 / 8, "contiguous",
                          "loop", p_bf16=True)  # fmt: skip
    assert all(torch.equal(o, outs[0][0]) for o, _ in outs[::97]), "not deterministic"


def test_graph_replay_with_new_inputs():
    q, k, v = _inputs(1, 1, 200, 4, 2, seed=4)
    qg, kg, vg = _gpu(q[0], k[0], v[0])
    mkernel.attention(qg, kg, vg, causal=True)  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mkernel.attention(qg, kg, vg, causal=True)
    for seed in (5, 6):
        q2, k2, v2 = _inputs(1, 1, 200, 4, 2, seed=seed)
        for dst, src in ((qg, q2[0]), (kg, k2[0]), (vg, v2[0])):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_attention(out.cpu()[None], lse.cpu()[None], q2, k2, v2, True, 1 / 8,
                          "contiguous", f"replay {seed}", p_bf16=True)  # fmt: skip
