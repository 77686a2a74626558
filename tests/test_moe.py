"""MoE dispatch + grouped GEMM and grouped GEMM + combine on the CPU interpreter (issue 11).

Expected values are computed here in fp64 from the issue's formulas, never taken from
``mkernel.reference`` (the references are checked against the same formulas); tolerances come
from bf16 rounding (tests/helpers.py assert_close_exact). Row order, ``src`` and ``expert_offsets``
are exact. Routings: uniform, everything to one expert, everything to rank 0 (experts and whole
ranks receive nothing), -1 slots, nothing routed, T = 0, k in {1, 2, 8}; both overlaps, W 1..4 and
one W = 8; pads zero after every call, two calls with different routings; bad input; planted
protocol mistakes caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.bench.baselines import moe_gpu
from mkernel.errors import CommTimeout, RaceError, TileWriteError
from mkernel.interp.program import run_plan
from mkernel.ops import common
from mkernel.ops import moe_dispatch_gemm as mdg
from mkernel.ops import moe_gemm_combine as mgc
from mkernel.ops.moe_common import route
from mkernel.protocol import Raise
from tests.helpers import assert_close_exact, assert_pads_zero

dispatch, combine = mdg.moe_dispatch_gemm, mgc.moe_gemm_combine
H, INTER = 16, 8


def routing(W: int, T: int, E: int, k: int, mode: str, seed: int) -> torch.Tensor:
    """[W, T, k] int64 global expert ids (E local experts per rank), distinct per token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((W, T, k), -1, dtype=torch.int64)
    for s in range(W):
        for t in range(T):
            if mode == "uniform":
                row = torch.randperm(W * E, generator=g)[:k]
                drop = torch.rand(k, generator=g) < 0.2  # some unused slots
                ids[s, t] = torch.where(drop, -1, row)
            elif mode == "one_expert":  # every token to global expert W * E - 1, slot 0 only
                ids[s, t, 0] = W * E - 1
            elif mode == "rank0":  # every slot to one of rank 0's experts (k <= E here)
                ids[s, t] = torch.randperm(E, generator=g)[:k]
    return ids


