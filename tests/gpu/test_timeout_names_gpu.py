"""A timeout names the same signal on the CPU interpreter and on the GPU: a silent rank in the
same plan makes both backends raise CommTimeout naming the same pad (by the op's SPEC), the silent
peer, and the same role."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.helpers import assert_pads_zero, gemm_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EXPECTED = {"gemm_rs": "partial", "gemm_ar": "tile_flag", "ag_gemm": "chunk_ready"}


@pytest.mark.parametrize("op", sorted(EXPECTED))
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_timeout_names_agree(op, overlap):
    W = 3
    a, b = gemm_inputs(W, 3 * 64, 64, 16, 1)
    seen = {}
    for device in ("cpu", "cuda"):
        world = mkernel.World.emulated(W, device=device, timeout_s=0.2)
        sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
        with pytest.raises(mkernel.CommTimeout) as e:
            getattr(mkernel, op)(a.to(device), b.to(device), world, sched)
            world.check()  # GPU calls are asynchronous
        v = e.value
        assert v.peer == 1, str(v)  # the waiter may be rank 1 itself (its own flag never rises)
        seen[device] = (v.signal.split("[")[0], v.role.rstrip("0123456789"))
        assert_pads_zero(world)
    assert seen["cpu"] == seen["cuda"] == (EXPECTED[op], seen["cpu"][1]), seen
