"""gemm_rs, ag_gemm and gemm_ar over several nodes on one GPU (kernels/<op>_nodes.cu; issue 14):
an emulated world split into virtual nodes, whose cross-node data (node sums, chunks, results) and
arrivals travel as rdma puts through each rank's ring and host proxy thread (mkernel/rdma.py
fused_rings). Fresh random inputs, poisoned
outputs, the fp32 reference; the rings drained after every call (reserve == head == tail)."""

from __future__ import annotations

import random
import sys

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16, assert_pads_zero, poisoned, randn_bf16, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OVERLAPS = ["intra_sm", "inter_sm"]
WORLDS = [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]


OPS = ["gemm_rs", "ag_gemm", "gemm_ar"]


def _inputs(W, m, n, kl, seed):
    g = torch.Generator().manual_seed(seed)
    return randn_bf16(W, m, kl, device="cuda", generator=g), randn_bf16(
        W, kl, n, device="cuda", generator=g
    )


def _op_inputs(op, W, rows, n, k, seed):
    """Operands of ``op`` with ``rows`` rows per rank's a (gemm_rs: W * rows), ``k`` columns per
    rank's a (ag_gemm: the whole K), and its result's per-rank shape."""
    if op == "ag_gemm":
        return _inputs(W, rows, n, k, seed), (W * rows, n)
    m = W * rows if op == "gemm_rs" else rows
    return _inputs(W, m, n, k, seed), ((rows if op == "gemm_rs" else m), n)


def _assert_rings_drained(world) -> None:
    torch.cuda.synchronize()
    rings = world._rdma
    for r in range(world.size):
        c = rings.counters(r)
        assert c["reserve"] == c["head"] == c["tail"], (r, c)
    assert rings.errors() == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("W,N", WORLDS)
