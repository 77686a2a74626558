"""MoE dispatch fused with the first grouped GEMM (expert parallelism): API, plan, layout and
data-movement twins, reference. One launch on a GPU (kernels/moe_dispatch_gemm.cu: every rank of
an emulated world, or this process's rank of a distributed one; its layout phase makes the same
tasks as the twin here), the same protocol in the CPU interpreter. docs/moe.md has the picture.

Unfused meaning, per destination rank d of W (E_local experts per rank, global id d * E_local + e)::

    for e in range(E_local):                   # rows of expert e: by source rank, token, slot
        for s in range(W):
            for t, j with topk_ids[s][t, j] == d * E_local + e:
                y_d.append((x[s][t].float() @ w1[d][e].float()).bfloat16()); src_d.append((s, t, j))

Protocol. The routing first: the layout phase of every rank stores its routing ids into every
rank's ``ids_all`` (rows s * T for rank s) and sets ``ids_landed[s]`` there, waits until every
rank's have landed (resetting each flag), then computes from them, locally, the
Routing (moe_common.py): prefix sums give each token copy its receive row and each (token, slot)
its y row before any data moves. Its tasks, made per call (the comm and compute roles are
``Capacity``: how many tasks a rank runs is routing data):

- comm, on source s: pushes of its tokens, destinations nearest first: x_token is copied once to
  each rank it feeds, into that rank's ``recv`` row s * T + (its position among s's tokens that
  feed it); a push moves a run of up to PIECE_ROWS such tokens (rows gathered by index, one bulk
  stream) and adds their number to ``landed[s]`` there;
- comm, on destination d, after its pushes: the expands, per (local expert e, source s) pieces
  of up to PIECE_ROWS of e's rows from s, expert by expert: each waits ``landed[s] == tokens of
  s sent to d`` (all of s's pieces are its counted consumers), copies its rows' tokens from
  ``recv`` into ``expanded`` (the rows in y's order: the GEMM's A, loaded by TMA on the device)
  and adds its rows to ``expert_rows[e, s]``;
- compute, on destination d: per expert e, tiles of ``tile_rows`` of its rows, each cut into
  BN-wide column tiles (the engine's tile); each waits, for every source s that sends e rows,
  for ``expert_rows[e, s] == rows of e from s`` (so an expert's GEMM starts once its own rows are
  expanded, not after a global barrier; twice the patience of the expands' waits, so a late
  source is named by the expand that waits for it; the tiles of e are its counted consumers,
  the last resets the flags), multiplies its ``expanded`` rows by w1[e] with fp32 accumulation
  and stores its bf16 rows of ``y`` (the kernel end reads them).

    W = 2, E_local = 1; rank 0's token 0 -> experts {0, 1}, token 1 -> {1}; rank 1's token 0 -> {0}
    rank 0 comm:  push x0[0] -> recv_0[0] (+1 landed_0[0]); x0[0:2] -> recv_1[0:2]
                  (+2 landed_1[0]); expand (e 0, s 0): wait landed_0[0] == 1,
                  recv_0[0] -> expanded_0[0] (+1 expert_rows_0[0, 0]); (e 0, s 1): wait
                  landed_0[1] == 1, recv_0[T] -> expanded_0[1] (+1 expert_rows_0[0, 1])
    rank 1 comm:  push x1[0] -> recv_0[T] (+1 landed_0[1]); expand (e 0, s 0): wait
                  landed_1[0] == 2, recv_1[0:2] -> expanded_1[0:2] (+2 expert_rows_1[0, 0])
    rank 0 compute: wait expert_rows_0[0, 0] == 1, [0, 1] == 1 -> y_0 = expanded_0[0:2] @ w1_0[0]
    rank 1 compute: wait expert_rows_1[0, 0] == 2 -> y_1 = expanded_1[0:2] @ w1_1[0]
"""

from __future__ import annotations

import sys
from collections import Counter
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
    Routing,
    bad_id,
    capturing,
    check_capture,
    check_columns,
    check_ids,
    dispatch_result,
    gemm_tasks,
    grouped_tile,
    max_rows,
    route,
    rows_per_rank,
    tile_rows,
)

