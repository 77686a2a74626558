"""The CPU interpreter: runs a plan's per-role programs with W virtual ranks and many virtual SMs.

Each unit of a role (a CTA, or a CTA's communicator warp) is an *agent*: a Python generator running
its tasks in plan order. Agents yield at every primitive (see ``twins.py``); the machine picks the
next agent to resume with a seeded random policy, so tests explore interleavings.

Ordering is tracked with vector clocks, as the PTX memory model's release/acquire pairs would order
it: a release stores the agent's clock in the signal, an acquire that reads it joins that clock.
Every data access is logged per (buffer, rank) with its rectangle; an access that overlaps an
earlier conflicting access by another agent not ordered before it is a race (RaceError). Concurrent
reduce-adds do not conflict with each other. A blocked agent past its deadline raises CommTimeout;
no runnable agent at all raises DeadlockError (a CommTimeout, since on a GPU it would run into the
deadline).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CommTimeout, DeadlockError, RaceError, TileWriteError
from .trace import Timeline

Rect = tuple[int, int, int, int]  # row0, rows, col0, cols


@dataclass
class Wait:
    """Yielded by wait twins: block until ``pad[rank][index] == value``, then acquire (and
    reset)."""

    sig: SigRef
    value: int
    reset: bool
    peer: int


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


@dataclass
class _Access:
    rect: Rect
    agent: int
    time: int
    kind: str  # "r", "w", "add"
    task: int


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


@dataclass
class Agent:
    id: int
    rank: int
    role: str
    unit: int
    gen: Iterator[Any] | None = None
    clock: list[int] = field(default_factory=list)
    task: int = -1
    blocked: Wait | None = None
    blocked_since: int = 0
    wake_at: int = 0
    done: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}{self.unit}"


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
    ) -> None:
        self.W = world_size
        self.pads = pads  # name -> int32 [W, ...] (the world's real signal pads)
        self.buffers = buffers  # name -> [W, rows, cols] data tensors (fp32 / bf16)
        self.rng = random.Random(seed)
        self.deadline_steps = deadline_steps
        self.agents: list[Agent] = []
        self.sig_clock: dict[SigRef, list[int]] = {}
        self.log: dict[tuple[str, int], list[_Access]] = {}
        self.outputs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, tile) -> writers
        self.step = 0
        self.timeline = Timeline()

    # -- agents ---------------------------------------------------------------------------------
    def add_agent(
        self, rank: int, role: str, unit: int, tasks: list[int], program: Program
    ) -> None:
        agent = Agent(id=len(self.agents), rank=rank, role=role, unit=unit)
        self.agents.append(agent)
        agent.gen = self._drive(agent, tasks, program)

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
        agent.task = -1

    def run(self) -> Timeline:
        for a in self.agents:
            # NOTE: an agent's own component starts at 1, so an access made before any release is
            # not ordered before another agent whose clock still holds 0 for it.
            a.clock = [0] * len(self.agents)
            a.clock[a.id] = 1
        live = [a for a in self.agents]
        while live:
            self.step += 1
            runnable = [a for a in live if self._ready(a)]
            if not runnable:
                sleepers = [a for a in live if a.blocked is None]
                if sleepers:  # only sleepers: jump the clock to the first wake-up
                    self.step = min(a.wake_at for a in sleepers)
                    continue
                self._raise_blocked(live)
            agent = self.rng.choice(runnable)
            self._resume(agent)
            if agent.done:
                live.remove(agent)
            self._check_deadlines(live)
        return self.timeline

    def _ready(self, a: Agent) -> bool:
        if a.blocked is not None:
            w = a.blocked
            return int(self.pads[w.sig.pad][w.sig.rank][w.sig.index]) == w.value
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
            a.done = True
            return
        if isinstance(item, Wait):
            a.blocked, a.blocked_since = item, self.step
        elif isinstance(item, Sleep):
            a.wake_at = self.step + item.steps

    def _check_deadlines(self, live: list[Agent]) -> None:
        for a in live:
            if a.blocked is not None and self.step - a.blocked_since > self.deadline_steps:
                if not self._ready(a):
                    w = a.blocked
                    raise CommTimeout(a.rank, w.peer, str(w.sig), a.task, a.role)

    def _raise_blocked(self, live: list[Agent]) -> None:
        waiters = [(a.rank, a.role, a.task, a.blocked.peer, str(a.blocked.sig)) for a in live]
        raise DeadlockError(sorted(waiters))

    # -- ordering -------------------------------------------------------------------------------
    def _acquire(self, a: Agent, sig: SigRef) -> None:
        c = self.sig_clock.get(sig)
        if c is not None:
            a.clock = [max(x, y) for x, y in zip(a.clock, c, strict=True)]

    def release(self, a: Agent, sig: SigRef, accumulate: bool) -> None:
        prev = self.sig_clock.get(sig) if accumulate else None
        snap = (
            list(a.clock)
            if prev is None
            else [max(x, y) for x, y in zip(a.clock, prev, strict=True)]
        )
        self.sig_clock[sig] = snap
        a.clock[a.id] += 1

    def access(self, a: Agent, buf: str, rank: int, rect: Rect, kind: str) -> None:
        entries = self.log.setdefault((buf, rank), [])
        for e in entries:
            if e.agent == a.id or (kind == "add" and e.kind == "add"):
                continue
            if kind == "r" and e.kind == "r":
                continue
            if a.clock[e.agent] < e.time and _overlap(e.rect, rect):
                other = self.agents[e.agent]
                raise RaceError(
                    "race",
                    a.rank,
                    a.task,
                    f"{kind} of {buf}[{rank}] rows {rect[0]}:{rect[0] + rect[1]} cols "
                    f"{rect[2]}:{rect[2] + rect[3]}",
                    f"not ordered after the {e.kind} by rank {other.rank} {other.name} task "
                    f"{e.task} (no completed wait covers it)",
                )
        entries.append(_Access(rect, a.id, a.clock[a.id], kind, a.task))

    def record_output(self, a: Agent, rank: int, tile: int) -> None:
        writers = self.outputs.setdefault((rank, tile), [])
        writers.append((a.rank, a.task))
        if len(writers) > 1:
            raise TileWriteError(
                "tile written twice",
                a.rank,
                a.task,
                f"output tile {tile} of rank {rank}",
                f"writers (rank, task): {writers}",
            )

    def check_outputs(self, expected: dict[int, list[int]]) -> None:
        """Every expected output tile (rank -> tile ids) written exactly once."""
        for rank, tiles in expected.items():
            for t in tiles:
                if (rank, t) not in self.outputs:
                    raise TileWriteError("tile never written", rank, -1, f"output tile {t}")


class Ctx:
    """What a program twin sees: its rank, the machine, and the primitive twins (see twins.py)."""

    def __init__(self, machine: Machine, agent: Agent) -> None:
        self.m = machine
        self.agent = agent
        self.rank = agent.rank
        self.W = machine.W

    def sig(self, pad: str, rank: int, *index: int) -> SigRef:
        return SigRef(pad, rank, tuple(index))