def operands(W: int, T: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(W, T, H, generator=g).bfloat16()
    w1 = torch.randn(W, E, H, INTER, generator=g).bfloat16()
    w2 = torch.randn(W, E, INTER, H, generator=g).bfloat16()
    weights = torch.rand(W, T, 8, generator=g)  # the first k columns are used
    return x, w1, w2, weights


def expected_rows(ids: torch.Tensor, E: int) -> list[list[tuple[int, int, int, int]]]:
    """Per destination: (src, token, slot, local expert) by expert, then source, token, slot."""
    W, T, k = ids.shape
    return [
        [
            (s, t, j, e)
            for e in range(E)
            for s in range(W)
            for t in range(T)
            for j in range(k)
            if int(ids[s, t, j]) == d * E + e
        ]
        for d in range(W)
    ]


def check_dispatch(res, x, ids, w1, E: int, what: str) -> None:
    W = x.shape[0]
    for d, rows in enumerate(expected_rows(ids, E)):
        assert res.src[d].dtype == torch.int32 and res.expert_offsets[d].dtype == torch.int32
        assert res.src[d].tolist() == [list(r[:3]) for r in rows], f"{what}: src of rank {d}"
        offs = [sum(1 for r in rows if r[3] < e) for e in range(E + 1)]
        assert res.expert_offsets[d].tolist() == offs, f"{what}: offsets of rank {d}"
        assert res.y[d].shape == (len(rows), INTER), f"{what}: y of rank {d}"
        if rows:
            a = torch.stack([x[s, t].double() for s, t, _, _ in rows])
            b = torch.stack([w1[d, e].double() for _, _, _, e in rows])
            exact = torch.einsum("rh,rhi->ri", a, b)
            mag = torch.einsum("rh,rhi->ri", a.abs(), b.abs())
            assert_close_exact(res.y[d], exact, mag, H, f"{what}: y of rank {d}")
    assert len(res.y) == W


def expected_out(h, w2, ids, weights, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, magnitude) of out[s, t] = sum_j weights[s, t, j] * (h_row(s, t, j) @ w2[e])."""
    W, T, k = ids.shape
    exact = torch.zeros(W, T, H, dtype=torch.float64)
    mag = torch.zeros_like(exact)
    for d, rows in enumerate(expected_rows(ids, E)):
        for r, (s, t, j, e) in enumerate(rows):
            p = h[d][r].double() @ w2[d, e].double()
            pm = h[d][r].double().abs() @ w2[d, e].double().abs()
            exact[s, t] += weights[s, t, j].double() * p
            mag[s, t] += weights[s, t, j].double().abs() * pm
    return exact, mag


def layer(W, T, E, k, mode, seed, overlap, chunk_rows=None, world=None):
    """dispatch -> relu -> combine, each checked; returns the world."""
    world = world or mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, seed)
    weights = weights[..., :k].contiguous()
    ids = routing(W, T, E, k, mode, seed)
    sched = mkernel.Schedule(overlap=overlap, chunk_rows=chunk_rows, seed=seed)
    what = f"W={W} T={T} E={E} k={k} {mode} {overlap} chunk_rows={chunk_rows}"
    res = dispatch(x, ids, w1, world, sched)
    check_dispatch(res, x, ids, w1, E, what)
    assert_pads_zero(world)
    h = [torch.relu(y) for y in res.y]
    out = combine(h, w2, res, weights, world, sched)
    assert out.shape == (W, T, H) and out.dtype == torch.bfloat16
    exact, mag = expected_out(h, w2, ids, weights, E)
    assert_close_exact(out, exact, mag, INTER + k, f"{what}: out")
    unrouted = (ids < 0).all(dim=-1)
    assert bool((out[unrouted] == 0).all()), f"{what}: a token routed nowhere is not zero"
    assert_pads_zero(world)
    return world


MODES = ["uniform", "one_expert", "rank0", "none"]


@settings(max_examples=30)
@given(
    W=st.integers(1, 4),
    T=st.integers(0, 12),
    E=st.integers(1, 3),
    k=st.sampled_from([1, 2, 8]),
    mode=st.sampled_from(MODES),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    chunk_rows=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
@example(W=4, T=6, E=2, k=8, mode="uniform", overlap="inter_sm", chunk_rows=3, seed=0)
@example(W=3, T=5, E=3, k=8, mode="uniform", overlap="intra_sm", chunk_rows=None, seed=1)
@example(W=2, T=0, E=2, k=2, mode="uniform", overlap="intra_sm", chunk_rows=None, seed=2)
@example(W=3, T=7, E=2, k=1, mode="one_expert", overlap="inter_sm", chunk_rows=2, seed=3)
@example(W=3, T=5, E=2, k=2, mode="rank0", overlap="intra_sm", chunk_rows=1, seed=4)
@example(W=2, T=4, E=1, k=1, mode="none", overlap="inter_sm", chunk_rows=None, seed=5)
def test_moe_layer_matches_the_formulas(W, T, E, k, mode, overlap, chunk_rows, seed):
    assume(k <= W * E and (mode != "rank0" or k <= E))
    world = layer(W, T, E, k, mode, seed, overlap, chunk_rows)
    # the same world and shapes (the cached plan), another routing: the layout makes new tasks
    other = MODES[(MODES.index(mode) + 1) % len(MODES)]
    if other != "rank0" or k <= E:
        layer(W, T, E, k, other, seed + 7, overlap, chunk_rows, world)


@settings(max_examples=15)
@given(
    W=st.integers(1, 3),
    T=st.integers(1, 12),
    E=st.integers(1, 3),
    k=st.sampled_from([1, 2, 8]),
    pieces=st.sampled_from([1, 2, 3]),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    seed=st.integers(0, 2**16),
)
def test_pushes_and_expands_cut_in_small_pieces(W, T, E, k, pieces, overlap, seed):
    # PIECE_ROWS (32: never reached by the shapes above) shrunk so runs of tokens and of an
    # expert's rows are cut at every boundary: several pieces per destination and per (expert,
    # source), all counted into one flag, under random interleavings
    assume(k <= W * E)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mdg, "PIECE_ROWS", pieces)
        layer(W, T, E, k, "uniform", seed, overlap)


def test_eight_ranks():
    layer(8, 3, 1, 2, "uniform", 11, "inter_sm")


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_a_late_rank_changes_nothing_and_a_silent_one_times_out(overlap):
    W, T, E, k = 3, 5, 2, 2
    x, w1, w2, weights = operands(W, T, E, 6)
    ids = routing(W, T, E, k, "uniform", 6)
    world = mkernel.World.emulated(W, timeout_s=0.05)
    on_time = dispatch(x, ids, w1, world, mkernel.Schedule(overlap=overlap))
    late = mkernel.Faults(delay_rank=1, delay_us=50)
    res = dispatch(x, ids, w1, world, mkernel.Schedule(overlap=overlap, faults=late))
    assert all(torch.equal(a, b) for a, b in zip(res.y, on_time.y, strict=True))
    w = weights[..., :k].contiguous()
    out = combine(res.y, w2, res, w, world, mkernel.Schedule(overlap=overlap))
    out_late = combine(res.y, w2, res, w, world, mkernel.Schedule(overlap=overlap, faults=late))
    assert torch.equal(out, out_late)
    silent = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=0))
    # a silent rank raises nothing: its peers' layouts wait for its routing ids
    with pytest.raises(CommTimeout, match=r"ids_landed\[src=0\]"):
        dispatch(x, ids, w1, world, silent)
    with pytest.raises(CommTimeout, match=r"slots_landed\[src=0\]"):  # its rows' places
        combine(res.y, w2, res, w, world, silent)
    assert_pads_zero(world)  # a timed-out call resets the world's pads


def test_row_order_src_and_offsets_by_hand():
    # W = 2, E_local = 2 (global experts 0, 1 on rank 0; 2, 3 on rank 1), k = 2
    ids = torch.tensor([[[3, 0], [1, -1], [2, 3]], [[0, 2], [-1, -1], [1, 0]]])
    world = mkernel.World.emulated(2)
    x, w1, _, _ = operands(2, 3, 2, 0)
    res = dispatch(x, ids, w1, world)
    # rank 0: expert 0 <- (0, 0, 1), (1, 0, 0), (1, 2, 1); expert 1 <- (0, 1, 0), (1, 2, 0)
    assert res.src[0].tolist() == [[0, 0, 1], [1, 0, 0], [1, 2, 1], [0, 1, 0], [1, 2, 0]]
    assert res.expert_offsets[0].tolist() == [0, 3, 5]
    # rank 1: expert 2 <- (0, 2, 0), (1, 0, 1); expert 3 <- (0, 0, 0), (0, 2, 1)
    assert res.src[1].tolist() == [[0, 2, 0], [1, 0, 1], [0, 0, 0], [0, 2, 1]]
    assert res.expert_offsets[1].tolist() == [0, 2, 4]
    check_dispatch(res, x, ids, w1, 2, "by hand")


def _plan_and_routing(ids: torch.Tensor, E: int, chunk_rows: int | None = None):
    W, T, k = ids.shape
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(overlap="intra_sm", chunk_rows=chunk_rows)
    plan = mdg.make_plan(sched, world, T, H, INTER, E, k)
    return plan, route(ids.tolist(), E)


def test_a_token_goes_to_each_destination_rank_once():
    # token 0 of rank 0 feeds both experts of rank 1 and one of rank 0: two pushes, not three
    ids = torch.tensor([[[2, 3, 0], [3, -1, -1]], [[-1, -1, -1], [1, 2, -1]]])
    plan, r = _plan_and_routing(ids, 2)
    comm = mdg.layout_tasks(plan, r, 0)["comm"]
    pushes = [t for t in comm if t.args[0] == mdg.PUSH]
    # (destination, first position, tokens): own rank first; one run of both tokens to rank 1
    assert [t.args[1:] for t in pushes] == [(0, 0, 1), (1, 0, 2)]
    assert r.sent[0] == [[0], [0, 1]]  # the tokens of each run, in token order
    # each push counts its tokens landed at its destination, from me
    assert [[(x.pad, x.rank, x.index, x.value, x.op) for x in t.raises] for t in pushes] == [
        [("landed", 0, (0,), 1, "add")],
        [("landed", 1, (0,), 2, "add")],
    ]
    assert r.recv_base[1] == [0, 2]  # each source owns T = 2 receive rows on rank 1
    # rank 1's expands: its rows by expert, sources nearest first (itself, then rank 0), each
    # after all of that source's tokens landed, counting the rows it expanded
    expands = [t for t in mdg.layout_tasks(plan, r, 1)["comm"] if t.args[0] == mdg.EXPAND]
    # rank 1: expert 0 (global 2) <- (0, 0, 0), (1, 1, 1); expert 1 <- (0, 0, 1), (0, 1, 0)
    assert [t.args[1:] for t in expands] == [(1, 1, 1), (0, 1, 0), (2, 2, 0)]
    assert [[(w.pad, w.index, w.value, w.consumers, w.peer) for w in t.waits] for t in expands] == [
        [("landed", (1,), 1, 1, 1)],
        [("landed", (0,), 2, 2, 0)],
        [("landed", (0,), 2, 2, 0)],
    ]
    assert [[(x.pad, x.rank, x.index, x.value) for x in t.raises] for t in expands] == [
        [("expert_rows", 1, (0, 1), 1)],
        [("expert_rows", 1, (0, 0), 1)],
        [("expert_rows", 1, (1, 0), 2)],
    ]


def test_long_runs_are_cut_into_pieces_and_counted_whole():
    # 70 tokens of rank 0 all feed rank 1 (expert 2) and 40 of them rank 0 too: pushes and expands
    # of at most PIECE_ROWS rows, whose counts add up to what the waits expect
    T, P = 70, mdg.PIECE_ROWS
    ids = torch.full((2, T, 2), -1)
    ids[0, :, 0] = 2
    ids[0, :40, 1] = 0
    plan, r = _plan_and_routing(ids, 2)
    comm = mdg.layout_tasks(plan, r, 0)["comm"]
    pushes = [t.args[1:] for t in comm if t.args[0] == mdg.PUSH]
    assert pushes == [(0, 0, P), (0, P, 40 - P), (1, 0, P), (1, P, P), (1, 2 * P, T - 2 * P)]
    for d in (0, 1):
        mine = [t for t in comm if t.args[0] == mdg.PUSH and t.args[1] == d]
        assert sum(x.value for t in mine for x in t.raises) == len(r.sent[0][d])
        expands = [t for t in mdg.layout_tasks(plan, r, d)["comm"] if t.args[0] == mdg.EXPAND]
        assert [t.args[2] for t in expands] == ([P, 40 - P] if d == 0 else [P, P, T - 2 * P])
        assert all(t.waits[0].value == len(r.sent[0][d]) for t in expands)
        assert all(t.waits[0].consumers == len(expands) for t in expands)


def test_each_expert_tile_waits_for_its_own_experts_rows_only():
    ids = routing(3, 8, 2, 2, "uniform", 5)
    plan, r = _plan_and_routing(ids, 2, chunk_rows=2)
    assert plan.sizes["inter"] <= plan.tile.bn  # one column tile per row tile here
    for d in range(3):
        tiles = mdg.layout_tasks(plan, r, d)["compute"]
        offs = r.offsets[d]
        assert sum(t.args[2] for t in tiles) == offs[-1]  # args: expert, first row, rows, column
        for t in tiles:
            e = t.args[0]
            n_tiles = sum(1 for u in tiles if u.args[0] == e)
            # one wait per source that sends expert e rows: its count of them, and it is the peer
            from_src = [
                sum(1 for (s, tt, j, ee) in r.rows[d] if ee == e and s == src) for src in range(3)
            ]
            want = [("expert_rows", d, (e, s), n, s) for s, n in enumerate(from_src) if n]
            assert [(w.pad, w.rank, w.index, w.value, w.peer) for w in t.waits] == want
            assert sum(w.value for w in t.waits) == offs[e + 1] - offs[e]
            # counted: the last tile of the expert resets each flag
            assert all(w.consumers == n_tiles for w in t.waits)


def test_wide_rows_are_cut_into_column_tiles_as_on_the_device():
    # I and H over the engine's BN = 128: every row tile is several tasks (as the device lays them
    # out), an expert's flags count all of them as consumers, a combine row tile's flag all of its
    # column tiles; the layer still matches the formulas
    W, T, E, k = 2, 6, 2, 2
    world = mkernel.World.emulated(W)
    g = torch.Generator().manual_seed(11)
    Hw, Iw = 136, 264  # 2 and 3 column tiles
    x = torch.randn(W, T, Hw, generator=g).bfloat16()
    w1 = (torch.randn(W, E, Hw, Iw, generator=g) / 12).bfloat16()
    w2 = (torch.randn(W, E, Iw, Hw, generator=g) / 16).bfloat16()
    w = torch.rand(W, T, k, generator=g)
    ids = routing(W, T, E, k, "uniform", 11)
    sched = mkernel.Schedule(chunk_rows=4)
    res = dispatch(x, ids, w1, world, sched)
    plan = next(p for p in world._plans.values() if p.op == "moe_dispatch_gemm")
    r = route(ids.tolist(), E)
    for d in range(W):
        tiles = mdg.layout_tasks(plan, r, d)["compute"]
        assert {t.args[3] for t in tiles} == {0, 128, 256}
        for t in tiles:
            row_tiles = -(-(r.offsets[d][t.args[0] + 1] - r.offsets[d][t.args[0]]) // 4)
            assert all(wt.consumers == row_tiles * 3 for wt in t.waits)
        for row, (s, t, _, e) in enumerate(r.rows[d]):
            exact = x[s, t].double() @ w1[d, e].double()
            mag = x[s, t].double().abs() @ w1[d, e].double().abs()
            assert_close_exact(res.y[d][row : row + 1], exact[None], mag[None], Hw, f"y {d} {row}")
    out = combine(res.y, w2, res, w, world, sched)
    plan_c = next(p for p in world._plans.values() if p.op == "moe_gemm_combine")
    offs = [o.tolist() for o in res.expert_offsets]
    made = mgc.layout_tasks(
        plan_c, offs[0], mgc.slot_table(plan_c, offs, [s.tolist() for s in res.src], 0), 0
    )
    assert all(x.value == 1 for t in made["compute"] for x in t.raises)  # one per column tile
    assert all(wt.value == 2 for t in made["comm"] for wt in t.waits)  # H: 2 column tiles
    exact = torch.zeros(W, T, Hw, dtype=torch.float64)
    mag = torch.zeros_like(exact)
    for d, rows in enumerate(expected_rows(ids, E)):
        for i, (s, t, j, e) in enumerate(rows):
            exact[s, t] += w[s, t, j].double() * (res.y[d][i].double() @ w2[d, e].double())
            mag[s, t] += w[s, t, j].double() * (
                res.y[d][i].double().abs() @ w2[d, e].double().abs()
            )
    assert_close_exact(out, exact, mag, Iw + k, "out")
    assert_pads_zero(world)


def test_back_to_back_calls_in_one_run_reuse_the_workspace_safely():
    # two calls on one machine state: the second call's pushes into recv and partial must be
    # ordered after the first call's reads (the entry barrier does it)
    W, T, E, k = 3, 6, 2, 2
    world = mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, 3)
    ids = routing(W, T, E, k, "uniform", 3)
    for overlap in ("intra_sm", "inter_sm"):
        sched = mkernel.Schedule(overlap=overlap, chunk_rows=2)
        world_, _, plan, r, bufs = mdg.prepare(x, ids, w1, world, sched)
        tw = mdg.twins_of(plan, r)
        ws = {k_: v.local for k_, v in common.workspace(world, plan).items() if v is not None}
        run_plan(world, plan, {**bufs, **ws}, tw.moves, 1, tw.outputs, 2, tw.layout, "y")
        res = mdg.reference(x, ids, w1, world)
        h = [torch.relu(y) for y in res.y]
        _, _, plan, bufs = mgc.prepare(h, w2, res, weights[..., :k].contiguous(), world, sched)
        tw = mgc.twins_of(plan, res)
        ws = {k_: v.local for k_, v in common.workspace(world, plan).items() if v is not None}
        run_plan(world, plan, {**bufs, **ws}, tw.moves, 2, tw.outputs, 2, tw.layout)
        assert_pads_zero(world)


def test_references_match_the_formulas():
    W, T, E, k = 3, 5, 2, 2
    world = mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, 9)
    weights = weights[..., :k].contiguous()
    ids = routing(W, T, E, k, "uniform", 9)
    res = mkernel.reference.moe_dispatch_gemm(x, ids, w1, world)
    check_dispatch(res, x, ids, w1, E, "reference")
    out = mkernel.reference.moe_gemm_combine(res.y, w2, res, weights, world)
    assert_close_exact(out, *expected_out(res.y, w2, ids, weights, E), INTER + k, "reference out")


# -- bad input ------------------------------------------------------------------------------------


def _good(W: int = 2, T: int = 3, E: int = 2, k: int = 2):
    world = mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, 0)
    ids = routing(W, T, E, k, "uniform", 0)
    return world, x, ids, w1, w2, weights[..., :k].contiguous()


def _bad_dispatch_cases():
    world, x, ids, w1, _, _ = _good()
    dup = ids.clone()
    dup[1, 2] = torch.tensor([3, 3])
    far = ids.clone()
    far[1, 2, 0] = 4
    neg = ids.clone()
    neg[0, 1, 1] = -2
    w4 = mkernel.World.emulated(4)
    return [
        ((x.float(), ids, w1, world), TypeError, "x must be torch.bfloat16"),
        ((x, ids.float(), w1, world), TypeError, "topk_ids must be torch.int32 or torch.int64"),
        ((x, ids, w1.half(), world), TypeError, "w1 must be torch.bfloat16"),
        ((x[:, :2].contiguous(), ids, w1, world), ValueError, "topk_ids has 3 tokens"),
        ((x, ids, w1[:, :, :8].contiguous(), world), ValueError, "w1 is .* but x has H=16"),
        ((x, ids[..., 0].contiguous(), w1, world), ValueError, "topk_ids must have shape"),
        ((x, ids, w1[:, :0].contiguous(), world), ValueError, "w1 has E_local=0"),
        ((x, torch.zeros(2, 3, 5, dtype=torch.int32), w1, world), ValueError, "k .*=5 must be"),
        ((x, ids[..., :0].contiguous(), w1, world), ValueError, "k .*=0 must be"),
        ((x, ids, w1, w4), ValueError, "x has leading dimension 2.*another world"),
        ((x[..., :12].contiguous(), ids, w1[:, :, :12].contiguous(), world), ValueError, "H .*=12"),
        ((x, dup, w1, world), ValueError, "topk_ids: token 2 of rank 1 names an expert twice"),
        ((x, far, w1, world), ValueError, r"expert id 4 of rank 1, token 2 .*\[-1, E=4\)"),
        ((x, neg, w1, world), ValueError, "topk_ids: expert id -2 of rank 0, token 1"),
        ((x.transpose(1, 2).contiguous().transpose(1, 2), ids, w1, world), ValueError, "x must"),
        ((x, ids, w1, "world"), TypeError, "world must be an mkernel.World"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(16))
def test_bad_dispatch_input_is_named_before_anything_runs(case):
    args, exc, match = _bad_dispatch_cases()[case]
    with pytest.raises(exc, match=match):
        dispatch(*args)
    assert len(_bad_dispatch_cases()) == 16


@pytest.mark.parametrize("seed", range(4))
def test_the_one_host_read_counts_bad_ids_repeats_and_rows_per_destination(seed):
    """routing_summary (check_ids' and the counts exchange's one read of the device): per source
    rank, ids outside [-1, E), ids a token repeats, and its used slots per destination rank,
    counted here token by token; check_ids returns the counts of good ids."""
    from mkernel.ops.moe_common import check_ids, routing_summary

    g = torch.Generator().manual_seed(seed)
    W, T, k, E = 3, 17, 4, 2
    ids = torch.stack([torch.randperm(W * E + 1, generator=g)[:k] - 1 for _ in range(W * T)])
    ids = ids.view(W, T, k).to(torch.int32 if seed % 2 else torch.int64)
    want = [[0, 0] + [int(((ids[s] >= 0) & (ids[s] // E == d)).sum()) for d in range(W)]
            for s in range(W)]  # fmt: skip
    assert routing_summary(ids, W * E, E).tolist() == want
    assert check_ids(ids, W * E, E) == [row[2:] for row in want]
    bad = ids.clone()
    bad[1, 5, 0], bad[2, 0] = W * E, torch.tensor([1, 1, -1, -1])
    got = routing_summary(bad, W * E, E).tolist()
    assert [row[:2] for row in got] == [[0, 0], [1, 0], [0, 1]]
    was = int(ids[1, 5, 0])  # the id the bad one replaced: no longer counted
    assert got[1][2:] == [n - (was >= 0 and d == was // E) for d, n in enumerate(want[1][2:])]


def test_results_without_out_are_nan_on_the_cpu_whatever_the_poison_switch(monkeypatch):
    """common.result_buffer: the interpreter's results are always poisoned (its kernel-end check
    and the tests rely on it); MKERNEL_POISON only decides on a GPU."""
    for value in (None, "0", "1"):
        if value is None:
            monkeypatch.delenv("MKERNEL_POISON", raising=False)
        else:
            monkeypatch.setenv("MKERNEL_POISON", value)
        t = common.result_buffer((3, 5), torch.float32, torch.device("cpu"))
        assert t.shape == (3, 5) and t.dtype == torch.float32 and bool(t.isnan().all())


def test_bad_combine_input_is_named_before_anything_runs():
    world, x, ids, w1, w2, weights = _good()
    res = dispatch(x, ids, w1, world)
    h = list(res.y)
    other = mkernel.World.emulated(2)
    cases = [
        ((h[:1], w2, res, weights, world), TypeError, "h must be a list of W=2"),
        ((res.y[0], w2, res, weights, world), TypeError, "h must be a list of W=2"),
        (([h[0].float(), h[1]], w2, res, weights, world), TypeError, r"h\[0\] must be a torch.bf"),
        (([h[0], h[1][:-1]], w2, res, weights, world), ValueError, r"h\[1\] must be \[R=.*rank 1"),
        ((h, w2[..., :8].contiguous(), res, weights, world), ValueError, "w2 is .* H=16"),
        ((h, w2.float(), res, weights, world), TypeError, "w2 must be torch.bfloat16"),
        ((h, w2, "dispatch", weights, world), TypeError, "dispatch must be the MoeDispatch"),
        ((h, w2, res, weights, other), ValueError, "dispatch was made in another world"),
        ((h, w2, res, weights.double(), world), TypeError, "topk_weights must be torch.float32"),
        ((h, w2, res, weights[:, :2].contiguous(), world), ValueError, "topk_weights is"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            combine(*args)
    assert_pads_zero(world)


def test_distributed_cpu_worlds_are_refused_before_anything_runs():
    """The interpreter runs emulated worlds; a distributed world runs on GPUs (the fused kernels):
    on the CPU both ops say so by name."""
    dist = mkernel.World(size=2, device=torch.device("cpu"), kind="distributed")
    with pytest.raises(NotImplementedError, match="moe_dispatch_gemm on the CPU runs"):
        dispatch(None, None, None, dist)
    with pytest.raises(NotImplementedError, match="moe_gemm_combine on the CPU runs"):
        combine(None, None, None, None, dist)
    from mkernel.runtime import registry

    # the dispatch has its fused kernel (kernels/moe_dispatch_gemm.cu) in the build
    assert mdg.SPEC.device and "moe_dispatch_gemm" in registry.device_names()


def test_a_world_of_several_nodes_is_refused_as_by_the_other_flat_ops():
    """Both ops take the run path's nodes check (common.check_nodes): a world of nodes > 1 raises
    the UnsupportedWorld the other ops without a hierarchical plan raise (all_gather's message,
    the op's name in it), before anything runs."""
    W, T, E, k = 4, 3, 1, 1
    world, flat = mkernel.World.emulated(W, nodes=2), mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, 5)
    ids, w = routing(W, T, E, k, "uniform", 5), weights[..., :k].contiguous()
    with pytest.raises(common.UnsupportedWorld) as ag:
        mkernel.all_gather(x, world=world)
    with pytest.raises(common.UnsupportedWorld) as got:
        dispatch(x, ids, w1, world)
    assert str(got.value) == str(ag.value).replace("all_gather", "moe_dispatch_gemm", 1)
    d = dispatch(x, ids, w1, flat)
    moved = mkernel.MoeDispatch(d.y, d.src, d.expert_offsets, world, d.topk_ids, d.hidden)
    with pytest.raises(common.UnsupportedWorld) as got:
        combine(d.y, w2, moved, w, world)
    assert str(got.value) == str(ag.value).replace("all_gather", "moe_gemm_combine", 1)
    assert world.last_timeline is None and not world.signal_pads()


