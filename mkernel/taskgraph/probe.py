"""A short timing probe of TaskGraph's GPU kernel (not the benchmark: mkernel.bench.decode is):
``python -m mkernel.taskgraph.probe`` prints, interleaved in rounds on one GPU, the device copy
rate, the GEMV of a bf16 weight through a one-linear graph against torch.matmul (GB/s of weight
streamed), and a Qwen3-shaped decode graph's one launch against the eager fallback (torch ops
per task) and against its HBM bound (bytes read / copy rate). ``--trace [--batch B]
[--no-fuse] [--chrome PATH]`` prints instead, per node of the decode graph, how long its tasks
ran once their inputs were ready, how late they started, and what each node adds to the launch
(one Schedule(trace=True) launch: ``node_times``; PATH: its timeline for Perfetto)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import NamedTuple

import torch

from ..models import DecoderConfig, decode_graph, random_decoder
from ..schedule import Schedule
from .compiled import compile_graph
from .device import gpu_blocks
from .graph import TaskGraph

bf16 = torch.bfloat16


def _time(fn, iters: int) -> float:
    """Median of 5 timings of ``iters`` back-to-back calls (seconds per call). The calls are
    queued behind a sleeping kernel, so the device runs them back to back (device time, not the
    host's enqueue time, unless the host is slower than the calls)."""
    fn()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # ~10 ms: longer than enqueueing the calls
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / iters)
    return sorted(out)[2]


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(bf16)


def qwen3_shaped(layers: int) -> DecoderConfig:
    """Qwen3-8B's layer shapes (hidden 4096, 32 / 8 heads of 128, MLP 12288), ``layers`` deep."""
    return DecoderConfig(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, layers=layers
    )


