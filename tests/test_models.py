"""mkernel.models (issue 36): the Llama / Qwen3-shaped decode step built with TaskGraph, in the
CPU interpreter, against the plain torch decode step (fp32, unsharded weights): 1, 2 and 8
layers, batch 1 and 8, one device and TP over emulated worlds of 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel import models
from tests.helpers import assert_pads_zero
from tests.test_taskgraph import assert_close


@pytest.mark.parametrize(
    "layers, batch, W",
    [(1, 1, None), (2, 8, None), (8, 1, None), (1, 8, 2), (2, 1, 2), (1, 1, 4), (2, 8, 4)],
)
def test_decode_step_matches_torch(layers, batch, W):
    cfg = models.DecoderConfig(layers=layers, heads=8, kv_heads=4)
    weights, final = models.random_decoder(cfg, batch, seq=16, seed=layers + batch)
    world = mkernel.World.emulated(W) if W else None
    g = models.decode_graph(cfg, weights, final, batch, length=11, world=world)
    x = (torch.randn(batch, cfg.hidden, generator=torch.Generator().manual_seed(7))).bfloat16()
    y = g.compile(mkernel.Schedule(seed=batch))(x=x)["y"]
    ref = models.torch_decode(cfg, weights, final, x, length=11)
    ranks = [y] if W is None else list(y)  # a TP world: every rank holds the whole result
    for r, yr in enumerate(ranks):
        assert yr.shape == (batch, cfg.hidden)
        # bf16 values along the chain (2^-9 each), over a stack of `layers` residual blocks
        assert_close(yr, ref, 2.0**-6 * (1 + layers / 4), f"L={layers} B={batch} rank {r}")
    if world is not None:
        assert_pads_zero(world)
        assert all(torch.equal(y[0], y[r]) for r in range(W)), "the ranks agree bit for bit"


def test_tp_decode_has_one_all_reduce_per_row_parallel_linear():
    cfg = models.DecoderConfig(layers=2, heads=8, kv_heads=4)
    weights, final = models.random_decoder(cfg, 1, seq=8)
    g = models.decode_graph(cfg, weights, final, 1, 4, mkernel.World.emulated(2))
    ops = [n.op for n in g.nodes]
    assert ops.count("all_reduce") == 2 * cfg.layers and ops.count("attention_decode") == 2


def test_shard_rejects_heads_the_world_does_not_divide():
    cfg = models.DecoderConfig(heads=4, kv_heads=2)
    weights, final = models.random_decoder(cfg, 1, seq=8)
    with pytest.raises(ValueError, match="kv_heads=2 is not divisible by W=4"):
        models.decode_graph(cfg, weights, final, 1, 4, mkernel.World.emulated(4))
