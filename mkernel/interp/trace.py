"""Timelines of tasks per rank and unit, exported as Chrome / Perfetto trace JSON or as text."""

from __future__ import annotations

import json
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

    def ascii(self, width: int = 72) -> str:
        """One line per (rank, unit); each task drawn with the last digit of its id."""
        if not self.spans:
            return "(empty timeline)"
        t0 = min(s.start for s in self.spans)
        t1 = max(s.end for s in self.spans)
        scale = max(1.0, (t1 - t0) / width)
        lines = []
        for rank, unit in sorted({(s.rank, s.unit) for s in self.spans}):
            row = [" "] * (width + 1)
            for s in self.spans:
                if (s.rank, s.unit) == (rank, unit):
                    a, b = int((s.start - t0) / scale), int((s.end - t0) / scale)
                    for x in range(a, max(a + 1, b)):
                        row[min(x, width)] = str(s.task % 10)
            lines.append(f"r{rank} {unit:>9} |{''.join(row)}|")
        return "\n".join(lines)
