"""The GPU kernel records the same timeline as the interpreter (Schedule(trace=True))."""

from __future__ import annotations

import pytest
import torch

import mkernel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_gpu_timeline_has_every_task(overlap, tmp_path):
    W = 2
    world = mkernel.World.emulated(W, device="cuda")
    a = torch.randn(W, W * 512, 256, device="cuda").bfloat16()
    b = torch.randn(W, 256, 1024, device="cuda").bfloat16()
    sched = mkernel.Schedule(overlap=overlap, trace=True)
    plan = sched.plan("gemm_rs", world, m=W * 512, n=1024, k=W * 256)
    mkernel.gemm_rs(a, b, world=world, schedule=sched)
    tl = world.last_timeline
    assert tl is not None and tl.unit_of_time == "ns"
    compute = [s for s in tl.spans if s.unit.startswith("compute")]
    comm = [s for s in tl.spans if s.unit.startswith("comm")]
    assert len(compute) == W * len(plan.tiles)
    assert len(comm) == plan.comm_tasks.numel()
    assert all(0 <= s.start <= s.end for s in tl.spans)
    for r in range(W):  # every rank computed every tile once
        assert sorted(s.task for s in compute if s.rank == r) == list(range(len(plan.tiles)))
    assert tl.save_chrome(tmp_path / "gpu.json").stat().st_size > 100
