"""GEMM + AllReduce: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    out_r = sum(a_q.float() @ b_q.float() for q in range(W)).bfloat16()   # [M, N], same on all

Device protocol (kernels/gemm_ar.cu), no multicast: tile t of the [M, N] output is owned by rank
t % W. Every rank computes every tile of its partial product (all ranks in the same row-major order,
so a tile's W contributions arrive close together, while consecutive tiles go to different owners);
the epilogue reduce-adds the fp32 tile into the owner's accumulator and raises
``tile_flag[t][me]`` there. The owner's comm role waits for all W flags of t (consuming them),
converts the accumulator tile to bf16, writes it into EVERY rank's result (its own first), zeroes
the accumulator tile for the next call and raises ``tile_ready[t]`` on every peer. Each rank's comm
role then waits for ``tile_ready`` of every tile it does not own, so no kernel exits before its
whole result has landed.

    W = 2, tiles t0 t1 t2 t3 (owners 0 1 0 1)
    compute, both ranks: t0 t1 t2 t3  -- red.add --> acc[owner] ; tile_flag[t][me] on the owner
    rank 0 comm:  finalize t0, t2 (-> out[0], out[1]; tile_ready on 1), then wait tile_ready t1, t3
    rank 1 comm:  finalize t1, t3 (-> out[1], out[0]; tile_ready on 0), then wait tile_ready t0, t2

In a distributed world the peers write into a symmetric ``result`` buffer, copied into ``out`` after
the kernel (one extra [M, N] device copy per call); an emulated world writes ``out`` directly.
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


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k // W, sms)
    tiles = [t._replace(tag=t.index % W) for t in grid_tiles(0, m, n, cfg, 0, 0)]  # tag = owner
    T = len(tiles)
    default = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)  # same on every rank
    orders, comms = [], []
    for r in range(W):
        orders.append(apply_order(schedule.tile_order, r, tiles, default))
        # Finalize ids t (owned tiles) first, then "wait tile_ready t" ids T + t for the others.
        # NOTE: no cycle. A unit takes every n-th entry of this list, so each unit runs all of its
        # finalizes before any of its waits; a finalize waits only on compute epilogues, which wait
        # on nothing; so every finalize completes, and with them every tile_ready a wait needs.
        owned = [t for t in range(T) if t % W == r]
        # W == 1: the epilogue stores the bf16 tile straight into out; nothing to communicate.
        comms.append(owned + [T + t for t in range(T) if t % W != r] if W > 1 else [])
    shapes = {"m": m, "n": n, "k": k}
    return build_plan("gemm_ar", schedule, world, cfg, shapes, tiles, orders, comms, {"tiles": T})


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
        fp32 (the same on every rank). Equivalent to ``reference.gemm_ar(a, b, world=world)``.
        In a distributed world peers write a symmetric buffer that is then copied into ``out``
        (one extra device copy of [M, N] bf16).

    Requires M >= 1, and K/W and N multiples of 8 (16-byte rows). Raises TypeError / ValueError
    naming the argument before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    out_shape = lambda s, W: (s["m"], s["n"])  # per rank
    return common.run_op(sys.modules[__name__], a, b, world, schedule, out, out_shape)


def _workspace(world: World, plan: Plan):
    W, m, n, T = world.size, plan.shapes["m"], plan.shapes["n"], plan.extra["tiles"]
    acc = world.symmetric(("gemm_ar", "acc"), (m, n), torch.float32)  # owned tiles only are used
    flags = world.symmetric(("gemm_ar", "flags"), (T, W), torch.int32)
    ready = world.symmetric(("gemm_ar", "ready"), (T,), torch.int32)
    return acc, flags, ready, common.barrier_pad(world)


# -- GPU ----------------------------------------------------------------------------------------


def _run_gpu(world: World, plan: Plan, a, b, out: torch.Tensor) -> torch.Tensor:
    acc, flags, ready, barrier = _workspace(world, plan)
    m, n = plan.shapes["m"], plan.shapes["n"]
    L = common.fill_launch(world, plan)
    common.set_operands(L, world, a, b)  # out differs by world: set below
    result = None
    if world.emulated_world:  # peers' results are slices of one tensor: out + p * M * N
        L.out, L.out_rank_stride, L.aux_ptr = out.data_ptr(), m * n, 0
    else:  # peers' results must be symmetric memory: their addresses come from a table
        result = world.symmetric(("gemm_ar", "result"), (m, n), torch.bfloat16)
        L.out, L.aux_ptr = result.local.data_ptr(), result.peer_ptrs.data_ptr()
    L.M, L.N, L.K = m, n, a.shape[-1]
    L.work_ptrs, L.flag_ptrs = acc.peer_ptrs.data_ptr(), flags.peer_ptrs.data_ptr()
    L.flag2_ptrs, L.barrier_ptrs = ready.peer_ptrs.data_ptr(), barrier.peer_ptrs.data_ptr()
    L.tiles_per_rank = plan.extra["tiles"]
    common.launch_and_check(world, common.extension().launch_gemm_ar, L, common.SIGNAL_NAMES)
    if result is not None:
        out.copy_(result.local)
    return out


# -- CPU interpreter: program twins mirroring kernels/gemm_ar.cu ---------------------------------


def compute_program(plan: Plan):
    k = plan.shapes["k"] // plan.world_size
    f = plan.faults

    def run(ctx, task):
        t = plan.tiles[task]
        a = yield from twins.tile_load(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        rect = (t.m0, t.rows, t.n0, t.cols)
        if plan.world_size == 1:
            yield from twins.output_store(ctx, "out", ctx.rank, rect, a.float() @ b.float(), task)
            return
        yield from twins.reduce_add(ctx, "acc", t.tag, rect, a.float() @ b.float())
        if ctx.rank == f.silent_rank:
            return
        if ctx.rank == f.delay_rank:
            yield from twins.delay(ctx, f.delay_us)
        yield from twins.signal_set_release(ctx, ctx.sig("tile_flag", t.tag, task, ctx.rank))

    return run


def comm_program(plan: Plan):
    W, T = plan.world_size, plan.extra["tiles"]
    f = plan.faults

    def run(ctx, task):
        me = ctx.rank
        if task >= T:  # wait until the owner's reduced tile has landed in our result
            t = task - T
            yield from twins.wait_acquire_reset(ctx, ctx.sig("tile_ready", me, t), 1, t % W)
            return
        t = plan.tiles[task]
        if me == f.delay_rank:
            yield from twins.delay(ctx, f.delay_us)
        for j in range(W):
            src = (me + 1 + j) % W
            yield from twins.wait_acquire_reset(ctx, ctx.sig("tile_flag", me, task, src), 1, src)
        rect = (t.m0, t.rows, t.n0, t.cols)
        v = yield from twins.tile_load(ctx, "acc", me, rect)
        for j in range(W):  # own result first, then r+1, r+2, ...
            yield from twins.output_store(ctx, "out", (me + j) % W, rect, v.bfloat16(), task)
        yield from twins.tile_send(ctx, "acc", me, rect, torch.zeros_like(v))
        if me == f.silent_rank:
            return
        for j in range(1, W):
            yield from twins.signal_set_release(ctx, ctx.sig("tile_ready", (me + j) % W, task))

    return run


def _run_cpu(world: World, plan: Plan, a, b, schedule: Schedule, out) -> torch.Tensor:
    acc, flags, ready, barrier = _workspace(world, plan)
    buffers = {"a": a, "b": b, "acc": acc.local, "out": out}
    pads = {"tile_flag": flags.local, "tile_ready": ready.local, "barrier": barrier.local}
    programs = compute_program(plan), comm_program(plan)
    common.run_interpreter(world, plan, pads, buffers, *programs, schedule.seed)
    return out


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: fp32 GEMM per rank, sum, bf16 everywhere."""
    parts = common.per_rank(a, world), common.per_rank(b, world)
    full = sum(x.float() @ y.float() for x, y in zip(*parts, strict=True)).bfloat16()
    if world.emulated_world:
        return full.expand(world.size, *full.shape).contiguous()
    return full
