"""Timelines (mkernel/interp/trace.py) as the tools that read them see them: every span becomes one
Chrome trace event at its own start and length, on its rank's process and its unit's thread; the
text view keeps whole ranks under ``max_rows``."""

from __future__ import annotations

import random

from mkernel.interp.trace import Timeline

UNITS = {0: ["comm0", "compute0"], 1: ["comm0", "compute0"], 2: ["compute0"]}  # 5 rows


def _timeline(seed: int = 0) -> Timeline:
    """Spans on every (rank, unit) of UNITS, at seeded starts and lengths (some 0 ticks long)."""
    rng = random.Random(seed)
    tl = Timeline()
    for rank, units in UNITS.items():
        for unit in units:
            for task in range(3):
                start = rng.randint(0, 500)
                tl.add(rank, unit, task + 10 * rank, start, start + rng.randint(0, 40))
    return tl


def test_chrome_events_are_the_spans():
    tl = _timeline()
    events = tl.to_chrome()["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in UNITS}
    assert sorted((p, u) for (p, _), u in threads.items()) == sorted(
        (r, u) for r, us in UNITS.items() for u in us
    )
    got = sorted(
        (e["pid"], threads[(e["pid"], e["tid"])], e["args"]["task"], e["ts"], e["dur"], e["name"])
        for e in events
        if e["ph"] == "X"
    )
    want = sorted(
        (s.rank, s.unit, s.task, s.start, max(1, s.end - s.start), f"{s.unit[:-1]} task {s.task}")
        for s in tl.spans
    )
    assert got == want


def test_ascii_max_rows_keeps_whole_ranks_that_fit():
    tl = _timeline(1)
    ranks_shown = lambda text: sorted(
        {int(line[1]) for line in text.splitlines() if line[0] == "r"}
    )
    for max_rows, shown in ((5, [0, 1, 2]), (4, [0, 1]), (3, [0]), (2, [0]), (1, [0])):
        text = tl.ascii(max_rows=max_rows, legend=False)
        assert ranks_shown(text) == shown, f"max_rows={max_rows}"
        left_out = len(UNITS) - len(shown)
        if left_out:
            assert f"({left_out} more rank" in text, f"max_rows={max_rows}"
        else:
            assert "more rank" not in text
    assert ranks_shown(tl.ascii(ranks=[2, 0], legend=False)) == [0, 2]
