"""The fused ring attention BACKWARD on ONE GPU (issue 13): what the template, the plan and the ring
cost against the backward engine's own launches and cuDNN, before any link is involved.

``python3 -m mkernel.bench.ring_local_bwd``: B = 1, H = 32 (Hkv = 32), D = 128, bf16, global
S = 8192, full and causal; versions (``ring_local``'s rows, backward):
- ``engine``: ``attention_ext.attention_backward`` as ``mkernel/bench/attention_bwd.py`` calls it
  (its prep kernel, the backward kernel, dq's fp32 -> bf16);
- ``cudnn``: ``torch.autograd.grad`` through SDPA's cuDNN backend on [B, H, S, D];
- ``ring_w1``: ``ring_attention_backward`` in a one-rank emulated world (the fused kernel);
- ``ring_w2_<overlap>``: an emulated world of two ranks sharing the GPU (S_local = S / 2;
  contiguous when full, zigzag when causal): the same FLOPs, so ``vs_engine`` shows the ring's
  own cost (K/V sends, fp32 dK/dV partials, prep, dq and finish tails).
Versions run INTERLEAVED in rounds (median of ROUNDS measurements of >= ~2 ms each). TFLOP/s
counts 2.5 x the forward's 4 B H S^2 D (half for causal). Writes ring_local_bwd_<date>.json under
$MKERNEL_BENCH_DIR.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from .. import World, attention_ext, ring_attention, ring_attention_backward
from ..schedule import Schedule
from .attention_bwd import _sdpa_backward
from .ring_local import B, D, H, S, interleaved_rows, rank_rows
from .timing import save

ROUNDS = 8
TARGET_MS = 4.0


def _case(causal: bool) -> list[tuple[str, bool, dict[str, Callable[[], object]]]]:
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    base: dict[str, Callable[[], object]] = {
        "engine": lambda: attention_ext.attention_backward(dout, q, k, v, out, lse, causal),
        "cudnn": _sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, dout, causal),
    }
    w1, w2 = World.emulated(1, device="cuda"), World.emulated(2, device="cuda")
    one = dict(base)
    one["ring_w1"] = lambda: ring_attention_backward(
        dout[None], q[None], k[None], v[None], out[None], lse[None], w1, causal
    )
    layout = "zigzag" if causal else "contiguous"
    rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
    rout, rlse = ring_attention(rq, rk, rv, w2, causal, None, layout)
    two = dict(base)
    for overlap in ("inter_sm", "intra_sm"):
        sched = Schedule(overlap=overlap)
        two[f"ring_w2_{overlap}"] = lambda s=sched: ring_attention_backward(
            rdo, rq, rk, rv, rout, rlse, w2, causal, None, layout, s
        )
    return [("W=1", causal, one), ("W=2", causal, two)]


def run(save_json: bool = True) -> list[dict]:
    attention_ext.load()
    cases = _case(False) + _case(True)
    flops = lambda causal: 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)  # noqa: E731
    rows = interleaved_rows(cases, flops, ROUNDS, TARGET_MS)
    if save_json:
        print("saved", save("ring_local_bwd", rows))
    return rows


if __name__ == "__main__":
    run()
