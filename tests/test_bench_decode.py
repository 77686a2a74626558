"""The decode benchmark's baselines compute the model TaskGraph builds (mkernel.models), and its
bound counts the bytes the step reads, on the CPU (the timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from mkernel.bench import decode
from mkernel.models import DecoderConfig, decode_graph, random_decoder, torch_decode


@pytest.mark.parametrize("batch, length", [(1, 5), (3, 8)])
def test_the_eager_baseline_is_the_models_step(batch, length):
    cfg = DecoderConfig(layers=2)
    layers, final = random_decoder(cfg, batch, seq=8, seed=1)
    x = torch.randn(batch, cfg.hidden).bfloat16()
    want = torch_decode(cfg, layers, final, x, length)
    got = decode.eager_step(cfg, layers, final, length)(x).float()
    # bf16 values between the ops: a few bf16 ulps of the output's scale
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    g = decode_graph(cfg, layers, final, batch, length).compile()
    tg = g(x=x)["y"].float()
    assert (tg - want).abs().max() <= 0.05 * want.abs().max()


def test_the_bound_counts_every_weight_and_the_attended_cache_once():
    cfg = DecoderConfig(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=6, layers=3)
    layers, final = random_decoder(cfg, batch=2, seq=10, seed=0)
    weights = sum(
        t.numel() * 2
        for ly in layers
        for t in (ly.attn_norm, ly.wq, ly.wo, ly.mlp_norm, ly.wg, ly.wu, ly.wd)
    )
    cache = sum(2 * ly.k_cache[:, :, :7].numel() * 2 for ly in layers)
    assert decode.step_bytes(cfg, 2, 7) == weights + cache + final.numel() * 2


def test_cases_parse_batch_x_kv_and_refuse_anything_else():
    assert decode.parse_cases("1x1024, 8x4096") == [(1, 1024), (8, 4096)]
    for bad in ("1024", "1x", "0x1024", "ax2", "1x1024,"):
        with pytest.raises(ValueError, match="BATCHxKV"):
            decode.parse_cases(bad)
