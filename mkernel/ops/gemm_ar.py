"""GEMM + AllReduce: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    out_r = sum(a_q.float() @ b_q.float() for q in range(W)).bfloat16()   # [M, N], same on all

Protocol (the plan's tables below; device data movement in kernels/gemm_ar.cu), no multicast:
tile t of the [M, N] output is owned by rank t % W, the j-th of its tiles (j = t // W). Every rank
computes every tile of its partial product, the tiles its peers own first: each such fp32 partial
is stored (bulk copies) into slot ``me`` of the owner's ``stage`` (tile j of the slot, [BM, BN]),
then ``partial[tile=t, src=me]`` is raised there. A rank's own tiles come last: each waits for its
W - 1 peers' partials, adds them in fp32 in its epilogue (the fp32 sum rounded once, as the
reference), stores the bf16 tile into its own result and raises ``tile_done[t]`` on itself. The
owner's comm role waits for ``tile_done[t]``, copies the bf16 tile into every peer's result and
raises ``tile_ready[t]`` there; each rank's comm role then waits for ``tile_ready`` of every tile it
does not own, so no kernel exits before its whole result has landed (a reduce-scatter of tiles,
then an all-gather of the reduced tiles: two-shot at any W). Nothing is zeroed, no red.add.

    W = 2, tiles t0 t1 t2 t3 (owners 0 1 0 1)
    rank 0 compute:  t1 t3 (fp32 -> stage[1]) | t0 t2 (wait partial[t][1], add, bf16 -> out[0])
    rank 1 compute:  t0 t2 (fp32 -> stage[0]) | t1 t3 (wait partial[t][0], add, bf16 -> out[1])
    rank 0 comm:  wait tile_done t0, t2 -> into out[1], tile_ready on 1 | wait tile_ready t1, t3
    rank 1 comm:  wait tile_done t1, t3 -> into out[0], tile_ready on 0 | wait tile_ready t0, t2

In a distributed world the results are a symmetric ``result`` buffer, copied into ``out`` after the
kernel (one extra [M, N] device copy per call); an emulated world writes ``out`` directly.
"""

from __future__ import annotations

import sys

import torch

from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..schedule import (
    TILE_CONFIGS,
    Plan,
    Schedule,
    apply_order,
    build_plan,
    grid_tiles,
    grouped_order,
    pick_tile,
    rank_sms,
)
from ..world import World
from . import common

