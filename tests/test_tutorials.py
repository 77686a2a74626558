"""The CPU tutorials run as written (CI runs them, so the docs stay true)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).parents[1] / "tutorials"


EXPECT = {
    "01_send_signal_wait.py": [
        "caught: race",
        "intra_sm: relative error",
        "inter_sm: relative error",
    ],
    "02_schedules_and_races.py": [
        "correct in 50 interleavings",
        "race caught",
        "missing signal",
        "reversed  relative error",
        "rank 0 computes tiles [7, 6, 5, 4, 3, 2, 1, 0]",
        "legend: row",
    ],
    "03_author_a_fused_op.py": [
        "struct Layout {",
        "intra_sm: exact on every rank",
        "inter_sm: exact on every rank",
        "property: exact, pads reset",
        "refused before running: all_gather: landed[src=0, chunk=0] on rank 0 is raised but nobody",
        "caught while running: RaceError",
    ],
    "04_ring_attention.py": [
        "compute tasks per rank [36, 36, 36, 36]",
        "zigzag: out within",
        "caught while running: RaceError on the K/V slot",
        "backward: d{q,k,v} match the reference (autograd, fp32); pads 0",
        "grad sends per rank (steps) [[0], [0, 1], [0, 1, 2], [1, 2, 3]]",
    ],
    "05_moe.py": [
        "rows per rank [11, 15, 7, 14]",
        "out matches the dense MoE",
        "the layout phase on rank 0 made",
        "same plans, pads back to zero",
    ],
    "06_nodes.py": [
        "nodes of ranks [0, 0, 1, 1]",
        "gemm_rs: relative error",
        "ag_gemm: relative error",
        "gemm_ar: relative error",
        "hierarchical over 2 nodes x 2 ranks (rdma puts across nodes)",
        "puts per rank and call [2, 2, 2, 2]",
        "caught while running: RaceError, rank",
        "not ordered after the write by rank",
    ],
    "07_taskgraph.py": [
        "MLP block: relative error",
        "3 of the 6 silu_mul tiles: those of its rows",
        "caught while running: RaceError",
        "fused nodes: ['norm_linear', 'silu_linear']",
        "decode step, one device: relative error",
        "decode step, TP over 2 emulated ranks: relative error",
        "attention_partial",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_tutorial_runs(name, capsys):
    runpy.run_path(str(TUTORIALS / name), run_name="__main__")
    out = capsys.readouterr().out
    for text in EXPECT[name]:
        assert text in out, f"{name}: {text!r} not printed"


def test_every_tutorial_is_run():
    assert sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py")) == sorted(EXPECT)


def test_demo_passes(capsys):
    from mkernel.__main__ import main

    assert main(["demo", "--device", "cpu"]) == 0
    assert "demo passed" in capsys.readouterr().out
