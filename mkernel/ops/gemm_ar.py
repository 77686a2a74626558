"""GEMM + AllReduce: API, plan, program twins and reference, side by side.

Unfused meaning, per rank r of W (a_r: [M, K/W], b_r: [K/W, N], bf16)::

    out_r = sum(a_q.float() @ b_q.float() for q in range(W)).bfloat16()   # [M, N], same on all

Protocol (the plan's tables below; device data movement in kernels/gemm_ar.cu), no multicast:
tile t of the [M, N] output is owned by rank
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

Over several nodes (``World.emulated(W, nodes=N)``: SPEC_NODES, docs/rdma.md "Hierarchical ops"; on
a GPU kernels/gemm_ar_nodes.cu), R = W / N ranks per node: tile t (owner o = t % W) is reduced in
each node n by its reducer (n, local(o)) (o itself on o's node): the node's ranks red.add their fp32
partials into the reducer's ``acc``; a reducer on another node moves the node's sum into ``xsend``,
zeroes ``acc`` and puts the sum into slot n of o's ``xrecv`` (rdma, ``node_part[t, node=n]``); o
adds its ``acc`` and the N - 1 node sums in fp32, rounds once to bf16, stores the tile into its
node's results and puts it into the ``xout`` of its rail peers (the reducers of t elsewhere,
``tile_ready[t]``), which forward it into their node's results. Comm tasks per rank, in this order
(no cycle: each class waits only on the ones before it): the reducers' puts, the owner's finalizes,
the forwards, the waits for the tiles of others. No rail arrival (gemm_rs, ag_gemm): data flows both
ways along each rail, so a put of the next call already follows the previous call's reads of its
destination (o's finalize waits for the next call's node sum; the reducer's next call follows its
forward of o's result).

    W = 4, N = 2 (nodes {0, 1}, {2, 3}); tile t of owner 2:
    ranks 0, 1: red.add -> acc of 0 (tile_flag[t, src] on 0); ranks 2, 3: -> acc of 2
    rank 0: waits tile_flag[t, 0..1]; acc -> xsend -> rdma put -> xrecv[slot 0] of 2
    rank 2: waits tile_flag[t, 2..3], node_part[t, 0]; bf16 -> out of 2, 3; rdma put -> xout of 0
    rank 0: waits tile_ready[t]; xout -> out of 0, 1 (tile_ready[t] on 1)
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
    name="gemm_ar",
    doc="GEMM + AllReduce",
    buffers=(
        Buffer("a", "input", bf16, ("m", "k_local")),
        Buffer("b", "input", bf16, ("k_local", "n")),
        Buffer("out", "output", bf16, ("m", "n"), "the sum, on every rank"),
        Buffer("acc", "symmetric", f32, ("m", "n"), "fp32 sums; only owned tiles are used"),
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
        Pad("tile_flag", ("tile", "src"), ("tiles", "W"), doc="src's part of tile landed"),
        Pad("tile_ready", ("tile",), ("tiles",), doc="the reduced tile landed here"),
    ),
    scalars=("m", "n", "k_local", "tiles"),
)
# over several nodes: SPEC_NODES and _make_plan_nodes (gemm_ar_nodes.cu)
SPEC_NODES = OpSpec(
    name="gemm_ar",
    doc="GEMM + AllReduce over nodes (rdma puts of node sums and results across them)",
    buffers=(
        *SPEC.buffers[:3],
        Buffer("acc", "symmetric", f32, ("m", "n"), "fp32 sums of my node; tiles I reduce"),
        Buffer("xsend", "symmetric", f32, ("m", "n"), "my node's sum of a tile, put to its owner"),
        Buffer("xrecv", "symmetric", f32, ("node_m", "n"), "slot n: node n's sum of my tiles"),
        Buffer("xout", "symmetric", bf16, ("m", "n"), "the result of a tile, put by its owner"),
        SPEC.buffers[4],  # result: node peers' results in a distributed world (copied into out)
    ),
    pads=(
        *SPEC.pads,
        Pad("node_part", ("tile", "node"), ("tiles", "nodes"), doc="node's sum landed (rdma)"),
    ),
    scalars=SPEC.scalars,
    kernel="gemm_ar_nodes",
)
SEND, FINALIZE, FORWARD, LANDED = range(4)  # comm task kinds over several nodes (args[1])


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    if world.nodes > 1:
        return _make_plan_nodes(schedule, world, m, n, k)
    W = world.size
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k // W, sms)
    tiles = [t._replace(tag=t.index % W) for t in grid_tiles(0, m, n, cfg, 0, 0)]  # tag = owner
    T = len(tiles)
    default = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)  # same on every rank
    compute, comm = [], []
    for r in range(W):
        order = apply_order(schedule.tile_order, r, tiles, default)
        flags = [(Raise("tile_flag", t.tag, (t.index, r)),) if W > 1 else () for t in tiles]
        compute.append([Task(i, (i,), raises=flags[i]) for i in order])
        if W == 1:  # the epilogue stores the bf16 tile straight into out: nothing to communicate
            comm.append([])
            continue
        # Finalize ids t (owned tiles) first, then pure waits T + t for the others.
        # NOTE: no cycle. A unit takes every n-th entry of this list, so each unit runs all of its
        # finalizes before any of its waits; a finalize waits only on compute epilogues, which wait
        # on nothing; so every finalize completes, and with them every tile_ready a wait needs.
        # The waits get twice the deadline, so that a stuck owner's own wait reports first.
        finalize = [
            Task(
                t,
                (t,),
                waits=tuple(Wait("tile_flag", r, (t, (r + 1 + j) % W)) for j in range(W)),
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
    shapes = {"m": m, "n": n, "k": k}
    sizes = {**shapes, "k_local": k // W, "tiles": T}
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


def _make_plan_nodes(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    """The plan over N > 1 nodes of R ranks (module docstring)."""
    W, N = world.size, world.nodes
    R = W // N
    sms = rank_sms(schedule, world)
    cfg = TILE_CONFIGS[schedule.tile] if schedule.tile else pick_tile(m, n, k // W, sms)
    tiles = [t._replace(tag=t.index % W) for t in grid_tiles(0, m, n, cfg, 0, 0)]  # tag = owner
    T = len(tiles)
    default = grouped_order(-(-m // cfg.bm), -(-n // cfg.bn), cfg, sms)
    compute, comm = [], []
    for r in range(W):
        node, local = divmod(r, R)
        peers = [node * R + (local + j) % R for j in range(1, R)]  # my node's other ranks
        rail = [((node + j) % N) * R + local for j in range(1, N)]  # my local index elsewhere
        team = [r, *peers]
        reducer = lambda t, node=node: node * R + t.tag % R  # noqa: E731
        order = apply_order(schedule.tile_order, r, tiles, default)
        flags = [(Raise("tile_flag", reducer(t), (t.index, r)),) for t in tiles]
        compute.append([Task(i, (i,), raises=flags[i]) for i in order])
        mine = [t for t in tiles if t.tag % R == local]  # the tiles I reduce
        sends = [t for t in mine if t.tag != r]
        owned = [t for t in mine if t.tag == r]
        node_flags = lambda t, r=r, team=team: tuple(  # noqa: E731
            Wait("tile_flag", r, (t.index, s)) for s in team
        )
        tasks = []
        for t in sends:
            waits = node_flags(t)
            raises = (Raise("node_part", t.tag, (t.index, node)),)
            tasks.append(Task(1 + t.index, (t.index, SEND), waits=waits, raises=raises))
        for t in owned:
            arrived = tuple(Wait("node_part", r, (t.index, (node + j) % N)) for j in range(1, N))
            waits = (*node_flags(t), *arrived)
            raises = tuple(Raise("tile_ready", q, (t.index,)) for q in peers + rail)
            tasks.append(Task(1 + t.index, (t.index, FINALIZE), waits=waits, raises=raises))
        for t in sends:  # the result of a tile of another node's owner, landed here
            landed = (Wait("tile_ready", r, (t.index,)),)
            raises = tuple(Raise("tile_ready", q, (t.index,)) for q in peers)
            tasks.append(Task(1 + T + t.index, (t.index, FORWARD), waits=landed, raises=raises))
        for t in tiles:  # every other tile: its finalize or forward in my node stores it here
            if t.tag % R != local:
                landed = (Wait("tile_ready", r, (t.index,), patience=2),)
                tasks.append(Task(1 + T + t.index, (t.index, LANDED), waits=landed))
        comm.append(tasks)
    shapes = {"m": m, "n": n, "k": k}
    sizes = {**shapes, "k_local": k // W, "tiles": T, "node_m": N * m}
    return build_plan(SPEC_NODES, schedule, world, cfg, shapes, sizes, tiles, compute, comm)


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
    return common.run_op(OP, {"a": a, "b": b}, world, schedule, out=out)


# -- cost model (mkernel/cost.py): one rank's work per call ----------------------------------------


def _cost_work(s: dict[str, int], W: int, bm: int, bn: int, rates: cost.Rates) -> cost.Work:
    """One rank's call: every tile, its epilogue reduce-adding the fp32 tile into the owner's
    ``acc``; the comm role finalizes the owned tiles (1 in W): loads 4 bytes an element, stores 4
    (zeros) and 2 (bf16 out), and 2 into each peer's result. After the kernel (W > 1) the result
    is copied into ``out``."""
    m, n, k = s["m"], s["n"], s["k"]
    tile = bm * bn
    tiles = -(-m // bm) * -(-n // bn)
    remote = (W - 1) * tile * 2.0  # bf16 into each peer's result
    return cost.Work(
        tiles=tiles,
        flops=2.0 * m * n * (k // W),
        epilogue_bytes=tile * 4.0 if W > 1 else 0.0,
        comm_tasks=-(-tiles // W) if W > 1 else 0,
        task_bytes=tile * 10.0 + remote,  # load fp32, store zeros, store bf16
        task_remote=remote,
        comm_produces=False,
        link_bytes=(W - 1) / W * m * n * 6.0,
        after_ms=0.0 if W == 1 else m * n * 4.0 / rates.local_gbps / 1e6,
    )


cost.register(SPEC.name, cost.OpCost(work=_cost_work, mechanism="loop"))  # the finalize loop


# -- CPU interpreter: data-movement twins of kernels/gemm_ar.cu ----------------------------------


def twins_of(plan: Plan):
    if plan.nodes > 1:
        return _twins_nodes(plan)
    W, T, k = plan.world_size, plan.sizes["tiles"], plan.sizes["k_local"]

    def compute(ctx, task):  # GemmAR::dest: reduce-add into the owner (W == 1: bf16 into out)
        t = plan.tiles[task.args[0]]
        a = yield from twins.tile_load_async(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        rect, part = (t.m0, t.rows, t.n0, t.cols), a.float() @ b.float()
        if W == 1:
            yield from twins.output_store(ctx, "out", ctx.rank, rect, part, t.index)
        else:
            yield from twins.red_add_v2_f32_sys(ctx, "acc", t.tag, rect, part)

    def comm(ctx, task):  # GemmAR::comm_move: finalize into every rank's out; waits move nothing
        if task.args[0] >= T:
            return
        t = plan.tiles[task.args[0]]
        rect = (t.m0, t.rows, t.n0, t.cols)
        v = yield from twins.tile_load(ctx, "acc", ctx.rank, rect)
        for j in range(W):  # own result first, then r+1, r+2, ...
            p = (ctx.rank + j) % W
            yield from twins.output_store(ctx, "out", p, rect, v.bfloat16(), t.index)
        yield from twins.tile_send(ctx, "acc", ctx.rank, rect, torch.zeros_like(v))

    return {"compute": compute, "comm": comm}


def _twins_nodes(plan: Plan):
    """The data movement over several nodes (kernels/gemm_ar_nodes.cu): red.add within a node,
    fp32 node sums and bf16 results across by rdma puts (program.put_on_completion)."""
    W, N, M, k = plan.world_size, plan.nodes, plan.sizes["m"], plan.sizes["k_local"]
    R = W // N

    def compute(ctx, task):  # reduce-add into my node's reducer of the tile
        t = plan.tiles[task.args[0]]
        a = yield from twins.tile_load_async(ctx, "a", ctx.rank, (t.m0, t.rows, 0, k))
        b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))
        reducer = ctx.rank // R * R + t.tag % R
        rect = (t.m0, t.rows, t.n0, t.cols)
        yield from twins.red_add_v2_f32_sys(ctx, "acc", reducer, rect, a.float() @ b.float())

    def store_team(ctx, rect, v, tile):  # my result, then my node peers'
        me = ctx.rank
        for j in range(R):
            p = me // R * R + (me + j) % R
            yield from twins.output_store(ctx, "out", p, rect, v, tile)

    def comm(ctx, task):
        i, kind = task.args[:2]
        if kind == LANDED:  # waits only
            return
        me, node, t = ctx.rank, ctx.rank // R, plan.tiles[i]
        rect = (t.m0, t.rows, t.n0, t.cols)
        if kind == FORWARD:
            v = yield from twins.tile_load(ctx, "xout", me, rect)
            yield from store_team(ctx, rect, v, i)
            return
        v = yield from twins.tile_load(ctx, "acc", me, rect)
        yield from twins.tile_send(ctx, "acc", me, rect, torch.zeros_like(v))
        if kind == SEND:  # my node's sum -> xsend -> slot `node` of the owner's xrecv
            yield from twins.tile_send(ctx, "xsend", me, rect, v)
            dst = (node * M + t.m0, t.rows, t.n0, t.cols)
            program.put_on_completion(ctx, task, t.tag, "xrecv", dst, "xsend", rect)
            return
        for j in range(1, N):  # FINALIZE: the other nodes' sums, in node order from mine
            slot = (((node + j) % N) * M + t.m0, t.rows, t.n0, t.cols)
            v = v + (yield from twins.tile_load(ctx, "xrecv", me, slot))
        yield from store_team(ctx, rect, v.bfloat16(), i)
        for j in range(1, N):  # my result tile, to the reducers of the other nodes
            q = ((node + j) % N) * R + me % R
            program.put_on_completion(ctx, task, q, "xout", rect, "out", rect)

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


# the run path's view of the op (mkernel/runtime/run.py): one bf16 result, its per-rank shape
OP = common.single_output_op(
    sys.modules[__name__], lambda s, W: (s["m"], s["n"]), after_gpu=common.copy_result
)
registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
