"""The second grouped GEMM of an MoE layer fused with the combine (expert parallelism): API, plan,
layout and data-movement twins, reference. The mirror of moe_dispatch_gemm.py; one launch on a GPU
(kernels/moe_gemm_combine.cu; emulated or distributed worlds), the same tasks in the CPU
interpreter; docs/moe.md has the picture.

Unfused meaning, per source rank s (h_d: rows of destination d in the dispatch's order, the row of
(s, t, j) holding the token's activation for expert e = topk_ids[s][t, j] of rank d)::

    out[s][t] = sum(topk_weights[s][t, j] * (h_d[row(s, t, j)].float() @ w2[d][e].float())
                    for j with topk_ids[s][t, j] >= 0).bfloat16()        # zero if routed nowhere

Protocol (tasks made per call by the layout phase, from every rank's ``src`` and
``expert_offsets`` as the dispatch left them; both roles are ``Capacity``):

- compute, on destination d: per expert e, row tiles of ``tile_rows`` of its rows (row tile i of
  the rank, in expert order), each cut into BN-wide column tiles: h rows @ w2[e] with fp32
  accumulation, stored in fp32 into d's own ``partial`` rows (no atomics, no send), then
  ``tile_done[i] += 1`` on d (a row tile is done when all of its column tiles are);
- comm, on source s: per token t, for each used slot j in slot order a wait for ``tile_done[i]``
  on the rank d holding its row (its row tile's rows are the counted consumers: each is one
  token's), then ``out[t] = bf16(sum_j topk_weights[t, j] * partial@d[row])`` read from the
  peers in slot order in fp32 (deterministic, whatever order the tiles finished in); a token
  routed nowhere stores zeros without waiting. The rows come back to their token's rank as the
  reduce reads them: one fp32 row per (token, slot) crosses, each once.

The slots' places travel first: each rank's layout writes, for every row it holds (its own
``src`` and ``expert_offsets``), the (rank + 1, row, row tile, tile rows) of that row into the
row's source's ``slot_rows`` entry t * k + j (a peer store), then sets ``slots_landed[me]`` on
every rank; a layout waits for every rank's flag (resetting it) and reads its own table. An
entry of 0 is an unused slot: the reduce that reads a token's entries zeroes them, so every call
starts from zeros (the symmetric workspace starts zeroed; the next call's stores follow the entry
barrier). No layout reads a peer's input; its own ``topk_ids`` are not read on the device.

    W = 2, E_local = 1; rank 0: token 0 -> experts {0, 1}; rank 1: token 0 -> {0}
    rank 0 compute: tile 0 (rows of x0[0], x1[0]) @ w2_0[0] -> partial@0 rows 0, 1; tile_done@0[0]
    rank 1 compute: tile 0 (row of x0[0]) @ w2_1[0] -> partial@1 row 0;              tile_done@1[0]
    rank 0 comm:    token 0: wait tile_done@0[0], tile_done@1[0] | w00 p@0[0] + w01 p@1[0] -> out
    rank 1 comm:    token 0: wait tile_done@0[0] | w10 p@0[1] -> out
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..interp import twins
from ..interp.program import PlanSignals
from ..protocol import Buffer, Capacity, OpSpec, Pad, Raise, Task, Wait
from ..runtime import registry
from ..schedule import Plan, Schedule, build_plan
from ..world import World
from . import common
from .moe_common import (
    MoeDispatch,
    check_capture,
    check_columns,
    gemm_tasks,
    gemm_tiles,
    grouped_tile,
    max_rows,
    partial_rows,
    stacked,
    tile_rows,
)

# compute task: (local expert, first row, rows, first column): one BN-wide column tile of a row tile
REDUCE = 2  # comm task kind: (REDUCE, token)
SLOT_FIELDS = 4  # slot_rows columns: rank, row, row tile, rows in that tile (rank -1: unused)
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
        Buffer("topk_weights", "input", torch.float32, ("tokens", "k"), "this rank's weights"),
        Buffer("out", "output", torch.bfloat16, ("tokens", "hidden"), "this rank's tokens"),
        Buffer(
            "partial",
            "output",
            torch.float32,
            ("max_rows", "hidden"),
            "emulated worlds: this rank's expert rows in fp32, read by their sources (a per-call "
            "workspace sized by the rows: every rank's at base + rank * stride)",
        ),
        Buffer(
            "slot_rows",
            "symmetric",
            torch.int32,
            ("slots", "slot_fields"),
            "per own (token, slot): rank + 1 (0: unused), row, row tile, tile rows of its row",
        ),
        Buffer(
            "partial_peers",
            "symmetric",
            torch.float32,
            ("partial_rows", "hidden"),
            "distributed worlds: partial as a symmetric buffer (rows: the largest rank's, rounded "
            "up, moe_common.partial_rows; every row read was written in this call)",
            when="distributed",
        ),
    ),
    pads=(
        Pad(
            "slots_landed",
            ("src",),
            ("W",),
            doc="rank src's rows' places landed in my slot_rows (set by src's layout, reset here)",
        ),
        Pad(
            "tile_done",
            ("tile",),
            ("mtiles",),
            counted=True,
            doc="column tiles of row tile i here stored in partial (its rows' reduces consume it)",
        ),
    ),
    scalars=("tokens", "hidden", "inter", "experts", "k", "tile_rows", "max_rows"),
    # comm_any_order: the reduces are independent, so the warps of a CTA claim them in any
    # order, side by side (templates/persistent.cuh claim_comm; the interpreter runs each comm
    # unit as several agents claiming its tasks)
    constants=(("slot_fields", SLOT_FIELDS), ("comm_any_order", 1)),
)


def make_plan(
    schedule: Schedule,
    world: World,
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    k: int,
    partial_rows: int,
) -> Plan:
    """Empty per-rank tables of the room any routing of these shapes needs (the layout phase, or
    its twin, fills them per call). The device cuts each row tile into BN-wide column tiles.
    ``partial_rows``: rows of the symmetric fp32 ``partial_peers`` of a distributed world
    (moe_common.partial_rows; 0 in an emulated one, which has no such buffer)."""
    W, T, tr = world.size, tokens, tile_rows(schedule, tokens, k, experts)
    tile = grouped_tile(tr, world)
    rows = max_rows(W, T, k, experts)
    mtiles = -(-rows // tr) + experts  # each expert's rows cut into tiles: at most one short each
    tiles = mtiles * -(-hidden // tile.bn)
    compute = Capacity(rows=tiles, waits=0, raises=tiles)
    comm = Capacity(rows=T, waits=T * k, raises=0)
    shapes = {"tokens": T, "hidden": hidden, "inter": inter, "experts": experts, "k": k}
    shapes["partial_rows"] = partial_rows
    sizes = {
        **shapes,
        "max_rows": rows,
        "w2_rows": experts * inter,
        "offsets": experts + 1,
        "slots": T * k,
        "slot_fields": SLOT_FIELDS,
        "mtiles": mtiles,
        "tile_rows": tr,
    }
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, [], compute, comm)


def shapes(h: Any, w2: Any, dispatch: Any, topk_weights: Any, world: World) -> dict[str, int]:
    if not isinstance(dispatch, MoeDispatch):
        raise TypeError(
            f"dispatch must be the MoeDispatch of moe_dispatch_gemm, got {type(dispatch).__name__}"
        )
    if dispatch.world is not world:
        raise ValueError("dispatch was made in another world than the one passed")
    W, E, H = world.size, dispatch.experts, dispatch.hidden
    T, k = dispatch.topk_ids.shape[-2:]
    emulated = world.emulated_world
    if not emulated and isinstance(h, torch.Tensor):  # a distributed world: this rank's
        h = [h]
    n = W if emulated else 1
    if not isinstance(h, (list, tuple)) or len(h) != n:
        got = f"{len(h)} entries" if isinstance(h, (list, tuple)) else type(h).__name__
        want = f"a list of W={W} bf16 tensors [R, I] (one per rank)"
        if not emulated:
            want = "this rank's bf16 tensor [R, I] (or a one-element list of it)"
        raise TypeError(f"h must be {want}, got {got}")
    inter = None
    for i, (hd, rows) in enumerate(zip(h, dispatch.buffer_rows, strict=True)):
        d = i if emulated else world.rank
        if not isinstance(hd, torch.Tensor) or hd.dtype != torch.bfloat16:
            what = hd.dtype if isinstance(hd, torch.Tensor) else type(hd).__name__
            raise TypeError(f"h[{i}] must be a torch.bfloat16 tensor [R, I], got {what}")
        if hd.device != world.device:
            raise ValueError(f"h[{i}] is on {hd.device}, but the world's device is {world.device}")
        if hd.dim() != 2 or hd.shape[0] != rows:
            raise ValueError(
                f"h[{i}] must be [R={rows}, I] (the dispatch's rows of rank {d}), got "
                f"{tuple(hd.shape)}"
            )
        if inter is not None and hd.shape[1] != inter:
            raise ValueError(f"h[{i}] has I={hd.shape[1]} columns, h[0] has {inter}")
        inter = hd.shape[1]
    Ew, Iw, Hw = common.check_operand("w2", w2, world, 3, "[E_local, I, H]")
    if (Ew, Iw, Hw) != (E, inter, H):
        raise ValueError(
            f"w2 is [E_local, I, H] = {[Ew, Iw, Hw]}, but the dispatch has E_local={E}, "
            f"H={H} and h has I={inter}"
        )
    check_columns("I (columns of h)", inter)
    f32 = (torch.float32,)
    Tw, kw = common.check_operand("topk_weights", topk_weights, world, 2, "[T, k]", f32, False)
    if (Tw, kw) != (T, k):
        raise ValueError(f"topk_weights is [T, k] = {[Tw, kw]}, the dispatch's topk_ids {[T, k]}")
    return {
        "tokens": T,
        "hidden": H,
        "inter": inter,
        "experts": E,
        "k": k,
        # distributed: the symmetric partial's rows (a plan per size); emulated: 0, so a plan
        # serves every routing and a CUDA graph captures no new plan or allocation
        "partial_rows": 0 if emulated else partial_rows(dispatch.peak),
    }


def check_sizes(
    world: World, tokens: int, hidden: int, inter: int, experts: int, k: int, partial_rows: int
) -> None:
    """What a plan's sizes given by name need (Schedule.plan; a call's come from its dispatch
    and h, checked in shapes): k in [1, E], 16-byte rows of h and out."""
    del tokens, partial_rows  # any T >= 0; the partial's rows are the plan's to size
    if not 1 <= k <= world.size * experts:
        raise ValueError(f"k={k} must be in [1, E={world.size * experts}] (E = W * E_local)")
    check_columns("H (columns of out)", hidden)
    check_columns("I (columns of h)", inter)


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
        world: the dispatch's World (emulated: the fused kernel on a GPU, the interpreter on the
            CPU; or distributed on GPUs: the fused kernel, h this rank's tensor [R, I] or a
            one-element list of it, w2 and topk_weights this rank's).
        schedule: a Schedule (overlap, sms, ``chunk_rows``: rows per grouped-GEMM tile, as for
            the dispatch; seed).

    Returns:
        bf16, per rank [T, H] (emulated: [W, T, H]). Raises TypeError / ValueError naming the
        argument before anything runs, CommTimeout if a wait passes the world's deadline.
    """
    inputs = {"h": h, "w2": w2, "dispatch": dispatch, "topk_weights": topk_weights}
    return common.run_op(OP, inputs, world, schedule)


