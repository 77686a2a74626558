"""The CPU tutorials run as written (CI runs them, so the docs stay true)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).parents[1] / "tutorials"


@pytest.mark.parametrize("path", sorted(TUTORIALS.glob("01_*.py")), ids=lambda p: p.name)
def test_tutorial_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "caught: race" in out
    assert "intra_sm: relative error" in out and "inter_sm: relative error" in out


def test_demo_passes(capsys):
    from mkernel.__main__ import main

    assert main(["demo", "--device", "cpu"]) == 0
    assert "demo passed" in capsys.readouterr().out
