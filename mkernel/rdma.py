"""rdma_put through the ``proxy`` transport on one GPU (issue 14): descriptor rings in pinned host
memory, one host proxy thread per ring, and a test exchange between the virtual nodes of an
emulated world. Device side: primitives/rdma/put.cuh; host side: kernels/rdma_proxy.cpp; the
protocol and its CPU twin: docs/rdma.md, mkernel/interp/rdma.py.

    ring = ProxyRing(world_size=4, capacity=8)
    with ring:                                   # starts the proxy threads, stops them on exit
        dst, out = exchange(src, ring, nodes=2, puts=16)

A call is synchronous: it launches the kernel, waits for it, and raises ``CommTimeout`` if a wait
timed out (after which the ring is stopped and reset: ``ring.start()`` resumes).
"""

from __future__ import annotations

import time
import weakref
from types import ModuleType
from typing import Any

import torch

from . import rdma_ext
from .errors import CommTimeout
from .protocol import STATUS_FIELDS
from .rdma_streams import copy_stream

__all__ = ["ProxyRing", "exchange", "fused_rings"]

# Counters are int32 and monotonic (primitives/rdma/ring_layout.h): a ring is reset before this.
_MAX_COUNT = 2**31 - 1


class ProxyRing:
    """The rings of an emulated world's ``world_size`` ranks on one GPU, ``capacity`` descriptor
    slots each (pinned, mapped host memory), their ticket counters (device int32 [W]), a block of
    ``signals_per_rank`` int32 signals per rank that the proxies raise (mapped host memory, zero
    between calls), the launch's CommStatus, and one proxy thread per ring."""

    def __init__(
        self,
        world_size: int,
        capacity: int,
        *,
        device: torch.device | str | int | None = None,
        signals_per_rank: int = 4096,
    ) -> None:
        for name, v in (("world_size", world_size), ("capacity", capacity)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(signals_per_rank, int) or signals_per_rank < 1:
            raise ValueError(f"signals_per_rank must be an int >= 1, got {signals_per_rank!r}")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        dev = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        self.world_size, self.capacity = world_size, capacity
        self.signals_per_rank = signals_per_rank
        self.device = torch.device("cuda", dev.index if dev.index is not None else 0)
        self.ext: ModuleType = rdma_ext.load()
        if self.ext.STATUS_INTS != len(STATUS_FIELDS):
            raise RuntimeError("CommStatus (protocol_gen.h) and STATUS_FIELDS disagree: codegen")
        ext = self.ext
        with torch.cuda.device(self.device):
            self.rings = ext.MappedHost(world_size * ext.ring_bytes(capacity))
            self.signals = ext.MappedHost(world_size * signals_per_rank * 4)
            self.status = ext.MappedHost(ext.STATUS_INTS * 4)
            self.reserve = torch.zeros(world_size, dtype=torch.int32, device=self.device)
        ext.init_rings(self.rings.ptr, world_size, capacity)
        lo, hi = self.signals.ptr, self.signals.ptr + self.signals.bytes
        # the device's one copy stream, shared by every proxy on it (mkernel/rdma_streams.py)
        self.copy_stream = copy_stream(ext, self.device.index)
        self.proxies = [
            ext.RingProxy(
                ext.ring_ptr(self.rings.ptr, r, capacity),
                self.device.index,
                world_size,
                lo,
                hi,
                stream=self.copy_stream.handle,
            )
            for r in range(world_size)
        ]
        self.copy_stream.rings.add(self)
        self._stalled = False
        self.posted = 0  # puts per ring since the last reset
        self.launches = 0

    # -- proxy threads ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return all(p.running for p in self.proxies)

    def start(self, stalled: bool = False) -> None:
        """Starts every ring's proxy thread (``stalled``: alive but draining nothing, the dead
        proxy of the timeout tests)."""
        self._stalled = stalled
        for p in self.proxies:
            if not p.running:
                p.start(stalled)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Waits until every started proxy thread has its stream and has run one of each of its
        operations (RingProxy::warm_up), so that a launch that waits for puts finds them ready;
        raises RuntimeError naming the proxies that are not (or failed) by ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        while not all(p.ready for p in self.proxies):
            if self.errors() or time.perf_counter() > deadline:
                late = [r for r, p in enumerate(self.proxies) if not p.ready]
                raise RuntimeError(f"rdma proxies of ranks {late} not ready: {self.errors()}")
            time.sleep(1e-4)

    def stop(self) -> None:
        """Stops and joins every proxy thread (bounded: a thread ends after its current batch)."""
        for p in self.proxies:
            p.stop()

    def set_stalled(self, stalled: bool) -> None:
        self._stalled = stalled
        for p in self.proxies:
            p.set_stalled(stalled)

    def ensure_independent(self, compute: int) -> None:
        """Before a launch on stream ``compute`` (a handle; 0 = the legacy default stream; not
        capturing) of a kernel that waits for these proxies' puts: their copy stream shares no
        hardware queue with it (mkernel/rdma_streams.py CopyStream.ensure_independent)."""
        self.copy_stream.ensure_independent(compute)

    def reset(self) -> None:
        """Zeroes counters, slots, signals and status, once the GPU and the proxies are idle.
        NOTE: after a timeout the rings hold descriptors that no one will drain (and tickets that
        were never published): they must go before the next call."""
        if any(p.running for p in self.proxies):
            raise RuntimeError("ProxyRing.reset: stop the proxies first")
        torch.cuda.synchronize(self.device)
        self.ext.init_rings(self.rings.ptr, self.world_size, self.capacity)
        self.signals.zero()
        self.status.zero()
        self.reserve.zero_()
        # NOTE: the zero is queued on the current stream; a next launch on another stream (or
        # one queued before this stream reaches the zero) would take tickets from the old count
        torch.cuda.synchronize(self.device)
        self.posted = 0

    def count_posted(self, puts: int) -> None:
        """Counts ``puts`` more puts per ring: after a launch of ``exchange(..., sync=False)`` or a
        replay of a graph that captured one."""
        if not isinstance(puts, int) or puts < 0 or self.posted + puts > _MAX_COUNT:
            raise ValueError(f"puts must be an int >= 0 that the counters can hold, got {puts!r}")
        self.posted += puts

    def check(self) -> None:
        """Waits for the device and raises CommTimeout if a wait of an unsynchronized exchange
        timed out (the ring is then stopped and reset, as after a synchronous call)."""
        torch.cuda.synchronize(self.device)
        _raise_timeout(self)

    def restart(self) -> None:
        self.stop()
        self.reset()
        self.start()

    def __enter__(self) -> ProxyRing:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        # NOTE: the threads read the rings: they must end before the mapped memory is freed.
        for p in getattr(self, "proxies", ()):
            p.stop()

    # -- state -----------------------------------------------------------------------------------
    def counters(self, rank: int) -> dict[str, int]:
        """The ring of ``rank``: head (published), tail (done), reserve (tickets taken)."""
        head, tail = self.ext.ring_counters(self.rings.ptr, rank, self.capacity)
        return {"head": head, "tail": tail, "reserve": int(self.reserve[rank].item())}

    def signal_values(self) -> torch.Tensor:
        """The signal block as int32 [W, signals_per_rank] (a copy)."""
        n = self.world_size * self.signals_per_rank
        return torch.tensor(self.signals.read_i32(0, n), dtype=torch.int32).view(
            self.world_size, self.signals_per_rank
        )

    def errors(self) -> list[str]:
        return [e for e in (p.error() for p in self.proxies) if e]


# Descriptor slots per rank's ring for the fused ops over nodes: room for a call's puts (gemm_rs
# at W = 4 puts 257 times per ring at 8192 x 4096 x 2048), so that a call rarely waits for a slot.
# NOTE: at 64 slots ag_gemm at W = 8 over 4 nodes with 21 chunks per shard (66 puts per ring)
# failed in every run; at 1024 its random-shape tests passed (H200, 2026-12-01, docs/rdma.md).
FUSED_RING_CAPACITY = 1024
# The rings of worlds that went: stopped, never freed. NOTE: freeing them (cudaFreeHost, the
# proxies' cudaFree) synchronizes the device; a world collected by the garbage collector while
# another world's kernel waits for its proxies' copies then held the driver until that kernel
# timed out (GPU tests, 5 s stalls). A few KB per world.
_RETIRED: list[ProxyRing] = []


def _retire(rings: ProxyRing) -> None:
    rings.stop()
    _RETIRED.append(rings)


def fused_rings(world: Any) -> ProxyRing:
    """The rings of an emulated GPU world of several nodes, into which its fused ops' kernels post
    their cross-node puts (templates/persistent.cuh run_raises_nodes): made and started on the
    world's first such call, stopped when the world goes; ``world.reset()`` (after a timeout)
    empties and restarts them. Their signals are the ops' pads (device memory), so no signal
    block is needed beyond the one int the ring requires."""
    rings = getattr(world, "_rdma", None)
    if rings is None:
        rings = ProxyRing(world.size, FUSED_RING_CAPACITY, device=world.device, signals_per_rank=1)
        rings.start()
        rings.wait_ready()
        world._rdma = rings
        weakref.finalize(world, _retire, rings)  # the threads end; the memory is kept
    return rings


def _choice(name: str, value: str, table: tuple[tuple[str, int], ...]) -> int:
    ids = dict(table)
    if value not in ids:
        raise ValueError(f"{name} must be one of {sorted(ids)}, got {value!r}")
    return ids[value]


def _check_buffer(name: str, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.empty_like(like)
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must match src: {tuple(like.shape)} {like.dtype} {like.device}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    return t


def _check_exchange(
    src: torch.Tensor,
    ring: ProxyRing,
    nodes: Any,
    puts: Any,
    posters: Any,
    receive: int,
    timeout_s: float,
) -> int:
    """Every check of ``exchange`` before anything is launched; returns the bytes per put."""
    W = ring.world_size
    if not isinstance(src, torch.Tensor) or not src.is_cuda or src.device != ring.device:
        raise ValueError(f"src must be a CUDA tensor on {ring.device}")
    if src.dim() != 2 or src.shape[0] != W or not src.is_contiguous() or src.data_ptr() % 16:
        raise ValueError(
            f"src must be a contiguous, 16-byte aligned [{W}, n] tensor, got {tuple(src.shape)}"
        )
    if not isinstance(nodes, int) or nodes < 2 or W % nodes:
        raise ValueError(f"nodes must be an int >= 2 dividing world_size={W}, got {nodes!r}")
    if not isinstance(puts, int) or puts < 1:
        raise ValueError(f"puts must be an int >= 1, got {puts!r}")
    if not isinstance(posters, int) or not 1 <= posters <= puts:
        raise ValueError(f"posters must be an int in [1, puts={puts}], got {posters!r}")
    row = src.shape[1] * src.element_size()
    if row % puts or (row // puts) % 16 or row == 0:
        raise ValueError(f"bytes per put ({row} / {puts}) must be a positive multiple of 16")
    if puts > ring.signals_per_rank:
        raise ValueError(f"puts ({puts}) exceeds the ring's signals_per_rank")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    ctas = W * posters * (1 if receive == _receive_id(ring, "none") else 2)
    sms = torch.cuda.get_device_properties(ring.device).multi_processor_count
    if ctas > sms:
        raise ValueError(f"{ctas} CTAs exceed the {sms} SMs (all must be resident at once)")
    if ring.posted + puts > _MAX_COUNT:
        raise ValueError("the ring's int32 counters are nearly exhausted: ring.restart()")
    if not ring.running:
        raise ValueError("the ring's proxies are not running: `with ring:` or ring.start()")
    return row // puts


def _receive_id(ring: ProxyRing, name: str) -> int:
    return dict(ring.ext.RECEIVE)[name]


def exchange(
    src: torch.Tensor,
    ring: ProxyRing,
    nodes: int,
    puts: int,
    *,
    posters: int = 1,
    op: str = "set",
    receive: str = "copy",
    timeout_s: float = 5.0,
    dst: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sync: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every emulated rank r puts its row ``src[r]`` to rank ``(r + W // nodes) % W`` (a rank of
    the next virtual node) through its ring and proxy, in ``puts`` equal tiles posted by
    ``posters`` CTAs; the receiving rank's CTAs wait (bounded) for each tile's signal and, with
    ``receive="copy"``, copy the tile into ``out``. Unfused meaning::

        dst = torch.roll(src, W // nodes, dims=0)       # [W, n], src's dtype
        out = dst.clone()                                # what the receivers read after each signal

    src: [W, n] contiguous CUDA tensor on the ring's device, any dtype, n * itemsize / puts a
    multiple of 16. op: how the proxy raises the signals ("set": a flag per tile; "add": a counter
    per poster CTA). receive: "copy", "wait" (out is None), "none" (no receivers; out is None).
    Synchronizes the current stream. Raises ValueError before launching on bad input, and
    CommTimeout (naming rank, peer and signal) when a wait timed out; the ring is then stopped and
    reset (``ring.start()`` resumes).

    ``sync=False`` (receive "copy" or "wait"): only enqueues the kernel, so the call can be
    captured in a CUDA graph. The caller then counts the launch's puts (``ring.count_posted(puts)``
    after each launch or replay) and calls ``ring.check()`` for the timeout. A replay needs nothing
    else from the host but the proxy threads running: the device takes its tickets from the
    ring's counters and the receivers reset the signals they consumed.
    """
    ext = ring.ext
    op_id = _choice("op", op, ext.OPS)
    receive_id = _choice("receive", receive, ext.RECEIVE)
    bytes_per_put = _check_exchange(src, ring, nodes, puts, posters, receive_id, timeout_s)
    if not sync and receive == "none":
        raise ValueError('sync=False needs receivers (receive "copy" or "wait")')
    dst = _check_buffer("dst", dst, src)
    out = _check_buffer("out", out, src) if receive == "copy" else None
    ring.launches += 1
    a = ext.RdmaTestArgs()
    a.src, a.dst = src.data_ptr(), dst.data_ptr()
    a.out = out.data_ptr() if out is not None else 0
    a.rings, a.reserve, a.signals = ring.rings.ptr, ring.reserve.data_ptr(), ring.signals.ptr
    a.status = ring.status.ptr
    a.bytes, a.timeout_ns = bytes_per_put, int(timeout_s * 1e9)
    a.world_size, a.nodes, a.puts, a.posters = ring.world_size, nodes, puts, posters
    a.capacity, a.signals_per_rank = ring.capacity, ring.signals_per_rank
    a.op, a.receive, a.launch = op_id, receive_id, ring.launches
    with torch.cuda.device(ring.device):
        stream = torch.cuda.current_stream()
        if not torch.cuda.is_current_stream_capturing():
            ring.ensure_independent(stream.cuda_stream)
        rc = ext.launch_rdma_test(a, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"launch_rdma_test: {ext.rdma_test_status_string(rc)}")
        if not sync:
            return dst, out
        ring.posted += puts
        stream.synchronize()
    _raise_timeout(ring)
    if receive == "none":
        _drain(ring, timeout_s)
    return dst, out


def _raise_timeout(ring: ProxyRing) -> None:
    """CommTimeout from the launch's CommStatus, if a wait timed out; then the ring is reset."""
    v = dict(zip(STATUS_FIELDS, ring.status.read_i32(0, len(STATUS_FIELDS)), strict=True))
    if not v["error"]:
        return
    ext = ring.ext
    rank, peer, index = v["rank"], v["peer"], v["index"]
    pad = ext.WAIT_NAMES[v["pad"]] if 0 <= v["pad"] < len(ext.WAIT_NAMES) else f"pad{v['pad']}"
    # Named as the twin names them (SigRef): pad[rank][index...].
    signal = f"{pad}[{rank}][{peer}, {index}]" if pad == "landed" else f"{pad}[{rank}][0]"
    role = ext.ROLE_NAMES[v["role"]] if 0 <= v["role"] < len(ext.ROLE_NAMES) else "?"
    c = ring.counters(rank)
    detail = (
        f"ring of rank {rank}: head {c['head']}, tail {c['tail']}, reserve {c['reserve']}, "
        f"capacity {ring.capacity}"
    )
    errors = ring.errors()
    if errors:
        detail += "; " + "; ".join(errors)
    exc = CommTimeout(rank, peer, signal, v["task"], role, detail)
    ring.stop()
    ring.reset()
    raise exc


def _drain(ring: ProxyRing, timeout_s: float) -> None:
    """With no receivers the kernel ends before its puts land: wait (bounded) until every proxy
    has done them, then clear the signals no receiver consumed."""
    deadline = time.perf_counter() + timeout_s
    for r in range(ring.world_size):
        while ring.counters(r)["tail"] < ring.posted:
            if time.perf_counter() > deadline:
                c = ring.counters(r)
                detail = f"head {c['head']}, tail {c['tail']}, {ring.posted} posted"
                ring.stop()
                ring.reset()
                raise CommTimeout(r, r, f"rdma_tail[{r}][0]", -1, "host", detail)
            time.sleep(1e-4)
    # NOTE: every proxy raised its signals before releasing its tail.
    ring.signals.zero()
