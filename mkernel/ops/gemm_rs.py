"""GEMM + ReduceScatter: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    full = sum(a_q.float() @ b_q.float() for q in range(W))     # [M, N], fp32
    out_r = full[r * M // W : (r + 1) * M // W].bfloat16()        # [M/W, N]

Protocol (the plan's tables below; device data movement in kernels/gemm_rs.cu): tile u of owner o
(o's rows) is computed by every rank. A rank computes the tiles its peers own first: each such
fp32 partial is stored (bulk copies) into slot ``me`` of the owner's ``stage``, then
``partial[tile=u, src=me]`` is raised there. It computes its own tiles last: the task waits for
the W - 1 peers' partials of the tile (consuming the flags), and its epilogue adds them to the fp32
accumulator in registers before the one bf16 store into out, so the result is the fp32 sum rounded
once, as the reference's. Nothing is zeroed, there are no atomics, no comm role and no pass after
the GEMM (the design before it, fp32 red.add into an accumulator that a comm role then converted,
ended each call with ~240 us of conversions after the last tile at M = 2048 on two H200s:
benchmarks/tp_timeline.py). Partials stay fp32 because a bf16 partial adds one rounding per
peer, which moves 1-4% of the elements past the bf16 rounding of the exact sum.

    W = 2, owners' tiles 0a 0b (rank 0's rows) and 1a 1b; t = time ->
    rank 0 compute:  1a 1b  (fp32 -> stage[1][slot 0]) | 0a 0b  (wait partial[*, src=1], add, out)
    rank 1 compute:  0a 0b  (fp32 -> stage[0][slot 1]) | 1a 1b  (wait partial[*, src=0], add, out)

Peers' tiles wait on nothing and every unit runs all of its peers' tiles before its own (a
``tile_order`` hook orders the tiles within those two classes), so no wait can block the tile it
waits for: deadlock-free for any order. The default sends to rank r+1 first, then r+2, ..., so at
each moment the links carry traffic in both directions. W == 1: the engine stores bf16 tiles
straight into out, nothing to communicate.

Over several nodes (``World.emulated(W, nodes=N)``: SPEC_NODES, docs/rdma.md "Hierarchical
ops"; on a GPU kernels/gemm_rs_nodes.cu), R = W / N ranks per node, rank r = (node n, local index
l): a tile of an owner o in another node is reduced within r's node first, by o's rail peer
agg = (n, local(o)): every other rank of node n stores its fp32 partial into agg's ``stage`` (as to
an owner above), agg adds them to its own partial in fp32 and puts the node's sum (fp32,
``xsend`` -> o's ``stage``) to o by one rdma put carrying ``node_part[tile, node=n]``. The owner
adds its node peers' partials and the N - 1 node sums in fp32 and rounds once to bf16. Each rank
first tells its rail peers that its previous call has ended (``rail_ready``, a put of no bytes):
an aggregate waits for it before its put may land in the owner's ``stage``. Slots: stage_slot.

    W = 4, N = 2 (nodes {0, 1}, {2, 3}); tiles of owner 2 on node 0:
    rank 1 (local 1):  partial -> stage of rank 0 (local 0 = local(2))      partial[t, src=1] on 0
    rank 0 (agg):      waits partial[t, 1], rail_ready[node=1]; own + 1's -> xsend
                       rdma put xsend -> stage of rank 2                 node_part[u, node=0] on 2
    rank 2 (owner):    waits partial[t, src=3], node_part[u, node=0]; own + 3's + node 0's -> out
"""

from __future__ import annotations

import sys

import torch

from .. import cost
from ..interp import program, twins
from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..runtime import registry
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
        Buffer(
            "stage",
            "symmetric",
            f32,
            ("stage_rows", "n"),
            "slot s (rows s * rows_per_rank ..): rank s's fp32 partial of my rows",
            when="ranks",
        ),
    ),
    pads=(Pad("partial", ("tile", "src"), ("per_owner", "W"), doc="src's partial of tile landed"),),
    scalars=("n", "k_local", "rows_per_rank"),
)
# over several nodes: SPEC_NODES and _make_plan_nodes (gemm_rs_nodes.cu)
SPEC_NODES = OpSpec(
    name="gemm_rs",
    doc="GEMM + ReduceScatter over nodes (rdma puts of node sums across them)",
    buffers=(
        *SPEC.buffers[:3],
        Buffer(
            "stage",
            "symmetric",
            f32,
            ("stage_rows", "n"),
            "W - 1 slots of rows_per_rank rows (stage_slot): what I reduce, my own rows' first",
        ),
        Buffer("xsend", "symmetric", f32, ("node_rows", "n"), "slot m: my node's sum for (m, l)"),
    ),
    pads=(
        Pad("partial", ("tile", "src"), ("tiles", "W"), doc="src's partial landed at the reducer"),
        Pad("node_part", ("tile", "node"), ("per_owner", "nodes"), doc="node's sum landed (rdma)"),
        Pad("rail_ready", ("node",), ("nodes",), counted=True, doc="my rail peer's call began"),
    ),
    scalars=SPEC.scalars,
    kernel="gemm_rs_nodes",
)


