"""AllGather (standalone, no GEMM): API, plan, data-movement twin and reference, side by side. The
op of tutorials/03_author_a_fused_op.py: the smallest op written on the protocol-as-data shape.

Unfused meaning, per rank r of W (x_r: [R, C], bf16)::

    out_r = torch.cat([x_q for q in range(W)])                    # [W * R, C], the same on all

Protocol (the plan's tables below; device data movement in kernels/all_gather.cu): each rank's rows
are cut into chunks of ``chunk_rows``. Rank r's comm tasks push each own chunk into every rank's
result (own copy first, then r+1, ...: chunk-major), each raising ``landed[src=r, chunk=c]`` on
its destination; then each rank waits for every chunk of every source to have landed in its result
(the single consumer resets the flag), so no kernel ends before its whole result is there. There is
nothing to compute: the compute role has no tasks.

    W = 2, 2 chunks per rank; result rows on each rank: [ x0c0 x0c1 | x1c0 x1c1 ]
    rank 0 comm:  push x0c0 -> r0, r1; x0c1 -> r0, r1 | wait landed[0, 0..1], landed[1, 0..1]
    rank 1 comm:  push x1c0 -> r1, r0; x1c1 -> r1, r0 | wait landed[1, 0..1], landed[0, 0..1]
"""

from __future__ import annotations

import sys

import torch

from .. import cost
from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..runtime import registry
from ..schedule import TILE_CONFIGS, Plan, Schedule, build_plan
from ..world import World
from . import common

PUSH, LANDED = 0, 1  # comm task kinds (args[0])
SPEC = OpSpec(
    name="all_gather",
    doc="AllGather, no compute",
    buffers=(
        Buffer("x", "input", torch.bfloat16, ("rows", "cols"), "this rank's rows"),
        Buffer("out", "output", torch.bfloat16, ("all_rows", "cols"), "every rank's rows"),
        Buffer(
            "result",
            "symmetric",
            torch.bfloat16,
            ("all_rows", "cols"),
            "peers write here",
            when="distributed",
        ),
    ),
    pads=(Pad("landed", ("src", "chunk"), ("W", "chunks"), doc="chunk of src is in my result"),),
    scalars=("rows", "cols", "chunk_rows"),
)


def make_plan(schedule: Schedule, world: World, rows: int, cols: int) -> Plan:
    W = world.size
    cr = min(schedule.chunk_rows or 64, rows)
    C = -(-rows // cr)
    comm = []
    for r in range(W):
        push = [
            Task(c * W + p, (PUSH, c, p), raises=(Raise("landed", p, (r, c)),))
            for c in range(C)
            for p in ((r + j) % W for j in range(W))
        ]
        # NOTE: every unit runs its pushes before its waits (a unit takes every n-th task of this
        # list), and pushes wait on nothing: no cycle.
        waits = [
            Task(W * C + s * C + c, (LANDED, s, c), waits=(Wait("landed", r, (s, c)),))
            for s in ((r + j) % W for j in range(W))
            for c in range(C)
        ]
        comm.append(push + waits)
    shapes = {"rows": rows, "cols": cols}
    sizes = {**shapes, "all_rows": W * rows, "chunks": C, "chunk_rows": cr}
    tile = TILE_CONFIGS["64x128x64"]  # unused: the op runs on the comm-only engine (no GEMM)
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, [], [[]] * W, comm)


def shapes(x: torch.Tensor, world: World) -> dict[str, int]:
    rows, cols = common.check_operand("x", x, world, 2, "[R, C]")
    common.check_divides("R (rows of x)", rows, 1, "at least one row")
    common.check_divides("C (columns of x)", cols, common.ALIGN, "16-byte rows")
    return {"rows": rows, "cols": cols}


def all_gather(
    x: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """AllGather in one persistent kernel: every rank's rows, on every rank.

    Unfused equivalent, per rank r::

        out[r] = torch.cat([x[q] for q in range(W)])

    Args:
        x: bf16, per rank [R, C] (emulated world: [W, R, C]); contiguous; C a multiple of 8.
        world: the World the ranks belong to.
        schedule: a Schedule (overlap, SMs, ``chunk_rows``: rows per pushed chunk, default 64).
        out: optional bf16 result tensor of the result's shape.

    Returns:
        bf16, per rank [W * R, C] (emulated: [W, W * R, C]). Equivalent to
        ``reference.all_gather(x, world=world)``. Raises TypeError / ValueError naming the argument
        before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    return common.run_op(OP, {"x": x}, world, schedule, out=out)


# -- cost model (mkernel/cost.py): one rank's work per call ----------------------------------------


def _cost_work(s: dict[str, int], W: int, bm: int, bn: int, rates: cost.Rates) -> cost.Work:
    """One rank's call: no GEMM; the comm role pushes its rows in chunks of ``chunk_rows`` (default
    64), one task per (chunk, destination), (W - 1) / W of them over a link (one in W is the rank's
    own copy, made at W = 1 too)."""
    rows, cols = s["rows"], s["cols"]
    cr = min(s.get("chunk_rows") or 64, rows)
    chunk = cr * cols * 2.0
    return cost.Work(
        tiles=0,
        flops=0.0,
        epilogue_bytes=0.0,
        comm_tasks=W * -(-rows // cr),
        task_bytes=chunk,
        task_remote=chunk * (W - 1) / W,
        comm_produces=True,
        link_bytes=(W - 1) * rows * cols * 2.0,
        after_ms=0.0,
    )


cost.register(SPEC.name, cost.OpCost(work=_cost_work, tiled=False))  # no tiles: bm, bn unused


# -- CPU interpreter: the data-movement twin of kernels/all_gather.cu -----------------------------


def twins_of(plan: Plan):
    rows, cols, cr = plan.sizes["rows"], plan.sizes["cols"], plan.sizes["chunk_rows"]

    def comm(ctx, task):  # AllGather::comm_move: push chunk c of x into rank p's result
        kind, c, p = task.args[:3]
        if kind != PUSH:
            return
        n = min(cr, rows - c * cr)
        v = yield from twins.tile_load(ctx, "x", ctx.rank, (c * cr, n, 0, cols))
        rect = (ctx.rank * rows + c * cr, n, 0, cols)
        yield from twins.output_store(ctx, "out", p, rect, v, ctx.rank * plan.sizes["chunks"] + c)

    return {"compute": None, "comm": comm}


def outputs(plan: Plan, rank: int) -> dict[int, tuple[int, int, int, int]]:
    """Every chunk of every source, on every rank (output tile id = src * chunks + chunk)."""
    rows, cr, C = plan.sizes["rows"], plan.sizes["chunk_rows"], plan.sizes["chunks"]
    cols = plan.sizes["cols"]
    return {
        s * C + c: (s * rows + c * cr, min(cr, rows - c * cr), 0, cols)
        for s in range(plan.world_size)
        for c in range(C)
    }


def reference(x: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference: gather every rank's rows (a copy: exact)."""
    full = torch.cat(common.per_rank(x, world))
    if world.emulated_world:
        return full.expand(world.size, *full.shape).contiguous()
    return full


# the run path's view of the op (mkernel/runtime/run.py): one bf16 result, its per-rank shape
OP = common.single_output_op(
    sys.modules[__name__], lambda s, W: (W * s["rows"], s["cols"]), after_gpu=common.copy_result
)
registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