def node_times(
    graph: TaskGraph,
    inputs: dict,
    schedule: Schedule | None = None,
    chrome: str | Path | None = None,
    **kw,
) -> list[dict]:
    """One traced launch of ``graph`` (``Schedule(trace=True)``, rank 0; ``kw`` go to
    compile_graph: ``fuse``, ``device``), per live node, in ns (ticks in the CPU interpreter):

    - ``run``: its tasks' times from the moment their inputs were ready (the last end of the tasks
      each waits for, or its own start if later) to their end, median and max;
    - ``late``: how long after its inputs were ready a task started (its unit was still busy with
      an earlier task), median; ``waited``: how long a task that started first waited, median;
    - ``last_end``, and ``adds``: its last end past the previous node's (what the node adds to
      the launch past the nodes before it: the stages of the critical path; 0 for one that ends
      before an earlier node).

    ``chrome``: also write the launch's timeline there as Chrome trace-event JSON (Perfetto), each
    task named by its op and tile (``Lowered.describe``).
    """
    sched = Schedule(trace=True) if schedule is None else schedule
    k = compile_graph(graph, sched, **kw)
    k(**inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timeline = k.world.last_timeline
    if chrome is not None:
        trace = timeline.to_chrome()
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                e["name"] = k.lowered.describe(e["args"]["task"])
        Path(chrome).write_text(json.dumps(trace))
    span = {s.task: (s.start, s.end) for s in timeline.spans if s.rank == 0}
    deps = {i: [j for q, j in d if q == 0] for i, d in enumerate(k.lowered.deps[0])}
    per: dict[int, list[_TaskTime]] = {}
    for i, t in enumerate(k.lowered.tasks[0]):
        start, end = span[i]
        ready = max((span[j][1] for j in deps[i]), default=0)
        late, waited = max(0, start - ready), max(0, ready - start)
        per.setdefault(t.node, []).append(_TaskTime(end - max(start, ready), end, late, waited))
    rows, prev = [], 0
    for n, v in per.items():
        last = max(x.end for x in v)
        rows.append(
            {
                "node": n,
                "op": k.lowered.nodes[n].op,
                "tasks": len(v),
                "run_median_ns": statistics.median(x.run for x in v),
                "run_max_ns": max(x.run for x in v),
                "late_median_ns": statistics.median(x.late for x in v),
                "waited_median_ns": statistics.median(x.waited for x in v),
                "last_end_ns": last,
                "adds_ns": max(0, last - prev),
            }
        )
        prev = max(prev, last)
    return rows


class _TaskTime(NamedTuple):
    run: int  # from its inputs ready (or its start, if later) to its end
    end: int
    late: int  # its start past its inputs ready
    waited: int  # its inputs ready past its start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m mkernel.taskgraph.probe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--trace", action="store_true", help="per node of the decode graph: run times")
    p.add_argument("--batch", type=int, default=1, help="--trace: the batch")
    p.add_argument("--no-fuse", action="store_true", help="--trace: norms and SiLUs as own tasks")
    p.add_argument("--chrome", metavar="PATH", help="--trace: the timeline as Chrome trace JSON")
    args = p.parse_args(argv)
    if args.trace:
        return _trace(args)
    res: dict = {"device": torch.cuda.get_device_name()}
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    gemvs, extra = {}, {}
    for N, K in ((12288, 4096), (4096, 12288)):
        w = _rand(N, K, scale=K**-0.5)
        for B in (1, 8, 16):
            g = TaskGraph()
            g.output("y", g.linear(g.input("x", (B, K)), w))
            k = g.compile()
            x = _rand(B, K)
            gemvs[(N, K, B)] = (lambda k=k, x=x: k(x=x), lambda w=w, x=x: x @ w.T, N * K * 2)
            if B != 16:  # the same with 2 and 4 tasks per CTA (smaller column blocks)
                sms = k.plan.compute_units
                for m in (2, 4):
                    km = compile_graph(g, blocks=gpu_blocks(m * sms))
                    extra[(N, K, B, m)] = (lambda k=km, x=x: k(x=x), N * K * 2)
    cfg = qwen3_shaped(args.layers)
    layers, final = random_decoder(cfg, 1, args.kv, device="cuda")
    g = decode_graph(cfg, layers, final, 1, args.kv)
    # the fallback on the kernel's tiles (its own 4 x 32 default would be thousands of tasks)
    kern = g.compile()
    eager = compile_graph(g, backend="eager", blocks=gpu_blocks(kern.plan.compute_units))
    x = _rand(1, cfg.hidden)
    wbytes = sum(
        t.numel() * 2
        for ly in layers
        for t in (ly.wq, ly.wo, ly.wg, ly.wu, ly.wd, ly.k_cache, ly.v_cache)
    )
    rows = {"copy": [], "decode_kernel": [], "decode_eager": []}
    for _ in range(args.rounds):
        rows["copy"].append(2 * src.numel() / _time(copy, 5) / 1e9)
        for key, (ours, theirs, nbytes) in gemvs.items():
            rows.setdefault(f"gemv {key} kernel", []).append(nbytes / _time(ours, 50) / 1e9)
            rows.setdefault(f"gemv {key} torch", []).append(nbytes / _time(theirs, 50) / 1e9)
        for key, (ours, nbytes) in extra.items():
            rows.setdefault(f"gemv {key} kernel", []).append(nbytes / _time(ours, 50) / 1e9)
        rows["decode_kernel"].append(_time(lambda: kern(x=x), 20) * 1e6)
        rows["decode_eager"].append(_time(lambda: eager(x=x), 3) * 1e6)
    best = {k: (max(v) if "decode" not in k else min(v)) for k, v in rows.items()}
    rate = best["copy"]
    print(f"{res['device']}: device copy {rate:.0f} GB/s (read + write)")
    print(f"{'GEMV [N, K] x batch':32} {'kernel GB/s':>12} {'torch GB/s':>12} {'kernel/copy':>12}")
    for N, K, B in gemvs:
        ours, theirs = best[f"gemv {(N, K, B)} kernel"], best[f"gemv {(N, K, B)} torch"]
        print(f"{f'[{N}, {K}] x {B}':32} {ours:12.0f} {theirs:12.0f} {ours / rate:12.2f}")
    for N, K, B, m in extra:
        ours = best[f"gemv {(N, K, B, m)} kernel"]
        print(f"{f'[{N}, {K}] x {B}, {m} tasks/CTA':32} {ours:12.0f} {'':12} {ours / rate:12.2f}")
    bound = wbytes / (rate * 1e9) * 1e6
    print(
        f"decode {args.layers} layers B=1 KV={args.kv}: kernel {best['decode_kernel']:.0f} us, "
        f"eager fallback {best['decode_eager']:.0f} us, HBM bound {bound:.0f} us "
        f"(kernel {best['decode_kernel'] / bound:.2f}x bound)"
    )
    y, ye = kern(x=x)["y"].float(), eager(x=x)["y"].float()
    err = ((y - ye).abs().max() / ye.abs().max()).item()
    print(f"decode kernel vs eager: max rel err {err:.2g}")
    res.update({"best": {str(k): v for k, v in best.items()}, "bound_us": bound, "rel_err": err})
    print(json.dumps(res))
    return res


def _trace(args) -> dict:
    cfg = qwen3_shaped(args.layers)
    layers, final = random_decoder(cfg, args.batch, args.kv, device="cuda")
    g = decode_graph(cfg, layers, final, args.batch, args.kv)
    fuse = not args.no_fuse
    rows = node_times(g, {"x": _rand(args.batch, cfg.hidden)}, chrome=args.chrome, fuse=fuse)
    print(
        f"decode {args.layers} layers B={args.batch} KV={args.kv} (fuse={fuse}), one traced "
        "launch (us; run: from inputs ready to end; late: start after inputs ready; waited: "
        "ready after start; adds: last end past the previous node's):"
    )
    cols = ("run median", "run max", "late", "waited", "last end", "adds")
    print(f"{'node':>5} {'op':18} {'tasks':>6} " + " ".join(f"{c:>10}" for c in cols))
    keys = ("run_median_ns", "run_max_ns", "late_median_ns", "waited_median_ns")
    for r in rows:
        vals = [r[k] for k in keys] + [r["last_end_ns"], r["adds_ns"]]
        print(
            f"{r['node']:5} {r['op']:18} {r['tasks']:6} "
            + " ".join(f"{v / 1e3:10.1f}" for v in vals)
        )
    by_op: dict[str, float] = {}
    for r in rows:
        by_op[r["op"]] = by_op.get(r["op"], 0) + r["adds_ns"]
    print("adds per op (us): " + ", ".join(f"{o} {t / 1e3:.1f}" for o, t in by_op.items()))
    res = {"device": torch.cuda.get_device_name(), "fuse": fuse, "nodes": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
