"""The CPU interpreter catches protocol bugs: races, double / missing writes, deadlocks,
timeouts."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.interp import twins
from mkernel.interp.machine import Machine


def _machine(W=2, seed=0, deadline=10_000):
    pads = {"f": torch.zeros(W, 4, dtype=torch.int32)}
    bufs = {"x": torch.zeros(W, 4, 4)}
    return Machine(W, pads, bufs, seed=seed, deadline_steps=deadline)


def _producer(signal: bool):
    def run(ctx, task):
        yield from twins.tile_send(ctx, "x", 1, (0, 2, 0, 4), torch.ones(2, 4))
        if signal:
            yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

    return run


def _consumer(wait: bool):
    def run(ctx, task):
        if wait:
            yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 1, 0), 1, peer=0)
        v = yield from twins.tile_load(ctx, "x", 1, (0, 2, 0, 4))
        yield from twins.output_store(ctx, "x", 1, (2, 2, 0, 4), v, tile=0)

    return run


@pytest.mark.parametrize("seed", range(20))
def test_wait_orders_the_read(seed):
    m = _machine(seed=seed)
    m.add_agent(0, "compute", 0, [0], _producer(signal=True))
    m.add_agent(1, "comm", 0, [0], _consumer(wait=True))
    m.run()
    m.check_outputs({1: [0]})
    assert torch.equal(m.buffers["x"][1, 2:], torch.ones(2, 4))
    assert int(m.pads["f"].sum()) == 0


def test_read_without_wait_is_a_race():
    # Whatever the interleaving, the read is not ordered after the write: a race (or, if the read
    # happens first, the later write races with the read).
    for seed in range(10):
        m = _machine(seed=seed)
        m.add_agent(0, "compute", 0, [0], _producer(signal=True))
        m.add_agent(1, "comm", 0, [7], _consumer(wait=False))
        with pytest.raises(mkernel.RaceError) as e:
            m.run()
        assert "x[1]" in str(e.value)


def test_missing_signal_is_a_deadlock_naming_the_waiter():
    m = _machine()
    m.add_agent(0, "compute", 0, [0], _producer(signal=False))
    m.add_agent(1, "comm", 0, [5], _consumer(wait=True))
    with pytest.raises(mkernel.CommTimeout) as e:
        m.run()
    assert isinstance(e.value, mkernel.DeadlockError)
    assert (e.value.rank, e.value.peer, e.value.task) == (1, 0, 5)
    assert "f[1][0]" in e.value.signal


def test_wait_past_deadline_while_others_run():
    def spinner(ctx, task):
        for _ in range(200):
            yield from twins.delay(ctx, 1)

    m = _machine(deadline=50)
    m.add_agent(0, "compute", 0, [0], spinner)
    m.add_agent(1, "comm", 0, [3], _consumer(wait=True))
    with pytest.raises(mkernel.CommTimeout) as e:
        m.run()
    assert not isinstance(e.value, mkernel.DeadlockError)
    assert e.value.rank == 1 and e.value.task == 3


def test_tile_written_twice_and_never():
    def writer(ctx, task):
        yield from twins.output_store(ctx, "x", 0, (0, 1, 0, 4), torch.ones(1, 4), tile=0)

    m = _machine()
    m.add_agent(0, "compute", 0, [0, 1], writer)
    with pytest.raises(mkernel.TileWriteError, match="written twice"):
        m.run()
    m = _machine()
    m.add_agent(0, "compute", 0, [0], writer)
    m.run()
    with pytest.raises(mkernel.TileWriteError, match="never written"):
        m.check_outputs({0: [0, 1]})


def test_concurrent_reduce_adds_commute_but_need_a_wait_before_the_read():
    def adder(ctx, task):
        yield from twins.reduce_add(ctx, "x", 0, (0, 4, 0, 4), torch.full((4, 4), 1.0 + ctx.rank))
        yield from twins.signal_add_release(ctx, ctx.sig("f", 0, 1), 1)

    def reader(ctx, task):
        yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 0, 1), 2, peer=-1)
        v = yield from twins.tile_load(ctx, "x", 0, (0, 4, 0, 4))
        assert torch.equal(v, torch.full((4, 4), 3.0))

    for seed in range(10):
        m = _machine(seed=seed)
        m.add_agent(0, "compute", 0, [0], adder)
        m.add_agent(1, "compute", 0, [0], adder)
        m.add_agent(0, "comm", 0, [0], reader)
        m.run()


def test_seeds_change_the_interleaving():
    W = 4
    world = mkernel.World.emulated(W)
    a = torch.randn(W, W * 64, 16).bfloat16()
    b = torch.randn(W, 16, 64).bfloat16()
    orders = set()
    for seed in range(4):
        mkernel.gemm_rs(a, b, world=world, schedule=mkernel.Schedule(tile="128x128x64", seed=seed))
        spans = world.last_timeline.spans
        orders.add(tuple((s.rank, s.unit, s.task) for s in sorted(spans, key=lambda s: s.start)))
    assert len(orders) > 1
