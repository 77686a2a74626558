"""compute-sanitizer memcheck, racecheck and synccheck over every fused op in small emulated worlds
(tests/gpu/sanitize_ops.py: W 2 and 3, both overlaps) and over the attention engines, forward and
backward (tests/gpu/sanitize_attention.py): each must report 0 errors. A warp that reaches bar.sync
unconverged passes every other test and hangs one day; synccheck finds it."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from tests.helpers import ROOT, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer"),
]


SCRIPTS = [
    ("sanitize_ops.py", 24),
    ("sanitize_attention.py", 8),
    ("sanitize_taskgraph.py", 4),
]  # (script, cases it prints)


@pytest.mark.parametrize(("script", "runs"), SCRIPTS)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_sanitizer_reports_no_errors(tool, script, runs):
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", "--print-limit", "5"]
    rc, out = run_script([*cmd, sys.executable, str(ROOT / "tests/gpu" / script)], timeout=600)
    assert rc == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out or "0 hazards displayed (0 errors" in out, out[-2000:]
    assert out.count("ok ") >= runs, out[-2000:]  # every case of the script ran
