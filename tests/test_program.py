"""The template's twin (mkernel/interp/program.py run_plan) and the machine across calls, on a toy
op of a few lines: raises of op "add" (a counter several producers raise, one consumer waits for the
total), the entry barrier's arrival that waits for the previous one to be consumed (the device's
CAS) over several calls, and a kernel boundary that orders the previous call's plain stores for the
next call's TMA loads. Expected values are the toy's inputs, indexed here."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.interp import program, twins
from mkernel.interp.machine import Machine, SigRef
from mkernel.ops import common
from mkernel.protocol import MAX_BARRIER_SLOTS, Buffer, OpSpec, Pad, Raise, Task, Wait
from mkernel.schedule import TILE_CONFIGS, build_plan
from tests.helpers import assert_pads_zero

# fan_in: every rank stores its x into rank 0's out (rows r*R ..) and adds 1 to rank 0's counter;
# rank 0's second task waits for the counter to reach W, so its kernel end is ordered after every
# store through the release-adds.
SPEC = OpSpec(
    name="fan_in",
    buffers=(
        Buffer("x", "input", torch.float32, ("rows", "cols")),
        Buffer("out", "output", torch.float32, ("all_rows", "cols")),
    ),
    pads=(Pad("count", ("i",), ("1",)),),
    scalars=("rows", "cols"),
)


def fan_in_plan(world, sched: mkernel.Schedule, rows: int, cols: int):
    W = world.size
    comm = []
    for r in range(W):
        tasks = [Task(0, (0,), raises=(Raise("count", 0, (0,), 1, "add"),))]
        if r == 0:
            tasks.append(Task(1, (1,), waits=(Wait("count", 0, (0,), value=W),)))
        comm.append(tasks)
    sizes = {"rows": rows, "cols": cols, "all_rows": W * rows}
    tile = TILE_CONFIGS["64x128x64"]  # no GEMM
    return build_plan(SPEC, sched, world, tile, {}, sizes, [], [[] for _ in range(W)], comm)


def run_fan_in(W: int, overlap: str, seed: int, calls: int):
    world = mkernel.World.emulated(W)
    rows, cols = 3, 8
    plan = fan_in_plan(world, mkernel.Schedule(overlap=overlap, sms=2), rows, cols)
    x = torch.randn(W, rows, cols, generator=torch.Generator().manual_seed(seed))
    out = torch.full((W, W * rows, cols), float("nan"))

    def push(ctx, task):
        if task.args[0] != 0:
            return
        v = yield from twins.tile_load(ctx, "x", ctx.rank, (0, rows, 0, cols))
        rect = (ctx.rank * rows, rows, 0, cols)
        yield from twins.output_store(ctx, "out", 0, rect, v, ctx.rank)

    def outputs(rank):
        return {q: (q * rows, rows, 0, cols) for q in range(W)} if rank == 0 else {}

    ws = common.workspace(world, plan)
    buffers = {"x": x, "out": out, **{k: v.local for k, v in ws.items() if v is not None}}
    moves = {"compute": None, "comm": push}
    program.run_plan(world, plan, buffers, moves, seed, outputs, calls=calls)
    return out, x, world


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
@pytest.mark.parametrize("W", [2, 3, 5])
def test_add_raises_count_every_producer_over_calls(W, overlap):
    for seed in range(6):
        out, x, world = run_fan_in(W, overlap, seed, calls=3)
        for q in range(W):
            assert torch.equal(out[0, q * 3 : (q + 1) * 3], x[q]), f"seed {seed}: rows of {q}"
        assert_pads_zero(world)


def test_entry_barrier_arrival_waits_for_the_previous_one_to_be_consumed():
    # The template's barrier (program.entry_barrier): ranks 1 and 2 run ahead into their next call
    # while rank 0 is late; an arrival that overwrote one not yet consumed would be lost and the
    # late rank's next barrier would wait for it forever.
    W, calls = 3, 4
    sig = lambda pad, rank, flat: SigRef(pad, rank, (flat,))  # noqa: E731

    def arrive(ctx, task):
        yield from program.entry_barrier(ctx, sig, 1)
        if ctx.rank == 0:
            yield from twins.delay(ctx, 5)

    for seed in range(30):
        pads = {"barrier": torch.zeros(W, MAX_BARRIER_SLOTS * W, dtype=torch.int32)}
        m = Machine(W, pads, {}, seed=seed, deadline_steps=10_000)
        for call in range(calls):
            for r in range(W):
                m.add_agent(r, "compute", 0, [0], arrive, call=call)
        m.run()
        assert int(pads["barrier"].abs().sum()) == 0, f"seed {seed}: barrier flags left set"


@pytest.mark.parametrize("peer", [False, True])
def test_a_kernel_boundary_orders_plain_stores_for_the_next_calls_tma_loads(peer):
    # Call 0 stores x[0] with plain stores (rank 0 itself, or rank 1 announcing it to rank 0);
    # call 1 on rank 0 TMA-loads it with no wait and no fence of its own: the kernel boundary
    # between the calls orders everything before it, for every proxy.
    def store(ctx, task):
        if ctx.call == 0 and ctx.rank == (1 if peer else 0):
            yield from twins.peer_store(ctx, "x", 0, (0, 2, 0, 4), torch.ones(2, 4))
            if peer:
                yield from twins.signal_set_release(ctx, ctx.sig("f", 0, 0))
        if ctx.call == 0 and ctx.rank == 0 and peer:
            yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 0, 0), 1, peer=1)
        if ctx.call == 1 and ctx.rank == 0:
            v = yield from twins.tile_load_async(ctx, "x", 0, (0, 2, 0, 4))
            assert torch.equal(v, torch.ones(2, 4))

    for seed in range(8):
        pads = {"f": torch.zeros(2, 1, dtype=torch.int32)}
        m = Machine(2, pads, {"x": torch.zeros(2, 4, 4)}, seed=seed)
        for call in (0, 1):
            for r in (0, 1):
                m.add_agent(r, "comm", 0, [0], store, call=call)
        m.run()