@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("seed", range(2))
def test_random_shapes(op, W, N, overlap, seed):
    rng = random.Random(seed * 100 + W * 10 + N)
    rows, n, k = rng.randint(1, 300), 8 * rng.randint(1, 80), 8 * rng.randint(1, 64)
    world = mkernel.World.emulated(W, device="cuda", nodes=N)
    (a, b), shape = _op_inputs(op, W, rows, n, k, seed)
    tma = op == "ag_gemm" and overlap == "inter_sm"  # TMA pushes: comm CTAs only
    sched = mkernel.Schedule(
        overlap=overlap,
        tile=rng.choice([None, "128x128x64"]),
        chunk_rows=rng.choice([None, 7]) if op == "ag_gemm" else None,
        transfer=rng.choice([None, "tma"]) if tma else None,
    )
    for call in range(2):  # the second call reuses the workspaces and the rings
        out = poisoned((W, *shape), "cuda")
        got = getattr(mkernel, op)(a, b, world=world, schedule=sched, out=out)
        world.check()  # a timeout first, as itself (calls are asynchronous)
        what = f"{op} W={W} N={N} rows={rows} n={n} k={k} call {call}"
        assert_close_bf16(got, getattr(mkernel.reference, op)(a, b, world=world), what)
        _assert_rings_drained(world)
        assert_pads_zero(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_every_cta_waits_for_puts(op, overlap):
    """Shapes where every CTA has tiles that wait for puts, so none leaves early: the proxy's
    copies (kernels) must find SMs the fused kernel leaves free (schedule.PROXY_COPY_SMS)."""
    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N)
    rows = {"gemm_rs": 2048, "ag_gemm": 2048, "gemm_ar": 8192}[op]
    (a, b), shape = _op_inputs(op, W, rows, 4096, 512, 13)
    sched = mkernel.Schedule(overlap=overlap)
    out = getattr(mkernel, op)(a, b, world=world, schedule=sched, out=poisoned((W, *shape), "cuda"))
    world.check()
    assert_close_bf16(out, getattr(mkernel.reference, op)(a, b, world=world), f"{op} {overlap}")
    _assert_rings_drained(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_loop_1000_and_graph_replay(op, overlap):
    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N)
    (a, b), shape = _op_inputs(op, W, 256, 512, 128, 7)
    call = getattr(mkernel, op)
    ref = lambda: getattr(mkernel.reference, op)(a, b, world=world)  # noqa: E731
    sched = mkernel.Schedule(overlap=overlap)
    want = ref()
    world.sync_checks = False
    for _ in range(1000):
        out = call(a, b, world=world, schedule=sched)
    world.check()
    assert_close_bf16(out, want, "after 1000 calls")
    _assert_rings_drained(world)
    # CUDA graphs: the proxy threads keep serving whatever the replays post; nothing per call.
    out = poisoned((W, *shape), "cuda")
    call(a, b, world=world, schedule=sched, out=out)
    # NOTE: no global-mode capture while puts are in flight (docs/rdma.md): the proxy threads'
    # stream calls would fail it
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call(a, b, world=world, schedule=sched, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(30):
        out.fill_(float("nan"))
        a.copy_(randn_bf16(*a.shape, device="cuda"))
        graph.replay()
        if i % 10 == 0 or i == 29:
            torch.cuda.synchronize()
            assert_close_bf16(out, ref(), f"replay {i}")
    world.check()
    _assert_rings_drained(world)
    assert_pads_zero(world)


@pytest.mark.parametrize("W", [8, 16])
def test_many_proxies_with_work_queued_behind_the_kernel(W):
    """W proxies under asynchronous calls, each followed at once by other work on the same
    stream: their copies must never sit behind that work, nor behind each other's (one copy
    stream per GPU, kept out of the launching stream's hardware queue: mkernel/rdma_streams.py;
    with a stream per proxy, W = 8 stalled at CUDA's default 8 queues and W = 16 at 16:
    benchmarks/results/queue_probe_2026-12-01.json)."""
    world = mkernel.World.emulated(W, device="cuda", nodes=2)
    (a, b), _ = _op_inputs("gemm_rs", W, 64, 256, 64, 17)
    want = mkernel.reference.gemm_rs(a, b, world=world)
    side = torch.randn(512, 512, device="cuda")
    # NOTE: run once before the calls: the only failure of this test on the H200 came in a run
    # without this line (one run; a module loaded while the kernel waits can stall the proxies'
    # copies: tools/lazy_probe.py, docs/rdma.md)
    side = side @ side / 16
    torch.cuda.synchronize()
    for _ in range(100):
        out = mkernel.gemm_rs(a, b, world=world)
        side = side @ side / 16  # queued behind the fused kernel on its stream
    world.check()
    assert_close_bf16(out, want, f"W={W} after 100 calls")
    _assert_rings_drained(world)
    # a second launching stream: checked on its first call, the proxies still right for both
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = mkernel.gemm_rs(a, b, world=world)
        side = side @ side / 16
    torch.cuda.current_stream().wait_stream(s)
    out2 = mkernel.gemm_rs(a, b, world=world)
    world.check()
    assert_close_bf16(out, want, f"W={W} side stream")
    assert_close_bf16(out2, want, f"W={W} back on the default stream")


def test_one_hardware_queue_is_refused_before_launch():
    """CUDA_DEVICE_MAX_CONNECTIONS=1: every stream shares the one queue, so the proxies' copies
    would wait behind the kernel: the first call raises a clear RuntimeError, not a timeout."""
    code = (
        "import os, torch, mkernel\n"
        "w = mkernel.World.emulated(4, device='cuda', nodes=2)\n"
        "a = torch.randn(4, 256, 64, device='cuda').bfloat16()\n"
        "b = torch.randn(4, 64, 128, device='cuda').bfloat16()\n"
        "try:\n"
        "    mkernel.gemm_rs(a, b, world=w)\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
        "else:\n"
        "    print('LAUNCHED')\n"
    )
    rc, out = run_script([sys.executable, "-c", code], 300, CUDA_DEVICE_MAX_CONNECTIONS="1")
    assert rc == 0, out[-3000:]
    assert "REFUSED" in out and "CUDA_DEVICE_MAX_CONNECTIONS=1" in out, out[-3000:]


@pytest.mark.parametrize("op", OPS)
def test_stalled_proxy_times_out_names_the_signal_and_recovers(op):
    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=1.0)
    (a, b), _ = _op_inputs(op, W, 128, 256, 64, 3)
    call = getattr(mkernel, op)
    ref = getattr(mkernel.reference, op)(a, b, world=world)
    assert_close_bf16(call(a, b, world=world), ref, "before")  # starts the rings
    world._rdma.set_stalled(True)
    names = r"node_part|rail_ready|chunk_ready|tile_ready|rdma_tail"
    with pytest.raises(mkernel.CommTimeout, match=names):
        call(a, b, world=world)
        world.check()  # (calls are asynchronous: the timeout is raised here)
    # the emulated world reset itself (workspace, pads, rings emptied and restarted)
    assert world._rdma.running
    assert_close_bf16(call(a, b, world=world), ref, "after the timeout")
    _assert_rings_drained(world)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_silent_rank_times_out_and_the_next_call_is_right(op, overlap):
    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=1.0)
    (a, b), _ = _op_inputs(op, W, 128, 256, 64, 5)
    call = getattr(mkernel, op)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=2))
    with pytest.raises(mkernel.CommTimeout, match="timed out"):  # (a wait on 2, or behind one)
        call(a, b, world=world, schedule=sched)
        world.check()
    out = call(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap))
    assert_close_bf16(out, getattr(mkernel.reference, op)(a, b, world=world), "after")
    _assert_rings_drained(world)


def test_ticket_counters_restart_before_they_overflow():
    """The rings' int32 tickets: the host counts each launch's puts and, before they could pass
    2^31, empties and restarts the idle rings (mkernel/runtime/gpu.py before_nodes_launch)."""
    from mkernel.rdma import _MAX_COUNT, fused_rings

    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N)
    (a, b), _ = _op_inputs("gemm_rs", W, 128, 256, 64, 9)
    ref = mkernel.reference.gemm_rs(a, b, world=world)
    assert_close_bf16(mkernel.gemm_rs(a, b, world=world), ref, "first")
    rings = fused_rings(world)
    per_call = rings.posted
    assert per_call > 0 and rings.counters(0)["reserve"] <= per_call
    rings.posted = _MAX_COUNT - per_call + 1  # as if 2^31 puts had gone by: the next call restarts
    assert_close_bf16(mkernel.gemm_rs(a, b, world=world), ref, "after the restart")
    assert rings.posted == per_call
    _assert_rings_drained(world)


def test_stopped_proxy_times_out_and_the_world_restarts_it():
    from mkernel.rdma import fused_rings

    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=1.0)
    (a, b), _ = _op_inputs("ag_gemm", W, 64, 128, 64, 11)
    ref = mkernel.reference.ag_gemm(a, b, world=world)
    assert_close_bf16(mkernel.ag_gemm(a, b, world=world), ref, "before")
    fused_rings(world).stop()
    with pytest.raises(mkernel.CommTimeout, match=r"chunk_ready|rail_ready|rdma_tail"):
        mkernel.ag_gemm(a, b, world=world)
        world.check()
    assert fused_rings(world).running
    assert_close_bf16(mkernel.ag_gemm(a, b, world=world), ref, "after")
