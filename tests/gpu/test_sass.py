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


def _gathers(name: str) -> bool:
    """grouped_gemm_kernel<Cfg, kGather = true> (its bool template argument mangles as Lb1E)."""
    return "grouped_gemm_kernel" in name and "Lb1EE" in name


def test_engine_gemm_kernel_spills_nothing():
    funcs = _functions()
    plain = {k: v for k, v in funcs.items() if "gemm_kernel" in k and not _gathers(k)}
    assert len(plain) >= 6, list(plain)  # the plain GEMM's and the grouped GEMM's configs
    for name, body in plain.items():
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name} uses local memory (spills)"


def test_gathering_kernels_spill_only_a_few_words():
    # NOTE: the gather warps run after setmaxnreg.dec (24-40 registers): ptxas keeps a few
    # per-task words (the task count, the tile's row pointers) in local memory, read once per task
    # or stage, never per copy. The consumers' path must stay free of it: checked by count.
    funcs = {k: v for k, v in _functions().items() if _gathers(k)}
    assert len(funcs) == 3, list(funcs)
    for name, body in funcs.items():
        assert "HGMMA" in body, name
        assert len(re.findall(r"\b(?:LDL|STL)\b", body)) <= 32, f"{name} spills more than before"
