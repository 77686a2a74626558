"""The MoE pair in emulated worlds on the GPU (the unfused path: device routing, grouped GEMM
engine, slot-order combine): the same rows, offsets and sums as tests/test_moe.py expects, W in
1..8, k in {1, 2, 8}, uniform / one-expert / one-rank / no routing, T = 0 and T off the tile, and
a loop of 1000 calls with the routing changing every call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mkernel
from tests.helpers import assert_close_exact
from tests.test_moe import INTER, H, check_dispatch, expected_out, operands, routing

pytestmark = pytest.mark.gpu


def _cpu(res) -> SimpleNamespace:
    return SimpleNamespace(
        y=[y.cpu() for y in res.y],
        src=[s.cpu() for s in res.src],
        expert_offsets=[o.cpu() for o in res.expert_offsets],
    )


def _layer(W: int, T: int, E: int, k: int, mode: str, seed: int, world=None) -> None:
    world = world or mkernel.World.emulated(W, device="cuda")
    x, w1, w2, weights = operands(W, T, E, seed)
    weights = weights[..., :k].contiguous()
    ids = routing(W, T, E, k, mode, seed)
    what = f"W={W} T={T} E={E} k={k} {mode}"
    res = mkernel.moe_dispatch_gemm(x.cuda(), ids.cuda(), w1.cuda(), world)
    assert all(y.is_cuda for y in res.y)
    check_dispatch(_cpu(res), x, ids, w1, E, what)
    h = [torch.relu(y) for y in res.y]
    out = mkernel.moe_gemm_combine(h, w2.cuda(), res, weights.cuda(), world)
    assert out.shape == (W, T, H) and out.dtype == torch.bfloat16 and out.is_cuda
    exact, mag = expected_out([t.cpu() for t in h], w2, ids, weights, E)
    assert_close_exact(out.cpu(), exact, mag, INTER + k, f"{what}: out")
    assert bool((out.cpu()[(ids < 0).all(dim=-1)] == 0).all()), f"{what}: routed nowhere"
    ref = mkernel.reference.moe_dispatch_gemm(x.cuda(), ids.cuda(), w1.cuda(), world)
    for d in range(W):
        assert torch.equal(ref.src[d], res.src[d]) and torch.equal(
            ref.expert_offsets[d], res.expert_offsets[d]
        )


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("mode", ["uniform", "one_expert", "none"])
def test_layer(W, k, mode):
    E = 2
    if W * E < k:
        pytest.skip("k > E")
    for T in (0, 1, 7, 70):
        _layer(W, T, E, k, mode, seed=W * 100 + k * 10 + T)


def test_all_slots_on_rank_zero():
    _layer(4, 33, 3, 2, "rank0", seed=1)


def test_loop_of_1000_calls_with_changing_routing():
    world = mkernel.World.emulated(2, device="cuda")
    W, T, E, k = 2, 24, 2, 2
    x, w1, w2, weights = (t.cuda() for t in operands(W, T, E, 0))
    weights = weights[..., :k].contiguous()
    for i in range(1000):
        ids = routing(W, T, E, k, "uniform", seed=i).cuda()
        res = mkernel.moe_dispatch_gemm(x, ids, w1, world)
        out = mkernel.moe_gemm_combine(res.y, w2, res, weights, world)
        if i % 200 == 199:
            exact, mag = expected_out(
                [y.cpu() for y in res.y], w2.cpu(), ids.cpu(), weights.cpu(), E
            )
            assert_close_exact(out.cpu(), exact, mag, INTER + k, f"call {i}")
