"""The README's usage example runs as written on the CPU (CI runs it, so the docs stay true)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def _usage_blocks() -> list[str]:
    """The ```python blocks of the README's "Using it" section, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)


def test_usage_example_runs_on_cpu() -> None:
    blocks = _usage_blocks()
    cpu = [b for b in blocks if "cuda" not in b]
    assert cpu and 'device="cpu"' in cpu[0], "the README's first usage example must run on the CPU"
    # NOTE: a fresh interpreter, as a user pasting the block would run it: it also sees the
    # warnings torch prints on import (e.g. "Failed to initialize NumPy" without numpy installed).
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", cpu[0]],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=120,  # it takes seconds; GPU-sized shapes on the interpreter take many minutes
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "legend:" in proc.stdout and "r0 " in proc.stdout  # the timeline it prints
    assert "NumPy" not in proc.stderr, proc.stderr


def test_gpu_usage_example_is_valid_python() -> None:
    for block in _usage_blocks():
        compile(block, "README.md", "exec")  # GPU blocks run only where CUDA is: check the syntax


def test_compile_example_runs_on_cpu() -> None:
    """The README's torch.compile block (issue 37) runs as written in a fresh interpreter."""
    block = next(b for b in _usage_blocks() if "torch.compile" in b)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", block],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
