"""What the interpreter models of the GPU: each test plants one mistake a kernel could make and
asserts the interpreter reports it in every interleaving tried, next to the correct version.

Covered: bulk (TMA) copies that land at bulk_wait_all, relaxed vs release signals, the async proxy
fence before a TMA load, two calls in stream order with the kernel end reading every output, and
errors that name role and unit.
"""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.interp import twins
from mkernel.interp.machine import Machine

SEEDS = range(12)
TOP, BOTTOM = (0, 2, 0, 4), (2, 2, 0, 4)  # rows 0:2 and 2:4 of a 4x4 buffer


def _machine(seed, W=2, deadline=10_000):
    pads = {
        "f": torch.zeros(W, 4, dtype=torch.int32),
        "bar": torch.zeros(W, 1, W, dtype=torch.int32),
    }
    return Machine(W, pads, {"x": torch.zeros(W, 4, 4)}, seed=seed, deadline_steps=deadline)


def _run_each_seed(build, error=None, match=None):
    """Builds and runs a machine per seed; with ``error``, asserts every seed raises it."""
    for seed in SEEDS:
        m = build(seed)
        if error is None:
            m.run()
            continue
        with pytest.raises(error, match=match):
            m.run()


def _reader(value=None, reset=True, load=twins.tile_load, fence=False):
    """Rank 1: waits for f[1][0] == 1 (from rank 0), reads TOP of x[1]."""

    def run(ctx, task):
        wait = twins.wait_acquire_reset if reset else twins.wait_acquire
        yield from wait(ctx, ctx.sig("f", 1, 0), 1, peer=0)
        if fence:
            yield from twins.fence_proxy_async(ctx)
        v = yield from load(ctx, "x", 1, TOP)
        if value is not None:
            assert torch.equal(v, torch.full((2, 4), value))

    return run


# -- races, role and unit in the message -------------------------------------------------------


def test_read_without_wait_is_a_race_naming_both_agents():
    def writer(ctx, task):
        yield from twins.tile_send(ctx, "x", 1, TOP, torch.ones(2, 4))

    def reader(ctx, task):
        yield from twins.tile_load(ctx, "x", 1, TOP)

    for seed in SEEDS:
        m = _machine(seed)
        m.add_agent(0, "compute", 1, [0], writer)
        m.add_agent(1, "comm", 0, [7], reader)
        with pytest.raises(mkernel.RaceError) as e:
            m.run()
        msg = str(e.value)
        # Whichever ran first, both agents are named by role and unit.
        assert "rank 1 comm0 task 7" in msg and "rank 0 compute1 task 0" in msg, msg
        assert {(e.value.rank, e.value.role, e.value.unit), e.value.other[:3]} == {
            (1, "comm", 0),
            (0, "compute", 1),
        }


def test_read_after_an_unwaited_reduce_add_is_a_race():
    def adder(signal_first):
        def run(ctx, task):
            if signal_first:  # BUG: the add is not ordered before the signal
                yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))
            yield from twins.reduce_add(ctx, "x", 1, TOP, torch.ones(2, 4))
            if not signal_first:
                yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

        return run

    def build(signal_first):
        def b(seed):
            m = _machine(seed)
            m.add_agent(0, "compute", 0, [0], adder(signal_first))
            m.add_agent(1, "comm", 0, [0], _reader(value=None if signal_first else 1.0))
            return m

        return b

    _run_each_seed(build(True), mkernel.RaceError, "reduce-add")
    _run_each_seed(build(False))


# -- bulk copies -------------------------------------------------------------------------------


def _bulk_writer(signal_before_wait: bool):
    def run(ctx, task):
        yield from twins.tile_send_bulk(ctx, "x", 1, TOP, torch.full((2, 4), 3.0))
        # Issued, not landed: nothing written yet.
        assert torch.equal(ctx.m.buffers["x"][1, 0:2], torch.zeros(2, 4))
        if signal_before_wait:  # BUG: the release does not order a copy still in flight
            yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))
        yield from twins.bulk_wait_all(ctx)
        if not signal_before_wait:
            yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

    return run