bf16, f32 = torch.bfloat16, torch.float32
SPEC = OpSpec(
    name="gemm_ar",
    doc="GEMM + AllReduce",
    buffers=(
        Buffer("a", "input", bf16, ("m", "k_local")),
        Buffer("b", "input", bf16, ("k_local", "n")),
        Buffer("out", "output", bf16, ("m", "n"), "the sum, on every rank"),
        Buffer(
            "stage",
            "symmetric",
            f32,
            ("stage_rows", "tile_cols"),
            "slot s, owned tile j at rows (s * own_tiles + j) * BM: rank s's fp32 partial",
            when="ranks",
        ),
        Buffer(
            "result",
            "symmetric",
            bf16,
            ("m", "n"),
            "peers' results (copied into out)",
            when="distributed",
        ),
    ),
    pads=(
        Pad("partial", ("tile", "src"), ("tiles", "W"), doc="src's partial of tile landed"),
        Pad("tile_done", ("tile",), ("tiles",), doc="the owner's reduced tile is in its result"),
        Pad("tile_ready", ("tile",), ("tiles",), doc="the reduced tile landed here"),
    ),
    scalars=("m", "n", "k_local", "tiles", "own_tiles"),
)


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k // W, sms)
    tiles = [t._replace(tag=t.index % W) for t in grid_tiles(0, m, n, cfg, 0, 0)]  # tag = owner
    T = len(tiles)
    default = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)  # same on every rank
    compute, comm = [], []
    for r in range(W):
        order = apply_order(schedule.tile_order, r, tiles, default)
        # NOTE: the peers' tiles first, each class in the hook's order (as gemm_rs): an own tile
        # waits for partials that only tasks without waits produce, so no order deadlocks.
        order = [i for i in order if tiles[i].tag != r] + [i for i in order if tiles[i].tag == r]
        tasks = []
        for i in order:
            owner = tiles[i].tag
            if W == 1:  # the epilogue stores the bf16 tile straight into out
                tasks.append(Task(i, (i,)))
            elif owner != r:
                tasks.append(Task(i, (i,), raises=(Raise("partial", owner, (i, r)),)))
            else:
                waits = tuple(Wait("partial", r, (i, (r + 1 + j) % W)) for j in range(W - 1))
                tasks.append(Task(i, (i,), waits=waits, raises=(Raise("tile_done", r, (i,)),)))
        compute.append(tasks)
        if W == 1:
            comm.append([])
            continue
        # Broadcast ids t (owned tiles) first, then pure waits T + t for the others.
        # NOTE: no cycle. A unit takes every n-th entry of this list, so each unit runs all of its
        # broadcasts before any of its waits; a broadcast waits only on its own compute tile; so
        # every broadcast completes, and with them every tile_ready a wait needs. Comm waits get
        # twice the deadline, so that a stuck peer's partial, waited for by a compute task,
        # reports first (naming the rank that did not send it).
        finalize = [
            Task(
                t,
                (t,),
                waits=(Wait("tile_done", r, (t,), patience=2),),
                raises=tuple(Raise("tile_ready", (r + j) % W, (t,)) for j in range(1, W)),
            )
            for t in range(T)
            if t % W == r
        ]
        landed = [
            Task(T + t, (T + t,), waits=(Wait("tile_ready", r, (t,), patience=2),))
            for t in range(T)
            if t % W != r
        ]
        comm.append(finalize + landed)
    own = -(-T // W)
    shapes = {"m": m, "n": n, "k": k}
    sizes = {
        **shapes,
        "k_local": k // W,
        "tiles": T,
        "own_tiles": own,
        "stage_rows": W * own * cfg.bm,
        "tile_cols": cfg.bn,
    }
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


def shapes(a: torch.Tensor, b: torch.Tensor, world: World) -> dict[str, int]:
    """The global GEMM sizes (m, n, k) of a call, after checking the operands."""
    (m, kl), (_, n) = common.check_operands(a, "[M, K/W]", b, "[K/W, N]", world, "K/W")
    common.check_divides("M (rows of a)", m, 1, "at least one row")
    common.check_columns("K/W", kl, n)
    return {"m": m, "n": n, "k": kl * world.size}


def gemm_ar(
    a: torch.Tensor,
    b: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM + AllReduce in one persistent kernel: the sum over ranks of ``a @ b``, on every rank.

    Unfused equivalent, per rank r::

        out[r] = sum(a[q].float() @ b[q].float() for q in range(W)).bfloat16()

    Args:
        a: bf16, per rank [M, K/W] (emulated world: [W, M, K/W]); contiguous.
        b: bf16, per rank [K/W, N] (emulated world: [W, K/W, N]); contiguous.
        world: the World the ranks belong to.
        schedule: a Schedule (overlap mode, SM split, tile order...); default Schedule().
        out: optional bf16 result tensor of the result's shape (written in full; tests poison it).

    Returns:
        bf16, per rank [M, N] (emulated: [W, M, N]): the sum over ranks of a@b, accumulated in
        fp32 (the peers' partials cross the links in fp32), rounded once (the same on every
        rank). Equivalent to ``reference.gemm_ar(a, b, world=world)``.
        In a distributed world peers write a symmetric buffer that is then copied into ``out``
        (one extra device copy of [M, N] bf16).

    Requires M >= 1, and K/W and N multiples of 8 (16-byte rows). Raises TypeError / ValueError
    naming the argument before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    out_shape = lambda s, W: (s["m"], s["n"])  # per rank
    return common.run_op(sys.modules[__name__], {"a": a, "b": b}, world, schedule, out, out_shape)


def after_gpu(world: World, plan: Plan, out: torch.Tensor) -> None:
    """A distributed world's peers wrote the symmetric result buffer: copy it into out."""
    result = plan.extra["_workspace"]["result"]  # (the launch cached the plan's workspace)
    if result is not None:
        out.copy_(result.local)


# -- CPU interpreter: data-movement twins of kernels/gemm_ar.cu ----------------------------------


def twins_of(plan: Plan):
    W, T, k = plan.world_size, plan.sizes["tiles"], plan.sizes["k_local"]
    own, bm = plan.sizes["own_tiles"], plan.tile.bm

    def slot(t, src: int) -> tuple[int, int, int, int]:  # tile t's rect in slot src of the stage
        return ((src * own + t.index // W) * bm, t.rows, 0, t.cols)

    def compute(ctx, task):  # GemmAR::dest: a peer's tile to its stage, an own tile + partials
        t = plan.tiles[task.args[0]]
        a = yield from twins.tile_load_async(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        rect, part = (t.m0, t.rows, t.n0, t.cols), a.float() @ b.float()
        if W > 1 and t.tag != ctx.rank:  # fp32 partial into slot `me` of the owner's stage
            yield from twins.tile_send_bulk(ctx, "stage", t.tag, slot(t, ctx.rank), part)
            return
        for s in range(W):  # own tile: the peers' partials, added in fp32 (Dest::add_*)
            if s != ctx.rank:
                part = part + (yield from twins.tile_load(ctx, "stage", ctx.rank, slot(t, s)))
        yield from twins.output_store(ctx, "out", ctx.rank, rect, part.bfloat16(), t.index)

    def comm(ctx, task):  # GemmAR::comm_move: the reduced tile into every peer; waits move nothing
        if task.args[0] >= T:
            return
        t = plan.tiles[task.args[0]]
        rect = (t.m0, t.rows, t.n0, t.cols)
        v = yield from twins.tile_load(ctx, "out", ctx.rank, rect)
        for j in range(1, W):  # r+1, r+2, ...
            yield from twins.output_store(ctx, "out", (ctx.rank + j) % W, rect, v, t.index)

    return {"compute": compute, "comm": comm}


def outputs(plan: Plan, rank: int) -> dict[int, tuple[int, int, int, int]]:
    """Every tile of [M, N], on every rank."""
    return {t.index: (t.m0, t.rows, t.n0, t.cols) for t in plan.tiles}


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: fp32 GEMM per rank, sum, bf16 everywhere."""
    parts = common.per_rank(a, world), common.per_rank(b, world)
    full = sum(x.float() @ y.float() for x, y in zip(*parts, strict=True)).bfloat16()
    if world.emulated_world:
        return full.expand(world.size, *full.shape).contiguous()
    return full
