"""The GEMM engine's correctness cases (benchmarks/engine_dev/test_gemm.py) through the package's
extension: every config x every store kind (bf16 store, fp32 reduce-add by atomics and by TMA bulk
reduce, fp32 store) on shapes with remainders and padded rows, few CTAs with many tiles, random
shapes / configs / orders, bitwise invariance to tile order, launcher status codes, and the
benchmark shapes. fp32 reference, poisoned or pre-filled outputs, guard rows and columns,
elementwise bounds from the reference's rounding."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from mkernel.ops.common import extension

pytestmark = pytest.mark.gpu
ENGINE_DEV = Path(__file__).parents[2] / "benchmarks" / "engine_dev"


@pytest.mark.parametrize("quick", [True])
def test_engine_cases(monkeypatch, capsys, quick):
    monkeypatch.syspath_prepend(str(ENGINE_DEV))
    cases = importlib.import_module("test_gemm")
    monkeypatch.setattr(cases, "load_module", lambda _build_dir: extension())
    monkeypatch.setattr(sys, "argv", ["test_gemm.py", "-", *(["--quick"] if quick else [])])
    cases.Stats.passed, cases.Stats.failed = 0, []
    with pytest.raises(SystemExit) as done:
        cases.main()
    out = capsys.readouterr().out
    assert done.value.code == 0, out[-3000:]
    assert cases.Stats.passed > 100, out[-3000:]
