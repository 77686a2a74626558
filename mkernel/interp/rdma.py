"""The ``proxy`` RDMA transport's twin: a descriptor ring per GPU in pinned host memory, drained by
a host proxy thread that copies the bytes and then raises the destination's signal.

Protocol (the device primitive ``rdma_put`` and the host proxy will follow it; see docs/rdma.md):

- poster (one thread of a CTA on rank r): take a ticket ``t`` (relaxed fetch-add on ``reserve``);
  wait, bounded, until ``tail >= t - capacity + 1`` (back-pressure: slot ``t % capacity`` is free);
  write the descriptor into that slot; wait until ``head == t`` (earlier tickets published), then
  ``head = t + 1`` with release. The poster owns its source until the put is done (the proxy reads
  it later): it must not rewrite it before the destination's signal says the put has landed;
- proxy (host thread of rank r): for n = 0, 1, ...: wait for ``head >= n + 1`` with acquire, read
  descriptor ``n % capacity``, copy source -> destination (cudaMemcpyAsync on its copy stream, then
  a stream sync), raise the destination's signal with release, then ``tail = n + 1`` with release
  (the slot may be reused);
- receiver: waits for the signal like every signal (bounded, names the peer): acquiring it orders
  the bytes before its reads. A stalled proxy leaves receivers and full-ring posters to time out.

Counters are monotonic (the slot is ``count % capacity``), so wrap-around is only the modulo. The
twin keeps head, tail and reserve as signal pads and logs every descriptor slot access, so the race
detector checks slot reuse (a poster overwriting a descriptor the proxy has not read) as well as
the data.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from .machine import STEP, Ctx, Rect, SigRef, Sleep, Wait

Gen = Generator[Any, Any, Any]


@dataclass(frozen=True)
class Descriptor:
    """One put: copy ``src_rect`` of ``src_buf`` on the poster's rank into ``dst_rect`` of
    ``dst_buf`` on ``dest``, then raise ``signal`` (on ``dest``) by ``op`` "set" or "add" of
    ``value``. No bytes (``src_buf`` None): a signal only; no ``signal``: bytes only (a silent
    rank's put)."""

    dest: int
    dst_buf: str | None
    dst_rect: Rect | None
    src_buf: str | None
    src_rect: Rect | None
    signal: SigRef | None
    value: int = 1
    op: str = "set"


@dataclass
class Ring:
    """The rings of every rank (one per GPU): ``capacity`` descriptor slots each, with pads
    ``{name}_head`` (written by posters), ``{name}_tail`` (written by the proxy) and
    ``{name}_reserve`` (tickets), and the data buffer ``{name}_slots`` (one row per slot) whose
    accesses stand for the descriptor bytes."""

    world_size: int
    capacity: int
    name: str = "rdma"
    slots: list[list[Descriptor | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {self.capacity}")
        self.slots = [[None] * self.capacity for _ in range(self.world_size)]

    def pads(self) -> dict[str, torch.Tensor]:
        """The ring's counters, to add to the machine's pads (int32 [W, 1], host memory)."""
        counters = ("head", "tail", "reserve")
        return {
            f"{self.name}_{c}": torch.zeros(self.world_size, 1, dtype=torch.int32) for c in counters
        }

    def buffers(self) -> dict[str, torch.Tensor]:
        """The slots' stand-in, to add to the machine's buffers."""
        return {f"{self.name}_slots": torch.zeros(self.world_size, self.capacity, 1)}

    def counter(self, which: str, rank: int) -> SigRef:
        return SigRef(f"{self.name}_{which}", rank, (0,))

    def slot_rect(self, count: int) -> Rect:
        return (count % self.capacity, 1, 0, 1)


def rdma_put(
    ctx: Ctx,
    ring: Ring,
    dest: int,
    dst_buf: str | None,
    dst_rect: Rect | None,
    src_buf: str | None,
    src_rect: Rect | None,
    signal: SigRef | None,
    value: int = 1,
    op: str = "set",
) -> Gen:
    """Device side: post one put into this rank's ring; returns (as the generator's value) its
    ticket once the descriptor is published (not when the bytes land: the destination's ``signal``
    says that; the proxy's ``tail`` passing the ticket says the source may be reused). ``src_buf``
    None: a put of no bytes (a signal only); ``signal`` None: no signal (bytes only). Every
    argument is checked (ValueError naming it) before a ticket is taken: a bad put moves no byte
    and raises no signal."""
    check_put(ctx.m, ring, dest, dst_buf, dst_rect, src_buf, src_rect, signal, value, op)
    m, a, me = ctx.m, ctx.agent, ctx.rank
    ticket = m.signal(a, ring.counter("reserve", me), "add", 1, release=False)
    yield STEP
    if ticket >= ring.capacity:  # back-pressure: wait for the proxy to free the slot
        free = ticket - ring.capacity + 1
        yield Wait(ring.counter("tail", me), free, reset=False, peer=me, at_least=True)
    m.access(a, f"{ring.name}_slots", me, ring.slot_rect(ticket), "w")
    desc = Descriptor(dest, dst_buf, dst_rect, src_buf, src_rect, signal, value, op)
    ring.slots[me][ticket % ring.capacity] = desc
    yield STEP
    # NOTE: publish in ticket order: the proxy reads every slot below head.
    yield Wait(ring.counter("head", me), ticket, reset=False, peer=me)
    m.signal(a, ring.counter("head", me), "set", ticket + 1, release=True)
    yield STEP
    return ticket


def check_put(
    m: Any,
    ring: Ring,
    dest: Any,
    dst_buf: Any,
    dst_rect: Any,
    src_buf: Any,
    src_rect: Any,
    signal: Any,
    value: Any,
    op: Any,
) -> None:
    """What rdma_put needs of its arguments on machine ``m``: ValueError naming the first that is
    wrong. Without it a bad rank or buffer name surfaced as an IndexError or KeyError inside the
    proxy, and a rectangle past the buffer's edge dropped bytes while the signal still rose."""
    if f"{ring.name}_reserve" not in m.pads or f"{ring.name}_slots" not in m.buffers:
        raise ValueError(f"ring {ring.name!r}: add ring.pads() and ring.buffers() to the machine")
    if not _is_int(dest) or not 0 <= dest < m.W:
        raise ValueError(f"dest must be a rank in [0, {m.W}), got {dest!r}")
    if op not in ("set", "add"):
        raise ValueError(f"op must be 'set' or 'add', got {op!r}")
    if not _is_int(value):
        raise ValueError(f"value must be an int, got {value!r}")
    shapes = [_check_rect(m, kind, buf, rect) for kind, buf, rect in
              (("dst", dst_buf, dst_rect), ("src", src_buf, src_rect))]  # fmt: skip
    if (shapes[0] is None) != (shapes[1] is None):
        raise ValueError(
            "a put of bytes names both ends (dst_buf, dst_rect, src_buf, src_rect), a signal "
            f"only none: got dst_buf={dst_buf!r}, src_buf={src_buf!r}"
        )
    if shapes[0] != shapes[1]:
        (dr, dc), (sr, sc) = shapes
        raise ValueError(f"dst_rect is {dr} x {dc} but src_rect is {sr} x {sc}: they must agree")
    if signal is not None:
        _check_signal(m, signal, dest)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_rect(m: Any, kind: str, buf: Any, rect: Any) -> tuple[int, int] | None:
    """(rows, cols) of ``{kind}_rect`` inside buffer ``{kind}_buf``, or None when both are None."""
    if (buf is None) != (rect is None):
        raise ValueError(
            f"{kind}_buf and {kind}_rect must both be given or both None, got {kind}_buf={buf!r}, "
            f"{kind}_rect={rect!r}"
        )
    if buf is None:
        return None
    if not isinstance(buf, str) or buf not in m.buffers:
        raise ValueError(f"{kind}_buf {buf!r} is not a buffer of this machine: {sorted(m.buffers)}")
    if not isinstance(rect, tuple) or len(rect) != 4 or not all(map(_is_int, rect)):
        raise ValueError(f"{kind}_rect must be 4 ints (row0, rows, col0, cols), got {rect!r}")
    r0, nr, c0, nc = rect
    rows, cols = m.buffers[buf].shape[1:3]
    if min(rect) < 0 or r0 + nr > rows or c0 + nc > cols:
        raise ValueError(f"{kind}_rect {rect} is outside {buf}'s [{rows}, {cols}] per rank")
    return nr, nc


def _check_signal(m: Any, signal: Any, dest: int) -> None:
    if not isinstance(signal, SigRef):
        raise ValueError(f"signal must be a SigRef or None, got {type(signal).__name__}")
    if signal.pad not in m.pads:
        raise ValueError(
            f"signal pad {signal.pad!r} is not a pad of this machine: {sorted(m.pads)}"
        )
    if signal.rank != dest:
        raise ValueError(f"the signal {signal} must live on the destination rank {dest}")
    shape = tuple(m.pads[signal.pad].shape[1:])
    index = signal.index
    inside = len(index) == len(shape) and all(
        _is_int(i) and 0 <= i < n for i, n in zip(index, shape, strict=True)
    )
    if not inside:
        raise ValueError(f"signal index {index} is outside pad {signal.pad!r} of {list(shape)}")


def proxy(
    ring: Ring,
    count: int | None,
    stall_after: int | None = None,
    signal_early: bool = False,
    tail_early: bool = False,
) -> Any:
    """The host proxy of one rank, as a program for ``Machine.add_agent``: drains ``count`` puts
    from that rank's ring (None: every put, for as long as the run goes on: run it as a host
    agent, ``Machine.add_agent(..., host=True)``, which ends with the kernels). ``stall_after`` =
    k: it hangs after k puts (a dead proxy thread).
    Planted bugs for tests: ``signal_early`` raises the signal before the copy; ``tail_early``
    frees the slot before reading the descriptor."""

    def run(ctx: Ctx, task: int) -> Gen:
        m, a, me = ctx.m, ctx.agent, ctx.rank
        for n in range(count) if count is not None else itertools.count():
            if stall_after is not None and n >= stall_after:
                yield Sleep(10 * m.deadline_steps)  # alive but stuck: waiters hit the deadline
                return
            yield Wait(ring.counter("head", me), n + 1, reset=False, peer=me, at_least=True)
            # The ring never holds more than its capacity (posters wait for the tail).
            assert int(m.pads[f"{ring.name}_head"][me, 0]) - n <= ring.capacity
            if tail_early:
                m.signal(a, ring.counter("tail", me), "set", n + 1, release=True)
            m.access(a, f"{ring.name}_slots", me, ring.slot_rect(n), "r")
            desc = ring.slots[me][n % ring.capacity]
            assert desc is not None
            yield STEP
            if signal_early:
                yield from _raise(ctx, desc)
            yield from _copy(ctx, desc)
            if not signal_early:
                yield from _raise(ctx, desc)
            if not tail_early:
                m.signal(a, ring.counter("tail", me), "set", n + 1, release=True)
            yield STEP

    return run


def _copy(ctx: Ctx, d: Descriptor) -> Gen:
    """cudaMemcpyAsync on the proxy's stream, then a stream sync: the copy lands at the sync."""
    m, a = ctx.m, ctx.agent
    if d.src_buf is None:  # a signal only
        return
    m.access(a, d.src_buf, a.rank, d.src_rect, "r")
    r0, nr, c0, nc = d.src_rect
    value = m.buffers[d.src_buf][a.rank, r0 : r0 + nr, c0 : c0 + nc]
    m.issue_bulk(a, d.dst_buf, d.dest, d.dst_rect, value, "w")
    yield STEP
    m.land_bulk(a)
    yield STEP


def _raise(ctx: Ctx, d: Descriptor) -> Gen:
    """The destination's signal, raised with release (the proxy writes it over the network)."""
    if d.signal is None:
        return
    ctx.m.signal(ctx.agent, d.signal, d.op, d.value, release=True)
    yield STEP