PUSH = 0  # comm task kind (args[0]): (PUSH, destination, first position in send_map, tokens)
EXPAND = 1  # comm task kind: (EXPAND, first y row, rows, source): their tokens into ``expanded``
PIECE_ROWS = 32  # rows per push or expand task (at most): runs of rows, one bulk stream each
# compute task: (local expert, first row, rows, first column): one BN-wide column tile of a row tile
SPEC = OpSpec(
    name="moe_dispatch_gemm",
    doc="MoE dispatch + the first grouped GEMM (x_token @ w1[e] per routed (token, slot))",
    buffers=(
        Buffer("x", "input", torch.bfloat16, ("tokens", "hidden"), "this rank's tokens"),
        Buffer("topk_ids", "input", torch.int32, ("tokens", "k"), "global expert ids, -1 unused"),
        Buffer("w1", "input", torch.bfloat16, ("w1_rows", "inter"), "[E_local * H, I] experts"),
        Buffer("y", "output", torch.bfloat16, ("max_rows", "inter"), "grouped-GEMM rows here"),
        Buffer("src", "output", torch.int32, ("max_rows", "3"), "(source, token, slot) per row"),
        Buffer("expert_offsets", "output", torch.int32, ("1", "offsets"), "row prefix per expert"),
        Buffer("recv", "symmetric", torch.bfloat16, ("recv_rows", "hidden"), "tokens sent here"),
        Buffer(
            "row_map",
            "symmetric",
            torch.int32,
            ("max_rows",),
            "the device layout's: the receive row of each y row",
        ),
        Buffer(
            "ids_all",
            "symmetric",
            torch.int32,
            ("ids_rows", "k"),
            "every rank's topk_ids (rank s's at rows s * T), written by the ranks' layouts",
        ),
        Buffer(
            "send_map",
            "symmetric",
            torch.int32,
            ("W", "tokens"),
            "the device layout's: per destination d, my tokens that feed d (token order)",
        ),
        Buffer(
            "expanded",
            "output",
            torch.bfloat16,
            ("max_rows", "hidden"),
            "each y row's token, copied here from recv (the GEMM's A; a per-call workspace "
            "sized by the rows, every rank's at base + rank * stride)",
        ),
    ),
    pads=(
        Pad(
            "ids_landed",
            ("src",),
            ("W",),
            doc="rank src's topk_ids landed in my ids_all (set by src's layout, reset by mine)",
        ),
        Pad(
            "landed",
            ("src",),
            ("W",),
            counted=True,
            doc="token copies from rank src landed in my recv (added by src, one per token)",
        ),
        Pad(
            "expert_rows",
            ("expert", "src"),
            ("experts", "W"),
            counted=True,
            doc="rows of local expert e from rank src expanded here (added by my expand tasks)",
        ),
    ),
    scalars=("tokens", "hidden", "inter", "experts", "k", "tile_rows", "max_rows"),
    constants=(("piece_rows", PIECE_ROWS),),
)


def bad_input_detail(plan: Plan, rank: int, task: int, index: int, value: int) -> str:
    """The message of a bad input the device layout recorded (runtime/gpu.py bad_input): routing id
    ``value`` of ``rank``'s token ``task``, slot ``index``."""
    return bad_id(value, rank, task, index, plan.world_size * plan.sizes["experts"])


