"""The CPU interpreter: runs a plan's per-role programs with W virtual ranks and many virtual SMs.

Each unit of a role (a CTA, or a CTA's communicator warp) is an *agent*: a Python generator running
its tasks in plan order. Agents yield at every primitive (see ``twins.py``); the machine picks the
next agent to resume with a seeded random policy, so tests explore interleavings.

Ordering is tracked with vector clocks, as the PTX memory model's release/acquire pairs would order
it: a release stores the agent's clock in the signal, an acquire that reads it joins that clock; a
relaxed store or add publishes no clock (a relaxed add keeps the releases already in the signal, as
a release sequence does). Every data access is logged per (buffer, rank) with its rectangle and
proxy; an access that overlaps a conflicting access by another agent that is not ordered before it
is a race (RaceError), whichever of the two came first. Concurrent reduce-adds do not conflict with
each other. What the GPU adds to that:

- bulk (TMA) copies land late: ``tile_send_bulk`` / ``reduce_add_bulk`` only queue a write; it is
  written and logged at the agent's ``bulk_wait_all`` (or its end), with the agent's clock then, so
  a release between issue and wait does not order it;
- proxies: TMA loads read through the async proxy, which sees a generic-proxy write only if the
  reader ran ``fence_proxy_async`` after acquiring it: such a read is checked with the agent's clock
  as of its last proxy fence (``proxy_clock``);
- calls in stream order: agents of call c+1 on a rank start when every agent of call c on that rank
  is done, from the clock of that call's *kernel end* (a virtual agent per (call, rank) whose clock
  joins those agents' final clocks). The kernel end reads every output declared with
  ``expect_outputs`` (the run then checks each tile was written exactly once in that call); the
  access log outlives the call, so a write that the kernel end does not see, or a next call's
  write racing this call's read, is a race too.

A blocked agent past its deadline raises CommTimeout; no runnable agent at all raises DeadlockError
(a CommTimeout, since on a GPU it would run into the deadline).

Progress: inside ``with progress_to(report):`` every run calls ``report(RunProgress)`` every few
seconds of wall time, and once at its end if it reported before; the CLI prints it. Unset
(libraries, tests), the run loop only tests a local for None.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import time
from collections.abc import Callable, Generator, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..errors import CommTimeout, DeadlockError, RaceError, TileWriteError
from .trace import Timeline

Rect = tuple[int, int, int, int]  # row0, rows, col0, cols


class RunProgress(NamedTuple):
    """Where a ``Machine.run`` is (``progress_to``)."""

    done: int  # tasks finished
    total: int | None  # tasks planned (None where a role is laid out on the device, or shared)
    running: int  # agents inside a task now
    steps: int  # scheduling steps so far
    seconds: float  # wall time since the run began


Progress = Callable[[RunProgress], None]
_PROGRESS: contextvars.ContextVar[tuple[Progress, float] | None] = contextvars.ContextVar(
    "mkernel_interp_progress", default=None
)


@contextlib.contextmanager
def progress_to(report: Progress, every_s: float = 2.0) -> Iterator[None]:
    """Every ``Machine.run`` inside the block calls ``report(RunProgress(...))`` about every
    ``every_s`` seconds, and once at its end if it reported before."""
    token = _PROGRESS.set((report, every_s))
    try:
        yield
    finally:
        _PROGRESS.reset(token)


@dataclass
class Wait:
    """Yielded by wait twins: block until ``pad[rank][index] == value`` (``>= value`` with
    ``at_least``: a monotonic counter such as a ring's head or tail), then acquire (and reset)."""

    sig: SigRef
    value: int
    reset: bool
    peer: int
    at_least: bool = False


@dataclass
class Sleep:
    steps: int


STEP = None  # a bare scheduling point


@dataclass(frozen=True)
class SigRef:
    pad: str
    rank: int
    index: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.pad}[{self.rank}]{list(self.index)}"


KERNEL_END = "kernel end"  # the role of the virtual agent that ends a call on a rank
KINDS = {"r": "read", "w": "write", "add": "reduce-add"}


@dataclass
class _Access:
    rect: Rect
    agent: int
    time: int
    kind: str  # "r", "w", "add"
    task: int
    proxy: str = "generic"  # "generic" (ld / st / red) or "async" (TMA)


