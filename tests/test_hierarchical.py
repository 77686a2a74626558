"""gemm_rs, ag_gemm and gemm_ar over several nodes (``World.emulated(W, nodes=N)``) on the CPU
interpreter: within a node data moves by peer stores and bulk copies, across nodes only by rdma
puts through the proxy ring's twin (docs/rdma.md "Hierarchical ops"). Properties over W in {2, 4,
8}, N in {2, 4}, both overlaps, shapes, tile orders and interleavings: results within the
reference's rounding, pads back to zero, two calls in a row (and two calls on one machine state),
every put drained; the interpreter's cross-node check never fires for these plans and does for a
plan of one node; planted mistakes are caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.interp import program, rdma
from mkernel.ops import ag_gemm as ag_mod
from mkernel.ops import common
from mkernel.ops import gemm_ar as ar_mod
from mkernel.ops import gemm_rs as rs_mod
from mkernel.world import World
from tests.helpers import (
    assert_close_bf16,
    assert_close_exact,
    assert_pads_zero,
    gemm_inputs,
    poisoned,
    random_order,
)
from tests.test_laws import assert_gemm_rs, gemm_ar_formula

WORLDS = [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]  # (W, nodes)
OVERLAP = st.sampled_from(["intra_sm", "inter_sm"])


def _schedule(overlap, sms, seed, shuffle, **kw):
    hook = random_order(seed) if shuffle else None
    return mkernel.Schedule(overlap=overlap, sms=sms, seed=seed, tile_order=hook, **kw)


def run_calls(module, world, sched, a, b, seed, calls=2):
    """``calls`` calls of the op's plan back to back on one machine state (program.run_plan), as
    kernels on one stream; returns the result of the last and the machine."""
    plan = sched.plan(module.SPEC.name, world, a, b)
    out_rows = {rs_mod: a.shape[1] // world.size, ag_mod: a.shape[1] * world.size}.get(
        module, a.shape[1]
    )
    out = poisoned((world.size, out_rows, b.shape[2]), "cpu")
    ws = common.workspace(world, plan)
    buffers = {"a": a, "b": b, "out": out, **{k: v.local for k, v in ws.items() if v is not None}}
    outputs = lambda r: module.outputs(plan, r)  # noqa: E731
    m = program.run_plan(world, plan, buffers, module.twins_of(plan), seed, outputs, calls=calls)
    return out, m, plan


def assert_rings_drained(m, plan, puts_per_rank: int, calls: int) -> None:
    """Every rank posted ``puts_per_rank`` descriptors per call and its proxy drained them all."""
    for r in range(plan.world_size):
        for c in ("reserve", "head", "tail"):
            got = int(m.pads[f"rdma_{c}"][r, 0])
            assert got == puts_per_rank * calls, f"rank {r} ring {c} = {got}"


def gemm_rs_puts(plan) -> int:
    """Per rank and call: N - 1 arrivals, and one node sum per tile of each rail peer."""
    N = plan.nodes
    return (N - 1) * (1 + plan.sizes["per_owner"])


def ag_gemm_puts(plan) -> int:
    """Per rank and call: N - 1 arrivals, and each own chunk once to each other node."""
    return (plan.nodes - 1) * (1 + plan.sizes["chunks"])


def gemm_ar_puts(plan, r: int) -> int:
    """Rank r's puts per call: a node sum per tile a rail peer owns, its own results to every rail
    peer (no arrivals: data flows both ways along the rails)."""
    W, N = plan.world_size, plan.nodes
    R = W // N
    owned = [sum(t.tag == q for t in plan.tiles) for q in range(W)]
    rail = [((r // R + j) % N) * R + r % R for j in range(1, N)]
    return sum(owned[q] + owned[r] for q in rail)


# -- results ---------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    wn=st.sampled_from(WORLDS),
    rows=st.integers(1, 50),
    n8=st.integers(1, 24),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    tile=st.sampled_from([None, "128x128x64", "64x128x64"]),
    sms=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_gemm_rs_over_nodes(wn, rows, n8, k8, overlap, tile, sms, seed, shuffle):
    (W, N), n, kl = wn, 8 * n8, 8 * k8
    world = mkernel.World.emulated(W, nodes=N)
    a, b = gemm_inputs(W, W * rows, n, kl, seed)
    sched = _schedule(overlap, sms, seed, shuffle, tile=tile)
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert out.shape == (W, rows, n)
    assert_gemm_rs(out, a, b, f"W={W} nodes={N} {W * rows}x{n}x{kl}")
    assert_pads_zero(world)
    # Another call, another interleaving: the same bits (every sum is added in a fixed order).
    again = mkernel.gemm_rs(a, b, world, _schedule(overlap, sms, seed + 1, shuffle, tile=tile))
    assert torch.equal(again, out)
    assert_pads_zero(world)


@settings(max_examples=20, deadline=None)
@given(
    wn=st.sampled_from(WORLDS),
    ms=st.integers(1, 40),
    n8=st.integers(1, 16),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    chunk_rows=st.sampled_from([None, 3, 16, 50]),
    transfer=st.sampled_from([None, "tma"]),
    sms=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_ag_gemm_over_nodes(wn, ms, n8, k8, overlap, chunk_rows, transfer, sms, seed, shuffle):
    (W, N), n, k = wn, 8 * n8, 8 * k8
    if transfer == "tma":
        overlap = "inter_sm"
    world = mkernel.World.emulated(W, nodes=N)
    a, b = gemm_inputs(W, ms, n, k, seed)
    sched = _schedule(overlap, sms, seed, shuffle, chunk_rows=chunk_rows, transfer=transfer)
    out = mkernel.ag_gemm(a, b, world=world, schedule=sched)
    ref = mkernel.reference.ag_gemm(a, b, world=world)
    assert_close_bf16(out, ref, f"W={W} nodes={N} ms={ms} n={n} k={k} chunk_rows={chunk_rows}")
    assert_pads_zero(world)
    resched = _schedule(overlap, sms, seed + 1, False, chunk_rows=chunk_rows, transfer=transfer)
    again = mkernel.ag_gemm(a, b, world=world, schedule=resched)
    assert torch.equal(again, out)
    assert_pads_zero(world)


@settings(max_examples=15, deadline=None)
@given(
    wn=st.sampled_from(WORLDS),
    m=st.integers(1, 160),
    n8=st.integers(1, 24),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    sms=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_gemm_ar_over_nodes(wn, m, n8, k8, overlap, sms, seed, shuffle):
    (W, N), n, kl = wn, 8 * n8, 8 * k8
    world = mkernel.World.emulated(W, nodes=N)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = _schedule(overlap, sms, seed, shuffle, tile="64x128x64")
    out = mkernel.gemm_ar(a, b, world=world, schedule=sched)
    assert_close_exact(out, *gemm_ar_formula(a, b), f"W={W} nodes={N} {m}x{n}x{kl}")
    assert all(torch.equal(out[r], out[0]) for r in range(W)), "one result on every rank"
    assert_pads_zero(world)
    again = mkernel.gemm_ar(
        a, b, world, _schedule(overlap, sms, seed + 1, shuffle, tile="64x128x64")
    )
    if W // N <= 2:  # the same bits: acc's red.adds are 0 + x + y; more commute only in value
        assert torch.equal(again, out)
    else:
        assert_close_exact(again, *gemm_ar_formula(a, b), "again")


@pytest.mark.parametrize("W,N", WORLDS)
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_two_calls_on_one_machine_drain_every_put(W, N, overlap):
    """Calls back to back on one machine state: the second call's puts race nothing of the first
    (the rail arrivals order them after the peer's previous call), every ring drains."""
    for seed in range(2):
        sched = mkernel.Schedule(overlap=overlap, sms=3, tile="64x128x64", chunk_rows=24)
        world = mkernel.World.emulated(W, nodes=N)
        a, b = gemm_inputs(W, W * 40, 24, 16, seed)
        out, m, plan = run_calls(rs_mod, world, sched, a, b, seed)
        assert_gemm_rs(out, a, b, f"gemm_rs W={W} nodes={N} seed={seed}")
        assert_rings_drained(m, plan, gemm_rs_puts(plan), calls=2)
        a, b = gemm_inputs(W, 40, 24, 16, seed)
        out, m, plan = run_calls(ag_mod, world, sched, a, b, seed)
        assert_close_bf16(out, mkernel.reference.ag_gemm(a, b, world=world), "ag_gemm")
        assert_rings_drained(m, plan, ag_gemm_puts(plan), calls=2)
        a, b = gemm_inputs(W, 100, 24, 16, seed)
        out, m, plan = run_calls(ar_mod, world, sched, a, b, seed)
        assert_close_exact(out, *gemm_ar_formula(a, b), "gemm_ar")
        for r in range(W):
            assert int(m.pads["rdma_tail"][r, 0]) == 2 * gemm_ar_puts(plan, r)
            assert int(m.pads["rdma_reserve"][r, 0]) == 2 * gemm_ar_puts(plan, r)
        assert_pads_zero(world)


# -- the plans: who talks to whom ------------------------------------------------------------------


def _cross_node(plan):
    """(src, dest, pad) of every raise whose destination is on another node."""
    R = plan.world_size // plan.nodes
    return [
        (r, x.rank, x.pad)
        for tables in plan.roles.values()
        for r, tasks in enumerate(tables.tasks)
        for t in tasks
        for x in t.raises
        if x.rank // R != r // R
    ]


@pytest.mark.parametrize("W,N", WORLDS)
def test_plans_cross_nodes_only_on_rails_and_once_per_node(W, N):
    R = W // N
    world = mkernel.World.emulated(W, nodes=N)
    sched = mkernel.Schedule(tile="64x128x64", chunk_rows=16)
    rs = sched.plan("gemm_rs", world, m=W * 130, n=200, k=8 * W)
    ag = sched.plan("ag_gemm", world, m=W * 40, n=200, k=16)
    for plan, per_rank in ((rs, gemm_rs_puts(rs)), (ag, ag_gemm_puts(ag))):
        assert f"hierarchical over {N} nodes x {R} ranks" in str(plan)
        cross = _cross_node(plan)
        assert all(src % R == dest % R for src, dest, _ in cross), "off the rails"
        for r in range(W):
            assert sum(src == r for src, _, _ in cross) == per_rank
    # gemm_rs: one node sum per (tile, other node) arrives at each owner
    assert sorted(p for _, _, p in _cross_node(rs) if p != "rail_ready") == ["node_part"] * (
        W * (N - 1) * rs.sizes["per_owner"]
    )
    # ag_gemm: each chunk of each shard crosses to each other node exactly once
    puts = [(t.args[0], t.args[1]) for ts in ag.roles["comm"].tasks for t in ts if t.args[2] == 1]
    C = ag.sizes["chunks"]
    assert len(puts) == len(set(puts)) == W * C * (N - 1)
    assert {(g, q // R) for g, q in puts} == {
        (g, n) for g in range(W * C) for n in range(N) if n != g // C // R
    }
    one = mkernel.Schedule().plan("gemm_rs", mkernel.World.emulated(W), m=W * 8, n=8, k=8 * W)
    assert one.nodes == 1 and "hierarchical" not in str(one)


# -- what the interpreter catches ------------------------------------------------------------------


def test_a_plan_of_one_node_in_a_world_of_two_is_a_cross_node_error():
    """The check is armed: gemm_rs's one-node plan stores partials straight into owners that live
    on the other node."""
    W = 4
    sched = mkernel.Schedule(overlap="inter_sm", sms=3)
    flat = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, W * 16, 16, 16, 0)
    plan = sched.plan("gemm_rs", flat, a, b)
    moves = rs_mod.twins_of(plan)
    plan.nodes = 2  # (this world's plan cache is not used again)
    out = poisoned((W, 16, 16), "cpu")
    ws = common.workspace(flat, plan)
    buffers = {"a": a, "b": b, "out": out, **{k: v.local for k, v in ws.items() if v is not None}}
    outputs = lambda r: rs_mod.outputs(plan, r)  # noqa: E731
    with pytest.raises(mkernel.PlanError, match=r"cross-node access.*stage\[\d\]"):
        program.run_plan(flat, plan, buffers, moves, 0, outputs)


def _inputs(module, seed):
    """Small operands of a 4-rank world for ``module``, and where its puts land."""
    rows = {rs_mod: 4 * 16, ag_mod: 16, ar_mod: 16}[module]
    dest = {rs_mod: "stage", ag_mod: "gather", ar_mod: "(?:xrecv|xout)"}[module]
    return gemm_inputs(4, rows, 16, 16, seed), dest


@pytest.mark.parametrize("module", [rs_mod, ag_mod, ar_mod])
def test_signal_raised_before_the_put_landed_is_a_race(module, monkeypatch):
    early = lambda ring, count: rdma.proxy(ring, count, signal_early=True)  # noqa: E731
    monkeypatch.setattr(program, "proxy", early)
    for seed in range(4):
        world = mkernel.World.emulated(4, nodes=2)
        (a, b), dest = _inputs(module, seed)
        sched = mkernel.Schedule(seed=seed, sms=3)
        with pytest.raises(mkernel.RaceError, match=rf"{dest}\[\d\]"):
            getattr(mkernel, module.SPEC.name)(a, b, world=world, schedule=sched)


@pytest.mark.parametrize("module", [rs_mod, ag_mod])
def test_without_the_rail_arrival_the_next_call_races_the_previous(module):
    """Strip the arrivals and their waits: a put of call 1 may land while the peer on the other
    node still reads what call 0 put there. (gemm_ar has none: its two calls on one machine in
    test_two_calls_on_one_machine_drain_every_put show that it needs none.)"""
    W, N = 4, 2
    world = mkernel.World.emulated(W, nodes=N)
    sched = mkernel.Schedule(overlap="inter_sm", sms=3, seed=5)
    (a, b), dest = _inputs(module, 1)
    plan = sched.plan(module.SPEC.name, world, a, b)
    for tables in plan.roles.values():
        for tasks in tables.tasks:
            for t in tasks:
                t.waits = tuple(w for w in t.waits if w.pad != "rail_ready")
                t.raises = tuple(x for x in t.raises if x.pad != "rail_ready")
    with pytest.raises(mkernel.RaceError, match=rf"{dest}\[\d\].*call [01]"):
        run_calls(module, world, sched, a, b, 5)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_silent_rank_times_out_its_peers_naming_it(overlap):
    for module in (rs_mod, ag_mod, ar_mod):
        world = mkernel.World.emulated(4, nodes=2, timeout_s=0.05)
        (a, b), _ = _inputs(module, 2)
        sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=2))
        with pytest.raises(mkernel.CommTimeout) as e:
            getattr(mkernel, module.SPEC.name)(a, b, world=world, schedule=sched)
        assert e.value.peer == 2 and e.value.rank != 2, str(e.value)
        pads = ("partial", "node_part", "rail_ready", "chunk_ready", "tile_flag", "tile_ready")
        assert e.value.signal.startswith(pads), str(e.value)
        assert "peer 2" in str(e.value)
        assert_pads_zero(world)  # the failed call left the world clean