def prepare(
    h: Any, w2: Any, dispatch: Any, topk_weights: Any, world: Any, schedule: Any
) -> tuple[World, Schedule, Plan, dict[str, torch.Tensor]]:
    """The run path up to the run (common.prepare), for benchmarks and tests that launch or
    interpret the plan themselves: the world, the schedule, the cached plan and the buffers by
    name of one call."""
    inputs = {"h": h, "w2": w2, "dispatch": dispatch, "topk_weights": topk_weights}
    call = common.prepare(OP, inputs, world, schedule)
    return call.world, call.schedule, call.plan, _operands(call)


# -- the run path's hooks (mkernel/runtime/run.py OpDef) ---------------------------------------


def _results(call: common.Call) -> dict[str, torch.Tensor]:
    """out and the per-call fp32 partial: NaN where poisoned (result_buffer), so rows nobody
    writes show. A distributed world's partial is a placeholder: its rows are the symmetric
    partial_peers' (the workspace run_gpu adds)."""
    world, z, dev = call.world, call.sizes, call.inputs["w2"].device  # (the world's: checked)
    T, H = z["tokens"], z["hidden"]
    if not world.emulated_world:
        return {
            "out": common.result_buffer((T, H), torch.bfloat16, dev),
            "partial": torch.empty((1, H), dtype=torch.float32, device=dev),  # partial_peers'
        }
    rows = max(1, *call.inputs["dispatch"].buffer_rows)
    return {
        "out": common.result_buffer((world.size, T, H), torch.bfloat16, dev),
        "partial": common.result_buffer((world.size, rows, H), torch.float32, dev),
    }


