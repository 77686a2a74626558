"""Plans, checked from outside against what each op's docstring says its protocol is: the compute
order is the Schedule.tile_order hook's on every rank (and its errors name the hook and the rank),
the int32 tables decode back to the tasks, the kernel end reads each rank's whole output exactly
once, units share their role's tasks round robin, and each op's waits and raises are the ones its
protocol needs (recomputed here from tile rows, owners and chunks)."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.protocol import RAISE_OPS, signal_name
from mkernel.runtime import registry
from tests.helpers import assert_pads_zero, gemm_inputs, random_order

OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


def _shapes(op: str, W: int) -> dict[str, int]:
    """Global sizes with remainder tiles in both dimensions (64x128 tiles)."""
    if op == "ag_gemm":
        return {"m": W * 70, "n": 136, "k": 16}
    return {"m": W * 70 if op == "gemm_rs" else 150, "n": 136, "k": W * 16}


def _operands(op: str, W: int, seed: int = 0):
    s = _shapes(op, W)
    if op == "ag_gemm":
        return gemm_inputs(W, s["m"] // W, s["n"], s["k"], seed)
    return gemm_inputs(W, s["m"], s["n"], s["k"] // W, seed)


def _plan(op: str, W: int, **kw):
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(tile="64x128x64", **kw)
    return world, sched, sched.plan(op, world, **_shapes(op, W))


def _ids(tasks) -> list[int]:
    return [t.id for t in tasks]


# -- the tile-order hook ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", [1, 2, 3, 5])
@pytest.mark.parametrize("op", OPS)
def test_compute_order_is_the_hooks_on_every_rank(op, W):
    calls = []
    orders = random_order(11)  # a different permutation per rank

    def hook(rank, tiles):
        calls.append((rank, list(tiles)))
        return orders(rank, tiles)

    for overlap in ("intra_sm", "inter_sm"):
        calls.clear()
        world, sched, plan = _plan(op, W, tile_order=hook, overlap=overlap, sms=3)
        assert sorted(r for r, _ in calls) == list(range(W)), "the hook runs once per rank"
        assert all(tiles == plan.tiles for _, tiles in calls), "the hook sees the plan's tiles"
        want = [orders(r, plan.tiles) for r in range(W)]
        if op == "gemm_rs":  # the peers' tiles first, each class in the hook's order
            want = [
                [i for i in o if plan.tiles[i].tag != r] + [i for i in o if plan.tiles[i].tag == r]
                for r, o in enumerate(want)
            ]
        if W > 1:
            assert len({tuple(o) for o in want}) > 1, "the test's hook must tell ranks apart"
        for r in range(W):
            assert _ids(plan.roles["compute"].tasks[r]) == want[r], f"rank {r}"
            assert plan.compute_order[r].tolist() == want[r], f"rank {r}"
            n = plan.compute_units
            for u in range(n):  # every compute unit runs its share in that order
                assert plan.tasks_of("compute", r, u) == want[r][u::n]
            for t in plan.roles["compute"].tasks[r]:
                assert t.args[0] == t.id, "a compute task's argument is its tile"


@pytest.mark.parametrize("op", OPS)
def test_default_order_computes_every_tile_once_on_every_rank(op):
    for W in (1, 2, 4):
        _, _, plan = _plan(op, W, sms=3)
        for r in range(W):
            assert sorted(plan.compute_order[r].tolist()) == list(range(len(plan.tiles)))


@pytest.mark.parametrize("op", OPS)
def test_interpreter_runs_each_ranks_order(op):
    # One compute unit per rank: the timeline shows each rank's tiles in its hook's order.
    W = 3
    world = mkernel.World.emulated(W)
    a, b = _operands(op, W)
    orders = random_order(5)
    sched = mkernel.Schedule(tile="64x128x64", sms=1, tile_order=orders)
    getattr(mkernel, op)(a, b, world, sched)
    tiles = sched.plan(op, world, a, b).tiles
    spans = sorted(world.last_timeline.spans, key=lambda s: s.start)
    for r in range(W):
        ran = [s.task for s in spans if s.rank == r and s.unit == "compute0"]
        want = orders(r, tiles)
        if op == "gemm_rs":  # the peers' tiles first, each class in the hook's order
            want = [i for i in want if tiles[i].tag != r] + [i for i in want if tiles[i].tag == r]
        assert ran == want, f"rank {r} ran its tiles in another order"


def _good_elsewhere(bad):
    """A hook that fails only on rank 2 (the others get the identity)."""

    def hook(rank, tiles):
        return bad(rank, tiles) if rank == 2 else list(range(len(tiles)))

    return hook


def _raises(rank, tiles):
    raise RuntimeError("boom")


BAD_HOOKS = {
    "returns None": (lambda r, t: None, "must return a sequence of tile indices"),
    "returns the tiles": (lambda r, t: list(t), "must return a sequence of tile indices"),
    "raises": (_raises, "raised RuntimeError: boom"),
    "duplicates": (lambda r, t: [0] * len(t), "not a permutation"),
    "one short": (lambda r, t: list(range(len(t) - 1)), "not a permutation"),
    "one too many": (lambda r, t: list(range(len(t))) + [0], "not a permutation"),
    "out of range": (lambda r, t: [i + 1 for i in range(len(t))], "not a permutation"),
}


@pytest.mark.parametrize("bad", sorted(BAD_HOOKS))
@pytest.mark.parametrize("op", OPS)
def test_tile_order_hook_errors_name_the_hook_and_the_rank(op, bad):
    fn, what = BAD_HOOKS[bad]
    W = 3
    world = mkernel.World.emulated(W)
    a, b = _operands(op, W)
    sched = mkernel.Schedule(tile="64x128x64", tile_order=_good_elsewhere(fn))
    T = len(mkernel.Schedule(tile="64x128x64").plan(op, world, a, b).tiles)
    where = rf"Schedule\.tile_order\(rank=2, tiles=<{T} tiles>\)"
    with pytest.raises(ValueError, match=where + ".*" + what) as e:
        getattr(mkernel, op)(a, b, world, sched)
    if bad == "raises":
        assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match=where):  # the plan API reports it the same way
        sched.plan(op, world, a, b)
    assert_pads_zero(world)  # nothing ran


def test_tile_order_hook_returning_strings_names_the_hook():
    world = mkernel.World.emulated(2)
    a, b = _operands("gemm_ar", 2)
    sched = mkernel.Schedule(tile_order=lambda r, t: ["x"] * len(t))
    want = r"Schedule\.tile_order\(rank=0.*permutation of range\(\d+\).*got \['x'"
    with pytest.raises(ValueError, match=want):
        mkernel.gemm_ar(a, b, world, sched)


# -- tables, outputs, units ------------------------------------------------------------------------


def _pad_ids(spec) -> dict[str, int]:
    """Pad ids as protocol.py's docstring states them: 0 the barrier, then the op's pads in order,
    each counted pad followed by its counter."""
    ids, names = {}, ["barrier"]
    for p in spec.pads:
        names += [p.name, p.name + "_count"] if p.counted else [p.name]
    for i, name in enumerate(names):
        ids[name] = i
    return ids


def _flat(plan, pad: str, index) -> int:
    """Row-major flat index of ``index`` in the pad's shape (plan sizes)."""
    (p,) = [p for p in plan.spec.pads if p.name == pad]
    shape = [plan.sizes[s] for s in p.shape]
    assert len(index) == len(shape) and all(0 <= i < n for i, n in zip(index, shape, strict=True))
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("op", OPS)
def test_tables_decode_back_to_the_tasks(op, W):
    _, _, plan = _plan(op, W, sms=3)
    ids = _pad_ids(plan.spec)
    raiser = {}
    for tables in plan.roles.values():
        for r, ts in enumerate(tables.tasks):
            for t in ts:
                for x in t.raises:
                    raiser[(x.pad, x.rank, x.index)] = r
    for role, tables in plan.roles.items():
        tt = {k: v.tolist() for k, v in tables.tensors.items()}
        counts = [len(ts) for ts in tables.tasks]
        starts = [sum(counts[:r]) for r in range(W + 1)]
        assert tt["task_span"] == [[starts[r], starts[r + 1]] for r in range(W)], role
        rows = [t for ts in tables.tasks for t in ts]
        assert len(tt["wait_span"]) == len(tt["raise_span"]) == len(rows)
        for row, t in enumerate(rows):
            assert tt["args"][row] == list(t.args) + [0] * (4 - len(t.args)), (role, row)
            waits = tt["waits"][slice(*tt["wait_span"][row])]
            want = []
            for w in t.waits:
                counter = ids[w.pad + "_count"] if w.consumers > 1 else -1
                flat = _flat(plan, w.pad, w.index)
                peer = raiser[(w.pad, w.rank, w.index)]
                assert w.peer == peer, f"{role} task {t.id}: the wait names peer {w.peer}"
                want.append(
                    [ids[w.pad], w.rank, flat, w.value, w.consumers, counter, w.patience, peer]
                )
                dims = [p.dims for p in plan.spec.pads if p.name == w.pad][0]
                label = ", ".join(f"{d}={i}" for d, i in zip(dims, w.index, strict=True))
                assert signal_name(plan.spec, ids[w.pad], flat, plan.sizes) == f"{w.pad}[{label}]"
            assert waits == want, (role, row)
            raises = tt["raises"][slice(*tt["raise_span"][row])]
            want = [
                [ids[x.pad], x.rank, _flat(plan, x.pad, x.index), x.value, RAISE_OPS.index(x.op)]
                for x in t.raises
            ]
            assert raises == want, (role, row)