def test_stalled_proxy_times_out_naming_the_signal(monkeypatch):
    stalled = lambda ring, count: rdma.proxy(ring, count, stall_after=0)  # noqa: E731
    monkeypatch.setattr(program, "proxy", stalled)
    for module in (rs_mod, ag_mod, ar_mod):
        world = mkernel.World.emulated(4, nodes=2, timeout_s=0.05)
        (a, b), _ = _inputs(module, 3)
        with pytest.raises(mkernel.CommTimeout) as e:
            getattr(mkernel, module.SPEC.name)(a, b, world=world)
        sig = e.value.signal
        assert sig.startswith(("node_part", "rail_ready", "chunk_ready", "tile_", "rdma_tail")), sig
        if not sig.startswith("rdma_tail"):  # a receiver: the peer is on the other node
            assert e.value.peer // 2 != e.value.rank // 2, str(e.value)


def test_missing_wait_for_a_node_peers_partial_is_a_race():
    """The reducer of a tile for another node's owner must wait for its node peers' partials."""
    W, N = 4, 2
    world = mkernel.World.emulated(W, nodes=N)
    sched = mkernel.Schedule(overlap="intra_sm", sms=2, seed=1)
    a, b = gemm_inputs(W, W * 16, 16, 16, 4)
    plan = sched.plan("gemm_rs", world, a, b)
    for tasks in plan.roles["compute"].tasks:
        for t in tasks:
            if t.raises and t.raises[0].pad == "node_part":
                t.waits = tuple(w for w in t.waits if w.pad != "partial")
    with pytest.raises((mkernel.RaceError, mkernel.CommTimeout), match=r"stage\[\d\]|partial"):
        run_calls(rs_mod, world, sched, a, b, 1, calls=1)