@pytest.mark.parametrize("early", [True, False])
def test_signal_before_bulk_wait_all_is_a_race(early):
    def build(seed):
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], _bulk_writer(signal_before_wait=early))
        # (early: the read may come before the landing, so no value check)
        m.add_agent(1, "comm", 0, [0], _reader(value=None if early else 3.0))
        return m

    if early:  # the read comes before or after the landing: a race either way
        _run_each_seed(build, mkernel.RaceError, "x\\[1\\]")
    else:
        _run_each_seed(build)


def test_bulk_reduce_adds_land_at_wait_all_or_at_the_agent_end():
    def adder(ctx, task):
        yield from twins.reduce_add_bulk_f32(ctx, "x", 0, TOP, torch.full((2, 4), 1.0 + ctx.rank))
        if ctx.rank == 0:
            yield from twins.bulk_wait_all(ctx)
        # rank 1 never waits: its copy lands when the agent ends (the kernel exit drains it)

    for seed in SEEDS:
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], adder)
        m.add_agent(1, "compute", 0, [0], adder)
        m.run()
        assert torch.equal(m.buffers["x"][0, 0:2], torch.full((2, 4), 3.0))


# -- relaxed vs release ------------------------------------------------------------------------


def test_relaxed_signal_instead_of_release_is_a_race():
    def writer(relaxed):
        def run(ctx, task):
            yield from twins.tile_send(ctx, "x", 1, TOP, torch.ones(2, 4))
            raise_ = twins.signal_set_relaxed if relaxed else twins.signal_set_release
            yield from raise_(ctx, ctx.sig("f", 1, 0))

        return run

    def build(relaxed):
        def b(seed):
            m = _machine(seed)
            m.add_agent(0, "compute", 0, [0], writer(relaxed))
            m.add_agent(1, "comm", 0, [0], _reader(value=1.0))
            return m

        return b

    _run_each_seed(build(True), mkernel.RaceError, "no completed wait")
    _run_each_seed(build(False))


def test_a_relaxed_add_keeps_earlier_releases_but_adds_no_ordering():
    # Rank 0 releases its tile into a counter, rank 1 adds to it relaxed: the consumer that sees
    # 2 may read rank 0's tile, but not rank 1's.
    def producer(ctx, task):
        rect = TOP if ctx.rank == 0 else BOTTOM
        yield from twins.tile_send(ctx, "x", 0, rect, torch.ones(2, 4))
        add = twins.signal_add_release if ctx.rank == 0 else twins.signal_add_relaxed
        yield from add(ctx, ctx.sig("f", 0, 1), 1)

    def consumer(ctx, task):
        yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 0, 1), 2, peer=-1)
        yield from twins.tile_load(ctx, "x", 0, TOP)  # fine: released by rank 0
        yield from twins.tile_load(ctx, "x", 0, BOTTOM)  # race: rank 1's add was relaxed

    for seed in SEEDS:
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], producer)
        m.add_agent(1, "compute", 0, [0], producer)
        m.add_agent(0, "comm", 0, [0], consumer)
        with pytest.raises(mkernel.RaceError, match="rows 2:4") as e:
            m.run()
        assert e.value.other[:3] == (1, "compute", 0)


def test_fetch_add_relaxed_hands_out_distinct_tickets():
    got = []

    def taker(ctx, task):
        got.append((yield from twins.fetch_add_relaxed(ctx, ctx.sig("f", 0, 2), 1)))

    for seed in SEEDS:
        got.clear()
        m = _machine(seed, W=3)
        for r in range(3):
            m.add_agent(r, "comm", 0, [0], taker)
        m.run()
        assert sorted(got) == [0, 1, 2]
        assert int(m.pads["f"][0, 2]) == 3


# -- proxy fences ------------------------------------------------------------------------------


