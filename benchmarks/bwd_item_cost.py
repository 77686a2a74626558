"""What one work item of the attention backward costs beyond its steps (issue 13 diagnostics).

The fused ring backward at W = 2 runs twice the items of W = 1 (each walking half the q rows) and
its K/V tile phase takes ~0.6 ms longer on the same FLOPs. Two measurements tell whether a fixed
cost per item explains it:

1. the backward engine's own launch (``attention_backward_into``, full attention, B = 1, H = 32,
   D = 128) on shapes of equal FLOPs, S_q x S_kv = 8192^2, with 1024 .. 8192 items of 256 .. 32
   q steps; interleaved rounds; a least-squares fit of time = items * o / SMs + steps * c / SMs;
2. one traced call of the fused kernel per case (W = 1 and emulated W = 2, full and causal): a
   unit's item time is the gap between the ends of its consecutive K/V tile tasks; fit
   time = o + c * steps (a step: 64 q rows of one q head against the item's 128 K/V rows).

``python3 benchmarks/bwd_item_cost.py``; prints both tables.
"""

from __future__ import annotations

import statistics
import sys

import torch

from mkernel import attention_ext, ring_attention_backward
from mkernel.bench.attention import _event_ms
from mkernel.bench.ring_local import B, D, H
from mkernel.bench.ring_local_bwd import backward_args
from mkernel.ops import ring_attention as ra
from mkernel.ops import ring_attention_backward as rb
from mkernel.schedule import Schedule

SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1


