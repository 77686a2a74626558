"""The fused ring attention kernel on ONE GPU (issue 12): what the template, the plan and the ring
cost against the attention engine's own launch and cuDNN, before any link is involved.

``python3 -m mkernel.bench.ring_local``: B = 1, H = 32 (Hkv = 32), D = 128, bf16, global S in
{8192} full and causal; rows:
- ``W=1``: ``ring_attention`` in a one-rank emulated world, as a user calls it (``ring_w1``: the
  default Schedule runs the engine, ring_attention.solo_engine) and with the fused kernel
  (``ring_w1_fused``: the plan's chains on the persistent template, Schedule(overlap=RING_OVERLAP),
  the overlap the default schedule had picked) against ``attention_ext.attention_forward`` (the
  engine, one launch) and SDPA's cuDNN backend ([B, H, S, D] contiguous: its faster layout);
- ``W=2``: an emulated world of two ranks sharing the GPU (66 SMs each; S_local = S / 2;
  contiguous when full, zigzag when causal), the K/V block pushed through local memory, for both
  overlaps: the same FLOPs as the W = 1 row, so ``vs_engine`` shows the ring's own cost.
Versions run INTERLEAVED in rounds (median of ROUNDS measurements of >= ~2 ms each). TFLOP/s
counts 4 B H S^2 D (half for causal). Writes ring_local_<date>.json under $MKERNEL_BENCH_DIR.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from .. import World, attention_ext, ring_attention
from ..ops.ring_cost import RING_OVERLAP
from ..schedule import Schedule
from .attention import _bhsd, _event_ms
from .plot import draw_run
from .timing import save, table

B, H, D, S = 1, 32, 128, 8192
ROUNDS = 10
TARGET_MS = 2.0


def baselines(causal: bool) -> tuple[tuple[torch.Tensor, ...], dict[str, Callable[[], object]]]:
    """Fresh q, k, v [B, S, H, D] and the versions every case is measured against: the engine's
    own launch and SDPA's cuDNN backend ([B, H, S, D] contiguous copies: its faster layout)."""
    q, k, v = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return (q, k, v), {
        "engine": lambda: attention_ext.attention_forward(q, k, v, causal, None, out=out, lse=lse),
        "cudnn": lambda: _bhsd(SDPBackend.CUDNN_ATTENTION, qh, kh, vh, causal),
    }


def _case(causal: bool) -> list[tuple[str, bool, dict[str, Callable[[], object]]]]:
    (q, k, v), base = baselines(causal)
    w1, w2 = World.emulated(1, device="cuda"), World.emulated(2, device="cuda")
    fused = Schedule(overlap=RING_OVERLAP)  # the fused kernel at W = 1 (not solo_engine)
    one = dict(base, ring_w1=lambda: ring_attention(q[None], k[None], v[None], w1, causal))
    one["ring_w1_fused"] = lambda: ring_attention(
        q[None], k[None], v[None], w1, causal, None, "contiguous", fused
    )
    layout = "zigzag" if causal else "contiguous"
    ranks = rank_rows((q, k, v), causal)
    two = dict(base)
    for overlap in ("inter_sm", "intra_sm"):
        sched = Schedule(overlap=overlap)
        two[f"ring_w2_{overlap}"] = lambda s=sched: ring_attention(
            *ranks, w2, causal, None, layout, s
        )
    return [("W=1", causal, one), ("W=2", causal, two)]


def rank_rows(xs: tuple[torch.Tensor, ...], causal: bool) -> list[torch.Tensor]:
    """Each [B, S, ...] tensor as [2, B, S / 2, ...]: rank r's rows of the global sequence in a
    two-rank world, contiguous when full, zigzag when causal (4 chunks: rank 0 holds chunks 0 and
    3, rank 1 chunks 1 and 2)."""
    if causal:
        parts = [x.view(x.shape[0], 4, x.shape[1] // 4, *x.shape[2:]) for x in xs]
        return [torch.stack([torch.cat([x[:, r], x[:, 3 - r]], 1) for r in (0, 1)]) for x in parts]
    return [
        x.view(x.shape[0], 2, x.shape[1] // 2, *x.shape[2:]).transpose(0, 1).contiguous()
        for x in xs
    ]


def interleaved_rows(
    cases: list[tuple[str, bool, dict[str, Callable[[], object]]]],
    flops: Callable[[bool], float],
    rounds: int,
    target_ms: float,
) -> list[dict]:
    """Every version of every case timed INTERLEAVED in ``rounds`` rounds (each measurement
    repeats a version to >= ~``target_ms``), one row per version: median ms, TFLOP/s of
    ``flops(causal)``, ratios to the case's ``engine`` and ``cudnn`` versions."""
    reps: dict[tuple[int, str], int] = {}
    for i, (_, _, fns) in enumerate(cases):
        for name, fn in fns.items():
            fn()
            fn()
            reps[(i, name)] = max(1, round(target_ms / max(_event_ms(fn, 1), 1e-3)))
    times: dict[tuple[int, str], list[float]] = {key: [] for key in reps}
    for _ in range(rounds):  # interleaved: every version of every case once per round
        for i, (_, _, fns) in enumerate(cases):
            for name, fn in fns.items():
                times[(i, name)].append(_event_ms(fn, reps[(i, name)]))
    rows = []
    for i, (world, causal, fns) in enumerate(cases):
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
                    "tflops": flops(causal) / ms / 1e9,
                    "vs_engine": eng / ms,
                    "vs_cudnn": cud / ms,
                    "B": B,
                    "H": H,
                    "D": D,
                    "S_global": S,
                }  # fmt: skip
            )
    print(table(rows, ["world", "causal", "version", "ms", "tflops", "vs_engine", "vs_cudnn"]))
    return rows


def run(save_json: bool = True) -> list[dict]:
    attention_ext.load()
    cases = _case(False) + _case(True)
    rows = interleaved_rows(
        cases, lambda causal: 4.0 * B * H * S * S * D / (2 if causal else 1), ROUNDS, TARGET_MS
    )
    if save_json:
        print("saved", save("ring_local", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, plot=True)
    draw_run("ring_local", run(), args.plot)