# -- what is not there: clear errors before anything runs ------------------------------------------


def test_a_distributed_world_over_nodes_without_nvshmem_says_so(monkeypatch):
    # A GPU world object without a GPU: the checks come before anything touches the device.
    from mkernel import nvshmem_ext

    monkeypatch.setattr(nvshmem_ext, "SPEC", None)
    monkeypatch.setattr(
        nvshmem_ext, "ABSENT", "NVSHMEM not found (pip install nvidia-nvshmem-cu13)"
    )
    a, b = gemm_inputs(4, 16, 16, 16, 0)
    distributed = World(size=4, device=torch.device("cuda", 0), kind="distributed", nodes=2)
    for op in (mkernel.gemm_rs, mkernel.ag_gemm, mkernel.gemm_ar):
        with pytest.raises(RuntimeError, match="NVSHMEM: NVSHMEM not found.*nvshmem-cu13"):
            op(a[0], b[0], world=distributed)


@pytest.mark.parametrize("module", [rs_mod, ag_mod, ar_mod])
def test_every_raise_across_nodes_is_a_set(module):
    """A cross-node raise becomes a put whose signal the proxy's stream sets (kPutSetDevice): the
    launch refuses a plan with an add across nodes; the three plans have none."""
    from mkernel.runtime.gpu import check_cross_node_raises

    for W, N in ((2, 2), (4, 2), (8, 2), (8, 4)):
        world = mkernel.World.emulated(W, nodes=N)
        for overlap in ("intra_sm", "inter_sm"):
            sched = mkernel.Schedule(overlap=overlap, sms=3)
            rows = {rs_mod: W * 40, ag_mod: 40, ar_mod: 40}[module]
            plan = sched.plan(
                module.SPEC.name, world, m=rows * (1 if module is rs_mod else W), n=48, k=16 * W
            )
            check_cross_node_raises(plan)
    R = plan.world_size // plan.nodes
    rank, task = next(
        (r, t)
        for role in ("compute", "comm")
        for r, ts in enumerate(plan.roles[role].tasks)
        for t in ts
        if any(x.rank // R != r // R for x in t.raises)
    )
    task.raises = tuple(
        dataclasses.replace(x, op="add") if x.rank // R != rank // R else x for x in task.raises
    )
    with pytest.raises(ValueError, match="another node; a put's signal can only be set"):
        check_cross_node_raises(plan)


def test_ops_without_a_hierarchical_plan_refuse_several_nodes():
    world = mkernel.World.emulated(4, nodes=2)
    x = torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="all_gather has no plan for a world of 2 nodes"):
        mkernel.all_gather(x, world=world)
