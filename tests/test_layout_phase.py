"""The layout phase (a role filled by the kernel from device data) in the interpreter, on a toy op
that is MoE dispatch in miniature: rank s sends row i of x to rank route[s, i] (or keeps it home
when -1). How many tasks each rank runs is data, so the comm role is a Capacity and the op's layout
twin makes the tasks: a push per routed row (raising arrived[s, i] at the destination), then a wait
per row routed here. Checks: exact results on every routed row for random routes (both overlaps,
two calls back to back), and that the interpreter reports each planted mistake."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mkernel import World
from mkernel.errors import CommTimeout, RaceError
from mkernel.interp import twins
from mkernel.interp.program import run_plan
from mkernel.protocol import Buffer, Capacity, OpSpec, Pad, Raise, Task, Wait
from mkernel.schedule import TILE_CONFIGS, Schedule, build_plan

ROWS, COLS = 6, 8
PUSH, ARRIVED = 0, 1
SPEC = OpSpec(
    name="routed_push",
    doc="toy: rows to the rank their route names",
    buffers=(
        Buffer("x", "input", torch.float32, ("rows", "cols"), "rows to send"),
        Buffer("route", "input", torch.int32, ("rows", "one"), "destination of each row"),
        Buffer("out", "output", torch.float32, ("all_rows", "cols"), "rows routed here"),
    ),
    pads=(Pad("arrived", ("src", "row"), ("W", "rows"), doc="row of src is in my out"),),
    scalars=("rows", "cols"),
)


def make_plan(world: World, overlap: str, cap_rows: int | None = None):
    W = world.size
    cap = cap_rows if cap_rows is not None else ROWS + W * ROWS  # every push and every wait
    sizes = {"rows": ROWS, "cols": COLS, "all_rows": W * ROWS, "one": 1}
    comm = Capacity(rows=cap, waits=W * ROWS, raises=ROWS)
    sched = Schedule(overlap=overlap)
    return build_plan(SPEC, sched, world, TILE_CONFIGS["64x128x64"], {}, sizes, [], [[]] * W, comm)


def layout_twin(mistake: str = ""):
    """The op's device layout, as its twin: reads every rank's routes (inputs, written before the
    launch) and makes this rank's comm tasks."""

    def layout(ctx):
        W, me = ctx.W, ctx.rank
        routes = []
        for s in range(W):
            col = yield from twins.tile_load(ctx, "route", s, (0, ROWS, 0, 1))
            routes.append([int(v) for v in col.flatten()])
        tasks = []
        for i, dest in enumerate(routes[me]):
            if dest >= 0:
                to = (dest + 1) % W if mistake == "wrong_rank" else dest
                tasks.append(Task(i, (PUSH, i, dest), raises=(Raise("arrived", to, (me, i)),)))
        for s in range(W):
            for i, dest in enumerate(routes[s]):
                if dest == me and not (mistake == "no_wait" and s != me):
                    w = Wait("arrived", me, (s, i), peer=s)
                    tasks.append(Task(ROWS + s * ROWS + i, (ARRIVED, s, i), waits=(w,)))
        if mistake == "overflow":
            tasks += [Task(10_000 + j, (ARRIVED, 0, 0)) for j in range(ROWS * (W + 1) + 1)]
        return {"comm": tasks}

    return layout