def _operands(call: common.Call) -> dict[str, torch.Tensor]:
    """The kernel's tensors by name: h, src and expert_offsets from the dispatch (emulated: every
    rank's, stacked to one row count; distributed: this rank's, at least one row: the engine's
    TMA maps need one), w2 as [E_local * I, H] per rank, the results, topk_weights. run_cpu /
    run_gpu add the workspace (partial_peers among it in a distributed world)."""
    world, z, ins = call.world, call.sizes, call.inputs
    h, w2, dispatch = ins["h"], ins["w2"], ins["dispatch"]
    E, N, H = z["experts"], z["inter"], z["hidden"]
    if world.emulated_world:
        rows = max(1, *dispatch.buffer_rows)
        ops = {
            "h": stacked(list(h), rows),
            "w2": w2.view(world.size, E * N, H),
            "src": stacked(dispatch.src, rows),
            "expert_offsets": torch.stack(dispatch.expert_offsets).view(world.size, 1, E + 1),
        }
    else:
        hd = h if isinstance(h, torch.Tensor) else h[0]
        rows = max(1, hd.shape[0])
        ops = {
            "h": stacked([hd], rows)[0] if hd.shape[0] == 0 else hd.contiguous(),
            "w2": w2.view(E * N, H),
            "src": stacked([dispatch.src[0]], rows, -1)[0],
            "expert_offsets": dispatch.expert_offsets[0].view(1, E + 1),
        }
    return {**ops, **call.results, "topk_weights": ins["topk_weights"]}


