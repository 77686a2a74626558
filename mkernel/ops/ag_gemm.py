"""AllGather + GEMM: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M/W, K], b_r: [K, N], bf16)::

    full_a = torch.cat([a_q for q in range(W)])                  # [M, K], all_gather(a)
    out_r = (full_a.float() @ b_r.float()).bfloat16()              # [M, N]

Device protocol (kernels/ag_gemm.cu): each rank's shard is cut into C chunks of ``chunk_rows`` rows.
The comm role of rank r pushes its own chunks, one after another, into every rank's symmetric
``gather`` buffer (its own copy first, then r+1, r+2, ...), raising ``chunk_ready[r*C + c]`` on each
destination right after that destination's copy. Order: chunk-major (chunk c goes to every rank
before chunk c+1 leaves) so that every rank can start on chunk 0 of every shard as early as
possible, instead of one peer receiving the whole shard while the others wait.
The compute role walks the output tiles of [M, N], local shard first, then the shards of r+1,
r+2, ... (the order in which they arrive); before the engine loads a tile it waits for every chunk
the tile's rows overlap (a tile can span several chunks and, when M/W is not a multiple of the tile
height, two shards), then counts itself as a consumer of each chunk; the last consumer of a chunk
resets both its ready flag and its counter, so every pad is back to zero when the call ends.

    W = 2, C = 2 chunks per shard; rows of gather on each rank:
      [ shard 0: c0 c1 | shard 1: c0 c1 ]
    rank 0 compute: tiles of shard 0 (own, landed first), then shard 1 as its chunks land
    rank 1 compute: tiles of shard 1, then shard 0
"""

from __future__ import annotations

import sys

import torch

from ..interp import twins
from ..schedule import (
    TILE_CONFIGS,
    Plan,
    Schedule,
    Tile,
    apply_order,
    build_plan,
    grid_tiles,
    grouped_order,
    pick_tile,
    rank_sms,
)
from ..world import World
from . import common

CHUNK_READY = 2  # WaitSite::signal id (common.SIGNAL_NAMES)


