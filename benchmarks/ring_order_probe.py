"""The forward ring's unit order and K/V pieces (issue 12 diagnostics, one GPU, emulated W = 2).

``python3 benchmarks/ring_order_probe.py``: B = 1, H = 32, D = 128, global S = 8192 (S_local =
4096; contiguous when full, zigzag when causal), intra_sm. Versions differ only in two plan-time
knobs, each with its own cached plan (a distinct ``backoff_ns`` keys it; the waits' backoff does
not matter here): ``sm<P>`` step-major order (chain_order with an infinite lag), ``ch<P>`` the
default chain_order (the cost model's lag), ``ch<P>_0`` chains back to back (lag 0); ``<P>`` the
most pieces a block travels in (ring_attention.MAX_PARTS; the units of a rank cap it, 66 here).
Every version is checked against the default plan, then timed interleaved with the engine and cuDNN
(mkernel.bench.ring_local's method); writes ring_order_probe_<date>.json under
$MKERNEL_BENCH_DIR. ``--landing``: one traced call per piece count, when the pieces land.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from mkernel import World, attention_ext, ring_attention
from mkernel.bench import ring_local
from mkernel.bench.ring_local import B, D, H, S, interleaved_rows, rank_rows
from mkernel.bench.timing import save
from mkernel.ops import ring_attention as ra
from mkernel.schedule import Schedule

FORWARD = {"sm66": (math.inf, 66), "ch66": (None, 66), "ch66_0": (0.0, 66), "ch16": (None, 16)}
_model_lag = ra.block_lag
_knob: dict[str, float | None] = {"lag": None}


def _lag(*args, **kwargs) -> float:
    return _model_lag(*args, **kwargs) if _knob["lag"] is None else _knob["lag"]


ra.block_lag = _lag


def _forward(causal: bool) -> list[tuple[str, bool, dict[str, Callable[[], object]]]]:
    (q, k, v), fns = ring_local.baselines(causal)
    w2 = World.emulated(2, device="cuda")
    layout = "zigzag" if causal else "contiguous"
    ranks = rank_rows((q, k, v), causal)
    ref = ring_attention(*ranks, w2, causal, None, layout, Schedule(overlap="intra_sm"))
    for j, (name, (lag, parts)) in enumerate(FORWARD.items()):
        sched = Schedule(overlap="intra_sm", backoff_ns=2048 + 1 + j)

        def fn(sched=sched, lag=lag, parts=parts):
            _knob["lag"], ra.MAX_PARTS = lag, parts  # read when the plan is built (first call)
            return ring_attention(*ranks, w2, causal, None, layout, sched)

        o, m = fn()
        err = max((o.float() - ref[0].float()).abs().max().item(), (m - ref[1]).abs().max().item())
        plan = next(p for key, p in w2._plans.items() if key[8] == sched.backoff_ns)
        print(f"causal={causal} {name}: lag {plan.extra['lag']:.0f} key rows, "
              f"{plan.extra['parts']} pieces, max diff to the default plan {err:.3g}")  # fmt: skip
        assert err < 2e-2, err
        fns[name] = fn
    return [("W=2", causal, fns)]


def landing() -> None:
    """One traced forward call per piece count: when the K/V pieces land, against the compute."""
    for causal in (False, True):
        q, k, v = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(3))
        ranks, layout = rank_rows((q, k, v), causal), "zigzag" if causal else "contiguous"
        for parts in (16, 66):
            ra.MAX_PARTS = parts
            w2 = World.emulated(2, device="cuda")
            for tr in (False, False, True):
                ring_attention(*ranks, w2, causal, None, layout, Schedule("intra_sm", trace=tr))
            torch.cuda.synchronize()
            spans = w2.last_timeline.spans
            t0 = min(x.start for x in spans)
            comm = sorted((x.end - t0) / 1e3 for x in spans if x.unit.startswith("comm"))
            last = max(x.end - t0 for x in spans if not x.unit.startswith("comm")) / 1e3
            print(f"causal={causal} {parts} pieces: {len(comm)} sends (both ranks) end by "
                  f"{comm[len(comm) // 2]:.1f} us (median), {comm[-1]:.1f} (last); "
                  f"the compute ends at {last:.1f} us")  # fmt: skip


def run() -> None:
    attention_ext.load()
    fwd_flops = lambda causal: 4.0 * B * H * S * S * D / (2 if causal else 1)  # noqa: E731
    rows = interleaved_rows(_forward(False) + _forward(True), fwd_flops, 10, 6.0)
    print("saved", save("ring_order_probe", rows))


if __name__ == "__main__":
    landing() if "--landing" in sys.argv else run()
