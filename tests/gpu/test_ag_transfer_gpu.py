"""ag_gemm's two push mechanisms (Schedule.transfer): 16-byte stores and TMA bulk copies land the
same gathered rows; both are checked against the fp32 reference with poisoned outputs."""

from __future__ import annotations

import random

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("transfer", ["stores", "tma"])
@pytest.mark.parametrize("seed", range(3))
def test_inter_sm_transfers(W, transfer, seed):
    rng = random.Random(seed * 7 + W)
    ms, n, k = rng.randint(1, 300), 8 * rng.randint(1, 64), 8 * rng.randint(1, 300)
    world = mkernel.World.emulated(W, device="cuda")
    a = torch.randn(W, ms, k, device="cuda").bfloat16()
    b = torch.randn(W, k, n, device="cuda").bfloat16()
    out = poisoned((W, W * ms, n), "cuda")
    chunk_rows = rng.choice([None, 8])
    sched = mkernel.Schedule(overlap="inter_sm", transfer=transfer, chunk_rows=chunk_rows)
    mkernel.ag_gemm(a, b, world, sched, out=out)
    assert_close_bf16(out, mkernel.reference.ag_gemm(a, b, world), f"{transfer} W={W}")
    for key, pad in world.signal_pads().items():
        assert int(pad.abs().sum()) == 0, f"signal pad {key} not reset"


def test_tma_transfer_needs_inter_sm():
    with pytest.raises(ValueError, match="transfer='tma' needs overlap='inter_sm'"):
        mkernel.Schedule(overlap="intra_sm", transfer="tma")