OP = common.OpDef(
    spec=SPEC,
    make_plan=make_plan,
    shapes=lambda *args: shapes(*args),
    world_check=lambda world: check_capture(SPEC.name, world),
    results=_results,
    empty=lambda c: None if c.sizes["tokens"] else c.results["out"],  # no tokens: no launch
    operands=_operands,
    twins=lambda c: twins_of(c.plan, c.inputs["dispatch"]),
)


# -- CPU interpreter: the layout twin and the data-movement twins ---------------------------------


def slot_entries(plan: Plan, offsets: list[int], src: list[list[int]], me: int):
    """What rank ``me``'s layout writes for its rows: (source, slot t * k + j, entry) per row, the
    entry (me + 1, row, row tile, rows of that tile); row tiles numbered in ``gemm_tiles`` order."""
    k, tr = plan.sizes["k"], plan.sizes["tile_rows"]
    for i, (_, r0, n) in enumerate(gemm_tiles(offsets, tr)):
        for row in range(r0, r0 + n):
            s, t, j = src[row]
            yield s, t * k + j, [me + 1, row, i, n]


def slot_table(
    plan: Plan, offsets: list[list[int]], src: list[list[list[int]]], me: int
) -> list[list[int]]:
    """Rank ``me``'s ``slot_rows`` once every rank's entries landed: per own (token, slot), the
    (rank, row, row tile, rows of that tile) of its expert row, rank -1 for an unused slot."""
    T, k = plan.sizes["tokens"], plan.sizes["k"]
    table = [[-1, 0, 0, 0] for _ in range(T * k)]
    for d in range(len(offsets)):
        for s, q, (rank1, row, i, n) in slot_entries(plan, offsets[d], src[d], d):
            if s == me:
                table[q] = [rank1 - 1, row, i, n]
    return table