@pytest.mark.parametrize("fence", [False, True])
def test_tma_load_of_plain_stores_needs_fence_proxy_async(fence):
    def writer(ctx, task):
        yield from twins.peer_store(ctx, "x", 1, TOP, torch.ones(2, 4))
        yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

    def build(seed):
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], writer)
        m.add_agent(1, "comm", 0, [0], _reader(1.0, load=twins.tile_load_async, fence=fence))
        return m

    if fence:
        _run_each_seed(build)
    else:
        _run_each_seed(build, mkernel.RaceError, "fence_proxy_async")


def test_tma_load_of_bulk_writes_needs_no_proxy_fence():
    def build(seed):
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], _bulk_writer(signal_before_wait=False))
        m.add_agent(1, "comm", 0, [0], _reader(3.0, load=twins.tile_load_async))
        return m

    _run_each_seed(build)


def test_own_plain_store_then_tma_load_needs_a_fence_after_the_store():
    def agent(fence_after_store):
        def run(ctx, task):
            yield from twins.fence_proxy_async(ctx)  # too early when not after the store
            yield from twins.tile_send(ctx, "x", 0, TOP, torch.ones(2, 4))
            if fence_after_store:
                yield from twins.fence_proxy_async(ctx)
            yield from twins.tile_load_async(ctx, "x", 0, TOP)

        return run

    m = _machine(0)
    m.add_agent(0, "compute", 0, [0], agent(False))
    with pytest.raises(mkernel.RaceError, match="fence_proxy_async"):
        m.run()
    m = _machine(0)
    m.add_agent(0, "compute", 0, [0], agent(True))
    m.run()


# -- outputs and the kernel end ----------------------------------------------------------------


def test_output_tile_written_twice_in_one_call():
    def writer(ctx, task):
        yield from twins.output_store(ctx, "x", 1, BOTTOM, torch.ones(2, 4), tile=0)

    m = _machine(0)
    m.add_agent(0, "compute", 0, [0], writer)
    m.add_agent(1, "compute", 2, [4], writer)
    with pytest.raises(mkernel.TileWriteError, match="written twice") as e:
        m.run()
    assert "output tile 0 of rank 1 in call 0" in str(e.value)


def test_output_tile_never_written_is_reported_at_the_kernel_end():
    def writer(ctx, task):
        yield from twins.output_store(ctx, "x", 1, TOP, torch.ones(2, 4), tile=0)

    m = _machine(0)
    m.add_agent(1, "compute", 0, [0], writer)
    m.expect_outputs(0, 1, "x", {0: TOP, 1: BOTTOM})
    with pytest.raises(mkernel.TileWriteError, match="never written") as e:
        m.run()
    assert "output tile 1 of rank 1 in call 0" in str(e.value)


@pytest.mark.parametrize("early", [True, False])
def test_ready_before_writing_a_peers_output_is_caught_by_the_kernel_end(early):
    # Rank 0 computes rank 1's output tile and tells rank 1 it is there; rank 1 only waits for
    # that (nobody reads the tile inside the kernel) and exits. The host reads it after the kernel.
    def owner(ctx, task):
        if early:  # BUG: "ready" before the data
            yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))
        yield from twins.output_store(ctx, "x", 1, TOP, torch.ones(2, 4), tile=0)
        if not early:
            yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

    def peer(ctx, task):
        yield from twins.wait_acquire_reset(ctx, ctx.sig("f", 1, 0), 1, peer=0)

    def build(seed):
        m = _machine(seed)
        m.add_agent(0, "compute", 0, [0], owner)
        m.add_agent(1, "comm", 0, [0], peer)
        m.expect_outputs(0, 1, "x", {0: TOP})
        return m

    if early:
        _run_each_seed(build, mkernel.RaceError, "kernel end of rank 1 call 0|rank 1 kernel end")
    else:
        _run_each_seed(build)


# -- two calls back to back --------------------------------------------------------------------


