"""Fused kernels at tensor-parallel shapes vs the unfused pair, PyTorch's fused ops and the ideal.

Run one process per GPU: ``torchrun --nproc_per_node=W -m mkernel.bench.tp``. Shapes: tokens M in
{2048, 4096, 8192, 16384}, hidden H = 8192, intermediate I = 28672 split over W:

- ag_gemm: a [M/W, H] @ b [H, I/W]  -> [M, I/W]   (column-parallel layer; all-gather of a)
- gemm_rs: a [M, I/W] @ b [I/W, H]  -> [M/W, H]   (row-parallel layer; reduce-scatter)
- gemm_ar: a [M, I/W] @ b [I/W, H]  -> [M, H]     (row-parallel layer; all-reduce)

Columns (ms per call, the slowest rank's median): ours with the default Schedule and with each
overlap forced, unfused = cuBLAS then NCCL in sequence, torch_fused = torch.ops.symm_mem fused op
where one exists, gemm = cuBLAS alone, comm = NCCL collective alone, ideal = max(gemm, comm); then
ours/unfused, ours/torch_fused and ours/ideal for the default Schedule (< 1 beats the pair / the
fused op; 1.0 is ideal). Every version of a row is timed interleaved with the others in rounds
(``interleaved_dist_ms``), so clock and thermal drift hit all of them alike.

``MKERNEL_TP_NODES=N`` splits the ranks into N virtual nodes: ours then run their plans over nodes,
every cross-node step an NVSHMEM put (docs/rdma.md), against the same baselines; saved as
tp_w<W>_nodes<N>. NVSHMEM's heap is then sized by ``NVSHMEM_SYMMETRIC_SIZE`` (8G unless set).
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

import mkernel

from .timing import save, table

TOKENS = (2048, 4096, 8192, 16384)
H, INTER = 8192, 28672


def interleaved_dist_ms(
    fns: dict[str, object], rounds: int = 5, per: int = 10, warmup: int = 3
) -> dict[str, float | None]:
    """Median ms per call of each version, interleaved: the versions take turns in rounds of
    ``per`` calls (the first version of a round rotates), every rank timing the same calls, then
    the slowest rank's median decides. A version that raises in its warm-up is reported as None
    (printed once) and left out of the rounds."""
    ok: dict[str, object] = {}
    for k, f in fns.items():
        if f is None:
            continue
        try:
            for _ in range(warmup):
                f()
            torch.cuda.synchronize()
            ok[k] = f
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            if dist.get_rank() == 0:
                print(f"  {k}: n/a: {repr(e)[:200]}", flush=True)
    times: dict[str, list[float]] = {k: [] for k in ok}
    names = list(ok)
    for r in range(rounds):
        for k in names[r % max(1, len(names)) :] + names[: r % max(1, len(names))]:
            dist.barrier()
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(per)
            ]
            for start, end in ev:
                start.record()
                ok[k]()
                end.record()
            torch.cuda.synchronize()
            times[k] += [start.elapsed_time(end) for start, end in ev]
    med = torch.tensor([statistics.median(times[k]) for k in names] or [0.0], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank decides
    out: dict[str, float | None] = dict.fromkeys(fns)
    out.update({k: float(v) for k, v in zip(names, med.tolist(), strict=False)})
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def bench_op(op: str, m: int, world: mkernel.World) -> dict:
    W, group = world.size, world.group
    gname = group.group_name
    if op == "ag_gemm":
        a = torch.randn(m // W, H, device="cuda").bfloat16()
        b = torch.randn(H, INTER // W, device="cuda").bfloat16()
        full = torch.empty(m, H, device="cuda", dtype=torch.bfloat16)
        gemm = lambda: torch.matmul(full, b)  # noqa: E731
        comm = lambda: dist.all_gather_into_tensor(full, a, group=group)  # noqa: E731
        unfused = lambda: (comm(), gemm())  # noqa: E731
        fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, gname)  # noqa: E731
        flop = 2 * m * H * (INTER // W)
    else:
        a = torch.randn(m, INTER // W, device="cuda").bfloat16()
        b = torch.randn(INTER // W, H, device="cuda").bfloat16()
        c = torch.empty(m, H, device="cuda", dtype=torch.bfloat16)
        gemm = lambda: torch.matmul(a, b, out=c)  # noqa: E731
        if op == "gemm_rs":
            part = torch.empty(m // W, H, device="cuda", dtype=torch.bfloat16)
            comm = lambda: dist.reduce_scatter_tensor(part, c, group=group)  # noqa: E731
            fused = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, gname)  # noqa: E731
        else:
            comm = lambda: dist.all_reduce(c, group=group)  # noqa: E731
            fused = None
        unfused = lambda: (gemm(), comm())  # noqa: E731
        flop = 2 * m * (INTER // W) * H
    fn = getattr(mkernel, op)
    world.sync_checks = False
    forced = {ov: mkernel.Schedule(overlap=ov) for ov in ("intra_sm", "inter_sm")}
    versions = {
        "ours": lambda: fn(a, b, world=world),  # the default Schedule
        **{
            f"ours_{ov}": (lambda s=s: fn(a, b, world=world, schedule=s))
            for ov, s in forced.items()
        },
        "unfused": unfused,
        "torch_fused": fused,
        "gemm": gemm,
        "comm": comm,
    }
    row: dict = {"op": op, "W": W, "nodes": world.nodes, "m": m, **interleaved_dist_ms(versions)}
    world.check()
    alone = (row["gemm"], row["comm"])
    row["ideal"] = max(alone) if None not in alone else None
    if row["ours"] is not None:
        row["ours_tflops"] = flop / row["ours"] / 1e9
    row["ours/unfused"] = _ratio(row["ours"], row["unfused"])
    row["ours/torch_fused"] = _ratio(row["ours"], row["torch_fused"])
    row["ours/ideal"] = _ratio(row["ours"], row["ideal"])
    return row


def sweep(world: mkernel.World, m: int = 8192) -> None:
    """Schedule knobs at one shape: wait backoff for both overlaps, comm SMs for inter_sm."""
    W = world.size
    shapes = {
        "gemm_rs": ((m, INTER // W), (INTER // W, H)),
        "ag_gemm": ((m // W, H), (H, INTER // W)),
        "gemm_ar": ((m, INTER // W), (INTER // W, H)),
    }
    world.sync_checks = False
    rows = []
    for op, (sa, sb) in shapes.items():
        a = torch.randn(*sa, device="cuda").bfloat16()
        b = torch.randn(*sb, device="cuda").bfloat16()
        fn = getattr(mkernel, op)
        knobs = [("intra_sm", None, bo, "auto") for bo in (1024, 2048, 4096, 16384)]
        knobs += [("inter_sm", c, 2048, "auto") for c in (8, 16, 24)]
        if op == "ag_gemm":
            knobs += [("inter_sm", c, 2048, "tma") for c in (8, 16, 24)]
        for overlap, comm_sms, bo, transfer in knobs:
            sched = mkernel.Schedule(
                overlap=overlap, comm_sms=comm_sms, backoff_ns=bo, transfer=transfer
            )
            call = lambda s=sched, fn=fn, a=a, b=b: fn(a, b, world=world, schedule=s)  # noqa: E731
            ms = interleaved_dist_ms({"ours": call}, rounds=2)["ours"]
            rows.append(
                {
                    "op": op,
                    "m": m,
                    "overlap": overlap,
                    "comm_sms": comm_sms,
                    "backoff_ns": bo,
                    "transfer": transfer,
                    "ms": ms,
                }
            )
    world.check()
    # One traced call per op and overlap: where the time goes (summaries of the GPU timeline).
    for op, (sa, sb) in shapes.items():
        a = torch.randn(*sa, device="cuda").bfloat16()
        b = torch.randn(*sb, device="cuda").bfloat16()
        for overlap in ("intra_sm", "inter_sm"):
            getattr(mkernel, op)(
                a, b, world=world, schedule=mkernel.Schedule(overlap=overlap, trace=True)
            )
            tl = world.last_timeline
            if world.rank == 0:
                for role in ("compute", "comm"):
                    d = [s.end - s.start for s in tl.spans if s.unit.startswith(role)]
                    end = max((s.end for s in tl.spans if s.unit.startswith(role)), default=0)
                    if d:
                        print(
                            f"trace {op} {overlap} {role}: {len(d)} tasks, "
                            f"mean {sum(d) / len(d) / 1e3:.1f} us, "
                            f"max {max(d) / 1e3:.1f} us, last end {end / 1e3:.1f} us",
                            flush=True,
                        )
    if world.rank == 0:
        print(table(rows, ["op", "m", "overlap", "comm_sms", "backoff_ns", "transfer", "ms"]))
        print("saved", save(f"tp_sweep_w{W}", rows))


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    nodes = int(os.environ.get("MKERNEL_TP_NODES", "1"))
    if nodes > 1:  # the largest rows' workspaces (gemm_ar at M = 16384: ~2.5 GB) exceed the default
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")
    world = mkernel.World.from_process_group(nodes=nodes)
    try:  # older releases need symmetric memory enabled per group for the fused ops
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(world.group.group_name)
    except Exception:  # noqa: BLE001 - newer releases need nothing
        pass
    rows = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for m in TOKENS:
            rows.append(bench_op(op, m, world))
            if world.rank == 0:
                print(rows[-1], flush=True)
    if os.environ.get("MKERNEL_TP_SWEEP"):
        sweep(world)
    if world.rank == 0:
        cols = [
            "op",
            "W",
            "m",
            "ours",
            "ours_intra_sm",
            "ours_inter_sm",
            "unfused",
            "torch_fused",
            "ideal",
            "ours/unfused",
            "ours/torch_fused",
            "ours/ideal",
        ]
        print(table(rows, cols))
        print("saved", save(f"tp_w{world.size}" + (f"_nodes{nodes}" if nodes > 1 else ""), rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    from . import cli

    cli(__spec__.name, __doc__, torchrun=True)
    main()
