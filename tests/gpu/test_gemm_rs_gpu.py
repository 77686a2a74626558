"""gemm_rs on the GPU in emulated worlds (run on the H200 with `pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import random

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, poisoned, randn_bf16

pytestmark = pytest.mark.gpu

OVERLAPS = ["intra_sm", "inter_sm"]


def _inputs(W, m, n, kl, seed):
    g = torch.Generator().manual_seed(seed)
    a = randn_bf16(W, m, kl, device="cuda", generator=g)
    b = randn_bf16(W, kl, n, device="cuda", generator=g)
    return a, b


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("seed", range(3))
def test_random_shapes(W, overlap, seed):
    rng = random.Random(seed * 100 + W)
    m = W * rng.randint(1, 300)
    n = 8 * rng.randint(1, 80)
    kl = 8 * rng.randint(1, 64)
    tile = rng.choice([None, "128x128x64", "128x256x64"])
    world = mkernel.World.emulated(W, device="cuda")
    a, b = _inputs(W, m, n, kl, seed)
    out = poisoned((W, m // W, n), "cuda")
    sched = mkernel.Schedule(overlap=overlap, tile=tile)
    got = mkernel.gemm_rs(a, b, world=world, schedule=sched, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close_bf16(got, mkernel.reference.gemm_rs(a, b, world=world), f"W={W} {m}x{n}x{kl}")
    for key, pad in world.signal_pads().items():
        assert int(pad.abs().sum()) == 0, f"signal pad {key} not reset"


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_loop_1000_and_graph_replay(overlap):
    W = 4
    world = mkernel.World.emulated(W, device="cuda")
    a, b = _inputs(W, 4 * 256, 512, 128, 7)
    sched = mkernel.Schedule(overlap=overlap)
    ref = mkernel.reference.gemm_rs(a, b, world=world)
    world.sync_checks = False
    for _ in range(1000):
        out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    world.check()
    assert_close_bf16(out, ref, "after 1000 calls")
    out = poisoned((W, 256, 512), "cuda")
    mkernel.gemm_rs(a, b, world=world, schedule=sched, out=out)  # warm (build, workspace)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        mkernel.gemm_rs(a, b, world=world, schedule=sched, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(100):
        out.fill_(float("nan"))
        a2 = randn_bf16(W, 4 * 256, 128, device="cuda")
        a.copy_(a2)
        graph.replay()
        if i % 25 == 0 or i == 99:
            torch.cuda.synchronize()
            assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), f"replay {i}")
    world.check()
    for key, pad in world.signal_pads().items():
        assert int(pad.abs().sum()) == 0, f"signal pad {key} not reset"


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_silent_rank_times_out_and_gpu_stays_usable(overlap):
    import time

    W = 4
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.5)
    a, b = _inputs(W, 4 * 128, 256, 64, 3)
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=2))
    t0 = time.perf_counter()
    mkernel.gemm_rs(a, b, world=world, schedule=bad)  # asynchronous: enqueued, returns
    with pytest.raises(mkernel.CommTimeout) as e:
        world.check()
    assert time.perf_counter() - t0 < 10
    assert e.value.peer == 2  # the silent rank raises nothing, not even its own flags
    assert "partial" in e.value.signal
    # The kernel exited cleanly: the same process keeps using the GPU (the emulated world cleared
    # the failed call's pads itself).
    good = mkernel.Schedule(overlap=overlap)
    out = mkernel.gemm_rs(a, b, world=world, schedule=good)
    assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), "after timeout")


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_delayed_rank_leaves_result_unchanged(overlap):
    W = 4
    world = mkernel.World.emulated(W, device="cuda")
    a, b = _inputs(W, 4 * 256, 512, 256, 11)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(delay_rank=1, delay_us=200))
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), "delayed rank")


def test_tile_order_hook_is_followed():
    W = 2
    world = mkernel.World.emulated(W, device="cuda")
    a, b = _inputs(W, 2 * 512, 512, 64, 5)
    sched = mkernel.Schedule(tile_order=lambda rank, tiles: list(reversed(range(len(tiles)))))
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert_close_bf16(out, mkernel.reference.gemm_rs(a, b, world=world), "reversed order")
