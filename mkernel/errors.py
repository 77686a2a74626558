"""Exceptions raised by mkernel: every one names where it happened (rank, task, peer, signal)."""

from __future__ import annotations


class CommTimeout(RuntimeError):
    """A wait passed its deadline (on the GPU or in the CPU interpreter).

    Attributes name the waiter: ``rank`` (who waited), ``peer`` (whose signal it waited for, or -1
    when unknown), ``signal`` (the signal's name and index), ``task`` (the waiter's task id, -1
    outside a task), ``role`` ("compute", "comm", "barrier") and ``unit`` (the role's unit, -1 when
    unknown).
    """

    def __init__(
        self,
        rank: int,
        peer: int,
        signal: str,
        task: int,
        role: str = "",
        detail: str = "",
        *,
        unit: int = -1,
    ) -> None:
        self.rank, self.peer, self.signal, self.task, self.role = rank, peer, signal, task, role
        self.unit = unit
        msg = (
            f"rank {rank} timed out waiting for signal {signal} from peer {peer} "
            f"(role {_unit_name(role, unit) or '?'}, task {task})"
        )
        super().__init__(msg + (f": {detail}" if detail else ""))


class DeviceInputError(ValueError):
    """A kernel found an input value it cannot use (checks on the host run before a launch; this
    one is found on the device, e.g. a routing id written into a buffer a CUDA graph replays). The
    kernel ignored the value (wrote nothing for it) and completed; raised like a timeout: by the
    next call on the world, ``world.check()`` or the watchdog.

    Attributes: ``op``, ``rank`` (whose input), ``task`` and ``index`` (where in it: for MoE
    routing ids, the token and the slot), ``value`` (what was found).
    """

    def __init__(self, op: str, rank: int, task: int, index: int, value: int, detail: str) -> None:
        self.op, self.rank, self.task, self.index, self.value = op, rank, task, index, value
        super().__init__(f"{op}: {detail} (found on the device; ignored, nothing written for it)")


class DeadlockError(CommTimeout):
    """The interpreter found no runnable agent: every unfinished agent waits on a signal.

    On a GPU the same plan would run into the deadline, hence a subclass of CommTimeout. ``waiters``
    lists every blocked (rank, role, task, peer, signal), optionally followed by the role's unit.
    """

    def __init__(self, waiters: list[tuple]) -> None:
        self.waiters = waiters
        rank, role, task, peer, signal, *unit = waiters[0]
        listing = "; ".join(
            f"rank {w[0]} {_unit_name(w[1], w[5] if len(w) > 5 else -1)} task {w[2]} waits {w[4]} "
            f"from peer {w[3]}"
            for w in waiters
        )
        super().__init__(
            rank,
            peer,
            signal,
            task,
            role,
            f"deadlock, no agent can run: {listing}",
            unit=unit[0] if unit else -1,
        )


class PlanError(RuntimeError):
    """The interpreter caught a plan or program bug; names rank, role, unit, task and the data or
    signal, e.g. ``race: rank 2 comm0 task 1, read of ...``. ``other`` is the (rank, role, unit,
    task) of the other party (the earlier access of a race), or None."""

    def __init__(
        self,
        kind: str,
        rank: int,
        task: int,
        what: str,
        detail: str = "",
        *,
        role: str = "",
        unit: int = -1,
        other: tuple[int, str, int, int] | None = None,
    ) -> None:
        self.kind, self.rank, self.task, self.what = kind, rank, task, what
        self.role, self.unit, self.other = role, unit, other
        who = f"rank {rank}" + (f" {_unit_name(role, unit)}" if role else "")
        who += f" task {task}" if task >= 0 else ""  # -1: outside any task
        super().__init__(f"{kind}: {who}, {what}" + (f": {detail}" if detail else ""))


class RaceError(PlanError):
    """A read (or write) of data that no completed wait orders after the last write."""


class TileWriteError(PlanError):
    """An output tile was written twice, or never."""


def _unit_name(role: str, unit: int) -> str:
    """``comm0`` for role "comm" unit 0; the bare role when the unit is unknown (-1)."""
    return f"{role}{unit}" if role and unit >= 0 else role
