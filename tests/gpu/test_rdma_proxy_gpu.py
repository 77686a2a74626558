"""rdma_put through the proxy transport on one GPU (mkernel/rdma.py; issue 14): emulated ranks on
virtual nodes put tiles to a rank of the next node through their ring and host proxy thread; the
receivers copy each tile right after its signal, so a signal raised before its bytes shows as
poison in ``out``. Every call uses fresh random data over poisoned destinations."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mkernel.errors import CommTimeout
from mkernel.rdma import ProxyRing, exchange

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POISON = 0x7FC0DEAD


def _data(W: int, puts: int, bytes_per_put: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = puts * bytes_per_put // 4
    return torch.randint(-(2**31), 2**31 - 1, (W, n), generator=g, device="cuda", dtype=torch.int32)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, POISON)


def _tails_catch_up(ring: ProxyRing, timeout_s: float = 2.0) -> None:
    """The proxy releases a tail after raising the signals the kernel waited for: wait for it."""
    deadline = time.perf_counter() + timeout_s
    while any(ring.counters(r)["tail"] != ring.posted for r in range(ring.world_size)):
        assert time.perf_counter() < deadline, [ring.counters(r) for r in range(ring.world_size)]
        time.sleep(1e-3)


def _check_call(ring, nodes, puts, bytes_per_put, seed, **kw) -> None:
    W = ring.world_size
    src = _data(W, puts, bytes_per_put, seed)
    dst, out = _poisoned(src), _poisoned(src)
    exchange(src, ring, nodes, puts, dst=dst, out=out, **kw)
    want = torch.roll(src, W // nodes, dims=0)
    assert torch.equal(dst, want), (dst != want).nonzero()[:8].tolist()
    assert torch.equal(out, want), (out != want).nonzero()[:8].tolist()  # read after the signal


WORLDS = [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]


@pytest.mark.parametrize("W,nodes", WORLDS)
@pytest.mark.parametrize("capacity", [1, 2, 8, 64])
@pytest.mark.parametrize("op", ["set", "add"])
def test_puts_land_exactly(W, nodes, capacity, op):
    puts, posters = 12, 3  # several CTAs per ring; 12 puts wrap capacities 1, 2 and 8
    with ProxyRing(W, capacity) as ring:
        for seed in range(3):
            _check_call(ring, nodes, puts, 4096, seed, posters=posters, op=op)
        _tails_catch_up(ring)
        for r in range(W):
            c = ring.counters(r)
            assert c["head"] == c["tail"] == c["reserve"] == 3 * puts, (r, c)
        assert not ring.signal_values().any()  # signals back to zero after each call
        assert not ring.errors()


@pytest.mark.parametrize("bytes_per_put", [4 << 10, 64 << 10, 1 << 20, 4 << 20])
@pytest.mark.parametrize("capacity", [2, 8])
def test_sizes(bytes_per_put, capacity):
    with ProxyRing(4, capacity) as ring:
        _check_call(ring, 2, 6, bytes_per_put, 7, posters=2)
        _check_call(ring, 2, 6, bytes_per_put, 8, posters=2, op="add")


def test_thousand_calls_with_changing_data():
    with ProxyRing(4, 2) as ring:
        for call in range(1000):
            _check_call(ring, 2, 8, 4096, call, posters=2, op=("set", "add")[call % 2])
        _tails_catch_up(ring)
        assert ring.counters(0)["tail"] == 8000


def test_graph_replay_with_new_data():
    """A CUDA graph captures one exchange; 50 replays over fresh data land it exactly. What the
    proxy needs there: its threads running, and the host's count of posted puts advanced per
    replay (ring.count_posted); tickets and signals carry over on the device."""
    W, nodes, puts = 4, 2, 8
    with ProxyRing(W, 2) as ring:
        src = _data(W, puts, 4096, 0)
        dst, out = _poisoned(src), _poisoned(src)
        exchange(src, ring, nodes, puts, dst=dst, out=out, posters=2)  # warm-up, outside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            exchange(src, ring, nodes, puts, dst=dst, out=out, posters=2, sync=False)
        for replay in range(50):
            src.copy_(_data(W, puts, 4096, replay + 1))
            dst.fill_(POISON)
            out.fill_(POISON)
            graph.replay()
            ring.count_posted(puts)
            ring.check()
            want = torch.roll(src, W // nodes, dims=0)
            assert torch.equal(dst, want), replay
            assert torch.equal(out, want), replay
        _tails_catch_up(ring)
        assert ring.counters(0)["tail"] == 51 * puts
        assert not ring.signal_values().any()
        assert not ring.errors()


def test_unsynchronized_exchange_needs_receivers():
    with ProxyRing(4, 2) as ring:
        src = _data(4, 4, 4096, 0)
        with pytest.raises(ValueError, match="sync=False needs receivers"):
            exchange(src, ring, 2, 4, receive="none", sync=False)


def test_posters_only_then_drained():
    """receive="none": the call waits for the proxies itself and leaves the signals at zero."""
    with ProxyRing(4, 1) as ring:
        src = _data(4, 5, 4096, 3)
        dst, out = exchange(src, ring, 2, 5, receive="none", dst=_poisoned(src))
        assert out is None and torch.equal(dst, torch.roll(src, 2, dims=0))
        assert not ring.signal_values().any()


def test_late_proxy_changes_nothing():
    """A proxy that stalls for 50 ms (posters pushed back by a full ring) gives the same result."""
    with ProxyRing(4, 1) as ring:
        ring.set_stalled(True)
        timer = threading.Timer(0.05, ring.set_stalled, args=(False,))
        timer.start()
        _check_call(ring, 2, 8, 4096, 11, posters=2)
        timer.join()


def test_stalled_proxy_times_out_the_receiver_then_recovers():
    W, nodes, timeout = 4, 2, 0.2
    ring = ProxyRing(W, 8)
    ring.start(stalled=True)
    src = _data(W, 4, 4096, 0)
    t0 = time.perf_counter()
    with pytest.raises(CommTimeout) as e:
        exchange(src, ring, nodes, 4, timeout_s=timeout)
    assert time.perf_counter() - t0 < timeout + 5.0
    v = e.value
    assert v.role == "receiver" and v.signal.startswith(f"landed[{v.rank}][{v.peer}, ")
    assert v.peer == (v.rank - W // nodes) % W, str(v)
    assert not ring.running  # stopped and reset by the failed call
    ring.start()  # recovery: the next call works
    _check_call(ring, nodes, 4, 4096, 1)
    ring.stop()


def test_full_ring_times_out_the_poster_then_recovers():
    """Capacity 1, no receivers, a proxy that never drains: the second put waits for the tail."""
    W, timeout = 2, 0.2
    ring = ProxyRing(W, 1)
    ring.start(stalled=True)
    src = _data(W, 3, 4096, 0)
    with pytest.raises(CommTimeout) as e:
        exchange(src, ring, 2, 3, receive="none", timeout_s=timeout)
    v = e.value
    assert v.role == "poster" and v.signal == f"rdma_tail[{v.rank}][0]" and v.peer == v.rank, v
    assert "tail 0" in str(v), str(v)
    ring.start()
    _check_call(ring, 2, 3, 4096, 1)
    ring.stop()


def test_stop_is_bounded_and_idempotent():
    ring = ProxyRing(8, 4)
    for stalled in (False, True):
        ring.start(stalled=stalled)
        t0 = time.perf_counter()
        ring.stop()
        ring.stop()
        assert time.perf_counter() - t0 < 1.0 and not ring.running


def test_bad_input_raises_before_launch():
    with pytest.raises(ValueError, match="capacity"):
        ProxyRing(4, 0)
    with pytest.raises(ValueError, match="world_size"):
        ProxyRing(0, 4)
    ring = ProxyRing(4, 4)
    src = _data(4, 4, 4096, 0)
    with pytest.raises(ValueError, match="not running"):
        exchange(src, ring, 2, 4)
    with ring:
        bad = [
            (dict(nodes=3), "nodes"),
            (dict(nodes=1), "nodes"),
            (dict(puts=0), "puts"),
            (dict(puts=3), "multiple of 16"),  # 16384 bytes / 3
            (dict(src=torch.zeros(4, 5, device="cuda")), "multiple of 16"),  # 20 bytes
            (dict(src=src.cpu()), "CUDA"),
            (dict(src=src[:3]), r"\[4, n\]"),
            (dict(posters=5), "posters"),
            (dict(op="xor"), "op"),
            (dict(receive="maybe"), "receive"),
            (dict(timeout_s=0), "timeout_s"),
            (dict(dst=torch.empty(4, 8, device="cuda")), "dst"),
            (dict(posters=4, puts=4, src=_data(4, 4, 4096, 0), nodes=2), None),  # fine: control
        ]
        for kw, match in bad:
            args = {"src": src, "nodes": 2, "puts": 4} | kw
            if match is None:
                exchange(args.pop("src"), ring, args.pop("nodes"), args.pop("puts"), **args)
                continue
            before = ring.launches
            with pytest.raises(ValueError, match=match):
                exchange(args.pop("src"), ring, args.pop("nodes"), args.pop("puts"), **args)
            assert ring.launches == before, kw  # nothing launched
