"""GEMM + ReduceScatter: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    full = sum(a_q.float() @ b_q.float() for q in range(W))     # [M, N], fp32
    out_r = full[r * M // W : (r + 1) * M // W].bfloat16()        # [M/W, N]

Device protocol (kernels/gemm_rs.cu): every rank computes every tile of its partial product; the
epilogue reduce-adds the fp32 tile into the owner's accumulator and raises flag[u][me] on the owner;
the owner's comm role waits for all W flags of its tile u (consuming them), writes out[u] in bf16
and zeroes the accumulator tile for the next call.
"""

from __future__ import annotations

import sys

import torch

from ..interp import twins
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

SIGNALS = {0: "barrier", 1: "tile_flag"}


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k, sms)
    ms = m // W
    tiles = []
    for owner in range(W):
        tiles += grid_tiles(owner * ms, ms, n, cfg, owner, len(tiles))
    per_owner = len(tiles) // W
    block = grouped_order(-(-ms // cfg.bm), -(-n // cfg.bn), cfg, sms)  # L2-friendly within a block
    orders, comms = [], []
    for r in range(W):
        # Default: every rank walks the owners' blocks in step (tile j of every owner, then j+1), so
        # a tile's W contributions land close together and its owner finalizes it while the GEMM
        # goes on; at each step rank r sends to owner r+1 first, spreading the links' load.
        default = [((r + 1 + i) % W) * per_owner + j for j in block for i in range(W)]
        orders.append(apply_order(schedule.tile_order, r, tiles, default))
        comms.append([r * per_owner + j for j in range(per_owner)] if W > 1 else [])
    shapes = {"m": m, "n": n, "k": k}
    extra = {"per_owner": per_owner, "rows_per_rank": ms}
    return build_plan("gemm_rs", schedule, world, cfg, shapes, tiles, orders, comms, extra)


def shapes(a: torch.Tensor, b: torch.Tensor, world: World) -> dict[str, int]:
    """The global GEMM sizes (m, n, k) of a call, after checking the operands."""
    (m, kl), (_, n) = common.check_operands(a, "[M, K/W]", b, "[K/W, N]", world, "K/W")
    common.check_divides("M (rows of a)", m, world.size, f"M is split over W={world.size} ranks")
    common.check_columns("K/W", kl, n)
    return {"m": m, "n": n, "k": kl * world.size}


def gemm_rs(
    a: torch.Tensor,
    b: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM + ReduceScatter in one persistent kernel.

    Args:
        a: bf16, per rank [M, K/W] (emulated world: [W, M, K/W]); contiguous.
        b: bf16, per rank [K/W, N] (emulated world: [W, K/W, N]); contiguous.
        world: the World the ranks belong to.
        schedule: a Schedule (overlap mode, SM split, tile order...); default Schedule().
        out: optional bf16 result tensor of the result's shape (written in full; tests poison it).

    Returns:
        bf16, per rank [M/W, N] (emulated: [W, M/W, N]): rank r's rows of the sum over ranks of a@b,
        accumulated in fp32. Equivalent to ``reference.gemm_rs(a, b, world=world)``.

    Requires M divisible by W, and K/W and N multiples of 8 (16-byte rows). Raises TypeError /
    ValueError naming the argument before anything runs, CommTimeout if a wait passes the world's
    deadline.
    """
    out_shape = lambda s, W: (s["m"] // W, s["n"])  # per rank
    return common.run_op(sys.modules[__name__], a, b, world, schedule, out, out_shape)


def _workspace(world: World, plan: Plan):
    W, ms, n = world.size, plan.extra["rows_per_rank"], plan.shapes["n"]
    acc = world.symmetric(("gemm_rs", "acc"), (ms, n), torch.float32)
    flags = world.symmetric(("gemm_rs", "flags"), (plan.extra["per_owner"], W), torch.int32)
    return acc, flags, common.barrier_pad(world)


# -- GPU ----------------------------------------------------------------------------------------


def _run_gpu(world: World, plan: Plan, a, b, out: torch.Tensor) -> torch.Tensor:
    acc, flags, barrier = _workspace(world, plan)
    ms, n = plan.extra["rows_per_rank"], plan.shapes["n"]
    L = common.fill_launch(world, plan)
    common.set_operands(L, world, a, b, out)  # out: [W, M/W, N], rank stride ms * n
    L.M, L.N, L.K = a.shape[-2], n, a.shape[-1]
    L.work_ptrs, L.flag_ptrs = acc.peer_ptrs.data_ptr(), flags.peer_ptrs.data_ptr()
    L.barrier_ptrs = barrier.peer_ptrs.data_ptr()
    L.rows_per_rank, L.tiles_per_rank = ms, plan.extra["per_owner"]
    ext = common.extension()
    common.launch_and_check(world, ext.launch_gemm_rs, L, SIGNALS)
    return out


# -- CPU interpreter: program twins mirroring kernels/gemm_rs.cu ---------------------------------


def compute_program(plan: Plan):
    W, per_owner, ms = plan.world_size, plan.extra["per_owner"], plan.extra["rows_per_rank"]
    k = plan.shapes["k"] // W
    f = plan.faults

    def run(ctx, task):
        t = plan.tiles[task]
        a = yield from twins.tile_load(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        part = a.float() @ b.float()
        rect = (t.m0 - t.tag * ms, t.rows, t.n0, t.cols)
        if W == 1:
            yield from twins.output_store(ctx, "out", ctx.rank, rect, part, task)
            return
        yield from twins.reduce_add(ctx, "acc", t.tag, rect, part)
        if ctx.rank == f.silent_rank:
            return
        if ctx.rank == f.delay_rank:
            yield from twins.delay(ctx, f.delay_us)
        u = task - t.tag * per_owner
        yield from twins.signal_set_release(ctx, ctx.sig("flags", t.tag, u, ctx.rank))

    return run


def comm_program(plan: Plan):
    W, per_owner, ms = plan.world_size, plan.extra["per_owner"], plan.extra["rows_per_rank"]
    f = plan.faults

    def run(ctx, task):
        t = plan.tiles[task]
        u = task - ctx.rank * per_owner
        if ctx.rank == f.delay_rank:
            yield from twins.delay(ctx, f.delay_us)
        for j in range(W):
            src = (ctx.rank + 1 + j) % W
            yield from twins.wait_acquire_reset(ctx, ctx.sig("flags", ctx.rank, u, src), 1, src)
        rect = (t.m0 - ctx.rank * ms, t.rows, t.n0, t.cols)
        v = yield from twins.tile_load(ctx, "acc", ctx.rank, rect)
        yield from twins.output_store(ctx, "out", ctx.rank, rect, v.bfloat16(), task)
        yield from twins.tile_send(ctx, "acc", ctx.rank, rect, torch.zeros_like(v))

    return run


def _run_cpu(world: World, plan: Plan, a, b, schedule: Schedule, out) -> torch.Tensor:
    acc, flags, barrier = _workspace(world, plan)
    buffers = {"a": a, "b": b, "acc": acc.local, "out": out}
    pads = {"flags": flags.local, "barrier": barrier.local}
    # Each owner writes its own tiles (W == 1: every tile, run_interpreter's default).
    expected = None
    if world.size > 1:
        expected = {r: plan.comm_tasks[r].tolist() for r in range(world.size)}
    common.run_interpreter(
        world,
        plan,
        pads,
        buffers,
        compute_program(plan),
        comm_program(plan),
        schedule.seed,
        expected,
    )
    return out


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: fp32 GEMM per rank, sum, scatter rows,
    bf16."""
    parts = common.per_rank(a, world), common.per_rank(b, world)
    full = sum(x.float() @ y.float() for x, y in zip(*parts, strict=True))
    ms = full.shape[0] // world.size
    if world.emulated_world:
        return torch.stack([full[r * ms : (r + 1) * ms] for r in range(world.size)]).bfloat16()
    return full[world.rank * ms : (world.rank + 1) * ms].bfloat16().contiguous()
