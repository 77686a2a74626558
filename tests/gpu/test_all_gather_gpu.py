"""all_gather (the op tutorial 03 writes) on the GPU in emulated worlds: exact results into a
poisoned output, W in 1..8, both overlaps, chunkings with a short last chunk, a 200-call loop,
CUDA-graph replay, pads back to zero, a silent rank times out naming the signal as the CPU does."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.helpers import assert_pads_zero, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _x(W, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(W, rows, cols, generator=g).bfloat16().cuda()


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
@pytest.mark.parametrize("rows, cols, chunk_rows", [(100, 24, 32), (1, 8, None), (300, 520, 7)])
def test_all_gather_exact(W, overlap, rows, cols, chunk_rows):
    world = mkernel.World.emulated(W, device="cuda")
    x = _x(W, rows, cols, W * rows)
    out = poisoned((W, W * rows, cols), "cuda")
    sched = mkernel.Schedule(overlap=overlap, chunk_rows=chunk_rows)
    got = mkernel.all_gather(x, world, sched, out=out)
    want = torch.cat(list(x.unbind(0)))  # written out here, not the op's reference
    for r in range(W):
        assert torch.equal(got[r], want), f"rank {r}"
    assert_pads_zero(world)


def test_all_gather_loop_and_graph():
    W = 4
    world = mkernel.World.emulated(W, device="cuda")
    xs = [_x(W, 64, 256, s) for s in range(3)]
    for i in range(200):
        x = xs[i % 3]
        assert torch.equal(mkernel.all_gather(x, world)[i % W], torch.cat(list(x.unbind(0))))
    world.sync_checks = False
    static = xs[0].clone()
    out = torch.empty(W, W * 64, 256, dtype=torch.bfloat16, device="cuda")
    mkernel.all_gather(static, world, out=out)  # warm: build, plan, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mkernel.all_gather(static, world, out=out)
    for i in range(20):
        static.copy_(xs[i % 3])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], torch.cat(list(xs[i % 3].unbind(0))))
    assert_pads_zero(world)


def test_all_gather_silent_rank_times_out_naming_the_signal():
    W = 3
    x = _x(W, 64, 64, 0)
    names = {}
    for device in ("cpu", "cuda"):
        world = mkernel.World.emulated(W, device=device, timeout_s=0.2)
        sched = mkernel.Schedule(faults=mkernel.Faults(silent_rank=1))
        with pytest.raises(mkernel.CommTimeout) as e:
            mkernel.all_gather(x.to(device), world, sched)
            world.check()  # GPU calls are asynchronous
        assert e.value.peer == 1  # (the silent rank may be the waiter: its own copy never lands)
        names[device] = e.value.signal.split("[")[0], "src=1" in e.value.signal
        out = mkernel.all_gather(x.to(device), world)  # the world is clean again
        assert torch.equal(out[0].cpu(), torch.cat(list(x.cpu().unbind(0))))
    assert names["cpu"] == names["cuda"] == ("landed", True)
