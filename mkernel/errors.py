"""Exceptions raised by mkernel: every one names where it happened (rank, task, peer, signal)."""

from __future__ import annotations


class CommTimeout(RuntimeError):
    """A wait passed its deadline (on the GPU or in the CPU interpreter).

    Attributes name the waiter: ``rank`` (who waited), ``peer`` (whose signal it waited for, or -1
    when unknown), ``signal`` (the signal's name and index), ``task`` (the waiter's task id, -1
    outside a task) and ``role`` ("compute", "comm", "barrier").
    """

    def __init__(
        self,
        rank: int,
        peer: int,
        signal: str,
        task: int,
        role: str = "",
        detail: str = "",
    ) -> None:
        self.rank, self.peer, self.signal, self.task, self.role = rank, peer, signal, task, role
        msg = (
            f"rank {rank} timed out waiting for signal {signal} from peer {peer} "
            f"(role {role or '?'}, task {task})"
        )
        super().__init__(msg + (f": {detail}" if detail else ""))


class DeadlockError(CommTimeout):
    """The interpreter found no runnable agent: every unfinished agent waits on a signal.

    On a GPU the same plan would run into the deadline, hence a subclass of CommTimeout. ``waiters``
    lists every blocked (rank, role, task, peer, signal).
    """

    def __init__(self, waiters: list[tuple[int, str, int, int, str]]) -> None:
        self.waiters = waiters
        rank, role, task, peer, signal = waiters[0]
        listing = "; ".join(
            f"rank {r} {ro} task {t} waits {s} from peer {p}" for r, ro, t, p, s in waiters
        )
        super().__init__(rank, peer, signal, task, role, f"deadlock, no agent can run: {listing}")


class PlanError(RuntimeError):
    """The interpreter caught a plan or program bug; names rank, task and the data or signal."""

    def __init__(self, kind: str, rank: int, task: int, what: str, detail: str = "") -> None:
        self.kind, self.rank, self.task, self.what = kind, rank, task, what
        super().__init__(
            f"{kind}: rank {rank}, task {task}, {what}" + (f": {detail}" if detail else "")
        )


class RaceError(PlanError):
    """A read (or write) of data that no completed wait orders after the last write."""


class TileWriteError(PlanError):
    """An output tile was written twice, or never."""
