"""ProxyRing.ensure_independent (mkernel/rdma_streams.py) on the CPU, over a fake extension whose
streams are dealt to a few hardware queues in turn (as CUDA deals them): every proxy of the device
ends on the one copy stream, outside the launching stream's queue; a move restarts the proxies
that ran, as they were (stalled or not); checks are made once per launching stream; one queue
gives a clear RuntimeError instead of a hang."""

from __future__ import annotations

import random

import pytest

from mkernel import rdma_streams
from mkernel.rdma import ProxyRing
from mkernel.rdma_streams import CopyStream


class FakeExt:
    """Streams numbered in creation order, stream s in queue s % queues; the legacy stream 0 and
    compute streams given by the test sit in the queue the test says."""

    def __init__(self, queues: int, compute_queue: dict[int, int]) -> None:
        self.queues, self.compute_queue = queues, compute_queue
        self.made = 0
        self.probes = 0
        self.destroyed: list[int] = []

    def copy_stream_create(self, device: int) -> int:
        self.made += 1
        return 1000 + self.made

    def copy_stream_destroy(self, stream: int) -> None:
        self.destroyed.append(stream)

    def queue(self, stream: int) -> int:
        return self.compute_queue[stream] if stream in self.compute_queue else stream % self.queues

    def stream_independent(self, copy: int, compute: int, device: int, timeout_us: int) -> bool:
        assert timeout_us > 0 and copy not in self.destroyed
        self.probes += 1
        return self.queue(copy) != self.queue(compute)


class FakeProxy:
    def __init__(self, stream: int) -> None:
        self.stream, self.running, self.stalled, self.starts = stream, False, False, 0

    def start(self, stalled: bool = False) -> None:
        assert not self.running
        self.running, self.stalled, self.starts = True, stalled, self.starts + 1

    def stop(self) -> None:
        self.running = False

    def set_stream(self, stream: int) -> None:
        assert not self.running, "set_stream while running"
        self.stream = stream

    ready = True

    def error(self) -> str:
        return ""


def _rings(ext: FakeExt, sizes: list[int]) -> list[ProxyRing]:
    """ProxyRings of these world sizes on one copy stream, without CUDA (only what
    ensure_independent uses)."""
    cs = CopyStream(ext, 0)
    rings = []
    for W in sizes:
        ring = ProxyRing.__new__(ProxyRing)
        ring.ext, ring.world_size, ring.copy_stream = ext, W, cs
        ring.proxies = [FakeProxy(cs.handle) for _ in range(W)]
        ring._stalled = False
        cs.rings.add(ring)
        rings.append(ring)
    return rings


@pytest.mark.parametrize("seed", range(20))
def test_every_proxy_ends_outside_the_launching_queue(seed):
    rng = random.Random(seed)
    queues = rng.choice([2, 4, 8, 32])
    computes = {0: 0, 7: rng.randrange(queues), 9: rng.randrange(queues)}
    ext = FakeExt(queues, computes)
    rings = _rings(ext, [rng.randint(1, 9) for _ in range(rng.randint(1, 3))])
    for ring in rings:
        if rng.random() < 0.8:  # some rings never started (or retired): they stay stopped
            ring.start(stalled=rng.random() < 0.3)
    started = {id(r): r.running for r in rings}
    cs = rings[0].copy_stream
    for compute in rng.choices(list(computes), k=6):
        rng.choice(rings).ensure_independent(compute)
        assert compute in cs.independent_of
        for ring in rings:
            for p in ring.proxies:  # one stream for every proxy of the device
                assert p.stream == cs.handle and ext.queue(cs.handle) != ext.queue(compute)
                assert p.running == started[id(ring)] and p.stalled == ring._stalled
    # each launching stream still listed is free of the copy stream's queue
    assert all(ext.queue(cs.handle) != ext.queue(c) for c in cs.independent_of)
    assert cs.handle not in ext.destroyed


def test_checked_once_per_stream():
    ext = FakeExt(8, {0: 0})
    (ring,) = _rings(ext, [4])  # stream 1001: queue 1
    ring.ensure_independent(0)
    assert ext.probes == 1 and ext.destroyed == []
    ring.ensure_independent(0)
    assert ext.probes == 1


def test_a_move_restarts_every_running_proxy_on_the_new_stream():
    ext = FakeExt(8, {0: 0, 5: 1})
    a, b = _rings(ext, [3, 2])  # stream 1001: queue 1, the queue of launching stream 5
    a.start()
    a.ensure_independent(5)
    assert ext.destroyed == [1001]
    assert all(p.stream == 1002 and p.starts == 2 for p in a.proxies)
    assert all(p.stream == 1002 and p.starts == 0 and not p.running for p in b.proxies)


def test_one_queue_is_a_clear_error():
    ext = FakeExt(1, {0: 0})
    (ring,) = _rings(ext, [2])
    with pytest.raises(RuntimeError, match=r"device 0.*CUDA_DEVICE_MAX_CONNECTIONS"):
        ring.ensure_independent(0)
    assert ext.probes == rdma_streams.PROBE_TRIES
    assert 0 not in ring.copy_stream.independent_of
