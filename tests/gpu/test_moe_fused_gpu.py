"""The fused MoE kernels (kernels/moe_dispatch_gemm.cu, kernels/moe_gemm_combine.cu) in emulated
GPU worlds, dispatch -> relu -> combine: the dispatch's rows, src and offsets exact, y and out
against fp64 formulas with bf16 tolerance (y, out and the combine's fp32 rows NaN-poisoned by the
API), tokens routed nowhere exactly zero, pads back to zero after every call; W 1..8, k 1 / 2 / 8,
uniform / one-expert / one-rank / no routing, T = 0 and off the tile, both overlaps, tile heights
1..128, H and I spanning several K blocks and column tiles; hypothesis over routings; a silent
rank times out naming the flag (either op); 1000 calls with a new routing each."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.errors import CommTimeout
from tests.helpers import assert_close_exact, assert_pads_zero
from tests.test_moe import expected_rows, routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _operands(W, T, E, H, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(W, T, H, generator=g).bfloat16()
    w1 = (torch.randn(W, E, H, N, generator=g) / H**0.5).bfloat16()
    return x, w1


def check(res, x, ids, w1, what):
    """Rows, src, offsets exact; y within the bf16 rounding of the fp64 products."""
    E = w1.shape[1]
    for d, rows in enumerate(expected_rows(ids, E)):
        src = res.src[d].cpu()
        assert src.tolist() == [list(r[:3]) for r in rows], f"{what}: src of rank {d}"
        offs = [sum(1 for r in rows if r[3] < e) for e in range(E + 1)]
        assert res.expert_offsets[d].cpu().tolist() == offs, f"{what}: offsets of rank {d}"
        y = res.y[d].cpu()
        assert y.shape == (len(rows), w1.shape[-1]), f"{what}: y of rank {d}"
        if rows:
            a = torch.stack([x[s, t].double() for s, t, _, _ in rows])
            b = torch.stack([w1[d, e].double() for _, _, _, e in rows])
            exact = torch.einsum("rh,rhi->ri", a, b)
            mag = torch.einsum("rh,rhi->ri", a.abs(), b.abs())
            assert_close_exact(y, exact, mag, x.shape[-1], f"{what}: y of rank {d}")


def check_combine(out, h, w2, ids, weights, what):
    """out[s, t] = sum_j weights[s, t, j] * (h_row(s, t, j) @ w2[e]) in fp64, bf16 tolerance."""
    W, T, k = ids.shape
    E, N, H = w2.shape[1:]
    exact = torch.zeros(W, T, H, dtype=torch.float64)
    mag = torch.zeros_like(exact)
    for d, rows in enumerate(expected_rows(ids, E)):
        hd = h[d].cpu().double()
        for r, (s, t, j, e) in enumerate(rows):
            wt = weights[s, t, j].double()
            exact[s, t] += wt * (hd[r] @ w2[d, e].double())
            mag[s, t] += wt.abs() * (hd[r].abs() @ w2[d, e].double().abs())
    out = out.cpu()
    assert_close_exact(out, exact, mag, N + k, f"{what}: out")
    assert bool((out[(ids < 0).all(dim=-1)] == 0).all()), f"{what}: a token routed nowhere"


def run(
    W, T, E, k, mode, seed, H=64, N=136, overlap="intra_sm", chunk_rows=None, world=None, sms=None
):
    """dispatch -> relu -> combine in one world, each checked."""
    world = world or mkernel.World.emulated(W, device="cuda")
    x, w1 = _operands(W, T, E, H, N, seed)
    g = torch.Generator().manual_seed(seed + 7)
    w2 = (torch.randn(W, E, N, H, generator=g) / N**0.5).bfloat16()
    weights = torch.rand(W, T, k, generator=g)
    ids = routing(W, T, E, k, mode, seed)
    sched = mkernel.Schedule(overlap=overlap, chunk_rows=chunk_rows, sms=sms)
    what = f"W={W} T={T} E={E} k={k} {mode} H={H} I={N} {overlap} rows={chunk_rows}"
    res = mkernel.moe_dispatch_gemm(x.cuda(), ids.cuda(), w1.cuda(), world, sched)
    check(res, x, ids, w1, what)
    assert_pads_zero(world)
    h = [torch.relu(y) for y in res.y]
    out = mkernel.moe_gemm_combine(h, w2.cuda(), res, weights.cuda(), world, sched)
    assert out.shape == (W, T, H) and out.dtype == torch.bfloat16 and out.is_cuda
    check_combine(out, h, w2, ids, weights, what)
    assert_pads_zero(world)
    return world


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_worlds_routings_and_overlaps(W, k, overlap):
    E = max(2, -(-k // W))  # k <= W * E
    for mode in ("uniform", "one_expert", "none"):
        for T in (0, 1, 70):
            run(W, T, E, k, mode, seed=W * 100 + k * 10 + T, overlap=overlap)
    if k <= E:
        run(W, 33, E, k, "rank0", seed=7, overlap=overlap)  # ranks and experts with no rows


@pytest.mark.parametrize("chunk_rows", [1, 16, 64, 100, 128])
def test_tile_heights(chunk_rows):
    run(3, 90, 3, 2, "uniform", seed=chunk_rows, chunk_rows=chunk_rows)


@pytest.mark.parametrize("H,N", [(8, 8), (64, 128), (192, 264), (512, 1024)])
def test_shapes_across_k_blocks_and_column_tiles(H, N):
    run(2, 150, 3, 2, "uniform", seed=H + N, H=H, N=N)


def test_many_experts_and_tokens():
    run(4, 300, 16, 8, "uniform", seed=3, H=256, N=256)


def test_tiles_taller_than_the_engine_are_refused():
    world = mkernel.World.emulated(2, device="cuda")
    x, w1 = _operands(2, 4, 1, 16, 8, 0)
    ids = routing(2, 4, 1, 1, "uniform", 0)
    with pytest.raises(ValueError, match="at most 128 rows"):
        mkernel.moe_dispatch_gemm(
            x.cuda(), ids.cuda(), w1.cuda(), world, mkernel.Schedule(chunk_rows=256)
        )


@settings(max_examples=25, deadline=None)
@given(
    W=st.integers(1, 5),
    T=st.integers(0, 140),
    E=st.integers(1, 4),
    k=st.sampled_from([1, 2, 8]),
    mode=st.sampled_from(["uniform", "one_expert", "rank0", "none"]),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_routings(W, T, E, k, mode, overlap, seed):
    if k > W * E or (mode == "rank0" and k > E):
        return
    run(W, T, E, k, mode, seed, overlap=overlap)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_silent_rank_times_out_naming_the_flag_and_the_world_recovers(overlap):
    world = mkernel.World.emulated(2, device="cuda", timeout_s=0.5)
    x, w1 = _operands(2, 20, 2, 64, 128, 1)
    ids = routing(2, 20, 2, 2, "uniform", 1).cuda()  # rank 1's tokens feed rank 0's experts
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    t0 = time.perf_counter()
    mkernel.moe_dispatch_gemm(x.cuda(), ids, w1.cuda(), world, bad)
    with pytest.raises(CommTimeout) as e:
        world.check()
    assert time.perf_counter() - t0 < 10
    assert e.value.peer == 1 and "landed" in e.value.signal  # the expand, first
    run(2, 20, 2, 2, "uniform", 1, overlap=overlap, world=world)  # usable after


def test_loop_of_1000_calls_with_changing_routing():
    W, T, E, k = 2, 48, 2, 2
    world = mkernel.World.emulated(W, device="cuda")
    x, w1 = _operands(W, T, E, 64, 128, 0)
    w2 = (torch.randn(W, E, 128, 64) / 8).bfloat16()
    weights = torch.rand(W, T, k)
    xc, w1c, w2c, wc = x.cuda(), w1.cuda(), w2.cuda(), weights.cuda()
    first = None
    for i in range(1000):
        ids = routing(W, T, E, k, "uniform", seed=i % 10)
        res = mkernel.moe_dispatch_gemm(xc, ids.cuda(), w1c, world)
        out = mkernel.moe_gemm_combine(res.y, w2c, res, wc, world)
        if i < 10:
            check(res, x, ids, w1, f"call {i}")
            check_combine(out, res.y, w2, ids, weights, f"call {i}")
        if i == 0:
            first = [y.clone() for y in res.y] + [out.clone()]
        if i % 10 == 0:  # the same routing again: the same bits
            again = list(res.y) + [out]
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), f"call {i}"
    assert_pads_zero(world)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_combine_silent_rank_times_out_naming_its_slots(overlap):
    W, T, E, k = 2, 20, 2, 2
    world = mkernel.World.emulated(W, device="cuda", timeout_s=0.5)
    x, w1 = _operands(W, T, E, 64, 64, 2)
    w2 = torch.randn(W, E, 64, 64).bfloat16().cuda()
    ids = routing(W, T, E, k, "uniform", 2).cuda()
    res = mkernel.moe_dispatch_gemm(x.cuda(), ids, w1.cuda(), world)
    bad = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    mkernel.moe_gemm_combine(res.y, w2, res, torch.rand(W, T, k).cuda(), world, bad)
    with pytest.raises(CommTimeout) as e:
        world.check()
    # the layouts' exchange of the rows' places waits for it first (half the patience)
    assert e.value.peer == 1 and "slots_landed" in e.value.signal
    run(W, T, E, k, "uniform", 2, overlap=overlap, world=world)


def _prepared(W, T, E, k, H, N, seed):
    """The dispatch kernel's plan and buffers sized for the worst case (no host work per launch:
    what a CUDA graph needs; the API synchronizes once for the row counts of its results)."""
    from mkernel.ops import common
    from mkernel.ops import moe_dispatch_gemm as mdg

    world = mkernel.World.emulated(W, device="cuda")
    x, w1 = _operands(W, T, E, H, N, seed)
    xc, w1c = x.cuda(), w1.cuda()
    ids = routing(W, T, E, k, "uniform", seed).to(torch.int32).cuda()
    plan = common.cached_plan(mdg.OP, mkernel.Schedule(), world, **mdg.shapes(xc, ids, w1c, world))
    R = plan.sizes["max_rows"]
    ops = {
        "x": xc,
        "topk_ids": ids,
        "w1": w1c.view(W, -1, N),
        "y": torch.full((W, R, N), float("nan"), dtype=torch.bfloat16, device="cuda"),
        "src": torch.empty(W, R, 3, dtype=torch.int32, device="cuda"),
        "expert_offsets": torch.empty(W, 1, E + 1, dtype=torch.int32, device="cuda"),
        "expanded": torch.empty(W, R, H, dtype=torch.bfloat16, device="cuda"),
    }
    return world, x, w1, plan, ops


def _results(ops, W):
    from types import SimpleNamespace

    offs = ops["expert_offsets"]
    rows = [int(offs[d, 0, -1]) for d in range(W)]
    return SimpleNamespace(
        y=[ops["y"][d, :n] for d, n in enumerate(rows)],
        src=[ops["src"][d, :n] for d, n in enumerate(rows)],
        expert_offsets=[offs[d, 0] for d in range(W)],
    )


def test_dispatch_kernel_replays_in_a_cuda_graph_with_new_routings():
    """The dispatch kernel on worst-case-sized buffers, captured once and replayed with a new
    routing written into the ids buffer before each replay: every replay's layout phase lays out
    the routing it finds."""
    from mkernel.ops import common

    W, T, E, k = 2, 40, 2, 2
    world, x, w1, plan, ops = _prepared(W, T, E, k, 64, 128, 0)
    common.run_gpu(world, plan, ops)  # warm-up: the launch record cached, the extension loaded
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        common.run_gpu(world, plan, ops)
    for seed in (1, 2, 3):
        new = routing(W, T, E, k, "uniform", seed)
        ops["topk_ids"].copy_(new.to(torch.int32))
        ops["y"].fill_(float("nan"))  # poisoned: a row the replay does not write fails the check
        graph.replay()
        torch.cuda.synchronize()
        check(_results(ops, W), x, new, w1, f"replay {seed}")
    assert_pads_zero(world)


@pytest.mark.parametrize("bad", [99, -2, 4])
def test_an_expert_id_out_of_range_found_on_the_device_names_rank_and_token(bad):
    """The host rejects such ids before a launch; written into the ids buffer afterwards (as a
    graph replay would find it), the layout phase finds it: the launch completes, the slot counts
    as unused (nothing written for it, every other row right), and the world reports it as it does
    a timeout, naming rank, token, slot and the id."""
    from mkernel.ops import common

    W, T, E, k = 2, 40, 2, 2  # E = 4 experts in all: 4 is the first id out of range
    world, x, w1, plan, ops = _prepared(W, T, E, k, 64, 128, 5)
    ids = ops["topk_ids"]
    ids[1, 7, 1] = bad
    common.run_gpu(world, plan, ops)
    with pytest.raises(mkernel.DeviceInputError, match=rf"expert id {bad} of rank 1, token 7 "):
        world.check()
    ids[1, 7, 1] = -1
    check(_results(ops, W), x, ids.cpu(), w1, f"id {bad} ignored")
    assert_pads_zero(world)
    world.check()  # reported once; the world runs on
    common.run_gpu(world, plan, ops)
    world.check()
    check(_results(ops, W), x, ids.cpu(), w1, "the next launch")


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_the_layer_is_captured_in_a_cuda_graph_and_replayed_with_new_routings(ids_dtype):
    """dispatch -> relu -> combine through the API, captured once (fixed T) and replayed with a
    new routing written into the ids tensor before each replay: no host read of the counts under
    capture (the results hold the worst case's rows, ``MoeDispatch.captured``; the first
    ``expert_offsets[-1]`` are each replay's), out and the rows right for every replay's routing."""
    from types import SimpleNamespace

    W, T, E, k, H, N = 2, 40, 2, 2, 64, 128
    world = mkernel.World.emulated(W, device="cuda")
    x, w1 = _operands(W, T, E, H, N, 7)
    g = torch.Generator().manual_seed(8)
    w2 = (torch.randn(W, E, N, H, generator=g) / N**0.5).bfloat16()
    weights = torch.rand(W, T, k, generator=g)
    xc, w1c, w2c, wc = x.cuda(), w1.cuda(), w2.cuda(), weights.cuda()
    ids = routing(W, T, E, k, "uniform", 0).to(ids_dtype).cuda()

    def layer():
        d = mkernel.moe_dispatch_gemm(xc, ids, w1c, world)
        h = [torch.relu(y) for y in d.y]
        return d, h, mkernel.moe_gemm_combine(h, w2c, d, wc, world)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # warm-up outside the capture: the extension, the plans
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d, h, out = layer()
    assert d.captured and d.buffer_rows == [W * T * min(k, E)] * W
    for seed in (1, 2, 3):
        new = routing(W, T, E, k, "uniform", seed)
        ids.copy_(new.to(ids_dtype))
        graph.replay()
        torch.cuda.synchronize()
        rows = d.rows
        res = SimpleNamespace(
            y=[y[:n] for y, n in zip(d.y, rows, strict=True)],
            src=[s[:n] for s, n in zip(d.src, rows, strict=True)],
            expert_offsets=d.expert_offsets,
        )
        check(res, x, new, w1, f"replay {seed}")
        hs = [hh[:n] for hh, n in zip(h, rows, strict=True)]
        check_combine(out, hs, w2, new, weights, f"replay {seed}")
    world.check()
    assert_pads_zero(world)


def test_a_repeated_expert_id_found_on_the_device_is_reported_and_ignored():
    """A token naming an expert twice (refused by the host; here written after the checks) would
    give a rank more rows of it than the plan's buffers hold: the layout ignores the later slot
    and reports it, naming rank, token and slot."""
    from mkernel.ops import common

    W, T, E, k = 2, 40, 2, 2
    world, x, w1, plan, ops = _prepared(W, T, E, k, 64, 128, 9)
    ids = ops["topk_ids"]
    ids[0, 3, 0], ids[0, 3, 1] = 1, 1
    common.run_gpu(world, plan, ops)
    with pytest.raises(mkernel.DeviceInputError, match=r"rank 0, token 3 \(slot 1\) names an"):
        world.check()
    ids[0, 3, 1] = -1
    check(_results(ops, W), x, ids.cpu(), w1, "repeated id ignored")
    assert_pads_zero(world)
