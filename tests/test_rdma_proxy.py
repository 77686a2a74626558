"""The proxy transport's descriptor ring (mkernel/interp/rdma.py) on the CPU interpreter: random
interleavings of device posters and host proxies; puts land exactly and in order, the ring wraps and
pushes back when full, a signal raised before the copy is a race, a stalled proxy times out its
waiters, and plain peer accesses across nodes are errors."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.errors import CommTimeout, PlanError
from mkernel.interp import twins
from mkernel.interp.machine import Machine, Wait
from mkernel.interp.rdma import Ring, proxy, rdma_put

SEEDS = range(12)
W, NODES, COLS = 4, 2, 4


def _dest(src: int) -> int:
    return (src + W // 2) % W  # always on the other node


def _fill(src: int, unit: int, i: int) -> torch.Tensor:
    """A pattern unique to (source rank, poster unit, put), so a misplaced row shows."""
    return torch.arange(COLS, dtype=torch.float32) + 1000 * src + 100 * unit + i


def _world(seed, units, puts, capacity, deadline=20_000, **proxy_kw):
    """Every rank: ``units`` posting CTAs with ``puts`` puts each to its peer on the other node,
    one proxy draining its ring, one receiver checking what lands from its source."""
    ring = Ring(W, capacity)
    seen: dict[tuple[int, int, int], torch.Tensor] = {}
    rows = units * puts
    pads = {"landed": torch.zeros(W, W, units, dtype=torch.int32), **ring.pads()}
    bufs = {
        "src": torch.zeros(W, rows, COLS),
        "dst": torch.zeros(W, W * rows, COLS),
        **ring.buffers(),
    }
    m = Machine(W, pads, bufs, seed=seed, deadline_steps=deadline, nodes=NODES)

    def poster(ctx, unit):
        me, dest = ctx.rank, _dest(ctx.rank)
        for i in range(puts):
            row = unit * puts + i
            yield from twins.tile_send(ctx, "src", me, (row, 1, 0, COLS), _fill(me, unit, i)[None])
            yield from rdma_put(
                ctx, ring, dest, "dst", (me * rows + row, 1, 0, COLS), "src", (row, 1, 0, COLS),
                ctx.sig("landed", dest, me, unit), op="add",
            )  # fmt: skip

    def receiver(ctx, task):
        me = ctx.rank
        src = _dest(me)
        for unit in range(units):
            for i in range(puts):
                # In order: the (i+1)-th signal of this poster means its put i has landed.
                counter = ctx.sig("landed", me, src, unit)
                yield Wait(counter, i + 1, reset=False, peer=src, at_least=True)
                row = src * rows + unit * puts + i
                got = yield from twins.tile_load(ctx, "dst", me, (row, 1, 0, COLS))
                # NOTE: checked after the run: a planted bug must surface as the race it is.
                seen[(src, unit, i)] = got[0]

    for r in range(W):
        for u in range(units):
            m.add_agent(r, "poster", u, [u], poster)
        m.add_agent(r, "proxy", -1, [0], proxy(ring, units * puts, **proxy_kw))
        m.add_agent(r, "receiver", -1, [0], receiver)
    return m, ring, seen


@pytest.mark.parametrize("units,puts,capacity", [(1, 3, 8), (1, 5, 2), (2, 3, 1), (2, 3, 4)])
def test_puts_land_exactly_and_in_order(units, puts, capacity):
    for seed in SEEDS:
        m, ring, seen = _world(seed, units, puts, capacity)
        m.run()
        assert len(seen) == W * units * puts
        for (src, unit, i), got in seen.items():  # what each receiver read after each signal
            assert torch.equal(got, _fill(src, unit, i)), (src, unit, i, got)
        n = units * puts
        for r in range(W):
            src, rows = _dest(r), units * puts
            want = torch.stack([_fill(src, u, i) for u in range(units) for i in range(puts)])
            assert torch.equal(m.buffers["dst"][r, src * rows : (src + 1) * rows], want)
            assert m.pads["landed"][r, src].tolist() == [puts] * units
            # Every descriptor posted and drained: head == tail == puts, across wrap-arounds.
            for c in ("head", "tail", "reserve"):
                assert int(m.pads[f"rdma_{c}"][r, 0]) == n, (c, r)
        assert all(d is not None for slots in ring.slots for d in slots[: min(n, capacity)])


def test_full_ring_pushes_back_the_poster():
    """Capacity 2, 5 puts: some poster must wait for the proxy in some interleaving."""
    blocked_on_tail = 0
    for seed in SEEDS:
        m, _, _ = _world(seed, units=1, puts=5, capacity=2)
        resume = m._resume

        def spy(a, resume=resume):
            nonlocal blocked_on_tail
            if a.blocked is not None and a.blocked.sig.pad == "rdma_tail":
                blocked_on_tail += 1
            resume(a)

        m._resume = spy
        m.run()
    assert blocked_on_tail > 0


def test_signal_before_the_copy_is_a_race():
    for seed in SEEDS:
        m, _, _ = _world(seed, units=1, puts=2, capacity=2, signal_early=True)
        with pytest.raises(mkernel.RaceError, match=r"dst\[\d\]"):
            m.run()


def test_slot_freed_before_the_descriptor_is_read_is_a_race():
    """Wrap-around: a poster may rewrite a slot only after the proxy has read it."""
    for seed in SEEDS:
        m, _, _ = _world(seed, units=1, puts=3, capacity=1, tail_early=True)
        with pytest.raises(mkernel.RaceError, match=r"rdma_slots\[\d\]"):
            m.run()


def test_stalled_proxy_times_out_the_receiver():
    for seed in SEEDS:
        m, _, _ = _world(seed, units=1, puts=2, capacity=4, deadline=500, stall_after=1)
        with pytest.raises(CommTimeout) as e:
            m.run()
        assert "landed" in e.value.signal and e.value.peer == _dest(e.value.rank), str(e.value)
        assert e.value.role == "receiver"


def test_stalled_proxy_times_out_a_poster_on_a_full_ring():
    """Capacity 1 and a proxy that never drains: the second put waits for the tail, bounded."""
    roles = set()
    for seed in SEEDS:
        m, _, _ = _world(seed, units=1, puts=3, capacity=1, deadline=500, stall_after=0)
        with pytest.raises(CommTimeout, match=r"rdma_tail|landed") as e:
            m.run()
        roles.add(e.value.role)
        if e.value.role == "poster":
            assert e.value.signal == f"rdma_tail[{e.value.rank}][0]", str(e.value)
            assert e.value.peer == e.value.rank  # its own GPU's proxy
    assert "poster" in roles


def test_plain_peer_store_across_nodes_is_an_error():
    def store(peer):
        def run(ctx, task):
            yield from twins.peer_store(ctx, "x", peer, (0, 1, 0, 1), torch.ones(1, 1))
            yield from twins.signal_set_release(ctx, ctx.sig("f", peer, 0))

        return run

    def machine(nodes, peer):
        pads = {"f": torch.zeros(W, 1, dtype=torch.int32)}
        m = Machine(W, pads, {"x": torch.zeros(W, 1, 1)}, nodes=nodes)
        m.add_agent(0, "comm", 0, [0], store(peer))
        return m

    machine(NODES, 1).run()  # same node
    machine(1, 3).run()  # one node: every peer is reachable, as before
    with pytest.raises(PlanError, match="cross-node access.*x\\[3\\]"):
        machine(NODES, 3).run()
    with pytest.raises(ValueError, match="nodes"):
        Machine(W, {}, {}, nodes=3)

    def other(ctx, task):  # a read and a signal raise across nodes are refused too
        if task == 0:
            yield from twins.tile_load(ctx, "x", 2, (0, 1, 0, 1))
        else:
            yield from twins.signal_add_release(ctx, ctx.sig("f", 2, 0))

    for task, what in ((0, "x\\[2\\]"), (1, "signal f\\[2\\]")):
        m = machine(NODES, 1)
        m.add_agent(1, "compute", 0, [task], other)
        with pytest.raises(PlanError, match=f"cross-node access: rank 1 compute0.*{what}"):
            m.run()


def test_node_of():
    world = mkernel.World.emulated(8, nodes=2)
    assert [world.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [mkernel.World.emulated(6, nodes=3).node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert mkernel.World.emulated(3).node_of(2) == 0
    for bad in (-1, 8, 1.0, True):
        with pytest.raises(ValueError, match="rank"):
            world.node_of(bad)
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="nodes"):
            mkernel.World.emulated(8, nodes=bad)


def test_default_nodes_from_the_launcher(monkeypatch):
    from mkernel.world import default_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_nodes(16) == 4 and default_nodes(4) == 1
    assert default_nodes(6) == 1  # not a whole number of hosts: one node
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_nodes(16) == 1
