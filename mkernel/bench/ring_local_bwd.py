"""The fused ring attention BACKWARD on ONE GPU (issue 13): what the template, the plan and the ring
cost against the backward engine's own launches and cuDNN, before any link is involved.

``python3 -m mkernel.bench.ring_local_bwd``: B = 1, H = 32 (Hkv = 32), D = 128, bf16, global
S = 8192, full and causal; versions (``ring_local``'s rows, backward):
- ``engine``: ``attention_ext.attention_backward`` as ``mkernel/bench/attention_bwd.py`` calls it
  (its prep kernel, the backward kernel, dq's fp32 -> bf16);
- ``cudnn``: ``torch.autograd.grad`` through SDPA's cuDNN backend on [B, H, S, D];
- ``ring_w1``: ``ring_attention_backward`` in a one-rank emulated world as a user calls it (the
  default Schedule runs the backward engine, ring_attention.solo_engine); ``ring_w1_fused``: the
  fused kernel there (Schedule(overlap=RING_OVERLAP), the default schedule's former pick);
- ``ring_w2_<overlap>``: an emulated world of two ranks sharing the GPU (S_local = S / 2;
  contiguous when full, zigzag when causal): the same FLOPs, so ``vs_engine`` shows the ring's
  own cost (K/V sends, fp32 dK/dV partials, prep, dq and finish tails).
Versions run INTERLEAVED in rounds (median of ROUNDS measurements of >= ~2 ms each). TFLOP/s
counts 2.5 x the forward's 4 B H S^2 D (half for causal). Writes ring_local_bwd_<date>.json under
$MKERNEL_BENCH_DIR.

``python3 -m mkernel.bench.ring_local_bwd --trace``: where the fused kernel's time goes, one traced
call per case (Schedule(trace=True): every task's start and end on the GPU), per rank and kind of
task (compute: prep, K/V tile, dq, finish; comm: K/V send, grad), us from the first task's start:
first start, last end, the sum of the spans and how many there are.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from .. import World, attention_ext, ring_attention, ring_attention_backward
from ..ops import ring_attention as ra
from ..ops import ring_attention_backward as rb
from ..ops.ring_cost import RING_OVERLAP
from ..schedule import Schedule
from .attention import _event_ms
from .attention_bwd import _sdpa_backward
from .plot import draw_run
from .ring_local import B, D, H, S, interleaved_rows, rank_rows
from .timing import save, span_summary, table

ROUNDS = 8
TARGET_MS = 4.0


def baselines(causal: bool) -> tuple[tuple[torch.Tensor, ...], dict[str, Callable[[], object]]]:
    """Fresh q, k, v, dout [B, S, H, D], the forward's out and lse, and the versions every case
    is measured against: the backward engine's own launch and SDPA's cuDNN backward."""
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    return (q, k, v, dout, out, lse), {
        "engine": lambda: attention_ext.attention_backward(dout, q, k, v, out, lse, causal),
        "cudnn": _sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, dout, causal),
    }


def _case(causal: bool) -> list[tuple[str, bool, dict[str, Callable[[], object]]]]:
    (q, k, v, dout, out, lse), base = baselines(causal)
    w1, w2 = World.emulated(1, device="cuda"), World.emulated(2, device="cuda")
    one = dict(base)
    ones = dout[None], q[None], k[None], v[None], out[None], lse[None]
    one["ring_w1"] = lambda: ring_attention_backward(*ones, w1, causal)
    fused = Schedule(overlap=RING_OVERLAP)  # the fused kernel at W = 1 (not solo_engine)
    one["ring_w1_fused"] = lambda: ring_attention_backward(
        *ones, w1, causal, None, "contiguous", fused
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


def _kind(plan, role: str, task: int) -> str:
    if role == "comm":
        return "kv send" if task < plan.world_size * plan.extra["parts"] else "grad"
    tile = plan.tiles[task]
    if tile.rows == 0:
        return "empty"
    if tile.tag & rb.AUX:
        kinds = {rb.PREP: "prep", rb.DQ: "dq", rb.HOME: "home", rb.FINISH: "finish"}
        return kinds[ra.unpack_tag(tile.tag)[0]]
    return "kv tile"


def backward_args(causal: bool) -> tuple[World, tuple, World, tuple, str]:
    """Fresh inputs of the bench's shapes: a one-rank world and its (dout, q, k, v, out, lse)
    (stacked, out and lse from the engine's forward), an emulated W = 2 world and its ranks' rows
    (out and lse from the ring forward), and W = 2's layout (zigzag when causal)."""
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
    layout = "zigzag" if causal else "contiguous"
    w2 = World.emulated(2, device="cuda")
    rout, rlse = ring_attention(rq, rk, rv, w2, causal, None, layout)
    ones = (dout[None], q[None], k[None], v[None], out[None], lse[None])
    return World.emulated(1, device="cuda"), ones, w2, (rdo, rq, rk, rv, rout, rlse), layout


def trace(overlaps: tuple[str, ...] = ("intra_sm",)) -> list[dict]:
    """One traced call of each case (W = 1; W = 2 per overlap; full and causal): per rank and kind
    of task, us from the first task's start: first start, last end, busy (the sum of the spans:
    K/V tiles overlap, the producer runs the next one's waits early), n."""
    rows = []
    for causal in (False, True):
        w1, ones, w2, twos, layout = backward_args(causal)
        cases = [("W=1", w1, None, ones, "contiguous")]
        for ov in overlaps:
            cases.append((f"W=2 {ov}", w2, ov, twos, layout))
        for name, world, ov, args, lay in cases:
            for tr in (False, False, False, True):  # warm: the plan, the extension, the clocks
                sched = Schedule(overlap=ov, trace=tr)
                ring_attention_backward(*args, world, causal, None, lay, sched)
            torch.cuda.synchronize()
            tl = world.last_timeline
            plan = next(p for p in world._plans.values() if p.op == rb.SPEC.name and
                        p.extra.get("trace") and p.overlap == (ov or "intra_sm"))  # fmt: skip
            t0 = min(x.start for x in tl.spans)
            for r in range(world.size):
                kinds: dict[str, list] = {}
                for x in tl.spans:
                    if x.rank == r:
                        role = "comm" if x.unit.startswith("comm") else "compute"
                        kinds.setdefault(_kind(plan, role, x.task), []).append(x)
                for kind, spans in kinds.items():
                    if kind == "empty":
                        continue
                    ends: dict[str, int] = {}  # per unit: its last span's end
                    for x in spans:
                        ends[x.unit] = max(ends.get(x.unit, 0), x.end)
                    row = {"case": name, "causal": causal, "rank": r, "tasks": kind}
                    row |= span_summary(spans, t0)
                    rows.append(row | {"unit_end_min_us": (min(ends.values()) - t0) / 1e3})
            if name == "W=1":  # the call's time, one call between events (as the rounds) or five

                def fn(args=args, world=world, causal=causal, lay=lay):
                    return ring_attention_backward(*args, world, causal, None, lay)

                t1 = sorted(_event_ms(fn, 1) for _ in range(5))[2]
                t5 = sorted(_event_ms(fn, 5) for _ in range(3))[1]
                torch.cuda.synchronize()
                h0 = time.perf_counter()
                for _ in range(5):
                    fn()
                host = (time.perf_counter() - h0) / 5 * 1e3  # the queue is ahead: host time
                torch.cuda.synchronize()
                print(f"W=1 causal={causal}: ms/call {t1:.3f} (1 a measurement), {t5:.3f} (5); "
                      f"host {host:.3f} ms a call")  # fmt: skip
    cols = ["case", "causal", "rank", "tasks", "n", "first_us", "last_us", "unit_end_min_us"]
    print(table(rows, cols + ["busy_us"]))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(
        __spec__.name, __doc__, {"--trace": "trace one call per case instead of timing"}, plot=True
    )
    if args.trace:
        trace()
    else:
        draw_run("ring_local_bwd", run(), args.plot)
