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

Over several nodes (``World.emulated(W, nodes=N)``: SPEC_NODES, docs/rdma.md "Hierarchical ops";
on a GPU kernels/ag_gemm_nodes.cu), R = W / N ranks per node, rank r = (node n, local index l):
each own chunk crosses to each other node once, by an rdma put from ``a`` into the ``gather`` of
the rank with the same local index there (its rail peer), carrying ``chunk_ready``; that rank
forwards the chunk over NVLink to the other R - 1 ranks of its node (a forward waits for the
chunk's flag, as a counted consumer beside the tiles). Within the node chunks move as above. A put
first waits for the rail peer's ``rail_ready`` (a put of no bytes each rank sends its rail peers
when its call begins), so it lands after the peer's previous call has read its gather. Comm tasks
per rank: the arrival; per own chunk its puts, then its own copy and node pushes; then the
forwards (they wait for remote puts, which wait only for arrivals: no cycle).

    W = 4, N = 2 (nodes {0, 1}, {2, 3}); chunk g of shard 0:
    rank 0: rdma put a -> gather of rank 2 (chunk_ready[g] on 2); stores -> gather of 0, 1
    rank 2: waits chunk_ready[g]; forwards its rows of gather -> gather of 3 (chunk_ready[g] on 3)
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
# over several nodes: SPEC_NODES and _make_plan_nodes (ag_gemm_nodes.cu)
SPEC_NODES = OpSpec(
    name="ag_gemm",
    doc="AllGather + GEMM over nodes (rdma puts of chunks across them)",
    buffers=SPEC.buffers,
    pads=(
        *SPEC.pads,
        Pad("rail_ready", ("node",), ("nodes",), counted=True, doc="my rail peer's call began"),
    ),
    scalars=SPEC.scalars,
    kernel="ag_gemm_nodes",
)
PUSH, PUT, FORWARD, ARRIVE = range(4)  # comm task kinds over several nodes (args[2])


def _chunk_of(row: int, ms: int, cr: int, chunks: int) -> int:
    """Global chunk id (src * C + c) holding global row ``row`` of the gathered A."""
    src = row // ms
    return src * chunks + (row - src * ms) // cr


def _chunked_tiles(schedule: Schedule, world: World, m: int, n: int, k: int):
    """The tile config, rows per shard, chunk rows, chunks per shard; the output tiles tagged with
    the first chunk they need, the chunks each needs, tiles per chunk, and the L2-friendly order."""
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
    return cfg, ms, cr, C, tiles, needs, consumers, grouped


def _sizes(schedule: Schedule, shapes: dict, W: int, ms: int, cr: int, C: int) -> dict[str, int]:
    return {
        **shapes,
        "ms": ms,
        "chunks": C,
        "chunk_rows": cr,
        "chunks_total": W * C,
        "transfer_tma": int(schedule.transfer == "tma"),
    }


def check_sizes(world: World, m: int, n: int, k: int) -> None:
    """What Schedule.plan by sizes adds to the generic checks (common.check_rows_divisible)."""
    common.check_rows_divisible("ag_gemm", world, m)