def _chunk_of(row: int, ms: int, cr: int, chunks: int) -> int:
    """Global chunk id (src * C + c) holding global row ``row`` of the gathered A."""
    src = row // ms
    return src * chunks + (row - src * ms) // cr


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k, sms)
    ms = m // W
    cr = min(schedule.chunk_rows or cfg.bm, ms)
    C = -(-ms // cr)  # chunks per shard; the last one may be short
    # Tag = the first chunk a tile needs; its last one is the chunk of its last row.
    tiles = [t._replace(tag=_chunk_of(t.m0, ms, cr, C)) for t in grid_tiles(0, m, n, cfg, 0, 0)]
    consumers = [0] * (W * C)
    shards: list[set[int]] = []
    for t in tiles:
        last = _chunk_of(t.m0 + t.rows - 1, ms, cr, C)
        for g in range(t.tag, last + 1):
            consumers[g] += 1
        shards.append({g // C for g in range(t.tag, last + 1)})
    grouped = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)  # L2-friendly
    orders, comms = [], []
    for r in range(W):
        # Default: arrival order. A tile's place is that of the latest shard it needs, counted from
        # our own (which lands first); ties keep the L2-friendly grouped order.
        default = sorted(grouped, key=lambda i: max((s - r) % W for s in shards[i]))
        orders.append(apply_order(schedule.tile_order, r, tiles, default))
        # W == 1: the engine reads a itself; there is nothing to gather.
        comms.append([r * C + c for c in range(C)] if W > 1 else [])
    shapes = {"m": m, "n": n, "k": k}
    return build_plan(
        "ag_gemm",
        schedule,
        world,
        cfg,
        shapes,
        tiles,
        orders,
        comms,
        {
            "rows_per_rank": ms,
            "chunk_rows": cr,
            "chunks": C,
            "consumers": torch.tensor(consumers, dtype=torch.int32),  # [W * C] tiles per chunk
        },
    )


def shapes(a: torch.Tensor, b: torch.Tensor, world: World) -> dict[str, int]:
    """The global GEMM sizes (m, n, k) of a call, after checking the operands."""
    (ms, k), (_, n) = common.check_operands(a, "[M/W, K]", b, "[K, N]", world, "K")
    common.check_divides("M/W (rows of a)", ms, 1, "every rank holds at least one row")
    common.check_columns("K", k, n)
    return {"m": ms * world.size, "n": n, "k": k}


def ag_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """AllGather + GEMM in one persistent kernel: ``all_gather(a) @ b`` on every rank.

    Unfused equivalent, per rank r::

        out[r] = (torch.cat([a[q] for q in range(W)]).float() @ b[r].float()).bfloat16()

    Args:
        a: bf16, per rank [M/W, K] (emulated world: [W, M/W, K]); contiguous. Rank q's shard is
            rows q*M/W .. (q+1)*M/W of the gathered A.
        b: bf16, per rank [K, N] (emulated world: [W, K, N]); contiguous.
        world: the World the ranks belong to.
        schedule: a Schedule (overlap mode, SM split, tile order, ``chunk_rows``: rows per pushed
            chunk, default one tile height); default Schedule().
        out: optional bf16 result tensor of the result's shape (written in full; tests poison it).

    Returns:
        bf16, per rank [M, N] (emulated: [W, M, N]), accumulated in fp32. Equivalent to
        ``reference.ag_gemm(a, b, world=world)``.

    Transfers: each rank pushes its shard in chunks into every rank's gather buffer, chunk-major
    (chunk c reaches every rank before chunk c+1 leaves, so all ranks start on every shard early);
    GEMM tiles wait only for the chunks their rows need.

    Requires M/W >= 1, and K and N multiples of 8 (16-byte rows). Raises TypeError / ValueError
    naming the argument before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    out_shape = lambda s, W: (s["m"], s["n"])  # per rank
    return common.run_op(sys.modules[__name__], a, b, world, schedule, out, out_shape)


def _workspace(world: World, plan: Plan):
    m, k, chunks = plan.shapes["m"], plan.shapes["k"], world.size * plan.extra["chunks"]
    gather = world.symmetric(("ag_gemm", "gather"), (m, k), torch.bfloat16)
    ready = world.symmetric(("ag_gemm", "ready"), (chunks,), torch.int32)
    consumed = world.symmetric(("ag_gemm", "consumed"), (chunks,), torch.int32)
    return gather, ready, consumed, common.barrier_pad(world)


# -- GPU ----------------------------------------------------------------------------------------


def _run_gpu(world: World, plan: Plan, a, b, out: torch.Tensor) -> torch.Tensor:
    gather, ready, consumed, barrier = _workspace(world, plan)
    m, n, k = plan.shapes["m"], plan.shapes["n"], plan.shapes["k"]
    if "consumers_dev" not in plan.extra:  # copied once: the plan is cached on the world
        plan.extra["consumers_dev"] = plan.extra["consumers"].to(world.device)
    L = common.fill_launch(world, plan)
    common.set_operands(L, world, a, b, out)  # out: [W, M, N], rank stride m * n
    L.M, L.N, L.K = m, n, k  # the engine's GEMM: gathered A [M, K] @ B [K, N]
    L.work_ptrs, L.flag_ptrs = gather.peer_ptrs.data_ptr(), ready.peer_ptrs.data_ptr()
    L.flag2_ptrs, L.barrier_ptrs = consumed.peer_ptrs.data_ptr(), barrier.peer_ptrs.data_ptr()
    L.work_local = gather.local.data_ptr()  # the engine's A (first served rank; + r*M*K per rank)
    L.aux_ptr = plan.extra["consumers_dev"].data_ptr()
    L.rows_per_rank, L.tiles_per_rank = plan.extra["rows_per_rank"], plan.extra["chunks"]
    L.chunk_rows = plan.extra["chunk_rows"]
    common.launch_and_check(world, common.extension().launch_ag_gemm, L, common.SIGNAL_NAMES)
    return out


# -- CPU interpreter: program twins mirroring kernels/ag_gemm.cu ---------------------------------


def compute_program(plan: Plan):
    ms, cr, C = plan.extra["rows_per_rank"], plan.extra["chunk_rows"], plan.extra["chunks"]
    consumers = plan.extra["consumers"].tolist()
    k = plan.shapes["k"]

    def run(ctx, task):
        t: Tile = plan.tiles[task]
        me = ctx.rank
        if plan.world_size == 1:  # the engine reads a directly: no gather, no waits
            a = yield from twins.tile_load(ctx, "a", me, (t.m0, t.rows, 0, k))
            b = yield from twins.tile_load(ctx, "b", me, (0, k, t.n0, t.cols))
            c = (a.float() @ b.float()).bfloat16()
            yield from twins.output_store(ctx, "out", me, (t.m0, t.rows, t.n0, t.cols), c, task)
            return
        chunks = range(t.tag, _chunk_of(t.m0 + t.rows - 1, ms, cr, C) + 1)
        # before_load: wait for every chunk the tile's rows overlap.
        for g in chunks:
            yield from twins.wait_acquire(ctx, ctx.sig("chunk_ready", me, g), 1, g // C)
        # Count ourselves as a consumer; the last one resets the chunk's flag and counter. The add
        # and the read of the old value happen in one step (the device's atomicAdd).
        for g in chunks:
            n_now = int(ctx.m.pads["consumed"][me][g]) + 1
            yield from twins.signal_add_release(ctx, ctx.sig("consumed", me, g))
            if n_now == consumers[g]:
                yield from twins.wait_acquire_reset(ctx, ctx.sig("consumed", me, g), n_now, me)
                yield from twins.wait_acquire_reset(ctx, ctx.sig("chunk_ready", me, g), 1, g // C)
        a = yield from twins.tile_load(ctx, "gather", me, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load(ctx, "b", me, (0, k, t.n0, t.cols))
        c = (a.float() @ b.float()).bfloat16()
        yield from twins.output_store(ctx, "out", me, (t.m0, t.rows, t.n0, t.cols), c, task)

    return run


def comm_program(plan: Plan):
    W, ms, k = plan.world_size, plan.extra["rows_per_rank"], plan.shapes["k"]
    cr, C = plan.extra["chunk_rows"], plan.extra["chunks"]
    f = plan.faults

    def run(ctx, g):
        r0 = (g - ctx.rank * C) * cr
        rows = min(cr, ms - r0)
        if ctx.rank == f.delay_rank:
            yield from twins.delay(ctx, f.delay_us)
        v = yield from twins.tile_load(ctx, "a", ctx.rank, (r0, rows, 0, k))
        for j in range(W):  # own copy first, then r+1, r+2, ...
            p = (ctx.rank + j) % W
            yield from twins.peer_store(ctx, "gather", p, (ctx.rank * ms + r0, rows, 0, k), v)
            if ctx.rank != f.silent_rank:
                yield from twins.signal_set_release(ctx, ctx.sig("chunk_ready", p, g))

    return run


def _run_cpu(world: World, plan: Plan, a, b, schedule: Schedule, out) -> torch.Tensor:
    gather, ready, consumed, barrier = _workspace(world, plan)
    buffers = {"a": a, "b": b, "gather": gather.local, "out": out}
    pads = {"chunk_ready": ready.local, "consumed": consumed.local, "barrier": barrier.local}
    programs = compute_program(plan), comm_program(plan)
    common.run_interpreter(world, plan, pads, buffers, *programs, schedule.seed)
    return out


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: gather shards, fp32 GEMM per rank, bf16."""
    full_a = torch.cat(common.per_rank(a, world)).float()
    if world.emulated_world:
        return torch.stack([full_a @ b[r].float() for r in range(world.size)]).bfloat16()
    return (full_a @ b.float()).bfloat16()