def layout_tasks(
    plan: Plan, offsets: list[int], slots: list[list[int]], me: int
) -> dict[str, list[Task]]:
    """Rank ``me``'s tasks: its experts' row tiles cut into column tiles (each adding 1 to its
    row tile's ``tile_done`` flag) and a reduce per own token, waiting for the row tile of each
    used slot in slot order (all of its column tiles)."""
    T, k, H = (plan.sizes[n] for n in ("tokens", "k", "hidden"))
    tiles_n = -(-H // plan.tile.bn)
    tasks = gemm_tasks(offsets, plan.sizes["tile_rows"], H, plan.tile.bn)
    compute = [
        Task(x, (e, r0, n, c0), raises=(Raise("tile_done", me, (i,), 1, op="add"),))
        for x, (i, e, r0, n, c0, _) in enumerate(tasks)
    ]
    comm = []
    for t in range(T):
        waits = tuple(
            Wait("tile_done", d, (i,), tiles_n, consumers=n, peer=d)
            for d, _, i, n in slots[t * k : (t + 1) * k]
            if d >= 0
        )
        comm.append(Task(t, (REDUCE, t), waits=waits))
    return {"compute": compute, "comm": comm}


def twins_of(plan: Plan, dispatch: MoeDispatch) -> common.Twins:
    """The interpreter side of one call; the layout twin reads every rank's ``expert_offsets`` and
    ``src`` (what the dispatch left in device memory), as the device's layout phase does."""
    T, H, N, k = (plan.sizes[n] for n in ("tokens", "hidden", "inter", "k"))
    E = plan.sizes["experts"]
    made: dict[int, list[list[int]]] = {}  # rank -> its slot table (slot_rows on the device)
    sig = PlanSignals(plan)

    def layout(ctx):
        me, silent = ctx.rank, ctx.rank == plan.faults.silent_rank
        offs = yield from twins.tile_load(ctx, "expert_offsets", me, (0, 1, 0, E + 1))
        offsets = offs.flatten().tolist()
        rows = yield from twins.tile_load(ctx, "src", me, (0, offsets[-1], 0, 3))
        for s, q, entry in slot_entries(plan, offsets, rows.tolist(), me):  # my rows' places
            v = torch.tensor([entry], dtype=torch.int32)
            yield from twins.peer_store(ctx, "slot_rows", s, (q, 1, 0, SLOT_FIELDS), v)
        for d in ((me + i) % ctx.W for i in range(ctx.W)):
            if not silent:  # (the fault: a silent rank raises nothing)
                yield from twins.signal_set_release(ctx, sig("slots_landed", d, me), 1)
        for d in range(ctx.W):
            yield from twins.wait_acquire_reset(ctx, sig("slots_landed", me, d), 1, d)
        table = yield from twins.tile_load(ctx, "slot_rows", me, (0, T * k, 0, SLOT_FIELDS))
        made[me] = slots = [[r - 1, row, i, n] for r, row, i, n in table.tolist()]
        return layout_tasks(plan, offsets, slots, me)

    def compute(ctx, task):  # one expert tile: h rows @ w2[e] into this rank's fp32 partial rows
        e, r0, n, c0 = task.args[:4]
        c = min(plan.tile.bn, H - c0)
        a = yield from twins.tile_load(ctx, "h", ctx.rank, (r0, n, 0, N))
        b = yield from twins.tile_load(ctx, "w2", ctx.rank, (e * N, N, c0, c))
        # the engine's fp32 epilogue: plain stores into this rank's rows (no output tile: the
        # reduces read them, the kernel end does not)
        yield from twins.tile_send(ctx, "partial", ctx.rank, (r0, n, c0, c), a.float() @ b.float())

    def comm(ctx, task):  # the weighted sum of one own token, in slot order, one bf16 store
        t = task.args[1]
        w = yield from twins.tile_load(ctx, "topk_weights", ctx.rank, (t, 1, 0, k))
        acc = torch.zeros(1, H, dtype=torch.float32)
        for j, (d, row, _, _) in enumerate(made[ctx.rank][t * k : (t + 1) * k]):
            if d >= 0:  # read from the rank that holds the row (a peer's memory)
                p = yield from twins.tile_load(ctx, "partial", d, (row, 1, 0, H))
                acc += w[0, j] * p
        yield from twins.output_store(ctx, "out", ctx.rank, (t, 1, 0, H), acc.bfloat16(), t)
        # the token's entries back to 0 (unused) for the next call
        zeros = torch.zeros(k, SLOT_FIELDS, dtype=torch.int32)
        yield from twins.peer_store(ctx, "slot_rows", ctx.rank, (t * k, k, 0, SLOT_FIELDS), zeros)

    def outputs(rank: int) -> dict[int, tuple[int, int, int, int]]:
        return {t: (t, 1, 0, H) for t in range(T)}

    return common.Twins({"compute": compute, "comm": comm}, layout, outputs)


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


registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