@settings(max_examples=40)
@given(
    W=st.integers(1, 4),
    T=st.integers(0, 9),
    E=st.integers(1, 3),
    k=st.sampled_from([1, 2, 8]),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_gpu_path_rows_and_sums(W, T, E, k, mode, seed):
    """The GPU path's routing (a device sort), gather and slot-order combine, run here with the
    grouped GEMM's CPU reference: the same rows, offsets and sums as the protocol's."""
    assume(mode != "rank0" or k <= E)
    k = min(k, W * E)
    world = mkernel.World.emulated(W)
    x, w1, w2, weights = operands(W, T, E, seed)
    weights = weights[..., :k].contiguous()
    ids = routing(W, T, E, k, mode, seed)
    what = f"gpu path W={W} T={T} E={E} k={k} {mode}"
    res = moe_gpu.dispatch(x, ids.to(torch.int32), w1, H, world)
    check_dispatch(res, x, ids, w1, E, what)
    h = [torch.relu(y) for y in res.y]
    out = moe_gpu.combine(h, w2, res, weights)
    exact, mag = expected_out(h, w2, ids, weights, E)
    assert_close_exact(out, exact, mag, INTER + k, f"{what}: out")
    assert bool((out[(ids < 0).all(dim=-1)] == 0).all()), f"{what}: a token routed nowhere"


# -- planted protocol mistakes --------------------------------------------------------------------


def _run_dispatch(edit=None, moves=None, seed: int = 0):
    """One dispatch call through run_cpu with the layout's tasks changed by ``edit(made, rank)``."""
    W, T, E, k = 3, 6, 2, 2
    world = mkernel.World.emulated(W, timeout_s=0.05)
    x, w1, _, _ = operands(W, T, E, 1)
    ids = routing(W, T, E, k, "uniform", 1)
    sched = mkernel.Schedule(overlap="inter_sm", chunk_rows=2, seed=seed)
    world, sched, plan, r, bufs = mdg.prepare(x, ids, w1, world, sched)
    tw = mdg.twins_of(plan, r)

    def layout(ctx):
        made = yield from tw.layout(ctx)
        return edit(made, ctx.rank) if edit else made

    common.run_cpu(world, plan, bufs, (moves or tw.moves), tw.outputs, seed, layout, "y")


def test_expert_gemm_not_waiting_for_its_rows_is_a_race():
    def no_waits(made, rank):
        made["compute"] = [dataclasses.replace(t, waits=()) for t in made["compute"]]
        return made

    with pytest.raises(RaceError, match="expanded"):
        _run_dispatch(no_waits)


def test_pushes_that_signal_nothing_time_out_naming_the_flag():
    def silent(made, rank):  # rank 0's pushes land but never count: its peers' experts starve
        for t in made["comm"] if rank == 0 else []:
            t.raises = ()
        return made

    # the peers' expands wait for rank 0's tokens (the GEMM tiles wait on the expands)
    with pytest.raises(CommTimeout, match=r"waits landed\[src=0\] from peer 0"):
        _run_dispatch(silent)


def test_counting_on_the_wrong_rank_is_caught():
    # a push counts on the next rank: that rank's expert starts before its rows have landed (a
    # race on recv) or never gets its count (a timeout): either way, caught
    def wrong(made, rank):
        for t in made["comm"]:
            t.raises = tuple(Raise(x.pad, (x.rank + 1) % 3, x.index, 1, "add") for x in t.raises)
        return made

    with pytest.raises((RaceError, CommTimeout)):
        _run_dispatch(wrong)


def test_a_gemm_tile_that_stores_nothing_is_reported_at_the_kernel_end():
    W, T, E, k = 2, 4, 1, 1
    world = mkernel.World.emulated(W)
    x, w1, _, _ = operands(W, T, E, 2)
    ids = routing(W, T, E, k, "uniform", 2)
    world, sched, plan, r, bufs = mdg.prepare(x, ids, w1, world, mkernel.Schedule())
    tw = mdg.twins_of(plan, r)

    def skip(ctx, task):  # the GEMM tile's twin forgets its store into y
        yield from ()

    moves = {**tw.moves, "compute": skip}
    with pytest.raises(TileWriteError, match="never written"):
        common.run_cpu(world, plan, bufs, moves, tw.outputs, 0, tw.layout, "y")


def test_combine_reduce_not_waiting_for_its_rows_is_a_race():
    W, T, E, k = 3, 5, 2, 2
    world = mkernel.World.emulated(W, timeout_s=0.05)
    x, w1, w2, weights = operands(W, T, E, 4)
    ids = routing(W, T, E, k, "uniform", 4)
    res = dispatch(x, ids, w1, world)
    sched = mkernel.Schedule(overlap="intra_sm")
    world, sched, plan, bufs = mgc.prepare(
        res.y, w2, res, weights[..., :k].contiguous(), world, sched
    )
    tw = mgc.twins_of(plan, res)

    def layout(ctx):
        made = yield from tw.layout(ctx)
        made["comm"] = [dataclasses.replace(t, waits=()) for t in made["comm"]]
        return made

    with pytest.raises(RaceError, match="partial"):
        common.run_cpu(world, plan, bufs, tw.moves, tw.outputs, 0, layout)


def test_combine_reduces_are_claimed_by_several_agents_in_any_order():
    # comm_any_order: each comm unit runs as ANY_ORDER_AGENTS agents claiming its tasks (the
    # device's warps); every reduce runs exactly once, some unit's by several agents, and the
    # result is the formula's whichever agent ran what
    from mkernel.interp.program import ANY_ORDER_AGENTS

    assert dict(mgc.SPEC.constants)["comm_any_order"] == 1 and ANY_ORDER_AGENTS > 1
    W, T, E, k = 2, 24, 2, 2
    for overlap in ("intra_sm", "inter_sm"):
        world = mkernel.World.emulated(W)
        x, w1, w2, weights = operands(W, T, E, 6)
        ids = routing(W, T, E, k, "uniform", 6)
        w = weights[..., :k].contiguous()
        res = dispatch(x, ids, w1, world)
        extra = {"comm_sms": 1} if overlap == "inter_sm" else {}
        sched = mkernel.Schedule(overlap=overlap, sms=2, **extra)
        world, sched, plan, bufs = mgc.prepare(res.y, w2, res, w, world, sched)
        tw = mgc.twins_of(plan, res)
        ran: list[tuple[int, int, int]] = []  # (rank, task, agent)

        def comm(ctx, task, inner=tw.moves["comm"], ran=ran):
            ran.append((ctx.rank, task.id, ctx.agent.id))
            yield from inner(ctx, task)

        moves = {**tw.moves, "comm": comm}
        common.run_cpu(world, plan, bufs, moves, tw.outputs, 3, tw.layout, "out")
        for r in range(W):
            assert sorted(t for rr, t, _ in ran if rr == r) == list(range(T)), overlap
        assert len({a for _, _, a in ran}) > W * plan.comm_units, f"{overlap}: one agent per unit"
        exact, mag = expected_out(res.y, w2, ids, w, E)
        assert_close_exact(bufs["out"], exact, mag, INTER + k, overlap)
        assert_pads_zero(world)


def test_a_bad_id_found_on_the_device_is_named_from_the_status_record():
    # the kernel's layout records (rank, token, slot, id) in the status block; the host names them
    from mkernel.protocol import STATUS_ERRORS, STATUS_FIELDS
    from mkernel.runtime.gpu import bad_input

    plan = mdg.make_plan(mkernel.Schedule(), mkernel.World.emulated(2), 8, H, INTER, 3, 2)
    v = dict.fromkeys(STATUS_FIELDS, 0)
    v.update(error=STATUS_ERRORS.index("bad_input"), rank=1, task=5, index=1, value=77)
    e = bad_input(plan, v)
    assert isinstance(e, mkernel.DeviceInputError) and isinstance(e, ValueError)
    assert (e.op, e.rank, e.task, e.index, e.value) == ("moe_dispatch_gemm", 1, 5, 1, 77)
    assert "expert id 77 of rank 1, token 5 (slot 1) is outside [-1, E=6)" in str(e)
