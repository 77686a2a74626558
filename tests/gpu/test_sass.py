"""The built kernels use Hopper's wgmma (HGMMA in SASS); the engine's GEMM kernel spills nothing.

The fused kernels' intra-SM communicator warp runs in the producer warpgroup after setmaxnreg.dec
(24-40 registers), where ptxas spills a few words; their compute path must still be HGMMA.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mkernel.ops.common import extension

pytestmark = pytest.mark.gpu


def _functions() -> dict[str, str]:
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    sass = subprocess.run(
        [tool, "--dump-sass", extension().__file__], capture_output=True, text=True, check=True
    ).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_gemm_kernel_uses_hgmma():
    funcs = _functions()
    # The fused ops on the GEMM engine (persistent_kernel<Op<gemm::Engine<...>>>); a comm-only op
    # (all_gather, templates/no_compute.cuh) has no GEMM.
    fused = {k for k in funcs if "persistent_kernel" in k and "Engine" in k}
    gemm = {k: v for k, v in funcs.items() if "gemm_kernel" in k or k in fused}
    assert len(gemm) >= 3 * 3 + 3, f"expected the plain and fused GEMM kernels, got {list(gemm)}"
    for name, body in gemm.items():
        assert "HGMMA" in body, f"{name} has no HGMMA"
        assert "HMMA" not in body.replace("HGMMA", ""), f"{name} falls back to HMMA"


def test_engine_gemm_kernel_spills_nothing():
    funcs = _functions()
    plain = {k: v for k, v in funcs.items() if "gemm_kernel" in k}
    assert plain
    for name, body in plain.items():
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name} uses local memory (spills)"