@dataclass
class _Bulk:
    """A bulk copy issued, not landed; its source is captured at issue (smem may be reused)."""

    buf: str
    rank: int
    rect: Rect
    value: torch.Tensor
    kind: str  # "w" or "add"


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


def _join(a: list[int], b: list[int]) -> list[int]:
    return [max(x, y) for x, y in zip(a, b, strict=True)]


def _by_buffer(buf: str, rects: dict) -> list[tuple[str, int, Rect]]:
    """(buffer, tile, rect) of ``{tile: rect}`` in ``buf``, or of ``{buffer: {tile: rect}}``."""
    if any(isinstance(key, str) for key in rects):
        return [(b, t, r) for b, tiles in rects.items() for t, r in tiles.items()]
    return [(buf, t, r) for t, r in rects.items()]


@dataclass
class Agent:
    id: int
    rank: int
    role: str
    unit: int
    call: int = 0
    gen: Iterator[Any] | None = None
    clock: list[int] = field(default_factory=list)
    # the clock as of the last fence_proxy_async (or the kernel start): what TMA reads may see
    proxy_clock: list[int] = field(default_factory=list)
    task: int = -1
    blocked: Wait | None = None
    blocked_since: int = 0
    wake_at: int = 0
    started: bool = False  # the previous call on this rank is over (stream order)
    # a host thread (the rdma proxy): outside stream order (no call, not part of any kernel end),
    # runs from the start, has no deadline, and the run ends without it once it is idle
    host: bool = False
    done: bool = False
    pending: list[_Bulk] = field(default_factory=list)  # bulk copies issued, not landed

    @property
    def name(self) -> str:
        return f"{self.role}{self.unit}" if self.unit >= 0 else self.role

    def describe(self, task: int) -> str:
        if self.role == KERNEL_END:
            return f"the kernel end of rank {self.rank} call {self.call}"
        later = f" call {self.call}" if self.call else ""
        return f"rank {self.rank} {self.name} task {task}{later}"


Program = Callable[["Ctx", int], Generator[Any, Any, None]]