def stage_slot(R: int, N: int, me: int, src: int, owner: int) -> int:
    """The slot (of rows_per_rank rows) of reducer ``me``'s stage that ``src``'s contribution to a
    tile of ``owner`` (me or me's rail peer) lands in. Relative to me (l = local offset of src,
    m = node offset of the owner, or of src for a node sum to me): my own rows' R - 1 node peers'
    partials (slots 0 .. R - 2) and N - 1 node sums (R - 1 .. R + N - 3) come first, so the owner's
    epilogue adds R + N - 2 consecutive slots; then, per other node m, the R - 1 partials of the
    rows I reduce for my rail peer there. W - 1 slots in all. (Device twin: kernels/gemm_rs_nodes.cu
    rs_stage_slot.)"""
    node, src_node = me // R, src // R
    if src_node != node:  # a node sum, to its owner
        return (R - 1) + (src_node - node) % N - 1
    lo, mo = (src - me) % R, (owner // R - node) % N
    return lo - 1 if mo == 0 else (R - 1) + (N - 1) + (mo - 1) * (R - 1) + lo - 1


# Over several nodes, what rank r does with a tile of owner o (_kind): store its partial to the
# owner in its node, or to the owner's rail peer in its node; reduce its node's partials and put
# them across (r is o's rail peer); or reduce its own tile.
TO_OWNER, TO_AGG, AGGREGATE, OWN = range(4)


def _owned_tiles(schedule: Schedule, world: World, m: int, n: int, k: int):
    """The tile config, rows per rank, output tiles grouped by owner (tag = owner), tiles per
    owner, and the L2-friendly order of one owner's block (indices within it)."""
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k, sms)
    ms = m // W
    tiles = []
    for owner in range(W):
        tiles += grid_tiles(owner * ms, ms, n, cfg, owner, len(tiles))
    per_owner = len(tiles) // W
    block = grouped_order(-(-ms // cfg.bm), -(-n // cfg.bn), cfg, sms)
    return cfg, ms, tiles, per_owner, block


def _sizes(shapes: dict[str, int], W: int, ms: int, per_owner: int) -> dict[str, int]:
    return {
        **shapes,
        "k_local": shapes["k"] // W,
        "rows_per_rank": ms,
        "per_owner": per_owner,
        "stage_rows": W * ms,
    }


def check_sizes(world: World, m: int, n: int, k: int) -> None:
    """What Schedule.plan by sizes adds to the generic checks (common.check_rows_divisible)."""
    common.check_rows_divisible("gemm_rs", world, m)


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    if world.nodes > 1:
        return _make_plan_nodes(schedule, world, m, n, k)
    W = world.size
    cfg, ms, tiles, per_owner, block = _owned_tiles(schedule, world, m, n, k)
    compute = []
    for r in range(W):
        # Default: the peers' blocks first, rank r+1's, then r+2's, ...; its own block last.
        default = [((r + 1 + i) % W) * per_owner + j for i in range(W) for j in block]
        order = apply_order(schedule.tile_order, r, tiles, default)
        # NOTE: the peers' tiles first whatever the hook's order (kept within each class): a unit
        # runs its tasks in order, so an own tile (which waits) never blocks a peer's tile that
        # another rank's own tile waits for. Every wait then depends only on tasks that wait on
        # nothing: no deadlock for any order.
        order = [i for i in order if tiles[i].tag != r] + [i for i in order if tiles[i].tag == r]
        tasks = []
        for i in order:
            u, owner = tiles[i].index - tiles[i].tag * per_owner, tiles[i].tag
            if W == 1:
                tasks.append(Task(i, (i,)))
            elif owner != r:
                tasks.append(Task(i, (i,), raises=(Raise("partial", owner, (u, r)),)))
            else:
                peers = [(r + 1 + j) % W for j in range(W - 1)]
                tasks.append(Task(i, (i,), waits=tuple(Wait("partial", r, (u, s)) for s in peers)))
        compute.append(tasks)
    shapes = {"m": m, "n": n, "k": k}
    sizes = _sizes(shapes, W, ms, per_owner)
    comm = [[] for _ in range(W)]
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


def _kind(R: int, r: int, o: int) -> int:
    if o == r:
        return OWN
    if o // R == r // R:
        return TO_OWNER
    return AGGREGATE if o % R == r % R else TO_AGG


def _make_plan_nodes(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    """The plan over N > 1 nodes of R ranks (module docstring): per rank, the tiles that wait on
    nothing (partials to owners and reducers of its node) first, then its aggregates (they wait
    only for those, and for the rail peer's arrival), then its own tiles; one comm task, the
    arrival at its rail peers."""
    W, N = world.size, world.nodes
    R = W // N
    cfg, ms, tiles, per_owner, block = _owned_tiles(schedule, world, m, n, k)
    stage_class = {TO_AGG: 0, TO_OWNER: 0, AGGREGATE: 1, OWN: 2}
    compute, comm = [], []
    for r in range(W):
        node, local = divmod(r, R)
        peers = [node * R + (local + j) % R for j in range(1, R)]  # my node's other ranks
        # Default: the longest paths first: partials for other nodes' owners (node n+1, n+2, ...),
        # then for my node's owners, then my aggregates, then my own tiles.
        far = lambda o, r=r: (stage_class[_kind(R, r, o)], _kind(R, r, o), (o - r) % W)
        owners = sorted(range(W), key=far)
        default = [o * per_owner + j for o in owners for j in block]
        order = apply_order(schedule.tile_order, r, tiles, default)
        # NOTE: whatever the hook's order (kept within each class): a unit runs its tasks in
        # order, so a wait never blocks a task that the awaited one depends on (no deadlock).
        order = sorted(order, key=lambda i, r=r: stage_class[_kind(R, r, tiles[i].tag)])
        tasks = []
        for i in order:
            o = tiles[i].tag
            u, kind = i - o * per_owner, _kind(R, r, o)
            partials = tuple(Wait("partial", r, (i, s)) for s in peers)
            if kind == TO_OWNER:
                tasks.append(Task(i, (i,), raises=(Raise("partial", o, (i, r)),)))
            elif kind == TO_AGG:
                agg = node * R + o % R
                tasks.append(Task(i, (i,), raises=(Raise("partial", agg, (i, r)),)))
            elif kind == AGGREGATE:
                ready = Wait("rail_ready", r, (o // R,), consumers=per_owner)
                raises = (Raise("node_part", o, (u, node)),)
                tasks.append(Task(i, (i,), waits=(*partials, ready), raises=raises))
            else:
                arrived = tuple(Wait("node_part", r, (u, (node + j) % N)) for j in range(1, N))
                tasks.append(Task(i, (i,), waits=partials + arrived))
        compute.append(tasks)
        rail = [((node + j) % N) * R + local for j in range(1, N)]
        comm.append([Task(0, (0,), raises=tuple(Raise("rail_ready", q, (node,)) for q in rail))])
    shapes = {"m": m, "n": n, "k": k}
    sizes = {
        **_sizes(shapes, W, ms, per_owner),
        "stage_rows": (W - 1) * ms,
        "tiles": len(tiles),
        "node_rows": N * ms,
    }
    return build_plan(SPEC_NODES, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


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
        accumulated in fp32 (the peers' partials cross the links in fp32), rounded once.
        Equivalent to ``reference.gemm_rs(a, b, world=world)``.

    Requires M divisible by W, and K/W and N multiples of 8 (16-byte rows). Raises TypeError /
    ValueError naming the argument before anything runs, CommTimeout if a wait passes the world's
    deadline.
    """
    return common.run_op(OP, {"a": a, "b": b}, world, schedule, out=out)


# -- cost model (mkernel/cost.py): one rank's work per call ----------------------------------------


def _cost_work(s: dict[str, int], W: int, bm: int, bn: int, rates: cost.Rates) -> cost.Work:
    """One rank's call: every tile of the [M, N] sum; the epilogue of a peer's tile (W - 1 in W)
    stores its fp32 partial (4 bytes an element) into the owner's ``stage``, which the owner adds
    in its own tile's epilogue. No comm role, no pass after."""
    m, n, k = s["m"], s["n"], s["k"]
    tiles = W * -(-(m // W) // bm) * -(-n // bn)
    return cost.Work(
        tiles=tiles,
        flops=2.0 * m * n * (k // W),
        epilogue_bytes=bm * bn * 4.0 * (W - 1) / W,  # the average tile's remote store
        comm_tasks=0,
        task_bytes=0.0,
        task_remote=0.0,
        comm_produces=False,
        link_bytes=(W - 1) / W * m * n * 4.0,
        after_ms=0.0,
    )


cost.register(SPEC.name, cost.OpCost(work=_cost_work, mechanism="loop"))


# -- CPU interpreter: data-movement twins of kernels/gemm_rs.cu ----------------------------------


def twins_of(plan: Plan):
    if plan.nodes > 1:
        return _twins_nodes(plan)
    W, ms, k = plan.world_size, plan.sizes["rows_per_rank"], plan.sizes["k_local"]

    def compute(ctx, task):  # GemmRS::dest: a peer's tile to its stage, an own tile + partials
        t = plan.tiles[task.args[0]]
        a = yield from twins.tile_load_async(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        part = a.float() @ b.float()
        rect = (t.m0 - t.tag * ms, t.rows, t.n0, t.cols)
        if W > 1 and t.tag != ctx.rank:  # fp32 partial into slot `me` of the owner's stage
            slot = (ctx.rank * ms + rect[0], t.rows, t.n0, t.cols)
            yield from twins.tile_send_bulk(ctx, "stage", t.tag, slot, part)
            return
        for s in range(W):  # own tile: the peers' partials, added in fp32 (Dest::add_*)
            if s != ctx.rank:
                slot = (s * ms + rect[0], t.rows, t.n0, t.cols)
                p = yield from twins.tile_load(ctx, "stage", ctx.rank, slot)
                part = part + p
        yield from twins.output_store(ctx, "out", ctx.rank, rect, part.bfloat16(), t.index)

    return {"compute": compute, "comm": None}


def _twins_nodes(plan: Plan):
    """The data movement over several nodes (kernels/gemm_rs_nodes.cu): fp32 partials by bulk
    copies within a node into the reducer's stage slot (stage_slot), node sums by rdma puts across
    (program.put_on_completion) into the owner's; a reducer adds its slots in slot order."""
    W, N, ms, k = plan.world_size, plan.nodes, plan.sizes["rows_per_rank"], plan.sizes["k_local"]
    R = W // N

    def add_slots(ctx, t, part, first, count):  # stage slots first .. first + count - 1
        row0 = t.m0 - t.tag * ms
        for slot in range(first, first + count):
            rect = (slot * ms + row0, t.rows, t.n0, t.cols)
            part = part + (yield from twins.tile_load(ctx, "stage", ctx.rank, rect))
        return part

    def compute(ctx, task):
        t = plan.tiles[task.args[0]]
        me, o = ctx.rank, t.tag
        a = yield from twins.tile_load_async(ctx, "a", me, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", me, (0, k, t.n0, t.cols))
        part = a.float() @ b.float()
        row0, kind, node = t.m0 - o * ms, _kind(R, me, o), me // R
        if kind in (TO_OWNER, TO_AGG):  # fp32 partial into my slot of the reducer's stage
            dest = o if kind == TO_OWNER else node * R + o % R
            rect = (stage_slot(R, N, dest, me, o) * ms + row0, t.rows, t.n0, t.cols)
            yield from twins.tile_send_bulk(ctx, "stage", dest, rect, part)
            return
        if kind == AGGREGATE:  # my node's sum -> xsend (lands before the put is posted) -> owner
            first = stage_slot(R, N, me, node * R + (me + 1) % R, o) if R > 1 else 0
            part = yield from add_slots(ctx, t, part, first, R - 1)
            src = ((o // R) * ms + row0, t.rows, t.n0, t.cols)
            yield from twins.tile_send_bulk(ctx, "xsend", me, src, part)
            dst = (stage_slot(R, N, o, me, o) * ms + row0, t.rows, t.n0, t.cols)
            program.put_on_completion(ctx, task, o, "stage", dst, "xsend", src)
            return
        part = yield from add_slots(ctx, t, part, 0, R + N - 2)  # own tile: peers', nodes' sums
        rect = (row0, t.rows, t.n0, t.cols)
        yield from twins.output_store(ctx, "out", me, rect, part.bfloat16(), t.index)

    def comm(ctx, task):  # the rail arrival: raises only (the template posts them as puts)
        yield from ()

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


# the run path's view of the op (mkernel/runtime/run.py): one bf16 result, its per-rank shape
OP = common.single_output_op(sys.modules[__name__], lambda s, W: (s["m"] // W, s["n"]))
registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