def fit(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a * x0 + b * x1: (a, b)."""
    a = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    sol = torch.linalg.lstsq(a, y).solution
    return float(sol[0]), float(sol[1])


def engine_shapes() -> None:
    shapes = [(16384, 4096), (8192, 8192), (4096, 16384), (2048, 32768)]
    fns = {}
    for s_q, s_kv in shapes:
        q, dout = (torch.randn(B, s_q, H, D, device="cuda").bfloat16() for _ in range(2))
        k, v = (torch.randn(B, s_kv, H, D, device="cuda").bfloat16() for _ in range(2))
        out, lse = attention_ext.attention_forward(q, k, v, False)
        delta = attention_ext.delta_of(dout, out)
        dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        fns[(s_q, s_kv)] = lambda a=(dout, q, k, v, lse, delta), o=(dq, dk, dv): (
            attention_ext.attention_backward_into(*a, False, D**-0.5, *o)
        )
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for f in fns.values():
        f()
    for _ in range(8):
        for s, f in fns.items():
            times[s].append(_event_ms(f, 3))
    xs, ys = [], []
    print("engine: S_q x S_kv, items, steps an item, ms")
    for s_q, s_kv in shapes:
        items, steps = B * H * s_kv // 128, s_q // 64
        ms = statistics.median(times[(s_q, s_kv)])
        xs.append((items / SMS, items * steps / SMS))
        ys.append(ms * 1e3)
        print(f"  {s_q:6d} x {s_kv:6d}  {items:5d}  {steps:4d}  {ms:.3f}")
    o, c = fit(xs, ys)
    print(f"engine fit: {o:.1f} us an item, {c:.3f} us a step")


def _steps(plan, tile) -> int:
    """q steps of a K/V tile task: 64-row q tiles of each q head it walks."""
    diag = bool(tile.tag & 1)  # ring_attention.pack_tag's bit 0; cols: the q chunk's rows
    group = plan.shapes["heads"] // plan.shapes["kv_heads"]
    return group * -(-(tile.cols - (tile.m0 if diag else 0)) // 64)


def fused_traces() -> None:
    print("fused: case, items, item us (median), fit o us, fit c us a step")
    for causal in (False, True):
        w1, ones, w2, twos, layout = backward_args(causal)
        for name, world, args, lay in (("W=1", w1, ones, "contiguous"), ("W=2", w2, twos, layout)):
            for tr in (False, False, True):
                ring_attention_backward(
                    *args, world, causal, None, lay, Schedule(overlap="intra_sm", trace=tr)
                )
            torch.cuda.synchronize()
            tl = world.last_timeline
            plan = next(
                p
                for p in world._plans.values()
                if p.op == rb.SPEC.name and p.extra.get("trace") and p.overlap == "intra_sm"
            )
            per_unit: dict[tuple[int, str], list] = {}
            for x in tl.spans:
                if x.unit.startswith("comm"):
                    continue
                per_unit.setdefault((x.rank, x.unit), []).append(x)
            xs, ys, cats, when = [], [], [], []
            t0 = min(x.start for x in tl.spans)
            ends: dict[tuple[int, str], tuple[float, int]] = {}
            for key, spans in per_unit.items():
                spans.sort(key=lambda x: x.end)
                prev, n = None, 0
                for x in spans:
                    tile = plan.tiles[x.task]
                    kv = tile.rows and not tile.tag & rb.AUX
                    if kv and prev is not None:
                        xs.append((1.0, float(_steps(plan, tile))))
                        ys.append((x.end - prev) / 1e3)
                        cats.append((ra.unpack_tag(tile.tag)[1], tile.tag & 1))  # (step, diag)
                        when.append((x.end - t0) / 1e3)
                    if kv:
                        n += 1
                        ends[key] = ((x.end - t0) / 1e3, n)
                    prev = x.end
            o, c = fit(xs, ys)
            print(f"  {name} causal={causal}: {len(ys)} items, median {statistics.median(ys):.1f}"
                  f" us, o {o:.1f} us, c {c:.3f} us a step")  # fmt: skip
            res: dict[tuple[int, int], list[float]] = {}
            for (_, st), y, cat in zip(xs, ys, cats, strict=True):
                res.setdefault(cat, []).append(y - o - c * st)
            for cat, r in sorted(res.items()):
                print(f"    step {cat[0]} diag {cat[1]}: {len(r)} items, residual median "
                      f"{statistics.median(r):.1f} us, p10 {sorted(r)[len(r) // 10]:.1f}, p90 "
                      f"{sorted(r)[len(r) * 9 // 10]:.1f}")  # fmt: skip
            by_time: dict[int, list[float]] = {}  # residuals by when the item ended, 250 us bins
            for (_, st), y, t in zip(xs, ys, when, strict=True):
                by_time.setdefault(int(t // 250), []).append(y - o - c * st)
            print("    residual by end time (us bin: items, median, p90): " + ", ".join(
                f"{b * 250}: {len(r)}, {statistics.median(r):.0f}, "
                f"{sorted(r)[len(r) * 9 // 10]:.0f}"
                for b, r in sorted(by_time.items())))  # fmt: skip
            order = sorted(ends.items(), key=lambda kv: kv[1][0])
            for rank in range(world.size):
                mine = [(k[1], e, n) for k, (e, n) in order if k[0] == rank]
                print(f"    rank {rank} units' last K/V tile end (us, items): first "
                      f"{mine[:4]}, last {mine[-4:]}")  # fmt: skip
            # does hosting comm tasks (intra_sm: the unit's spare warp) make a unit late?
            kv_sends = world.size * plan.extra["parts"]
            hosts: dict[tuple[int, str], set[str]] = {}
            for x in tl.spans:
                if x.unit.startswith("comm"):
                    kind = "kv" if x.task < kv_sends else "grad"
                    hosts.setdefault((x.rank, x.unit.replace("comm", "compute")), set()).add(kind)
            groups: dict[str, list[float]] = {}
            for key, (e, _) in ends.items():
                kinds = hosts.get(key, set())
                label = "+".join(sorted(kinds)) or "none"
                groups.setdefault(label, []).append(e)
            head = "    last K/V tile end by hosted comm (kind: units, mean us, min, max): "
            print(head + ", ".join(
                f"{k}: {len(v)}, {statistics.mean(v):.0f}, {min(v):.0f}, {max(v):.0f}"
                for k, v in sorted(groups.items())))  # fmt: skip


if __name__ == "__main__":
    attention_ext.load()
    if "--fused" not in sys.argv:
        engine_shapes()
    fused_traces()