class Machine:
    """Holds buffers, signal pads, agents and the logs; ``run()`` executes to completion."""

    def __init__(
        self,
        world_size: int,
        pads: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        seed: int = 0,
        deadline_steps: int = 1_000_000,
        nodes: int = 1,
    ) -> None:
        self.W = world_size
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"nodes must be a positive int dividing {world_size}, got {nodes!r}")
        # NOTE: ranks split into equal contiguous nodes; a plain peer access across nodes is an
        # error (twins.py), only the rdma proxy (rdma.py) moves data between nodes.
        self.nodes = nodes
        self.pads = pads  # name -> int32 [W, ...] (the world's real signal pads)
        self.buffers = buffers  # name -> [W, rows, cols] data tensors (fp32 / bf16)
        self.rng = random.Random(seed)
        self.deadline_steps = deadline_steps
        self.agents: list[Agent] = []
        self.ends: dict[tuple[int, int], Agent] = {}  # (call, rank) -> kernel end, made by run()
        self.sig_clock: dict[SigRef, list[int]] = {}
        self.log: dict[tuple[str, int], list[_Access]] = {}
        # (call, rank, tile) -> writers (rank, task)
        self.outputs: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        # (call, rank) -> (buffer, tile, rect) the kernel end reads
        self.expected: dict[tuple[int, int], list[tuple[str, int, Rect]]] = {}
        self._lazy_expected: dict[tuple[int, int], list[tuple[str, Callable]]] = {}
        self.step = 0
        self.timeline = Timeline()
        self.rdma: Any = None  # program.RdmaPort of a plan over several nodes
        self.planned: int | None = 0  # kernel agents' tasks (progress); None: not all known

    # -- agents ---------------------------------------------------------------------------------
    def add_agent(
        self,
        rank: int,
        role: str,
        unit: int,
        tasks: list[int],
        program: Program,
        call: int = 0,
        host: bool = False,
    ) -> None:
        """An agent running ``program`` over ``tasks`` (after ``program.prologue``, if any, and
        before ``program.epilogue``, if any), in call ``call``: calls run in stream order on each
        rank. ``host``: a host thread of ``rank`` (the rdma proxy) instead: it serves every call,
        starts at once, waits without a deadline, and the run ends when only idle (blocked) host
        agents are left."""
        agent = Agent(id=len(self.agents), rank=rank, role=role, unit=unit, call=call, host=host)
        self.agents.append(agent)
        agent.gen = self._drive(agent, tasks, program)
        if not host and self.planned is not None:  # a laid-out or shared list has no length yet
            self.planned = self.planned + len(tasks) if isinstance(tasks, Sized) else None

    def expect_outputs(
        self,
        call: int,
        rank: int,
        buf: str,
        rects_by_tile: dict[int, Rect] | Callable[[], dict[int, Rect]],
    ) -> None:
        """At the end of ``call`` on ``rank``, the kernel end reads each rect of ``buf`` on ``rank``
        (the host will read the output), and each tile must have been written exactly once in that
        call (``output_store``). A callable is asked at the kernel end (outputs that depend on what
        the kernel's layout phase made). An op with several output buffers (ring attention's out
        and lse) maps buffer names to such dicts instead, ``buf`` then unused; its tile ids are
        unique across its buffers (writes are counted per rank and tile)."""
        spec = self.expected.setdefault((call, rank), [])
        if callable(rects_by_tile):
            self._lazy_expected.setdefault((call, rank), []).append((buf, rects_by_tile))
            return
        spec += _by_buffer(buf, rects_by_tile)

    def _drive(self, agent: Agent, tasks: list[int], program: Program) -> Iterator[Any]:
        ctx = Ctx(self, agent)
        prologue = getattr(program, "prologue", None)
        if prologue is not None:
            yield from prologue(ctx)
        for task in tasks:
            agent.task = task
            start = self.step
            yield from program(ctx, task)
            self.timeline.add(agent.rank, agent.name, task, start, self.step + 1)
        epilogue = getattr(program, "epilogue", None)
        if epilogue is not None:  # what the unit still owes after its last task (a deferred raise)
            yield from epilogue(ctx)
        agent.task = -1

    def run(self) -> Timeline:
        calls = sorted({a.call for a in self.agents if not a.host} | {c for c, _ in self.expected})
        n = len(self.agents)
        for c in calls:
            for r in range(self.W):
                self.ends[(c, r)] = Agent(id=n, rank=r, role=KERNEL_END, unit=-1, call=c)
                n += 1
        self._all = self.agents + list(self.ends.values())  # by id, for naming
        self._calls = calls
        self._next_call = [0] * self.W  # per rank: index in calls of the call now running
        for a in self._all:
            # NOTE: an agent's own component starts at 1, so an access made before any release is
            # not ordered before another agent whose clock still holds 0 for it.
            a.clock = [0] * n
            a.clock[a.id] = 1
            a.proxy_clock = [0] * n
        for r in range(self.W):
            self._start_call(r, [0] * n)
        for a in self.agents:
            a.started = a.started or a.host
        live = [a for a in self.agents]
        progress, t0 = _PROGRESS.get(), time.perf_counter()
        reported = t0
        while live:
            self.step += 1
            if progress is not None and not self.step % 64:
                reported = self._report(progress, t0, reported, live)
            runnable = [a for a in live if self._ready(a)]
            if not runnable and all(a.host and a.blocked is not None for a in live):
                break  # every kernel agent is done; the host threads wait for work that never comes
            if not runnable:
                sleepers = [a for a in live if a.started and a.blocked is None]
                if sleepers:  # only sleepers: jump the clock to the first wake-up
                    self.step = min(a.wake_at for a in sleepers)
                    continue
                self._raise_blocked(live)
            agent = self.rng.choice(runnable)
            self._resume(agent)
            if agent.done:
                live.remove(agent)
                self._start_call(agent.rank, None)
            self._check_deadlines(live)
        if progress is not None and reported > t0:  # it reported: the final count too
            self._report(progress, t0, 0.0, live)
        self._check_expected()
        return self.timeline

    def _report(
        self, progress: tuple[Progress, float], t0: float, last: float, live: list[Agent]
    ) -> float:
        """Calls the report if ``every_s`` has passed since ``last``; returns when it last did."""
        report, every_s = progress
        now = time.perf_counter()
        if now - last < every_s:
            return last
        running = sum(1 for a in live if a.task >= 0 and not a.host)
        report(RunProgress(len(self.timeline.spans), self.planned, running, self.step, now - t0))
        return now

    def _start_call(self, rank: int, base: list[int] | None) -> None:
        """Starts the agents of the next call on ``rank`` from clock ``base`` (None: from the kernel
        end of the running call, once all its agents are done); a call without agents ends at
        once."""
        while self._next_call[rank] < len(self._calls):
            c = self._calls[self._next_call[rank]]
            members = [a for a in self.agents if a.rank == rank and a.call == c and not a.host]
            if base is None:
                if not all(a.done for a in members):
                    return
                base = self._kernel_end(self.ends[(c, rank)], members)
                self._next_call[rank] += 1
                continue
            for a in members:
                # NOTE: a kernel boundary orders everything before it for every proxy.
                a.clock, a.proxy_clock, a.started = _join(a.clock, base), list(base), True
            if members:
                return
            base = None

    def _kernel_end(self, end: Agent, members: list[Agent]) -> list[int]:
        """All agents of (call, rank) are done: the host may read the outputs now."""
        prev = self._next_call[end.rank] - 1
        if prev >= 0:
            end.clock = _join(end.clock, self.ends[(self._calls[prev], end.rank)].clock)
        for a in members:
            end.clock = _join(end.clock, a.clock)
        for buf, rects_of in self._lazy_expected.pop((end.call, end.rank), []):
            self.expected[(end.call, end.rank)] += _by_buffer(buf, rects_of())
        for buf, _, rect in self.expected.get((end.call, end.rank), []):
            self.access(end, buf, end.rank, rect, "r")
        end.done = True
        return end.clock

    def _check_expected(self) -> None:
        # NOTE: after the run, not at the kernel end: a write that lands after the kernel end is
        # reported as the race it is, not as a tile never written.
        for (call, rank), spec in self.expected.items():
            for _, tile, _ in spec:
                if (call, rank, tile) not in self.outputs:
                    raise TileWriteError(
                        "tile never written",
                        rank,
                        -1,
                        f"output tile {tile} of rank {rank} in call {call}",
                        role=KERNEL_END,
                    )

    def _ready(self, a: Agent) -> bool:
        if not a.started:
            return False
        if a.blocked is not None:
            w = a.blocked
            v = int(self.pads[w.sig.pad][w.sig.rank][w.sig.index])
            return v >= w.value if w.at_least else v == w.value
        return a.wake_at <= self.step

    def _resume(self, a: Agent) -> None:
        if a.blocked is not None:  # the wait is satisfied: acquire, maybe consume
            w, a.blocked = a.blocked, None
            self._acquire(a, w.sig)
            if w.reset:
                self.pads[w.sig.pad][w.sig.rank][w.sig.index] = 0
                self.sig_clock.pop(w.sig, None)
        try:
            item = next(a.gen)
        except StopIteration:
            self.land_bulk(a)  # NOTE: the kernel exit waits for the CTA's bulk copies
            a.done = True
            return
        if isinstance(item, Wait):
            a.blocked, a.blocked_since = item, self.step
        elif isinstance(item, Sleep):
            a.wake_at = self.step + item.steps

    def _check_deadlines(self, live: list[Agent]) -> None:
        for a in live:
            if a.host:  # a host thread polls until it is stopped
                continue
            if a.blocked is not None and self.step - a.blocked_since > self.deadline_steps:
                if not self._ready(a):
                    w = a.blocked
                    raise CommTimeout(a.rank, w.peer, str(w.sig), a.task, a.role, unit=a.unit)

    def _raise_blocked(self, live: list[Agent]) -> None:
        waiters = [
            (a.rank, a.role, a.task, a.blocked.peer, str(a.blocked.sig), a.unit)
            for a in live
            # the others wait for their previous call to end; an idle host thread is no news
            if a.blocked is not None and not a.host
        ]
        raise DeadlockError(sorted(waiters))

    def node_of(self, rank: int) -> int:
        return rank // (self.W // self.nodes)

    # -- ordering -------------------------------------------------------------------------------
    def _acquire(self, a: Agent, sig: SigRef) -> None:
        c = self.sig_clock.get(sig)
        if c is not None:
            a.clock = _join(a.clock, c)

    def release(self, a: Agent, sig: SigRef, accumulate: bool) -> None:
        prev = self.sig_clock.get(sig) if accumulate else None
        self.sig_clock[sig] = list(a.clock) if prev is None else _join(a.clock, prev)
        a.clock[a.id] += 1

    def signal(self, a: Agent, sig: SigRef, op: str, value: int, release: bool) -> int:
        """Sets (``op`` "set") or adds to (``op`` "add") a signal, with release or relaxed order;
        returns the old value."""
        slot = self.pads[sig.pad][sig.rank]
        old = int(slot[sig.index])
        if release:
            self.release(a, sig, accumulate=op == "add")
        elif op == "set":  # NOTE: a relaxed store ends the release sequence: nothing to acquire
            self.sig_clock.pop(sig, None)
        # NOTE: a relaxed add continues the release sequence: an acquirer still gets the earlier
        # releasers' clocks, never this agent's.
        slot[sig.index] = value if op == "set" else old + value
        return old

    def fence_proxy(self, a: Agent) -> None:
        """fence.proxy.async: what this agent's clock orders becomes visible to its async proxy."""
        a.proxy_clock = list(a.clock)
        # NOTE: the agent's own later generic writes are not covered: they need another fence.
        a.clock[a.id] += 1

    def access(
        self, a: Agent, buf: str, rank: int, rect: Rect, kind: str, proxy: str = "generic"
    ) -> None:
        entries = self.log.setdefault((buf, rank), [])
        for e in entries:
            if (kind == "add" and e.kind == "add") or (kind == "r" and e.kind == "r"):
                continue
            # An async read sees a generic write only through a proxy fence after its ordering,
            # even the agent's own write.
            cross = kind == "r" and proxy == "async" and e.proxy == "generic"
            if (e.agent == a.id and not cross) or not _overlap(e.rect, rect):
                continue
            clock = a.proxy_clock if cross else a.clock
            if clock[e.agent] >= e.time:
                continue
            other = self._all[e.agent]
            why = (
                "through the async proxy: no fence_proxy_async after the wait that orders it"
                if a.clock[e.agent] >= e.time or e.agent == a.id
                else "no completed wait covers it"
            )
            raise RaceError(
                "race",
                a.rank,
                a.task,
                f"{KINDS[kind]} of {buf}[{rank}] rows {rect[0]}:{rect[0] + rect[1]} cols "
                f"{rect[2]}:{rect[2] + rect[3]} in call {a.call}",
                f"not ordered after the {KINDS[e.kind]} by {other.describe(e.task)} ({why})",
                role=a.role,
                unit=a.unit,
                other=(other.rank, other.role, other.unit, e.task),
            )
        entries.append(_Access(rect, a.id, a.clock[a.id], kind, a.task, proxy))

    # -- bulk copies ----------------------------------------------------------------------------
    def issue_bulk(
        self, a: Agent, buf: str, rank: int, rect: Rect, value: torch.Tensor, kind: str
    ) -> None:
        a.pending.append(_Bulk(buf, rank, rect, value.clone(), kind))

    def land_bulk(self, a: Agent) -> None:
        """bulk_wait_all: the agent's bulk copies land now, ordered by its clock now."""
        for b in a.pending:
            self.access(a, b.buf, b.rank, b.rect, b.kind, proxy="async")
            r0, nr, c0, nc = b.rect
            dst = self.buffers[b.buf][b.rank, r0 : r0 + nr, c0 : c0 + nc]
            if b.kind == "add":
                dst.add_(b.value.to(dst.dtype))
            else:
                dst.copy_(b.value.to(dst.dtype))
        a.pending.clear()

    # -- outputs --------------------------------------------------------------------------------
    def record_output(self, a: Agent, rank: int, tile: int) -> None:
        writers = self.outputs.setdefault((a.call, rank, tile), [])
        writers.append((a.rank, a.task))
        if len(writers) > 1:
            raise TileWriteError(
                "tile written twice",
                a.rank,
                a.task,
                f"output tile {tile} of rank {rank} in call {a.call}",
                f"writers (rank, task): {writers}",
                role=a.role,
                unit=a.unit,
            )

    def check_outputs(self, expected: dict[int, list[int]], call: int = 0) -> None:
        """Every expected output tile (rank -> tile ids) written exactly once in ``call``."""
        for rank, tiles in expected.items():
            for t in tiles:
                if (call, rank, t) not in self.outputs:
                    raise TileWriteError("tile never written", rank, -1, f"output tile {t}")


class Ctx:
    """What a program twin sees: its rank, call, the machine, and the primitive twins (twins.py)."""

    def __init__(self, machine: Machine, agent: Agent) -> None:
        self.m = machine
        self.agent = agent
        self.rank = agent.rank
        self.call = agent.call
        self.W = machine.W

    def sig(self, pad: str, rank: int, *index: int) -> SigRef:
        return SigRef(pad, rank, tuple(index))