def run(W: int, overlap: str, route: torch.Tensor, seed: int, mistake: str = "", calls: int = 1):
    world = World.emulated(W, timeout_s=0.05)
    plan = make_plan(world, overlap)
    x = torch.randn(W, ROWS, COLS, generator=torch.Generator().manual_seed(seed))
    out = torch.full((W, W * ROWS, COLS), float("nan"))
    bufs = {
        "x": x,
        "route": route.view(W, ROWS, 1).clone(),
        "out": out,
        "barrier": torch.zeros(W, 256 * W, dtype=torch.int32),
        "arrived": torch.zeros(W, W * ROWS, dtype=torch.int32),
    }

    def outputs(rank: int):  # the rows routed to `rank` (output tile id: the row of its sender)
        return {
            s * ROWS + i: (s * ROWS + i, 1, 0, COLS)
            for s in range(W)
            for i in range(ROWS)
            if int(route[s, i]) == rank
        }

    def move(ctx, task):  # the device comm_move: a push copies row i into dest's out
        kind, i, dest = task.args[:3]
        if kind != PUSH:
            return
        v = yield from twins.tile_load(ctx, "x", ctx.rank, (i, 1, 0, COLS))
        rect = (ctx.rank * ROWS + i, 1, 0, COLS)
        yield from twins.output_store(ctx, "out", dest, rect, v, ctx.rank * ROWS + i)

    moves = {"compute": None, "comm": move}
    run_plan(world, plan, bufs, moves, seed, outputs, calls=calls, layout=layout_twin(mistake))
    for pad in ("barrier", "arrived"):  # the layout flag and counter reset like every signal
        assert int(bufs[pad].abs().sum()) == 0, f"pad {pad} not back to zero"
    return x, out


routes = st.integers(2, 4).flatmap(
    lambda W: st.tuples(
        st.just(W),
        st.lists(st.integers(-1, W - 1), min_size=W * ROWS, max_size=W * ROWS),
        st.sampled_from(["intra_sm", "inter_sm"]),
        st.integers(0, 2**16),
    )
)


@given(routes)
@example((2, [-1] * 12, "intra_sm", 0))  # nothing routed: no tasks at all
@example((3, [0] * 18, "inter_sm", 1))  # everything to rank 0
def test_routed_rows_arrive_exactly(case):
    W, flat, overlap, seed = case
    route = torch.tensor(flat, dtype=torch.int32).view(W, ROWS)
    x, out = run(W, overlap, route, seed, calls=2)
    assert_routed(x, route, out)


def assert_routed(x: torch.Tensor, route: torch.Tensor, out: torch.Tensor) -> None:
    """Row i of rank s is in out[route[s, i]] at row s * ROWS + i, bit for bit, and nowhere else
    (out was poisoned with NaN)."""
    W = x.shape[0]
    for s in range(W):
        for i in range(ROWS):
            d = int(route[s, i])
            for r in range(W):
                got = out[r, s * ROWS + i]
                if r == d:
                    assert torch.equal(got, x[s, i]), (s, i, r)
                else:
                    assert torch.isnan(got).all(), f"row {i} of {s} written on {r}, routed to {d}"


ROUTE3 = torch.tensor([[1, 2, 0, -1, 1, 2], [0, 0, 2, 1, -1, 2], [1, 1, 0, 0, 2, -1]])


def test_missing_wait_is_a_race_at_the_kernel_end():
    # The receiver's layout forgets to wait for its peers' rows: the kernel end reads them
    # unordered with the peers' stores.
    with pytest.raises(RaceError):
        run(3, "inter_sm", ROUTE3, 0, mistake="no_wait")


def test_signal_to_the_wrong_rank_times_out_naming_it():
    with pytest.raises(CommTimeout, match=r"arrived\[src="):
        run(3, "intra_sm", ROUTE3, 0, mistake="wrong_rank")


def test_layout_over_capacity_is_refused_naming_the_role():
    with pytest.raises(ValueError, match="comm tasks.*over the plan's Capacity"):
        run(3, "inter_sm", ROUTE3, 0, mistake="overflow")


def test_device_filled_plan_needs_a_layout():
    world = World.emulated(2)
    plan = make_plan(world, "intra_sm")
    assert plan.roles["comm"].capacity == Capacity(ROWS + 2 * ROWS, 2 * ROWS, ROWS)
    spans = plan.roles["comm"].tensors["task_span"].tolist()
    cap = plan.roles["comm"].capacity.rows
    assert spans == [[0, 0], [cap, cap]]  # empty regions, one per rank, until the kernel fills them
    with pytest.raises(ValueError, match="filled on the device: pass layout"):
        run_plan(world, plan, {}, {}, 0, lambda r: {})


def test_capacity_rejects_negative_room():
    with pytest.raises(ValueError, match="Capacity.rows"):
        Capacity(-1, 0, 0)