def _two_calls(seed, reset=True, barrier=True):
    """Each call: rank 0 writes TOP of x[1] and raises f[1][0]; rank 1 waits for it, reads TOP and
    writes its output tile BOTTOM. In call 1, rank 0 is late."""

    def producer(ctx, task):
        if ctx.call == 1:
            yield from twins.delay(ctx, 50)
        yield from twins.tile_send(ctx, "x", 1, TOP, torch.full((2, 4), 1.0 + ctx.call))
        yield from twins.signal_set_release(ctx, ctx.sig("f", 1, 0))

    def consumer(ctx, task):
        wait = twins.wait_acquire_reset if reset else twins.wait_acquire  # BUG: no reset
        yield from wait(ctx, ctx.sig("f", 1, 0), 1, peer=0)
        v = yield from twins.tile_load(ctx, "x", 1, TOP)
        yield from twins.output_store(ctx, "x", 1, BOTTOM, v, tile=0)

    def barrier_prologue(ctx):
        yield from twins.entry_barrier(ctx, "bar", 0)

    if barrier:
        producer.prologue = consumer.prologue = barrier_prologue
    m = _machine(seed)
    for call in (0, 1):
        m.add_agent(0, "compute", 0, [0], producer, call=call)
        m.add_agent(1, "comm", 0, [0], consumer, call=call)
        m.expect_outputs(call, 1, "x", {0: BOTTOM})
    return m


def test_two_calls_in_stream_order():
    for seed in SEEDS:
        m = _two_calls(seed)
        m.run()
        assert torch.equal(m.buffers["x"][1, 2:4], torch.full((2, 4), 2.0))  # call 1's data
        assert int(m.pads["f"].sum()) == 0 and int(m.pads["bar"].sum()) == 0  # pads reset
        assert sorted(m.outputs) == [(0, 1, 0), (1, 1, 0)]  # once per call, not twice


def test_a_flag_left_set_lets_the_next_call_read_early():
    _run_each_seed(lambda seed: _two_calls(seed, reset=False), mkernel.RaceError, "call 1")


def test_without_an_entry_barrier_the_next_call_writes_while_the_peer_still_reads():
    # Rank 0's call 1 writes into x[1] with nothing ordering it after rank 1's call-0 read: a
    # race whether the write comes before or after that read.
    for seed in SEEDS:
        m = _two_calls(seed, barrier=False)
        with pytest.raises(mkernel.RaceError) as e:
            m.run()
        parties = {(e.value.rank, e.value.role), e.value.other[:2]}
        assert parties == {(0, "compute"), (1, "comm")}, str(e.value)


def test_entry_barrier_flags_carry_over_three_calls():
    # A rank may arrive for its next call before a peer consumed its previous arrival: the
    # arrival waits for the flag to be 0 (the device's CAS), or an arrival is lost (deadlock).
    def arrive(ctx, task):
        yield from twins.entry_barrier(ctx, "bar", 0)
        if ctx.rank == 0:
            yield from twins.delay(ctx, 5)

    for seed in range(40):
        m = _machine(seed, W=3)
        for call in range(3):
            for r in range(3):
                m.add_agent(r, "compute", 0, [0], arrive, call=call)
        m.run()
        assert int(m.pads["bar"].sum()) == 0


# -- deadlocks ---------------------------------------------------------------------------------


def test_deadlock_names_the_waiter_with_its_unit():
    m = _machine(0)
    m.add_agent(1, "comm", 3, [5], _reader())  # nobody raises f[1][0]
    m.add_agent(1, "compute", 0, [0], _reader(), call=1)  # waits for call 0: not a waiter
    with pytest.raises(mkernel.DeadlockError) as e:
        m.run()
    assert (e.value.rank, e.value.role, e.value.unit, e.value.task) == (1, "comm", 3, 5)
    assert len(e.value.waiters) == 1
    assert "rank 1 comm3 task 5 waits f[1][0] from peer 0" in str(e.value)
