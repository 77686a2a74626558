"""Figures in the docs agree with each other and with the committed results (issue 33, point 6).

docs/benchmarks.md's "Headline figures" table is the one source: each row names a figure, its value
and the result file it comes from, and the value is recomputed here from that file. Elsewhere (the
README, docs/*.md, the package docstring, the tutorials) a figure is written ``value (figure
name)``: the name must be in the table and the value the table's. A ratio claim (``0.95x``) in the
README, the package docstring or a tutorial must be such a reference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
RESULTS = REPO / "benchmarks" / "results"
TABLE_ROW = re.compile(r"^\| ([a-z0-9_]+) \| ([^|]+?) \| [^|]+ \| `([^`]+)` \|$", re.M)
_NUM = r"\d+(?:\.\d+)?x?(?:-\d+(?:\.\d+)?x)?"  # 0.92x, 0.91-1.09x
REFERENCE = re.compile(rf"({_NUM}(?: / {_NUM})?|\d+ of \d+)\s+\(figure\s+([a-z0-9_]+)\)")
RATIO = re.compile(r"\b\d+\.\d+x\b")


def table() -> dict[str, tuple[str, str]]:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    section = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = {name: (value, source) for name, value, source in TABLE_ROW.findall(section)}
    assert len(rows) >= 8, "the headline table lost its rows"
    return rows


def docs() -> dict[str, str]:
    files = [REPO / "README.md", REPO / "mkernel" / "__init__.py"]
    files += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "tutorials").glob("*.py"))
    return {str(f.relative_to(REPO)): f.read_text() for f in files}


def _records(name: str) -> list[dict]:
    doc = json.loads((RESULTS / name).read_text())
    return doc["records"] if isinstance(doc, dict) else doc


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x"


def _pair(rows: list[dict], pick: Callable[[dict], bool], key: str) -> str:
    """full / causal: the one row of each that ``pick`` selects."""
    by = {r["causal"]: r[key] for r in rows if pick(r)}
    return f"{_x(by[False])} / {_x(by[True])}"


def _mutations(name: str) -> str:
    doc = json.loads((REPO / name).read_text())
    return f"{doc['killed']} of {doc['mutations']}"


# figure -> its value, computed from the result file the table names
COMPUTE: dict[str, Callable[[str], str]] = {
    "attention_fwd_vs_cudnn": lambda f: _span([r["ratio_vs_cudnn"] for r in _records(f)]),
    "attention_bwd_vs_cudnn": lambda f: _pair(
        _records(f), lambda r: r["S"] == 8192, "ratio_vs_cudnn"
    ),
    "ring_fwd_vs_engine": lambda f: _pair(
        _records(f), lambda r: r["version"] == "ring_w2_intra_sm", "vs_engine"
    ),
    "ring_bwd_vs_engine": lambda f: _pair(
        _records(f), lambda r: r["version"] == "ring_w2_intra_sm", "vs_engine"
    ),
    "grouped_vs_torch": lambda f: _span(
        [r["ratio"] for r in _records(f) if r["routing"] != "gather"]
    ),
    "gemm_engine_vs_cublas": lambda f: _span([r["ratio"] for r in _records(f)]),
    "fused_w1_vs_engine": lambda f: _span(
        [r[f"{op}_vs_engine"] for r in _records(f) for op in ("gemm_rs", "ag_gemm", "gemm_ar")]
    ),
    "tp_vs_unfused": lambda f: _span([r["unfused"] / r["ours"] for r in _records(f)]),
    "mutations_killed": _mutations,
}


def test_every_figure_is_computed_here() -> None:
    assert set(table()) == set(COMPUTE)


@pytest.mark.parametrize("name", sorted(COMPUTE))
def test_figure_comes_from_its_committed_result(name: str) -> None:
    value, source = table()[name]
    path = REPO / source if "/" in source else RESULTS / source
    assert path.is_file(), f"{name}: {source} is not a committed result"
    assert COMPUTE[name](source) == value, (
        f"{name}: docs/benchmarks.md says {value}, {source} gives {COMPUTE[name](source)}"
    )


def disagreements(texts: dict[str, str], rows: dict[str, tuple[str, str]]) -> list[str]:
    """Every ``value (figure name)`` whose name is not in the table or whose value is not its."""
    out = []
    for where, text in texts.items():
        for value, name in REFERENCE.findall(" ".join(text.split())):
            if name not in rows:
                out.append(f"{where}: figure {name} is not in docs/benchmarks.md's table")
            elif value != rows[name][0]:
                out.append(
                    f"{where}: figure {name} stated as {value}, the table has {rows[name][0]}"
                )
    return out


def test_references_agree_with_the_table() -> None:
    texts = docs()
    assert disagreements(texts, table()) == []
    named = {
        name for text in texts.values() for _, name in REFERENCE.findall(" ".join(text.split()))
    }
    assert {"ring_bwd_vs_engine", "attention_bwd_vs_cudnn", "grouped_vs_torch"} <= named


def test_ratio_claims_in_readme_docstring_and_tutorials_are_references() -> None:
    for where, text in docs().items():
        if where.startswith("docs/"):
            continue  # docs/*.md keep dated history with its own file citations
        flat = " ".join(text.split())
        cited = {m.start(1) + len(m.group(1)) for m in REFERENCE.finditer(flat)}
        for m in RATIO.finditer(flat):
            assert any(0 <= end - m.end() <= 8 for end in cited), (
                f"{where}: {flat[max(0, m.start() - 60) : m.end() + 20]!r} states a ratio with "
                "no (figure name) from docs/benchmarks.md"
            )


def test_the_check_catches_a_disagreement() -> None:
    """A doc stating another value, or an unknown figure, is reported (the test above can fail)."""
    rows = table()
    value = rows["ring_bwd_vs_engine"][0]
    good = {"x.md": f"runs at {value} (figure ring_bwd_vs_engine) of the engine"}
    assert disagreements(good, rows) == []
    bad = {
        "x.md": "runs at 0.88x / 0.76x (figure ring_bwd_vs_engine)",
        "y.md": "1.2x (figure nope)",
    }
    assert len(disagreements(bad, rows)) == 2
