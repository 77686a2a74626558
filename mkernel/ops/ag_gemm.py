"""AllGather + GEMM: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M/W, K], b_r: [K, N], bf16)::

    full_a = torch.cat([a_q for q in range(W)])                  # [M, K], all_gather(a)
    out_r = (full_a.float() @ b_r.float()).bfloat16()              # [M, N]

Protocol (the plan's tables below; device data movement in kernels/ag_gemm.cu): each rank's shard
is cut into C chunks of ``chunk_rows`` rows. Rank r's comm tasks push each own chunk into every
rank's symmetric ``gather`` buffer, one task per (chunk, destination): own copy first, then r+1,
r+2, ..., chunk-major (chunk c reaches every rank before chunk c+1 leaves, so every rank starts on
chunk 0 of every shard early); each task raises ``chunk_ready[chunk=g]`` on its destination. The
compute role walks the output tiles of [M, N], local shard first, then the shards of r+1, r+2, ...
(arrival order); before the engine loads a tile it waits for every chunk the tile's rows overlap (a
tile can span several chunks and, when M/W is not a multiple of the tile height, two shards).
``chunk_ready`` is a counted pad: every tile over chunk g consumes it, the last one resets it.

    W = 2, C = 2 chunks per shard; rows of gather on each rank:
      [ shard 0: c0 c1 | shard 1: c0 c1 ]
    rank 0 compute: tiles of shard 0 (own, landed first), then shard 1 as its chunks land
    rank 1 compute: tiles of shard 1, then shard 0
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

bf16 = torch.bfloat16
SPEC = OpSpec(
    name="ag_gemm",
    doc="AllGather + GEMM",
    buffers=(
        Buffer("a", "input", bf16, ("ms", "k"), "this rank's shard"),
        Buffer("b", "input", bf16, ("k", "n")),
        Buffer("out", "output", bf16, ("m", "n")),
        Buffer("gather", "symmetric", bf16, ("m", "k"), "the gathered A: the engine's A"),
    ),
    pads=(Pad("chunk_ready", ("chunk",), ("chunks_total",), counted=True, doc="chunk g landed"),),
    scalars=("m", "n", "k", "ms", "chunks", "chunk_rows", "transfer_tma"),
)


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
    needs = [range(t.tag, _chunk_of(t.m0 + t.rows - 1, ms, cr, C) + 1) for t in tiles]
    consumers = [0] * (W * C)
    for chunks in needs:
        for g in chunks:
            consumers[g] += 1
    grouped = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)  # L2-friendly
    compute, comm = [], []
    for r in range(W):
        # Default: arrival order. A tile's place is that of the latest shard it needs, counted from
        # our own (which lands first); ties keep the L2-friendly grouped order.
        default = sorted(grouped, key=lambda i: max((g // C - r) % W for g in needs[i]))
        order = apply_order(schedule.tile_order, r, tiles, default)
        if W == 1:  # the engine reads a itself: nothing to gather, nothing to wait for
            compute.append([Task(i, (i,)) for i in order])
            comm.append([])
            continue
        waits = [
            tuple(Wait("chunk_ready", r, (g,), consumers=consumers[g]) for g in needs[i])
            for i in range(len(tiles))
        ]
        compute.append([Task(i, (i,), waits=waits[i]) for i in order])
        comm.append(
            [
                Task(g * W + p, (g, p), raises=(Raise("chunk_ready", p, (g,)),))
                for g in range(r * C, (r + 1) * C)
                for p in ((r + j) % W for j in range(W))
            ]
        )
    shapes = {"m": m, "n": n, "k": k}
    sizes = {
        **shapes,
        "ms": ms,
        "chunks": C,
        "chunk_rows": cr,
        "chunks_total": W * C,
        "transfer_tma": int(schedule.transfer == "tma"),
    }
    extra = {"consumers": torch.tensor(consumers, dtype=torch.int32)}  # [W * C] tiles per chunk
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm, extra)


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
    return common.run_op(sys.modules[__name__], {"a": a, "b": b}, world, schedule, out, out_shape)


# -- CPU interpreter: data-movement twins of kernels/ag_gemm.cu ----------------------------------


def twins_of(plan: Plan):
    W, ms, k = plan.world_size, plan.sizes["ms"], plan.sizes["k"]
    cr, C = plan.sizes["chunk_rows"], plan.sizes["chunks"]
    bulk = plan.sizes["transfer_tma"] and plan.overlap == "inter_sm"

    def compute(ctx, task):  # the engine: TMA loads of the gathered A (W == 1: a), bf16 store
        t = plan.tiles[task.args[0]]
        src = "a" if W == 1 else "gather"
        a = yield from twins.tile_load_async(ctx, src, ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        c = (a.float() @ b.float()).bfloat16()
        rect = (t.m0, t.rows, t.n0, t.cols)
        yield from twins.output_store(ctx, "out", ctx.rank, rect, c, t.index)

    def comm(ctx, task):  # AgGemm::comm_move: own chunk g into rank p's gather buffer
        g, p = task.args[:2]
        r0 = (g - ctx.rank * C) * cr
        rows = min(cr, ms - r0)
        v = yield from twins.tile_load(ctx, "a", ctx.rank, (r0, rows, 0, k))
        dst = (ctx.rank * ms + r0, rows, 0, k)
        if bulk:
            yield from twins.tile_send_bulk(ctx, "gather", p, dst, v)
        else:
            yield from twins.copy_v4_team(ctx, "gather", p, dst, v)

    return {"compute": compute, "comm": comm}


def outputs(plan: Plan, rank: int) -> dict[int, tuple[int, int, int, int]]:
    """Every tile of [M, N], on every rank."""
    return {t.index: (t.m0, t.rows, t.n0, t.cols) for t in plan.tiles}


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: gather shards, fp32 GEMM per rank, bf16."""
    full_a = torch.cat(common.per_rank(a, world)).float()
    if world.emulated_world:
        return torch.stack([full_a @ b[r].float() for r in range(world.size)]).bfloat16()
    return (full_a @ b.float()).bfloat16()
