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

import statistics
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from .. import World, attention_ext, ring_attention, ring_attention_backward
from ..schedule import Schedule
from .attention import _event_ms
from .attention_bwd import _sdpa_backward
from .timing import save, table

B, H, D, S = 1, 32, 128, 8192
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
    # rank r's rows: the layout's positions of the global sequence (S_local = S / 2)
    if causal:  # zigzag: 4 chunks; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        parts = [x.view(B, 4, S // 4, *x.shape[2:]) for x in (q, k, v, dout)]
        ranks = [torch.stack([torch.cat([x[:, r], x[:, 3 - r]], 1) for r in (0, 1)]) for x in parts]
    else:
        ranks = [
            x.view(B, 2, S // 2, *x.shape[2:]).transpose(0, 1).contiguous() for x in (q, k, v, dout)
        ]
    rq, rk, rv, rdo = ranks
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
    reps: dict[tuple[int, str], int] = {}
    for i, (_, _, fns) in enumerate(cases):
        for name, fn in fns.items():
            fn()
            fn()
            reps[(i, name)] = max(1, round(TARGET_MS / max(_event_ms(fn, 1), 1e-3)))
    times: dict[tuple[int, str], list[float]] = {key: [] for key in reps}
    for _ in range(ROUNDS):  # interleaved: every version of every case once per round
        for i, (_, _, fns) in enumerate(cases):
            for name, fn in fns.items():
                times[(i, name)].append(_event_ms(fn, reps[(i, name)]))
    rows = []
    for i, (world, causal, fns) in enumerate(cases):
        flops = 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)
        eng = statistics.median(times[(i, "engine")])
        cud = statistics.median(times[(i, "cudnn")])
        for name in fns:
            ms = statistics.median(times[(i, name)])
            rows.append(
                {
                    "world": world,
                    "causal": causal,
                    "version": name,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "vs_engine": eng / ms,
                    "vs_cudnn": cud / ms,
                    "B": B,
                    "H": H,
                    "D": D,
                    "S_global": S,
                }  # fmt: skip
            )
    print(table(rows, ["world", "causal", "version", "ms", "tflops", "vs_engine", "vs_cudnn"]))
    if save_json:
        print("saved", save("ring_local_bwd", rows))
    return rows


if __name__ == "__main__":
    run()
