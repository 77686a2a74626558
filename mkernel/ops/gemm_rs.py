"""GEMM + ReduceScatter: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    full = sum(a_q.float() @ b_q.float() for q in range(W))     # [M, N], fp32
    out_r = full[r * M // W : (r + 1) * M // W].bfloat16()        # [M/W, N]

Protocol (the plan's tables below; device data movement in kernels/gemm_rs.cu): every rank
computes every tile of its partial product; the epilogue reduce-adds the fp32 tile into the owner's
accumulator, then raises ``tile_flag[tile=u, src=me]`` on the owner; the owner's comm task u waits
for all W flags (consuming them), writes out[u] in bf16 and zeroes the accumulator tile for the
next call. W == 1: the engine stores bf16 tiles straight into out, nothing to communicate.
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
    name="gemm_rs",
    doc="GEMM + ReduceScatter",
    buffers=(
        Buffer("a", "input", bf16, ("m", "k_local")),
        Buffer("b", "input", bf16, ("k_local", "n")),
        Buffer("out", "output", bf16, ("rows_per_rank", "n"), "this rank's rows of the sum"),
        Buffer("acc", "symmetric", f32, ("rows_per_rank", "n"), "fp32 sums of the owned rows"),
    ),
    pads=(Pad("tile_flag", ("tile", "src"), ("per_owner", "W"), doc="src's part of tile landed"),),
    scalars=("n", "k_local", "rows_per_rank"),
)


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
    compute, comm = [], []
    for r in range(W):
        # Default: every rank walks the owners' blocks in step (tile j of every owner, then j+1), so
        # a tile's W contributions land close together and its owner finalizes it while the GEMM
        # goes on; at each step rank r sends to owner r+1 first, spreading the links' load.
        default = [((r + 1 + i) % W) * per_owner + j for j in block for i in range(W)]
        order = apply_order(schedule.tile_order, r, tiles, default)
        flags = [
            (Raise("tile_flag", t.tag, (t.index - t.tag * per_owner, r)),) if W > 1 else ()
            for t in tiles
        ]
        compute.append([Task(i, (i,), raises=flags[i]) for i in order])
        owned = range(r * per_owner, (r + 1) * per_owner) if W > 1 else ()
        comm.append(
            [
                Task(
                    i,
                    (i,),
                    waits=tuple(
                        Wait("tile_flag", r, (i - r * per_owner, (r + 1 + j) % W)) for j in range(W)
                    ),
                )
                for i in owned
            ]
        )
    shapes = {"m": m, "n": n, "k": k}
    sizes = {**shapes, "k_local": k // W, "rows_per_rank": ms, "per_owner": per_owner}
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


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
    return common.run_op(sys.modules[__name__], {"a": a, "b": b}, world, schedule, out, out_shape)


# -- CPU interpreter: data-movement twins of kernels/gemm_rs.cu ----------------------------------


def twins_of(plan: Plan):
    W, ms, k = plan.world_size, plan.sizes["rows_per_rank"], plan.sizes["k_local"]

    def compute(ctx, task):  # GemmRS::dest: the engine's tile, reduce-added into its owner
        t = plan.tiles[task.args[0]]
        a = yield from twins.tile_load_async(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        part = a.float() @ b.float()
        rect = (t.m0 - t.tag * ms, t.rows, t.n0, t.cols)
        if W == 1:
            yield from twins.output_store(ctx, "out", ctx.rank, rect, part, t.index)
        else:
            yield from twins.red_add_v2_f32_sys(ctx, "acc", t.tag, rect, part)

    def comm(ctx, task):  # GemmRS::comm_move: accumulator -> bf16 out, zeroed for the next call
        t = plan.tiles[task.args[0]]
        rect = (t.m0 - ctx.rank * ms, t.rows, t.n0, t.cols)
        v = yield from twins.tile_load(ctx, "acc", ctx.rank, rect)
        yield from twins.output_store(ctx, "out", ctx.rank, rect, v.bfloat16(), t.index)
        yield from twins.tile_send(ctx, "acc", ctx.rank, rect, torch.zeros_like(v))

    return {"compute": compute, "comm": comm}


def outputs(plan: Plan, rank: int) -> dict[int, tuple[int, int, int, int]]:
    """The output tiles rank ``rank`` holds when its kernel ends: its rows (every tile at W=1)."""
    ms = plan.sizes["rows_per_rank"]
    mine = [t for t in plan.tiles if t.tag == rank or plan.world_size == 1]
    return {t.index: (t.m0 - t.tag * ms, t.rows, t.n0, t.cols) for t in mine}


def reference(a: torch.Tensor, b: torch.Tensor, world: World) -> torch.Tensor:
    """The unfused reference in the op's conventions: fp32 GEMM per rank, sum, scatter rows,
    bf16."""
    parts = common.per_rank(a, world), common.per_rank(b, world)
    full = sum(x.float() @ y.float() for x, y in zip(*parts, strict=True))
    ms = full.shape[0] // world.size
    if world.emulated_world:
        return torch.stack([full[r * ms : (r + 1) * ms] for r in range(world.size)]).bfloat16()
    return full[world.rank * ms : (world.rank + 1) * ms].bfloat16().contiguous()