def _out_shape(op: str, plan) -> tuple[int, int]:
    m, n, W = plan.shapes["m"], plan.shapes["n"], plan.world_size
    return (m // W, n) if op == "gemm_rs" else (m, n)


@pytest.mark.parametrize("op", OPS)
def test_kernel_end_reads_each_ranks_whole_output_once(op):
    module = registry.get(op)
    for W in (1, 2, 3):
        _, _, plan = _plan(op, W)
        for r in range(W):
            cover = torch.zeros(_out_shape(op, plan), dtype=torch.int32)
            rects = module.outputs(plan, r)
            for r0, nr, c0, nc in rects.values():
                cover[r0 : r0 + nr, c0 : c0 + nc] += 1
            assert bool((cover == 1).all()), f"W={W} rank {r}: outputs cover {cover.unique()}"
            if op == "gemm_rs" and W > 1:  # the owner's tiles: its rows of the sum
                assert sorted(rects) == [t.index for t in plan.tiles if t.tag == r]
            else:
                assert sorted(rects) == [t.index for t in plan.tiles]


@pytest.mark.parametrize("op", OPS)
def test_units_share_their_roles_tasks_round_robin(op):
    W = 3
    for overlap, sms, comm_sms in (
        ("intra_sm", 5, None),
        ("inter_sm", 6, 2),
        ("inter_sm", 8, None),
    ):
        _, _, plan = _plan(op, W, overlap=overlap, sms=sms, comm_sms=comm_sms)
        T = len(plan.roles["compute"].tasks[0])
        if overlap == "intra_sm":  # one communicator warp in every compute CTA
            assert plan.compute_units == plan.comm_units == min(sms, T)
            assert plan.ctas_per_rank == plan.compute_units
        else:
            comm = comm_sms or plan.extra["choice"].chosen.comm_sms  # the cost model's
            assert (plan.compute_units, plan.comm_units) == (min(sms - comm, T), comm)
            assert plan.ctas_per_rank == plan.compute_units + plan.comm_units
        for role, n in (("compute", plan.compute_units), ("comm", plan.comm_units)):
            for r in range(W):
                ids = _ids(plan.roles[role].tasks[r])
                for u in range(n):
                    assert plan.tasks_of(role, r, u) == ids[u::n]
                rows = list(plan.roles[role].rows(r))
                assert sorted(sum((plan.task_rows(role, r, u) for u in range(n)), [])) == rows


# -- each op's protocol, recomputed ----------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_w1_plans_communicate_nothing(op):
    _, _, plan = _plan(op, 1)
    assert plan.roles["comm"].tasks == [[]]
    for t in plan.roles["compute"].tasks[0]:
        assert t.waits == () and t.raises == (), f"W=1 {op} task {t.id}"


def _assert_tiles_cover(plan, m, n):
    cover = torch.zeros(m, n, dtype=torch.int32)
    for i, t in enumerate(plan.tiles):
        assert t.index == i
        cover[t.m0 : t.m0 + t.rows, t.n0 : t.n0 + t.cols] += 1
    assert bool((cover == 1).all()), "tiles must cover the output exactly once"


@pytest.mark.parametrize("W", [2, 3])
def test_gemm_rs_protocol(W):
    _, _, plan = _plan("gemm_rs", W)
    m, n = plan.shapes["m"], plan.shapes["n"]
    ms = m // W
    _assert_tiles_cover(plan, m, n)
    owned = {r: [t.index for t in plan.tiles if t.m0 // ms == r] for r in range(W)}
    for t in plan.tiles:
        assert t.tag == t.m0 // ms and (t.m0 + t.rows - 1) // ms == t.tag, "a tile has one owner"
    for r in range(W):
        tasks = plan.roles["compute"].tasks[r]
        own = [i for i, task in enumerate(tasks) if plan.tiles[task.id].tag == r]
        assert own == list(range(len(tasks) - len(owned[r]), len(tasks))), "own tiles come last"
        assert sorted(tasks[i].id for i in own) == owned[r]
        for task in tasks:
            t = plan.tiles[task.id]
            slot = owned[t.tag].index(t.index)
            if t.tag != r:  # a peer's tile: my bf16 partial lands in its stage, then its flag
                assert [(x.pad, x.rank, x.index, x.value, x.op) for x in task.raises] == [
                    ("partial", t.tag, (slot, r), 1, "set")
                ]
                assert task.waits == ()
            else:  # my own tile: every peer's partial first (consumed), nothing raised
                assert sorted(
                    (w.pad, w.rank, w.index, w.value, w.consumers) for w in task.waits
                ) == [("partial", r, (slot, q), 1, 1) for q in range(W) if q != r]
                assert task.raises == ()
        assert plan.roles["comm"].tasks[r] == [], "no pass after the GEMM"


@pytest.mark.parametrize("W", [2, 3])
def test_gemm_ar_protocol(W):
    _, _, plan = _plan("gemm_ar", W)
    m, n = plan.shapes["m"], plan.shapes["n"]
    _assert_tiles_cover(plan, m, n)
    T = len(plan.tiles)
    for r in range(W):
        for task in plan.roles["compute"].tasks[r]:
            t = task.id
            assert plan.tiles[t].tag == t % W
            assert [(x.pad, x.rank, x.index) for x in task.raises] == [("tile_flag", t % W, (t, r))]
        comm = plan.roles["comm"].tasks[r]
        finalize = [x for x in comm if x.id < T]
        landed = [x for x in comm if x.id >= T]
        assert comm == finalize + landed, "finalizes come before the pure waits"
        assert _ids(finalize) == [t for t in range(T) if t % W == r]
        for task in finalize:
            t = task.id
            got = sorted((w.pad, w.rank, w.index, w.consumers, w.patience) for w in task.waits)
            assert got == [("tile_flag", r, (t, q), 1, 1) for q in range(W)]
            assert sorted((x.pad, x.rank, x.index) for x in task.raises) == [
                ("tile_ready", p, (t,)) for p in range(W) if p != r
            ]
        assert sorted(x.id - T for x in landed) == [t for t in range(T) if t % W != r]
        for task in landed:  # twice the deadline: a stuck owner's own wait reports first
            assert [(w.pad, w.rank, w.index, w.patience) for w in task.waits] == [
                ("tile_ready", r, (task.id - T,), 2)
            ]
            assert task.raises == ()


@pytest.mark.parametrize("chunk_rows", [None, 16, 7])
@pytest.mark.parametrize("W", [2, 3])
def test_ag_gemm_protocol(W, chunk_rows):
    _, _, plan = _plan("ag_gemm", W, chunk_rows=chunk_rows)
    m, n = plan.shapes["m"], plan.shapes["n"]
    ms = m // W
    _assert_tiles_cover(plan, m, n)
    cr = min(chunk_rows or 64, ms)
    C = -(-ms // cr)
    # chunk g = src * C + c holds global rows src*ms + c*cr .. min(+cr, shard end)
    rows_of = {
        s * C + c: range(s * ms + c * cr, s * ms + min((c + 1) * cr, ms))
        for s in range(W)
        for c in range(C)
    }
    needs = {
        t.index: [g for g, rows in rows_of.items() if set(rows) & set(range(t.m0, t.m0 + t.rows))]
        for t in plan.tiles
    }
    users = {g: sum(g in gs for gs in needs.values()) for g in rows_of}
    for r in range(W):
        for task in plan.roles["compute"].tasks[r]:
            got = sorted((w.pad, w.rank, w.index, w.value, w.consumers) for w in task.waits)
            want = [("chunk_ready", r, (g,), 1, users[g]) for g in needs[task.id]]
            assert got == want, f"rank {r} tile {task.id}"
            assert task.raises == ()
        pushes = [(g, (r + j) % W) for g in range(r * C, (r + 1) * C) for j in range(W)]
        comm = plan.roles["comm"].tasks[r]
        assert [tuple(x.args[:2]) for x in comm] == pushes, "chunk-major, own copy first"
        for task, (g, p) in zip(comm, pushes, strict=True):
            assert task.waits == ()
            assert [(x.pad, x.rank, x.index, x.value) for x in task.raises] == [
                ("chunk_ready", p, (g,), 1)
            ]
