"""Timelines of tasks per rank and unit, exported as Chrome / Perfetto trace JSON or as text."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Span:
    rank: int
    unit: str  # e.g. "compute3", "comm0"
    task: int
    start: int
    end: int


@dataclass
class Timeline:
    """Spans in ticks (interpreter scheduling steps, or nanoseconds for a GPU-recorded timeline)."""

    spans: list[Span] = field(default_factory=list)
    unit_of_time: str = "step"

    def add(self, rank: int, unit: str, task: int, start: int, end: int) -> None:
        self.spans.append(Span(rank, unit, task, start, end))

    def to_chrome(self) -> dict:
        """Chrome trace-event JSON (open in chrome://tracing or ui.perfetto.dev): one process per
        rank, one thread per unit; ``ts`` and ``dur`` are in ticks read as microseconds."""
        units = sorted({(s.rank, s.unit) for s in self.spans})
        tid = {u: i for i, u in enumerate(units)}
        events: list[dict] = []
        for rank in sorted({s.rank for s in self.spans}):
            events.append(
                {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
            )
        for (rank, unit), i in tid.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": unit}}
            )
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": f"{s.unit.rstrip('0123456789')} task {s.task}",
                    "pid": s.rank,
                    "tid": tid[(s.rank, s.unit)],
                    "ts": s.start,
                    "dur": max(1, s.end - s.start),
                    "args": {"task": s.task, "unit_of_time": self.unit_of_time},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def save_chrome(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    def ascii(
        self,
        width: int = 72,
        *,
        ranks: Iterable[int] | None = None,
        max_rows: int | None = None,
        legend: bool = True,
    ) -> str:
        """Text view: one row per (rank, unit), time running left to right in ``width`` columns.

        A cell shows the last digit of the id of the task the unit runs during that column's ticks
        (compute: the tile index; comm: the comm task id), blank when idle; where two tasks share
        a column, the one recorded last shows. The time axis is the whole timeline's, whichever
        ranks are shown. ``ranks`` keeps those ranks only; ``max_rows`` keeps the first ranks whose
        rows all fit in that many rows (always at least one whole rank: a rank is never cut) and
        says how many ranks it left out. ``legend`` heads the rows with what the rows, columns and
        digits mean. ``width`` and ``max_rows`` are ints >= 1, ``ranks`` ints of ranks that have
        tasks in the timeline (a rank with none would print nothing); each is checked
        (TypeError / ValueError naming it).
        """
        _check_count("width", width)
        if max_rows is not None:
            _check_count("max_rows", max_rows, " or None")
        if not isinstance(legend, bool):
            raise TypeError(f"legend must be a bool, got {legend!r}")
        wanted = None if ranks is None else self._check_ranks(ranks)
        if not self.spans:
            return "(empty timeline)"
        t0 = min(s.start for s in self.spans)
        t1 = max(s.end for s in self.spans)
        scale = max(1.0, (t1 - t0) / width)
        rows = sorted({(s.rank, s.unit) for s in self.spans if wanted is None or s.rank in wanted})
        left_out: list[int] = []
        if max_rows is not None:
            kept: list[int] = []  # whole ranks, in order, while their rows fit
            for rank in sorted({r for r, _ in rows}):
                if left_out or (kept and sum(r in kept or r == rank for r, _ in rows) > max_rows):
                    left_out.append(rank)
                else:
                    kept.append(rank)
            rows = [(r, u) for r, u in rows if r in kept]
        lines = []
        if legend:
            tick = self.unit_of_time if self.unit_of_time == "ns" else self.unit_of_time + "s"
            lines += [
                "legend: row 'r2  compute1' = rank 2's compute unit 1 (commN: its comm unit N)",
                f"        column = {scale:.3g} {tick}, time left to right ({tick} {t0}..{t1})",
                "        digit = last digit of the running task's id "
                "(compute: tile index; comm: task id)",
                "        blank = idle",
            ]
        for rank, unit in rows:
            row = [" "] * (width + 1)
            for s in self.spans:
                if (s.rank, s.unit) == (rank, unit):
                    a, b = int((s.start - t0) / scale), int((s.end - t0) / scale)
                    for x in range(a, max(a + 1, b)):
                        row[min(x, width)] = str(s.task % 10)
            lines.append(f"r{rank} {unit:>9} |{''.join(row)}|")
        if left_out:
            lines.append(
                f"({len(left_out)} more rank{'s' if len(left_out) > 1 else ''} not shown: "
                f"max_rows={max_rows}; ranks= picks which)"
            )
        return "\n".join(lines)

    def _check_ranks(self, ranks: Iterable[int]) -> set[int]:
        """``ranks`` as a set: ints, each a rank with tasks in this timeline."""
        form = "ranks must be an iterable of ints or None"
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(f"{form}, got {type(ranks).__name__} {ranks!r}")
        wanted = list(ranks)
        for r in wanted:
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"{form}, got {wanted!r}")
        present = sorted({s.rank for s in self.spans})
        for r in wanted:
            if present and r not in present:  # (an empty timeline says so instead)
                have = f"ranks {present[0]}..{present[-1]}"
                if present != list(range(present[0], present[-1] + 1)):
                    have = f"ranks {present}"
                raise ValueError(f"ranks: rank {r} has no tasks in this timeline ({have})")
        return set(wanted)


def _check_count(name: str, v: object, none: str = "") -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int >= 1{none}, got {v!r}")
    if v < 1:
        raise ValueError(f"{name} must be an int >= 1{none}, got {v}")
