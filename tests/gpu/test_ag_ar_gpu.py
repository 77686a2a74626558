"""ag_gemm and gemm_ar on the GPU in emulated worlds (on the H200: `pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, poisoned, randn_bf16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPS = ["ag_gemm", "gemm_ar"]
OVERLAPS = ["intra_sm", "inter_sm"]


def _inputs(op, W, rows, n, k, seed):
    """ag_gemm: a [W, rows, k] shards of M = W*rows, b [W, k, n]. gemm_ar: a [W, rows, k] with
    k = K/W, b [W, k, n]. Returns (a, b, per-rank output shape)."""
    g = torch.Generator().manual_seed(seed)
    a = randn_bf16(W, rows, k, device="cuda", generator=g)
    b = randn_bf16(W, k, n, device="cuda", generator=g)
    return a, b, ((W * rows if op == "ag_gemm" else rows), n)


def _run(op, a, b, world, **kw):
    return getattr(mkernel, op)(a, b, world=world, **kw)


def _ref(op, a, b, world):
    return getattr(mkernel.reference, op)(a, b, world=world)


def _pads_zero(world):
    for key, pad in world.signal_pads().items():
        assert int(pad.abs().sum()) == 0, f"signal pad {key} not reset"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("seed", range(3))
def test_random_shapes(op, W, overlap, seed):
    rng = random.Random(seed * 100 + W)
    rows = rng.randint(1, 300)  # ag_gemm: M/W, often not a multiple of the tile height
    n = 8 * rng.randint(1, 80)
    k = 8 * rng.randint(1, 64)
    tile = rng.choice([None, "128x128x64", "128x256x64"])
    chunk_rows = rng.choice([None, 16, 100]) if op == "ag_gemm" else None
    world = mkernel.World.emulated(W, device="cuda")
    a, b, shape = _inputs(op, W, rows, n, k, seed)
    out = poisoned((W, *shape), "cuda")
    sched = mkernel.Schedule(overlap=overlap, tile=tile, chunk_rows=chunk_rows)
    got = _run(op, a, b, world, schedule=sched, out=out)
    assert got.data_ptr() == out.data_ptr()
    what = f"{op} W={W} rows={rows} n={n} k={k} tile={tile} chunk_rows={chunk_rows}"
    assert_close_bf16(got, _ref(op, a, b, world), what)
    _pads_zero(world)
    # A random tile order (the plan's hook) gives the same result.
    order = mkernel.Schedule(
        overlap=overlap,
        tile=tile,
        chunk_rows=chunk_rows,
        tile_order=lambda r, tiles: random.Random(seed + r).sample(range(len(tiles)), len(tiles)),
    )
    first = got.clone()
    out.fill_(float("nan"))
    again = _run(op, a, b, world, schedule=order, out=out)
    if op == "ag_gemm":  # a tile is one GEMM whatever the order: bit for bit
        assert torch.equal(again, first), what + " shuffled"
    assert_close_bf16(again, first, what + " shuffled")
    _pads_zero(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_loop_1000_and_graph_replay(op, overlap):
    W = 4
    world = mkernel.World.emulated(W, device="cuda")
    a, b, shape = _inputs(op, W, 200, 512, 128, 7)
    sched = mkernel.Schedule(overlap=overlap)
    ref = _ref(op, a, b, world)
    world.sync_checks = False
    for _ in range(1000):
        out = _run(op, a, b, world, schedule=sched)
    world.check()
    world.sync_checks = True
    assert_close_bf16(out, ref, "after 1000 calls")
    _pads_zero(world)
    out = poisoned((W, *shape), "cuda")
    _run(op, a, b, world, schedule=sched, out=out)  # warm: build, workspace, plan tables
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _run(op, a, b, world, schedule=sched, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(100):
        out.fill_(float("nan"))
        a.copy_(randn_bf16(*a.shape, device="cuda"))
        graph.replay()
        if i % 25 == 0 or i == 99:
            torch.cuda.synchronize()
            assert_close_bf16(out, _ref(op, a, b, world), f"replay {i}")
    world.check()
    _pads_zero(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_delayed_rank_leaves_result_unchanged(op, overlap):
    W = 4
    world = mkernel.World.emulated(W, device="cuda")
    a, b, _ = _inputs(op, W, 256, 512, 256, 11)
    faults = mkernel.Faults(delay_rank=1, delay_us=200)
    sched = mkernel.Schedule(
        overlap=overlap, chunk_rows=64 if op == "ag_gemm" else None, faults=faults
    )
    out = _run(op, a, b, world, schedule=sched)
    assert_close_bf16(out, _ref(op, a, b, world), "delayed rank")
    _pads_zero(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_silent_rank_times_out_and_gpu_stays_usable(op, overlap):
    W = 4
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.5)
    a, b, _ = _inputs(op, W, 128, 256, 64, 3)
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=2))
    t0 = time.perf_counter()
    _run(op, a, b, world, schedule=bad)  # asynchronous: enqueued, returns
    with pytest.raises(mkernel.CommTimeout) as e:
        world.check()
    assert time.perf_counter() - t0 < 10
    assert e.value.peer == 2
    assert ("chunk_ready" if op == "ag_gemm" else "tile_flag") in e.value.signal
    # The kernel exited cleanly and the emulated world cleared the failed call's workspace.
    good = mkernel.Schedule(overlap=overlap)
    out = _run(op, a, b, world, schedule=good)
    assert_close_bf16(out, _ref(op, a, b, world), "after timeout")
    _pads_zero(world)


def test_gemm_ar_every_rank_holds_the_same_bits():
    W = 8
    world = mkernel.World.emulated(W, device="cuda")
    a, b, shape = _inputs("gemm_ar", W, 300, 520, 64, 5)
    out = _run("gemm_ar", a, b, world, out=poisoned((W, *shape), "cuda"))
    assert all(torch.equal(out[r], out[0]) for r in range(W))
    assert_close_bf16(out, _ref("gemm_ar", a, b, world), "gemm_ar W=8")
