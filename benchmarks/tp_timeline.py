"""Diagnostic (issue 10): where a fused op's time goes on two GPUs, from the kernel's own timeline.

``torchrun --nproc_per_node=2 benchmarks/tp_timeline.py``: per op at the TP shapes of
mkernel.bench.tp (M = 2048 and 8192), after warm-up, one call with ``Schedule(trace=True)`` and the
same call timed by CUDA events. Prints per rank: the event time of a call, the kernel's span (first
task start to last task end), the compute units' mean busy time and idle gaps (before the first
task, between tasks, after the last), and when the comm role's last task ends relative to the last
compute task. Writes the Chrome traces and a JSON summary under $MKERNEL_BENCH_DIR.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import mkernel
from mkernel.bench.tp import INTER, H


def _summary(tl, rank: int) -> dict:
    spans = [s for s in tl.spans if s.rank == rank]
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    by_unit: dict[str, list] = {}
    for s in spans:
        by_unit.setdefault(s.unit, []).append(s)
    comp = {
        u: sorted(v, key=lambda s: s.start) for u, v in by_unit.items() if u.startswith("compute")
    }
    comm = [s for u, v in by_unit.items() if u.startswith("comm") for s in v]
    busy = [sum(s.end - s.start for s in v) for v in comp.values()]
    lead = [v[0].start - t0 for v in comp.values()]
    tail = [t1 - v[-1].end for v in comp.values()]
    gaps = [sum(b.start - a.end for a, b in zip(v, v[1:], strict=False)) for v in comp.values()]
    task = [s.end - s.start for v in comp.values() for s in v]
    last_compute = max(v[-1].end for v in comp.values())
    return {
        "span_us": (t1 - t0) / 1e3,
        "compute_units": len(comp),
        "busy_mean_us": statistics.mean(busy) / 1e3,
        "lead_mean_us": statistics.mean(lead) / 1e3,
        "gaps_mean_us": statistics.mean(gaps) / 1e3,
        "tail_mean_us": statistics.mean(tail) / 1e3,
        "task_median_us": statistics.median(task) / 1e3,
        "task_max_us": max(task) / 1e3,
        "comm_tasks": len(comm),
        "comm_last_end_after_compute_us": (max((s.end for s in comm), default=t0) - last_compute)
        / 1e3,
        "comm_busy_total_us": sum(s.end - s.start for s in comm) / 1e3,
    }


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = mkernel.World.from_process_group(dist.group.WORLD)
    world.sync_checks = False
    W = world.size
    out_dir = Path(os.environ.get("MKERNEL_BENCH_DIR", "benchmarks/results"))
    results = []
    for op in ("gemm_rs", "ag_gemm", "gemm_ar"):
        for m in (2048, 8192):
            if op == "ag_gemm":
                a = torch.randn(m // W, H, device="cuda").bfloat16()
                b = torch.randn(H, INTER // W, device="cuda").bfloat16()
            else:
                a = torch.randn(m, INTER // W, device="cuda").bfloat16()
                b = torch.randn(INTER // W, H, device="cuda").bfloat16()
            fn = getattr(mkernel, op)
            for overlap in ("intra_sm", "inter_sm"):
                sched = mkernel.Schedule(overlap=overlap)
                traced = mkernel.Schedule(overlap=overlap, trace=True)
                for _ in range(10):
                    fn(a, b, world=world, schedule=sched)
                torch.cuda.synchronize()
                dist.barrier()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(10):
                    fn(a, b, world=world, schedule=sched)
                e1.record()
                torch.cuda.synchronize()
                dist.barrier()
                fn(a, b, world=world, schedule=traced)
                torch.cuda.synchronize()
                world.check()
                tl = world.last_timeline
                event_us = e0.elapsed_time(e1) * 1e3 / 10
                row = {"op": op, "m": m, "overlap": overlap, "rank": rank, "event_us": event_us}
                row |= _summary(tl, rank)
                every: list = [None] * W
                dist.all_gather_object(every, row)
                results += every if rank == 0 else []
                if rank == 0:
                    for r in every:
                        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in r.items()), flush=True)  # fmt: skip
                    if op == "gemm_rs" and m == 2048:  # (a run brings back at most 8 files)
                        tl.save_chrome(out_dir / f"timeline_{op}_{m}_{overlap}_rank0.json")
    if rank == 0:
        (out_dir / "tp_timeline_summary.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
