"""ProxyRing.ensure_independent on the CPU, over a fake extension whose streams are dealt to a few
hardware queues in turn (as CUDA deals them): every proxy ends on a stream outside the launching
stream's queue, a moved proxy is restarted as it was (stalled or not) and continues, checks are
made once per launching stream, and one queue gives a clear RuntimeError instead of a hang."""

from __future__ import annotations

import random

import pytest

from mkernel import rdma
from mkernel.rdma import ProxyRing


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


def _ring(ext: FakeExt, W: int) -> ProxyRing:
    ring = ProxyRing.__new__(ProxyRing)  # no CUDA: only what ensure_independent uses
    ring.ext, ring.world_size = ext, W
    ring.device = type("D", (), {"index": 0})()
    ring.streams = [ext.copy_stream_create(0) for _ in range(W)]
    ring.proxies = [FakeProxy(s) for s in ring.streams]
    ring._independent_of, ring._stalled = set(), False
    return ring


@pytest.mark.parametrize("seed", range(20))
def test_every_proxy_ends_outside_the_launching_queue(seed):
    rng = random.Random(seed)
    queues, W = rng.choice([2, 4, 8, 32]), rng.randint(1, 9)
    computes = {0: 0, 7: rng.randrange(queues), 9: rng.randrange(queues)}
    ext = FakeExt(queues, computes)
    ring = _ring(ext, W)
    ring.start(stalled=rng.random() < 0.3)
    for compute in rng.choices(list(computes), k=6):
        ring.ensure_independent(compute)
        assert compute in ring._independent_of
        for p, s in zip(ring.proxies, ring.streams, strict=True):
            assert p.stream == s and ext.queue(s) != ext.queue(compute)
            assert p.running and p.stalled == ring._stalled
    # each checked stream is still free of every proxy's queue
    for compute in ring._independent_of:
        assert all(ext.queue(s) != ext.queue(compute) for s in ring.streams)


def test_checked_once_per_stream():
    ext = FakeExt(8, {0: 0})
    ring = _ring(ext, 4)  # streams 1001..1004: queues 1..4, none is queue 0
    ring.ensure_independent(0)
    probes = ext.probes
    assert probes == 4 and ext.destroyed == []
    ring.ensure_independent(0)
    assert ext.probes == probes


def test_a_moved_proxy_restarts_and_the_old_stream_goes():
    ext = FakeExt(8, {0: 0})
    ring = _ring(ext, 8)  # stream 1008 is in queue 0
    ring.start()
    ring.ensure_independent(0)
    assert ext.destroyed == [1008]
    assert ring.proxies[7].stream == ring.streams[7] != 1008 and ring.proxies[7].starts == 2
    assert [p.starts for p in ring.proxies[:7]] == [1] * 7


def test_one_queue_is_a_clear_error():
    ext = FakeExt(1, {0: 0})
    ring = _ring(ext, 2)
    with pytest.raises(RuntimeError, match=r"rank 0.*CUDA_DEVICE_MAX_CONNECTIONS"):
        ring.ensure_independent(0)
    assert ext.probes == rdma._PROBE_TRIES
    assert 0 not in ring._independent_of
