"""The second grouped GEMM of an MoE layer fused with the combine (expert parallelism): API, plan,
layout and data-movement twins, reference. The mirror of moe_dispatch_gemm.py; fused in the CPU
interpreter only for now (``SPEC.device = False``; on a GPU world unfused: moe_gpu.py); docs/moe.md
has the picture.

Unfused meaning, per source rank s (h_d: rows of destination d in the dispatch's order, the row of
(s, t, j) holding the token's activation for expert e = topk_ids[s][t, j] of rank d)::

    out[s][t] = sum(topk_weights[s][t, j] * (h_d[row(s, t, j)].float() @ w2[d][e].float())
                    for j with topk_ids[s][t, j] >= 0).bfloat16()        # zero if routed nowhere

Protocol (tasks made per call by the layout twin, from the dispatch's ``src`` and
``expert_offsets`` and the rank's own routing ids; both roles are ``Capacity``):

- compute, on destination d: per expert e, tiles of ``tile_rows`` of its rows: h rows @ w2[e] with
  fp32 accumulation; each fp32 result row goes back to its source rank as a bulk copy into the
  source's ``partial[t * k + j]`` (its own row: no atomics), raising ``token_back[t] += 1`` there;
- comm, on source s: per token t, wait for ``token_back[t] == its used slots``, then sum
  ``topk_weights[t, j] * partial[t * k + j]`` over its slots in slot order in fp32 (deterministic,
  whatever order the rows landed in) and store the bf16 row once; a token routed nowhere stores
  zeros. No expert tile waits for anything: h and w2 are inputs, written before the launch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..interp import twins
from ..protocol import Buffer, Capacity, OpSpec, Pad, Raise, Task, Wait
from ..schedule import TILE_CONFIGS, Plan, Schedule, build_plan
from ..world import World
from . import common, moe_gpu
from .moe_common import (
    MoeDispatch,
    Twins,
    check_columns,
    check_tensor,
    gemm_tiles,
    max_rows,
    on_gpu_path,
    stacked,
    tile_rows,
)

GEMM = 1  # compute task kind (args[0]): (GEMM, local expert, first row, rows)
REDUCE = 2  # comm task kind: (REDUCE, token)
SPEC = OpSpec(
    name="moe_gemm_combine",
    doc="second grouped GEMM + combine: out[t] = sum_j w[t, j] * (h_row(t, j) @ w2[e])",
    buffers=(
        Buffer("h", "input", torch.bfloat16, ("max_rows", "inter"), "rows in dispatch order"),
        Buffer("w2", "input", torch.bfloat16, ("w2_rows", "hidden"), "[E_local * I, H] experts"),
        Buffer(
            "src", "input", torch.int32, ("max_rows", "3"), "the dispatch's (rank, token, slot)"
        ),
        Buffer("expert_offsets", "input", torch.int32, ("1", "offsets"), "the dispatch's"),
        Buffer("topk_ids", "input", torch.int32, ("tokens", "k"), "this rank's routing"),
        Buffer("topk_weights", "input", torch.float32, ("tokens", "k"), "this rank's weights"),
        Buffer("out", "output", torch.bfloat16, ("tokens", "hidden"), "this rank's tokens"),
        Buffer("partial", "symmetric", torch.float32, ("slots", "hidden"), "expert rows, fp32"),
    ),
    pads=(Pad("token_back", ("token",), ("tokens",), doc="rows of my token t landed in partial"),),
    scalars=("tokens", "hidden", "inter", "experts", "k", "tile_rows"),
    device=False,
)


def make_plan(
    schedule: Schedule, world: World, tokens: int, hidden: int, inter: int, experts: int, k: int
) -> Plan:
    """Empty per-rank tables of the room any routing of these shapes needs (the layout twin fills
    them per call)."""
    W, T, tr = world.size, tokens, tile_rows(schedule)
    rows = max_rows(W, T, k, experts)
    tiles = -(-rows // tr) + experts
    compute = Capacity(rows=tiles, waits=0, raises=rows)
    comm = Capacity(rows=T, waits=T, raises=0)
    shapes = {"tokens": T, "hidden": hidden, "inter": inter, "experts": experts, "k": k}
    sizes = {
        **shapes,
        "max_rows": rows,
        "w2_rows": experts * inter,
        "offsets": experts + 1,
        "slots": T * k,
        "tile_rows": tr,
    }
    tile = TILE_CONFIGS["64x128x64"]  # unused until a grouped-GEMM engine exists
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, [], compute, comm)


def shapes(h: Any, w2: Any, dispatch: Any, topk_weights: Any, world: World) -> dict[str, int]:
    if not isinstance(dispatch, MoeDispatch):
        raise TypeError(
            f"dispatch must be the MoeDispatch of moe_dispatch_gemm, got {type(dispatch).__name__}"
        )
    if dispatch.world is not world:
        raise ValueError("dispatch was made in another world than the one passed")
    W, E, H = world.size, dispatch.experts, dispatch.hidden
    T, k = dispatch.topk_ids.shape[1:]
    if not isinstance(h, (list, tuple)) or len(h) != W:
        got = f"{len(h)} entries" if isinstance(h, (list, tuple)) else type(h).__name__
        raise TypeError(f"h must be a list of W={W} bf16 tensors [R, I] (one per rank), got {got}")
    inter = None
    for d, (hd, rows) in enumerate(zip(h, dispatch.rows, strict=True)):
        if not isinstance(hd, torch.Tensor) or hd.dtype != torch.bfloat16:
            what = hd.dtype if isinstance(hd, torch.Tensor) else type(hd).__name__
            raise TypeError(f"h[{d}] must be a torch.bfloat16 tensor [R, I], got {what}")
        if hd.device != world.device:
            raise ValueError(f"h[{d}] is on {hd.device}, but the world's device is {world.device}")
        if hd.dim() != 2 or hd.shape[0] != rows:
            raise ValueError(
                f"h[{d}] must be [R={rows}, I] (the dispatch's rows of rank {d}), got "
                f"{tuple(hd.shape)}"
            )
        if inter is not None and hd.shape[1] != inter:
            raise ValueError(f"h[{d}] has I={hd.shape[1]} columns, h[0] has {inter}")
        inter = hd.shape[1]
    Ew, Iw, Hw = common.check_operand("w2", w2, world, 3, "[E_local, I, H]")
    if (Ew, Iw, Hw) != (E, inter, H):
        raise ValueError(
            f"w2 is [E_local, I, H] = {[Ew, Iw, Hw]}, but the dispatch has E_local={E}, "
            f"H={H} and h has I={inter}"
        )
    check_columns("I (columns of h)", inter)
    Tw, kw = check_tensor("topk_weights", topk_weights, world, "[T, k]", (torch.float32,))
    if (Tw, kw) != (T, k):
        raise ValueError(f"topk_weights is [T, k] = {[Tw, kw]}, the dispatch's topk_ids {[T, k]}")
    return {"tokens": T, "hidden": H, "inter": inter, "experts": E, "k": k}


def prepare(
    h: Any, w2: Any, dispatch: Any, topk_weights: Any, world: Any, schedule: Any
) -> tuple[World, Schedule, Plan, dict[str, torch.Tensor]]:
    """Every check, then the cached plan and the buffers by name of one call."""
    world = common.check_world_for(SPEC, world)
    schedule = common.check_schedule(schedule)
    s = shapes(h, w2, dispatch, topk_weights, world)
    common.check_faults(schedule, world)
    plan = common.cached_plan(sys.modules[__name__], schedule, world, **s)
    W, E, N, H = world.size, s["experts"], s["inter"], s["hidden"]
    rows = max(dispatch.rows)
    buffers = {
        "h": stacked(list(h), rows),
        "w2": w2.view(W, E * N, H),
        "src": stacked(dispatch.src, rows),
        "expert_offsets": torch.stack(dispatch.expert_offsets).view(W, 1, E + 1),
        "topk_ids": dispatch.topk_ids,
        "topk_weights": topk_weights,
        "out": common.check_out(None, world, (s["tokens"], H)),  # poisoned
    }  # run_cpu adds the workspace (common.workspace)
    return world, schedule, plan, buffers


def moe_gemm_combine(
    h: list[torch.Tensor],
    w2: torch.Tensor,
    dispatch: MoeDispatch,
    topk_weights: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
) -> torch.Tensor:
    """Second grouped GEMM + combine in one kernel: every expert row times w2 goes back to its
    token's rank, which sums its slots weighted.

    Unfused equivalent, per source rank s (the row of (s, t, j) on rank d = its expert's rank)::

        out[s][t] = sum_j topk_weights[s][t, j] * (h[d][row(s, t, j)].float() @ w2[d][e].float())

    in fp32, one bf16 rounding; zero for a token routed nowhere.

    Args:
        h: a list of W bf16 tensors [R_d, I] (R_d: the dispatch's rows of rank d) in the
            dispatch's row order, e.g. an activation of ``dispatch.y``; I a multiple of 8.
        w2: bf16, per rank [E_local, I, H] (emulated world: [W, E_local, I, H]).
        dispatch: the MoeDispatch of ``moe_dispatch_gemm`` in this world.
        topk_weights: fp32, per rank [T, k]: the weight of each slot (unused slots are ignored).
        world: the dispatch's World (emulated; on a GPU the unfused path, moe_gpu.py; or
            distributed on GPUs, moe_dist.py, where h is this rank's tensor [R, I]).
        schedule: a Schedule (overlap, sms, ``chunk_rows``: rows per grouped-GEMM tile, seed).

    Returns:
        bf16, per rank [T, H] (emulated: [W, T, H]). Raises TypeError / ValueError naming the
        argument before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    if isinstance(world, World) and world.on_gpu and not world.emulated_world:
        from . import moe_dist  # products back to their tokens' ranks by all_to_all_single

        common.check_schedule(schedule)
        hr = moe_dist.check_combine(h, w2, dispatch, topk_weights, world)
        return moe_dist.combine(hr, w2, dispatch, topk_weights, world, moe_dist.engine_gemm)
    if on_gpu_path(SPEC.name, world):
        common.check_schedule(schedule)
        shapes(h, w2, dispatch, topk_weights, world)
        return moe_gpu.combine(list(h), w2, dispatch, topk_weights)
    world, schedule, plan, buffers = prepare(h, w2, dispatch, topk_weights, world, schedule)
    tw = twins_of(plan, dispatch)
    common.run_cpu(world, plan, buffers, tw.moves, tw.outputs, schedule.seed, tw.layout, "out")
    return buffers["out"]


# -- CPU interpreter: the layout twin and the data-movement twins ---------------------------------


def layout_tasks(
    plan: Plan, offsets: list[int], src: list[list[int]], ids: list[list[int]], me: int
) -> dict[str, list[Task]]:
    """Rank ``me``'s tasks: its experts' GEMM tiles (each row raising its token's flag on the
    row's source rank) and a reduce per own token (waiting for all of its rows)."""
    tiles = gemm_tiles(offsets, plan.sizes["tile_rows"])
    compute = [
        Task(i, (GEMM, e, r0, n), raises=tuple(
            Raise("token_back", s, (t,), 1, op="add") for s, t, _ in src[r0 : r0 + n]
        ))
        for i, (e, r0, n) in enumerate(tiles)
    ]  # fmt: skip
    E, comm = plan.sizes["experts"], []
    for t, row in enumerate(ids):
        used = [g for g in row if g >= 0]
        waits = (Wait("token_back", me, (t,), len(used), peer=min(used) // E),) if used else ()
        comm.append(Task(t, (REDUCE, t), waits=waits))
    return {"compute": compute, "comm": comm}


def twins_of(plan: Plan, dispatch: MoeDispatch) -> Twins:
    """The interpreter side of one call; the layout twin reads the dispatch's routing tables (on
    the device: what the dispatch's layout phase left in device memory)."""
    T, H, N, k = (plan.sizes[n] for n in ("tokens", "hidden", "inter", "k"))
    E = plan.sizes["experts"]
    made: dict[int, tuple[list[list[int]], list[list[int]]]] = {}  # rank -> (src rows, ids)

    def layout(ctx):
        me = ctx.rank
        offs = yield from twins.tile_load(ctx, "expert_offsets", me, (0, 1, 0, E + 1))
        offsets = offs.flatten().tolist()
        src = yield from twins.tile_load(ctx, "src", me, (0, offsets[-1], 0, 3))
        ids = yield from twins.tile_load(ctx, "topk_ids", me, (0, T, 0, k))
        made[me] = (src.tolist(), ids.tolist())
        return layout_tasks(plan, offsets, *made[me], me)

    def compute(ctx, task):  # one expert tile: h rows @ w2[e], each row back to its source
        _, e, r0, n = task.args[:4]
        a = yield from twins.tile_load(ctx, "h", ctx.rank, (r0, n, 0, N))
        b = yield from twins.tile_load(ctx, "w2", ctx.rank, (e * N, N, 0, H))
        rows = a.float() @ b.float()  # fp32, [n, H]
        for i, (s, t, j) in enumerate(made[ctx.rank][0][r0 : r0 + n]):
            yield from twins.tile_send_bulk(
                ctx, "partial", s, (t * k + j, 1, 0, H), rows[i : i + 1]
            )

    def comm(ctx, task):  # the weighted sum of one own token, in slot order, one bf16 store
        t = task.args[1]
        w = yield from twins.tile_load(ctx, "topk_weights", ctx.rank, (t, 1, 0, k))
        acc = torch.zeros(1, H, dtype=torch.float32)
        for j, g in enumerate(made[ctx.rank][1][t]):
            if g >= 0:
                p = yield from twins.tile_load(ctx, "partial", ctx.rank, (t * k + j, 1, 0, H))
                acc += w[0, j] * p
        yield from twins.output_store(ctx, "out", ctx.rank, (t, 1, 0, H), acc.bfloat16(), t)

    def outputs(rank: int) -> dict[int, tuple[int, int, int, int]]:
        return {t: (t, 1, 0, H) for t in range(T)}

    return Twins({"compute": compute, "comm": comm}, layout, outputs)


def reference(
    h: list[torch.Tensor],
    w2: torch.Tensor,
    dispatch: MoeDispatch,
    topk_weights: torch.Tensor,
    world: World,
) -> torch.Tensor:
    """The unfused reference (emulated worlds): every row's fp32 product, weighted into its token's
    fp32 sum, one bf16 rounding."""
    W, T, H = world.size, dispatch.topk_ids.shape[1], dispatch.hidden
    acc = torch.zeros(W, T, H, dtype=torch.float32, device=w2.device)
    for d in range(W):
        offs = dispatch.expert_offsets[d].tolist()
        for e in range(len(offs) - 1):
            for r in range(offs[e], offs[e + 1]):
                s, t, j = dispatch.src[d][r].tolist()
                acc[s, t] += topk_weights[s, t, j] * (h[d][r].float() @ w2[d, e].float())
    return acc.bfloat16()