def make_plan(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    if world.nodes > 1:
        return _make_plan_nodes(schedule, world, m, n, k)
    W = world.size
    cfg, ms, cr, C, tiles, needs, consumers, grouped = _chunked_tiles(schedule, world, m, n, k)
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
    sizes = _sizes(schedule, shapes, W, ms, cr, C)
    extra = {"consumers": torch.tensor(consumers, dtype=torch.int32)}  # [W * C] tiles per chunk
    return build_plan(SPEC, schedule, world, cfg, shapes, sizes, tiles, compute, comm, extra)


def _make_plan_nodes(schedule: Schedule, world: World, m: int, n: int, k: int) -> Plan:
    """The plan over N > 1 nodes of R ranks (module docstring)."""
    W, N = world.size, world.nodes
    R = W // N
    cfg, ms, cr, C, tiles, needs, tile_consumers, grouped = _chunked_tiles(schedule, world, m, n, k)
    compute, comm, consumers = [], [], []
    for r in range(W):
        node, local = divmod(r, R)
        peers = [node * R + (local + j) % R for j in range(1, R)]  # my node's other ranks
        rail = [((node + j) % N) * R + local for j in range(1, N)]  # my local index elsewhere
        # A chunk of a rail peer's shard lands here by rdma and is forwarded to my R - 1 peers.
        mine = [tile_consumers[g] + (R - 1) * (g // C in rail) for g in range(W * C)]
        consumers.append(mine)

        def arrival(q, node=node, local=local):  # own, node peers, rail peers, forwarded
            dn, dl = (q // R - node) % N, (q % R - local) % R
            return (0 if dn == 0 else 1 + (dl != 0), dn, dl)

        default = sorted(grouped, key=lambda i: max(arrival(g // C) for g in needs[i]))
        order = apply_order(schedule.tile_order, r, tiles, default)
        waits = [
            tuple(Wait("chunk_ready", r, (g,), consumers=mine[g]) for g in needs[i])
            for i in range(len(tiles))
        ]
        compute.append([Task(i, (i,), waits=waits[i]) for i in order])
        flag = lambda g, p: (Raise("chunk_ready", p, (g,)),)  # noqa: E731
        arrive = tuple(Raise("rail_ready", q, (node,)) for q in rail)
        tasks = [Task(W * C * W, (0, 0, ARRIVE), raises=arrive)]
        for g in range(r * C, (r + 1) * C):
            for q in rail:
                ready = Wait("rail_ready", r, (q // R,), consumers=C)
                tasks.append(Task(g * W + q, (g, q, PUT), waits=(ready,), raises=flag(g, q)))
            for p in [r, *peers]:
                tasks.append(Task(g * W + p, (g, p, PUSH), raises=flag(g, p)))
        for c in range(C):
            for q in rail:
                g = q * C + c
                for p in peers:
                    landed = (Wait("chunk_ready", r, (g,), consumers=mine[g]),)
                    tasks.append(Task(g * W + p, (g, p, FORWARD), waits=landed, raises=flag(g, p)))
        comm.append(tasks)
    shapes = {"m": m, "n": n, "k": k}
    sizes = _sizes(schedule, shapes, W, ms, cr, C)
    extra = {"consumers": torch.tensor(consumers, dtype=torch.int32)}  # [W, W * C] per rank
    return build_plan(SPEC_NODES, schedule, world, cfg, shapes, sizes, tiles, compute, comm, extra)


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
    return common.run_op(OP, {"a": a, "b": b}, world, schedule, out=out)


# -- cost model (mkernel/cost.py): one rank's work per call ----------------------------------------


def _cost_work(s: dict[str, int], W: int, bm: int, bn: int, rates: cost.Rates) -> cost.Work:
    """One rank's call: the comm role pushes its shard in chunks of ``chunk_rows`` (default: the
    tile's height), one task per (chunk, destination), (W - 1) / W of them over a link (one in W
    is the rank's own copy); the GEMM's tiles read them as they land. W = 1 reads ``a`` directly."""
    m, n, k = s["m"], s["n"], s["k"]
    ms = m // W
    cr = min(s.get("chunk_rows") or bm, ms)
    chunk = cr * k * 2.0
    return cost.Work(
        tiles=-(-m // bm) * -(-n // bn),
        flops=2.0 * m * n * k,
        epilogue_bytes=0.0,
        comm_tasks=W * -(-ms // cr) if W > 1 else 0,
        task_bytes=chunk,
        task_remote=chunk * (W - 1) / W,
        comm_produces=True,
        link_bytes=(W - 1) * ms * k * 2.0,
        after_ms=0.0,
    )


# Pushes by 16-byte stores or TMA bulk copies (the transfer knob).
cost.register(SPEC.name, cost.OpCost(work=_cost_work, transfers=("stores", "tma")))


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
        if plan.nodes > 1 and task.args[2] == ARRIVE:  # raises only: puts of no bytes
            return
        src = g // C  # == ctx.rank with one node
        r0 = (g - src * C) * cr
        rows = min(cr, ms - r0)
        dst = (src * ms + r0, rows, 0, k)
        if plan.nodes > 1 and task.args[2] == PUT:  # across nodes: a put the template posts
            program.put_on_completion(ctx, task, p, "gather", dst, "a", (r0, rows, 0, k))
            return
        load = twins.bulk_load if bulk else twins.tile_load  # TMA: the BulkRing's loads
        if plan.nodes > 1 and task.args[2] == FORWARD:  # a chunk that landed here, to a peer
            v = yield from load(ctx, "gather", ctx.rank, dst)
        else:
            v = yield from load(ctx, "a", ctx.rank, (r0, rows, 0, k))
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


# the run path's view of the op (mkernel/runtime/run.py): one bf16 result, its per-rank shape
OP = common.single_output_op(sys.modules[__name__], lambda s, W: (s["m"], s["n"]))
registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
