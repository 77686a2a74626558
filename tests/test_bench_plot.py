"""mkernel.bench.plot: the committed results draw (matplotlib an optional extra), every plotted
benchmark takes ``--plot`` on any machine, and a missing matplotlib says what to install."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from mkernel import bench
from mkernel.bench import plot

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# The newest committed result of each plotted benchmark (the PNGs of docs/plots.md), and older
# formats: gemm_engine's dev-harness records (no "benchmark" field), attention without
# default_mk, attention_bwd with other variants, a probe named moe_local_wide.
COMMITTED = [
    "gemm_2026-12-01_final.json",
    "attention_2026-12-02_default_by_length.json",
    "attention_bwd_2026-12-02_session17.json",
    "grouped_2026-12-01_final.json",
    "ring_local_2026-12-02_final.json",
    "ring_local_bwd_2026-12-02_tail_groups.json",
    "moe_local_2026-12-02_one_host_read.json",
]
OLDER = [
    "gemm_engine_2026-11-29_final.json",
    "attention_2026-12-01.json",
    "attention_bwd_2026-12-01_split_variants.json",
    "moe_local_2026-12-01_wide_probe.json",
]
PLOTTED = [
    "gemm",
    "attention",
    "attention_bwd",
    "grouped",
    "ring",
    "ring_local",
    "ring_local_bwd",
    "moe",
    "moe_local",
]


def _ring_rows() -> list[dict]:  # bench.ring's rows (no committed two-GPU run yet)
    rows = []
    for pass_ in ("fwd", "bwd"):
        for s, layout in ((4096, "zigzag"), (8192, "contiguous")):
            row = {"pass": pass_, "S_local": s, "layout": layout, "W": 2, "B": 1, "H": 32}
            row |= {"ours_ms": 2.0, "unfused_cudnn_ms": 3.0, "compute_ms": 1.5, "traffic_ms": 0.5}
            rows.append(row | {"ideal_ms": 1.5, "ours_tflops": 400.0})
    return rows


def _moe_rows() -> list[dict]:  # bench.moe's rows
    return [
        {"op": op, "routing": r, "W": 2, "T": 4096, "ours_ms": 3.0, "unfused_ms": 4.0}
        | {"gemm_ms": 2.0, "a2a_ms": 1.0, "ideal_ms": 2.0}
        for r in ("uniform", "zipf")
        for op in ("dispatch", "combine")
    ]


def _doc(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 5000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", COMMITTED + OLDER)
def test_each_committed_result_draws(name, tmp_path):
    pytest.importorskip("matplotlib")
    out = plot.draw_file(RESULTS / name, tmp_path / "out.png")
    assert _is_png(out)


@pytest.mark.parametrize("name, rows", [("ring_w2", _ring_rows()), ("moe_w2", _moe_rows())])
def test_distributed_rows_draw(name, rows, tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"benchmark": name, "device": "NVIDIA H100", "date": "2026-12-06", "records": rows}
    assert _is_png(plot.draw(doc, tmp_path / "out.png"))


@pytest.mark.parametrize("name", COMMITTED)
def test_charts_hold_every_shape(name):
    chart = plot.chart_of(_doc(name), name)
    assert chart.reference in chart.baselines and chart.ours
    for values in (*chart.ours.values(), *chart.baselines.values()):
        assert len(values) == len(chart.labels)
    for name_ in chart.ours:
        assert any(v is not None for v in chart.ratios(name_))


def test_ratios_are_the_benchmarks_own():
    """The ratio panel shows what the tables print: gemm's ratio, attention's ratio_vs_cudnn
    (cuDNN in its faster layout against the default schedule), ring_local's vs_cudnn."""
    doc = _doc("gemm_2026-12-01_final.json")
    got = plot.chart_of(doc).ratios("engine")
    assert got == pytest.approx([r["ratio"] for r in doc["records"]], rel=1e-9)
    doc = _doc("attention_2026-12-02_default_by_length.json")
    got = plot.chart_of(doc).ratios("ours (default schedule)")
    assert got == pytest.approx([r["ratio_vs_cudnn"] for r in doc["records"]], rel=1e-9)
    doc = _doc("ring_local_2026-12-02_final.json")
    chart = plot.chart_of(doc)
    want = {(f"{r['world']} {'causal' if r['causal'] else 'full'}", r["version"]): r["vs_cudnn"]
            for r in doc["records"]}  # fmt: skip
    for version in chart.ours:
        for label, ratio in zip(chart.labels, chart.ratios(version), strict=True):
            assert ratio == pytest.approx(want[(label, version)]) if ratio else True
    chart = plot.chart_of({"benchmark": "ring_w2", "records": _ring_rows()})
    assert chart.metric == "ms" and chart.ratios("ours") == pytest.approx([1.5] * 4)


def test_unknown_benchmark_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="no picture for benchmark 'p2p_w2'"):
        plot.chart_of({"benchmark": "p2p_w2", "records": [{"x": 1}]})
    path = tmp_path / "p2p_w2_2026-12-01.json"
    path.write_text(json.dumps({"benchmark": "p2p_w2", "records": [{"x": 1}]}))
    assert plot.main([str(path), "-o", str(tmp_path / "x.png")]) == 1
    assert "no picture for benchmark" in capsys.readouterr().err


def _run_main(module: str, argv: list[str]) -> SystemExit | None:
    """``python -m <module> <argv>`` in this process (fast: torch is imported already)."""
    old = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as exc:
        return exc
    finally:
        sys.argv = old
    return None


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: the module was imported before
@pytest.mark.parametrize("name", PLOTTED)
def test_help_lists_plot(name, capsys):
    exc = _run_main(f"mkernel.bench.{name}", ["--help"])
    assert exc is not None and exc.code == 0
    out = capsys.readouterr().out
    assert "--plot PATH" in out and "pip install mkernel[plot]" in out


def test_plot_is_no_benchmark():
    assert "plot" not in bench.names() and "gemm" in bench.names()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", ["gemm", "ring"])
def test_missing_matplotlib_stops_a_benchmark_first(name, monkeypatch, tmp_path):
    """Before the GPU (or torchrun) check, before anything is timed: one line, status 1."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    exc = _run_main(f"mkernel.bench.{name}", ["--plot", str(tmp_path / "x.png")])
    assert exc is not None and isinstance(exc.code, str)
    assert "pip install mkernel[plot]" in exc.code and "GPU" not in exc.code


def test_missing_matplotlib_plot_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    result, out = RESULTS / COMMITTED[0], tmp_path / "x.png"
    with pytest.raises(plot.MissingMatplotlib, match=r"pip install mkernel\[plot\]"):
        plot.draw_file(result, out)
    assert plot.main([str(result), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "pip install mkernel[plot]" in err and "Traceback" not in err
    assert not out.exists()
