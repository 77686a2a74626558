"""A call that failed leaves no result that looks valid (issue 33.2), on the CPU interpreter: a
silent rank makes the call raise CommTimeout naming rank, peer and signal, and the caller's
``out`` (finite random values before the call) then holds NaN everywhere, not partial sums; the
world serves the next call correctly. The GPU side: tests/gpu/test_failed_call_gpu.py."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, gemm_inputs

OPS = {  # op: (rows of a per rank, per-rank shape of the result) at W = 3, N = 64, K = 16
    "gemm_rs": (3 * 64, (64, 64)),
    "ag_gemm": (64, (3 * 64, 64)),
    "gemm_ar": (3 * 64, (3 * 64, 64)),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_timed_out_call_leaves_nan_in_out(op, overlap):
    W = 3
    rows, shape = OPS[op]
    a, b = gemm_inputs(W, rows, 64, 16, 5)
    world = mkernel.World.emulated(W, timeout_s=0.05)
    out = torch.randn(W, *shape).bfloat16()  # finite: what a partial write would leave behind
    silent = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    with pytest.raises(mkernel.CommTimeout) as e:
        getattr(mkernel, op)(a, b, world=world, schedule=silent, out=out)
    assert e.value.peer == 1 and e.value.signal and f"peer {e.value.peer}" in str(e.value)
    assert torch.isnan(out.float()).all(), f"{op}: a failed call left finite values in out"
    # the world is usable again: the next call is correct
    good = getattr(mkernel, op)(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap))
    assert_close_bf16(good, getattr(mkernel.reference, op)(a, b, world=world), op)


def test_late_rank_within_deadline_is_not_poisoned():
    """Only a failure poisons: a rank that is late but within the deadline gives the result."""
    W = 3
    a, b = gemm_inputs(W, 3 * 64, 64, 16, 6)
    world = mkernel.World.emulated(W)
    late = mkernel.Schedule(faults=mkernel.Faults(delay_rank=2, delay_us=300))
    out = mkernel.gemm_ar(a, b, world=world, schedule=late)
    assert_close_bf16(out, mkernel.reference.gemm_ar(a, b, world=world), "late rank")
