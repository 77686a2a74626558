"""Timing and result records shared by the benchmarks.

Method: CUDA events around each call, warm-up first, the median of >= 20 timed calls, inputs rotated
over several sets so the 60 MB L2 holds none of them between calls.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def median_ms(fn: Callable[[int], Any], sets: int, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn(i)`` where ``i`` cycles over ``sets`` input sets."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def interleaved_ms(
    fns: dict[str, Callable[[int], Any]], sets: int, rounds: int = 6, per: int = 20, warmup: int = 5
) -> dict[str, float]:
    """Median ms per call of each ``fn(i)`` (i cycles over ``sets`` input sets). The versions take
    turns in rounds of ``per`` calls, so clock and thermal drift hit all of them alike; the round's
    first version rotates, so none always runs right after the pause of a synchronize."""
    for f in fns.values():
        for i in range(warmup * sets):
            f(i % sets)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            f = fns[k]
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(per)
            ]
            for c, (a, b) in enumerate(ev):
                a.record()
                f(c % sets)
                b.record()
            torch.cuda.synchronize()
            times[k] += [a.elapsed_time(b) for a, b in ev]
    return {k: statistics.median(v) for k, v in times.items()}


def rotation(bytes_per_set: int, l2_bytes: int = 60 << 20) -> int:
    """How many input sets make the rotation several times larger than the L2."""
    return max(2, min(8, -(-4 * l2_bytes // max(1, bytes_per_set))))


def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save(name: str, records: Sequence[dict], out_dir: str | Path | None = None) -> Path:
    """Writes the JSON record under ``$MKERNEL_BENCH_DIR`` (default benchmarks/results)."""
    import os

    env = environment()
    out_dir = out_dir or os.environ.get("MKERNEL_BENCH_DIR", "benchmarks/results")
    path = Path(out_dir) / f"{name}_{env['date'][:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **env, "records": list(records)}, indent=1))
    return path


def span_summary(spans: Sequence[Any], t0: int) -> dict[str, float]:
    """A traced call's tasks of one kind (Timeline spans, ns): how many, the first start and the
    last end (us after ``t0``), and busy: the sum of their spans (us)."""
    return {
        "n": len(spans),
        "first_us": (min(x.start for x in spans) - t0) / 1e3,
        "last_us": (max(x.end for x in spans) - t0) / 1e3,
        "busy_us": sum(x.end - x.start for x in spans) / 1e3,
    }


def table(rows: Sequence[dict], cols: Sequence[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
    body = [
        "  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths, strict=True)) for r in rows
    ]
    return "\n".join([line, *body])


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