def make_plan(
    schedule: Schedule, world: World, tokens: int, hidden: int, inter: int, experts: int, k: int
) -> Plan:
    """Empty per-rank tables of the room any routing of these shapes needs (the layout phase, or
    its twin, fills them per call): a plan per shape, cached like every op's. A compute task is
    one BN-wide column tile of a row tile, so the compute room counts those."""
    W, T, tr = world.size, tokens, tile_rows(schedule, tokens, k, experts)
    # 128-row tiles: 128 x 256 (Schedule.tile may name 128x128x64): the grouped GEMM alone picks
    # it at these shapes (schedule.pick_grouped_tile) and ran faster than 128 x 128 (docs/moe.md)
    wide = schedule.tile if schedule.tile in ("128x128x64", "128x256x64") else "128x256x64"
    tile = grouped_tile(tr, world, wide)
    rows = max_rows(W, T, k, experts)
    tiles = (-(-rows // tr) + experts) * -(-inter // tile.bn)  # at most one short row tile each
    pushes = -(-T * min(k, W) // PIECE_ROWS) + W  # at most one short piece per destination
    expands = -(-rows // PIECE_ROWS) + experts * W  # at most one short piece per (expert, source)
    comm = Capacity(rows=pushes + expands, waits=expands, raises=pushes + expands)
    compute = Capacity(rows=tiles, waits=tiles * W, raises=0)  # a wait per source
    shapes = {"tokens": T, "hidden": hidden, "inter": inter, "experts": experts, "k": k}
    sizes = {
        **shapes,
        "w1_rows": experts * hidden,
        "max_rows": rows,
        "offsets": experts + 1,
        "recv_rows": W * T,  # every token of every rank, once
        "ids_rows": W * T,
        "tile_rows": tr,
    }
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, [], compute, comm)


def shapes(x: Any, topk_ids: Any, w1: Any, world: World) -> dict[str, int]:
    T, H = common.check_operand("x", x, world, 2, "[T, H]")
    ids_types = (torch.int32, torch.int64)
    Ti, k = common.check_operand("topk_ids", topk_ids, world, 2, "[T, k]", ids_types, False)
    E, Hw, N = common.check_operand("w1", w1, world, 3, "[E_local, H, I]")
    if Ti != T:
        raise ValueError(f"topk_ids has {Ti} tokens (rows), x has {T}")
    if Hw != H:
        raise ValueError(f"w1 is [E_local, H, I] = {[E, Hw, N]} but x has H={H} columns")
    if E < 1:
        raise ValueError(f"w1 has E_local={E} experts: each rank needs at least one")
    check_sizes(world, T, H, N, E, k)
    return {"tokens": T, "hidden": H, "inter": N, "experts": E, "k": k}


def check_sizes(world: World, tokens: int, hidden: int, inter: int, experts: int, k: int) -> None:
    """What a plan's sizes need (shapes' checks, and Schedule.plan's by name): k in [1, E],
    16-byte rows of x and y."""
    del tokens  # any T >= 0 (a call of no tokens launches nothing)
    if not 1 <= k <= world.size * experts:
        raise ValueError(
            f"k (columns of topk_ids)={k} must be in [1, E={world.size * experts}] "
            "(E = W * E_local)"
        )
    check_columns("H (columns of x)", hidden)
    check_columns("I (columns of w1)", inter)


def moe_dispatch_gemm(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    world: World,
    schedule: Schedule | None = None,
) -> MoeDispatch:
    """MoE dispatch + first grouped GEMM in one kernel: each rank's tokens go to the ranks of the
    experts they are routed to (once per destination rank) and are multiplied there by w1.

    Unfused equivalent, per destination rank d (module docstring for the row order)::

        y[d] = [x[s][t].float() @ w1[d][e].float() for e, s, t, j routed to d].bfloat16()

    Args:
        x: bf16, per rank [T, H] (emulated world: [W, T, H]); H a multiple of 8.
        topk_ids: int32 or int64, per rank [T, k]: global expert ids in [0, E), E = W * E_local,
            or -1 for an unused slot; a token's ids are distinct; 1 <= k <= E.
        w1: bf16, per rank [E_local, H, I]: this rank's experts; I a multiple of 8.
        world: an emulated World (on the CPU the interpreter runs the fused protocol, on a GPU
            the fused kernel) or a distributed one on GPUs (the fused kernel, this rank's
            tensors: x [T, H], topk_ids [T, k], the same T on every rank; the result holds
            one-element lists, this rank's; the rows per rank by one all-gather of counts).
        schedule: a Schedule (overlap, sms, ``chunk_rows``: rows per grouped-GEMM tile, at most
            128 on a GPU; default 128 when T * k >= 128 * E_local, else 64; seed).

    Returns:
        MoeDispatch: per rank ``y`` [R, I] bf16, ``src`` [R, 3] int32 (source rank, token, slot),
        ``expert_offsets`` [E_local + 1] int32, and what ``moe_gemm_combine`` needs. Under
        CUDA-graph capture nothing is read back to size the results: ``y``
        and ``src`` hold the worst case's rows (W * T * min(k, E_local)), of which each replay's
        are the first ``expert_offsets[-1]`` (``MoeDispatch.captured``); the combine takes such a
        result as it is. Raises TypeError / ValueError naming the argument before anything runs
        (under capture the ids are checked on the device instead: DeviceInputError, as below),
        CommTimeout if a wait passes the world's deadline, DeviceInputError (a ValueError, raised
        like a timeout: by the next call, ``world.check()`` or the watchdog) if the kernel found
        an expert id outside [-1, E) or repeated within a token (it ignored that slot).
    """
    inputs = {"x": x, "topk_ids": topk_ids, "w1": w1}
    return common.run_op(OP, inputs, world, schedule)


def prepare(
    x: Any, topk_ids: Any, w1: Any, world: Any, schedule: Any
) -> tuple[World, Schedule, Plan, Routing, dict[str, torch.Tensor]]:
    """The run path up to the run (common.prepare) in an emulated CPU world, for tests that run
    the interpreter themselves: the world, the schedule, the cached plan, the host's routing and
    the buffers by name."""
    inputs = {"x": x, "topk_ids": topk_ids, "w1": w1}
    call = common.prepare(OP, inputs, world, schedule)
    return call.world, call.schedule, call.plan, call.state["routing"], _operands(call)


# -- the run path's hooks (mkernel/runtime/run.py OpDef) ---------------------------------------


def _check(call: common.Call) -> None:
    """The routing ids, before anything runs (both paths): in an emulated world (not under
    capture) check_ids' one host read, which also gives each source rank's used slots per
    destination rank (``counts``); a distributed world's are checked by the counts exchange
    (rows_per_rank, in ``_results``), so that every rank raises when one refuses its ids. Then
    the ids as int32."""
    world, ids, E = call.world, call.inputs["topk_ids"], call.sizes["experts"]
    if world.emulated_world:
        call.state["counts"] = check_ids(ids, world.size * E, E)
    call.inputs["topk_ids"] = ids.to(torch.int32).contiguous()


def _refused(call: common.Call) -> None:
    """A check refused this rank's inputs: in a distributed world its peers are about to exchange
    counts (rows_per_rank), so this rank takes part too (as refusing), making them raise, not
    wait."""
    ids = call.inputs["topk_ids"]
    graph = isinstance(ids, torch.Tensor) and capturing(ids)
    if call.world.emulated_world or graph:
        return
    try:
        rows_per_rank(call.world, None, 0)
    except ValueError:
        pass


def _results(call: common.Call) -> dict[str, torch.Tensor]:
    """y, expanded, src and expert_offsets, one leading dimension of the ranks of this process.
    On the CPU the host's routing (``route``) sizes them and gives src and expert_offsets; on a
    GPU the host learns the rows per rank once (emulated: check_ids' counts; distributed: an
    all-gather of each rank's, rows_per_rank), the one synchronize of the call, to size y / src
    and return each rank's rows; the kernel's layout phase computes the same counts, the
    offsets, src and every task on the device."""
    world, ids, z = call.world, call.inputs["topk_ids"], call.sizes
    W, E, N, H = world.size, z["experts"], z["inter"], z["hidden"]
    if not world.on_gpu:
        call.state["routing"] = routing = route(ids.tolist(), E)
        rows = max(len(r) for r in routing.rows)
        return {
            "y": torch.full((W, rows, N), float("nan"), dtype=torch.bfloat16),  # poisoned
            "expanded": torch.full((W, rows, H), float("nan"), dtype=torch.bfloat16),
            # the device layout's outputs (the host's routing gives them here)
            "src": torch.full((W, rows, 3), -1, dtype=torch.int32),
            "expert_offsets": torch.full((W, 1, E + 1), -1, dtype=torch.int32),
        }  # run_cpu adds the workspace (common.workspace)
    emulated = world.emulated_world
    captured = capturing(ids)
    if captured:  # no host read: the results hold the worst case's rows (MoeDispatch.captured)
        per_rank = [call.plan.sizes["max_rows"]] * W
    elif emulated:  # check_ids' one host read: every source's slots to each rank
        per_rank = [sum(col) for col in zip(*call.state["counts"], strict=True)]
    else:
        per_rank = rows_per_rank(world, ids, E)  # NOTE: the host synchronize (and a collective)
    ranks = list(range(W)) if emulated else [world.rank]  # this process's
    call.state.update(per_rank=per_rank, ranks=ranks, captured=captured)
    n = len(ranks)  # one leading dimension in both worlds (a distributed rank's extent is its own)
    rows = max(1, *(per_rank[d] for d in ranks))
    dev = call.inputs["x"].device
    return {
        "y": common.result_buffer((n, rows, N), torch.bfloat16, dev),
        # workspace, every row written before it is read: not poisoned (a write of every row)
        "expanded": torch.empty((n, rows, H), dtype=torch.bfloat16, device=dev),
        "src": torch.full((n, rows, 3), -1, dtype=torch.int32, device=dev),
        "expert_offsets": torch.full((n, 1, E + 1), -1, dtype=torch.int32, device=dev),
    }


def _operands(call: common.Call) -> dict[str, torch.Tensor]:
    """x, the ids (int32), w1 as [n, E_local * H, I] (n: the ranks of this process), the results."""
    w1, n = call.inputs["w1"], call.world.size if call.world.emulated_world else 1
    return {**call.inputs, "w1": w1.view(n, -1, w1.shape[-1]), **call.results}


def _empty(call: common.Call) -> MoeDispatch | None:
    """No tokens on a GPU: nothing routed anywhere, no launch, every rank's rows empty (a
    distributed world of T = 0 everywhere launches nothing either). The interpreter runs such a
    call (its tables are empty)."""
    world, z, ids = call.world, call.sizes, call.inputs["topk_ids"]
    if z["tokens"] or not world.on_gpu:
        return None
    if not world.emulated_world:
        call.results["expert_offsets"].zero_()
        return _finish(call)
    dev, W, E, N = call.inputs["x"].device, world.size, z["experts"], z["inter"]
    return MoeDispatch(
        [torch.empty((0, N), dtype=torch.bfloat16, device=dev) for _ in range(W)],
        [torch.empty((0, 3), dtype=torch.int32, device=dev) for _ in range(W)],
        [torch.zeros(E + 1, dtype=torch.int32, device=dev) for _ in range(W)],
        world,
        ids.clone(),
        z["hidden"],
    )


def _finish(call: common.Call) -> MoeDispatch:
    """Each rank's rows of the results (the interpreter's: copies of the routed rows)."""
    world, r, ids, H = call.world, call.results, call.inputs["topk_ids"], call.sizes["hidden"]
    if not world.on_gpu:
        routing = call.state["routing"]
        y = [r["y"][d, : len(rows)].clone() for d, rows in enumerate(routing.rows)]
        return dispatch_result(world, routing, ids.clone(), y, H)
    per_rank, ranks = call.state["per_rank"], call.state["ranks"]
    return MoeDispatch(
        [r["y"][i, : per_rank[d]] for i, d in enumerate(ranks)],
        [r["src"][i, : per_rank[d]] for i, d in enumerate(ranks)],
        [r["expert_offsets"][i, 0] for i in range(len(ranks))],
        world,
        ids.clone(),
        H,
        call.state["captured"],
        max(per_rank),
    )


OP = common.OpDef(
    spec=SPEC,
    make_plan=make_plan,
    shapes=lambda *args: shapes(*args),
    world_check=lambda world: check_capture(SPEC.name, world),
    check=_check,
    refused=_refused,
    results=_results,
    empty=_empty,
    operands=_operands,
    twins=lambda c: twins_of(c.plan, c.state["routing"]),
    output="y",
    finish=_finish,
)


# -- CPU interpreter: the layout twin and the data-movement twins ---------------------------------


def layout_tasks(plan: Plan, routing: Routing, me: int) -> dict[str, list[Task]]:
    """Rank ``me``'s tasks for this routing (what the device layout phase writes into its tables):
    pushes of its tokens, nearest destination first (itself, then me + 1, ...); then the expands
    of the rows it receives, expert by expert (so the first experts' GEMMs can start first),
    sources nearest first; and its experts' GEMM tiles, each waiting for its expert's rows from
    each source that sends some."""
    W = plan.world_size
    comm = []
    for d in ((me + i) % W for i in range(W)):
        tokens = len(routing.sent[me][d])
        for i0 in range(0, tokens, PIECE_ROWS):
            n = min(PIECE_ROWS, tokens - i0)
            landed = Raise("landed", d, (me,), n, op="add")
            comm.append(Task(len(comm), (PUSH, d, i0, n), raises=(landed,)))
    from_src = Counter((e, s) for (s, _, _, e) in routing.rows[me])  # rows of e from source s
    pieces = []  # (expert, source, first y row, rows)
    for e in range(routing.experts):
        first = routing.offsets[me][e]  # e's rows: by source, then token
        starts = [first + sum(from_src[e, q] for q in range(s)) for s in range(W)]
        for s in ((me + i) % W for i in range(W)):
            n = from_src[e, s]
            pieces += [
                (e, s, starts[s] + c, min(PIECE_ROWS, n - c)) for c in range(0, n, PIECE_ROWS)
            ]
    expands_of = Counter(s for _, s, _, _ in pieces)  # the counted consumers of landed[s]
    for e, s, r0, n in pieces:
        # the expand follows the source's pushes: a late source is named here first (the GEMM
        # tiles' waits, on the expands, have twice the patience)
        tokens = len(routing.sent[s][me])
        landed = Wait("landed", me, (s,), tokens, consumers=expands_of[s], peer=s)
        rows = Raise("expert_rows", me, (e, s), n, op="add")
        comm.append(Task(len(comm), (EXPAND, r0, n, s), waits=(landed,), raises=(rows,)))
    N, bn = plan.sizes["inter"], plan.tile.bn
    tasks = gemm_tasks(routing.offsets[me], plan.sizes["tile_rows"], N, bn)
    consumers = Counter(t[1] for t in tasks)  # per expert: every column tile of every row tile
    waits = {
        e: tuple(
            Wait("expert_rows", me, (e, s), from_src[e, s], consumers=n, patience=2, peer=s)
            for s in range(W)
            if from_src[e, s]
        )
        for e, n in consumers.items()
    }
    compute = [
        Task(x, (e, r0, n, c0), waits=waits[e]) for x, (_, e, r0, n, c0, _) in enumerate(tasks)
    ]
    return {"comm": comm, "compute": compute}


def twins_of(plan: Plan, routing: Routing) -> common.Twins:
    """The interpreter side of one call. ``routing`` (the host's) gives the rows the kernel end
    reads; the layout twin makes the tasks from the ids it reads, as the device would."""
    T, H, N, k = (plan.sizes[n] for n in ("tokens", "hidden", "inter", "k"))
    E, tr, bn = plan.sizes["experts"], plan.sizes["tile_rows"], plan.tile.bn
    # rank -> the routing its layout phase computed. NOTE: the expands read their rows' receive
    # rows from here; on the device the layout phase writes that map into a workspace (row_map).
    made: dict[int, Routing] = {}

    sig = PlanSignals(plan)

    def layout(ctx):
        # the ids exchange: my routing into every rank's ids_all (rows me * T), then theirs here
        me, silent = ctx.rank, ctx.rank == plan.faults.silent_rank
        mine = yield from twins.tile_load(ctx, "topk_ids", me, (0, T, 0, k))
        for d in ((me + i) % ctx.W for i in range(ctx.W)):
            yield from twins.peer_store(ctx, "ids_all", d, (me * T, T, 0, k), mine)
        for d in ((me + i) % ctx.W for i in range(ctx.W)):
            if not silent:  # (the fault: a silent rank raises nothing)
                yield from twins.signal_set_release(ctx, sig("ids_landed", d, me), 1)
        ids = []
        for s in range(ctx.W):
            yield from twins.wait_acquire_reset(ctx, sig("ids_landed", me, s), 1, s)
            v = yield from twins.tile_load(ctx, "ids_all", me, (s * T, T, 0, k))
            ids.append(v.tolist())
        made[me] = r = route(ids, E)
        return layout_tasks(plan, r, me)

    def comm(ctx, task):
        r = made[ctx.rank]
        if task.args[0] == PUSH:  # a run of my tokens for d into my receive rows there
            _, d, i0, n = task.args[:4]
            rows = []
            for t in r.sent[ctx.rank][d][i0 : i0 + n]:
                v = yield from twins.tile_load(ctx, "x", ctx.rank, (t, 1, 0, H))
                rows.append(v)
            at = r.recv_base[d][ctx.rank] + i0
            yield from twins.tile_send_bulk(ctx, "recv", d, (at, n, 0, H), torch.cat(rows))
            return
        _, r0, n, _ = task.args[:4]  # EXPAND: each row's token from recv into its y row's place
        for i, (s, t, _, _) in enumerate(r.rows[ctx.rank][r0 : r0 + n]):
            at = r.recv_row(ctx.rank, s, t)
            v = yield from twins.tile_load(ctx, "recv", ctx.rank, (at, 1, 0, H))
            yield from twins.tile_send(ctx, "expanded", ctx.rank, (r0 + i, 1, 0, H), v)

    def compute(ctx, task):  # one grouped-GEMM tile: its expanded rows times w1[e]
        e, r0, n, c0 = task.args[:4]
        c = min(bn, N - c0)
        a = yield from twins.tile_load(ctx, "expanded", ctx.rank, (r0, n, 0, H))
        b = yield from twins.tile_load(ctx, "w1", ctx.rank, (e * H, H, c0, c))
        out = (a.float() @ b.float()).bfloat16()  # fp32 accumulation, one rounding
        yield from twins.output_store(ctx, "y", ctx.rank, (r0, n, c0, c), out, task.id)

    def outputs(rank: int) -> dict[int, tuple[int, int, int, int]]:
        tasks = gemm_tasks(routing.offsets[rank], tr, N, bn)
        return {x: (r0, n, c0, c) for x, (_, _, r0, n, c0, c) in enumerate(tasks)}

    return common.Twins({"comm": comm, "compute": compute}, layout, outputs)


def reference(
    x: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor, world: World
) -> MoeDispatch:
    """The unfused reference (emulated worlds): loops over experts, sources, tokens; fp32 math,
    bf16 rows."""
    W, E = world.size, w1.shape[1]
    ids = topk_ids.to(torch.int32)
    ys, srcs, offs = [], [], []
    for d in range(W):
        y, src, off = [], [], [0]
        for e in range(E):
            for s in range(W):
                for t, j in (ids[s] == d * E + e).nonzero().tolist():
                    y.append(x[s, t].float() @ w1[d, e].float())
                    src.append((s, t, j))
            off.append(len(src))
        dev = x.device
        ys.append((torch.stack(y) if y else torch.zeros(0, w1.shape[-1], device=dev)).bfloat16())
        srcs.append(torch.tensor(src, dtype=torch.int32, device=dev).reshape(-1, 3))
        offs.append(torch.tensor(off, dtype=torch.int32, device=dev))
    return MoeDispatch(ys, srcs, offs, world, ids.clone(), x.shape[-1])


registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
