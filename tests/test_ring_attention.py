"""ring_attention (forward) on the CPU interpreter: each rank's out and lse against an fp64 softmax
attention computed here from the global positions of the layout (never from mkernel.reference),
with a tolerance from fp32 score and sum errors plus the final bf16 rounding; NaN-poisoned outputs;
pads back to zero; two calls in a row; W = 1 is plain attention; the plan's laws (each q tile's
chain of tasks in a row on one unit, the landed waits and their consumers, what is sent, what is
skipped under causal masks, zigzag's equal work); bad input named before anything runs; planted
protocol mistakes caught while running (races on the slots, a chain split across units)."""

from __future__ import annotations

import copy
import dataclasses
import math
import types

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.errors import RaceError, TileWriteError
from mkernel.interp import program, twins
from mkernel.ops import common
from mkernel.ops import ring_attention as ra
from mkernel.ops.ring_attention import attention, ring_attention
from mkernel.protocol import encode
from tests.helpers import U_BF16, U_FP32, assert_pads_zero, assert_within


def _inputs(W: int, B: int, S: int, Hq: int, Hkv: int, D: int = 64, seed: int = 0):
    """q [W, B, S, Hq, D], k, v [W, B, S, Hkv, D]: bf16, seeded normal values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(W, B, S, Hq, D, generator=g).bfloat16()
    k = torch.randn(W, B, S, Hkv, D, generator=g).bfloat16()
    v = torch.randn(W, B, S, Hkv, D, generator=g).bfloat16()
    return q, k, v


def _positions(W: int, S: int, layout: str) -> list[list[int]]:
    """Global sequence positions of each rank's local rows, as issue 12 defines the layouts."""
    if layout == "contiguous":
        return [list(range(r * S, (r + 1) * S)) for r in range(W)]
    h = S // 2
    chunk = [list(range(c * h, (c + 1) * h)) for c in range(2 * W)]
    return [chunk[r] + chunk[2 * W - 1 - r] for r in range(W)]


def _exact(q, k, v, causal: bool, scale: float, layout: str, p_bf16: bool = False):
    """fp64 attention over every rank's rows at their global positions: per rank (out [W, B, S,
    Hq, D], lse [W, B, Hq, S]) and the tolerances of an fp32 computation rounded to bf16.
    ``p_bf16``: the probabilities are rounded to bf16 before P @ V (the GPU engine's wgmma takes
    bf16 operands, as every FlashAttention-style kernel does): one more U_BF16 * P @ |V|."""
    W, B, S, Hq, D = q.shape
    group = Hq // k.shape[3]
    pos = torch.tensor(_positions(W, S, layout)).reshape(-1)  # rank-major rows

    def rows(x):  # [W, B, S, H, D] -> [B, W * S, H, D], rank-major
        return x.double().transpose(0, 1).reshape(B, W * S, x.shape[3], D)

    Q = rows(q)
    K, V = rows(k).repeat_interleave(group, 2), rows(v).repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K) * scale
    # fp32 score error: a D-term dot product, then the scale's rounding
    s_err = (D + 2) * U_FP32 * scale * torch.einsum("bqhd,bkhd->bhqk", Q.abs(), K.abs())
    s_err = s_err + U_FP32 * s.abs()
    future = pos[None, :] > pos[:, None]  # [query, key]
    if causal:
        s = s.masked_fill(future, -math.inf)
        s_err = s_err.masked_fill(future, 0.0)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, n]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, V)
    mag = torch.einsum("bhqk,bkhd->bqhd", p, V.abs())
    e = s_err.amax(dim=-1)  # [B, H, n]
    terms = W * S + 8 * W + 16  # fp32 sums over the keys, the merges' rescaling, exp, division
    out_tol = U_BF16 * out.abs() + (4 * e.transpose(1, 2)[..., None] + terms * U_FP32) * mag
    if p_bf16:
        out_tol = out_tol + U_BF16 * mag
    lse_tol = 3 * e + terms * U_FP32 + 2 * U_FP32 * lse.abs()

    def per_rank(x, dim):  # rank-major rows back to [W, ...]
        return torch.stack(x.split(S, dim=dim))

    return (
        per_rank(out, 1),
        per_rank(lse, 2),
        per_rank(out_tol * 1.01, 1),
        per_rank(lse_tol * 1.01, 2),
    )


def _assert_attention(out, lse, q, k, v, causal, scale, layout, what: str, p_bf16=False) -> None:
    W, B, S, Hq, D = q.shape
    assert out.shape == (W, B, S, Hq, D) and out.dtype == torch.bfloat16, what
    assert lse.shape == (W, B, Hq, S) and lse.dtype == torch.float32, what
    assert not torch.isnan(out.float()).any(), f"{what}: NaN in out (an unwritten tile)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse (an unwritten tile)"
    x_out, x_lse, out_tol, lse_tol = _exact(q, k, v, causal, scale, layout, p_bf16)
    for name, got, want, tol in (("out", out, x_out, out_tol), ("lse", lse, x_lse, lse_tol)):
        assert_within(got, want, tol, f"{what}: {name}")


def ring_cases(max_examples: int):
    """The property tests' cases (forward and backward): W 1..4, both layouts, causal or not,
    GQA / MQA, S_local not a multiple of the tile, both overlaps; two fixed edge cases first."""

    def cases(test):
        for ex in reversed(EXAMPLES):
            test = example(**ex)(test)
        test = given(
            W=st.integers(1, 4),
            B=st.integers(1, 2),
            S=st.integers(1, 20),
            heads=st.sampled_from([(4, 2), (4, 1), (2, 2), (1, 1)]),
            causal=st.booleans(),
            layout=st.sampled_from(["contiguous", "zigzag"]),
            overlap=st.sampled_from(["intra_sm", "inter_sm"]),
            sms=st.integers(2, 6),
            seed=st.integers(0, 2**16),
        )(test)
        return settings(max_examples=max_examples)(test)

    return cases


EXAMPLES = (
    dict(W=4, B=1, S=18, heads=(4, 2), causal=True, layout="zigzag", overlap="intra_sm", sms=3,
         seed=0),
    dict(W=3, B=2, S=17, heads=(4, 1), causal=True, layout="contiguous", overlap="inter_sm", sms=4,
         seed=1),
)  # fmt: skip


@ring_cases(max_examples=30)
def test_every_rank_gets_its_rows_of_attention(W, B, S, heads, causal, layout, overlap, sms, seed):
    if layout == "zigzag":
        S += S % 2  # zigzag needs an even S_local
    Hq, Hkv = heads
    world = mkernel.World.emulated(W)
    q, k, v = _inputs(W, B, S, Hq, Hkv, seed=seed)
    sched = mkernel.Schedule(overlap=overlap, sms=sms, seed=seed)
    what = f"W={W} B={B} S={S} Hq={Hq} Hkv={Hkv} causal={causal} {layout} {overlap} sms={sms}"
    out, lse = ring_attention(q, k, v, world, causal=causal, layout=layout, schedule=sched)
    _assert_attention(out, lse, q, k, v, causal, 1 / math.sqrt(64), layout, what)
    assert_pads_zero(world)
    sched2 = mkernel.Schedule(overlap=overlap, sms=sms, seed=seed + 1)
    again = ring_attention(q, k, v, world, causal=causal, layout=layout, schedule=sched2)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), f"{what}: 2nd call differs"
    assert_pads_zero(world)


@pytest.mark.parametrize(
    "W, S, D, layout, causal, scale",
    [
        (8, 4, 64, "zigzag", True, None),  # the one W = 8 case: small
        (8, 3, 64, "contiguous", True, 0.3),
        (2, 20, 128, "zigzag", True, None),
        (3, 9, 128, "contiguous", False, 2.0),
    ],
)
def test_wide_worlds_head_dim_128_and_scales(W, S, D, layout, causal, scale):
    q, k, v = _inputs(W, 1, S, 2, 1, D, seed=W + S)
    world = mkernel.World.emulated(W)
    out, lse = ring_attention(q, k, v, world, causal=causal, scale=scale, layout=layout)
    s = 1 / math.sqrt(D) if scale is None else scale
    _assert_attention(out, lse, q, k, v, causal, s, layout, f"W={W} S={S} D={D} {layout}")
    assert_pads_zero(world)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_q_tile_height_is_a_schedule_knob(rows, layout):
    """Schedule.chunk_rows sets the q rows of a compute task (a GPU engine's 64 or 128; here also
    1, and 64 > S: one tile per chunk); the protocol and the results stay the same."""
    W, S = 3, 10
    q, k, v = _inputs(W, 1, S, 2, 1, seed=rows)
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(chunk_rows=rows, seed=rows)
    out, lse = ring_attention(q, k, v, world, causal=True, layout=layout, schedule=sched)
    _assert_attention(out, lse, q, k, v, True, 1 / 8, layout, f"rows={rows} {layout}")
    plan = next(p for p in world._plans.values() if p.op == "ring_attention")
    assert plan.extra["q_tile"] == rows
    want = -(-S // rows) if layout == "contiguous" else 2 * -(-(S // 2) // rows)
    assert len(plan.extra["out_tiles"]) == 2 * want  # 2 heads, B = 1
    assert all(0 < n <= rows for *_, n in plan.extra["out_tiles"])
    _check_plan(plan, f"rows={rows} {layout}")
    assert_pads_zero(world)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_ring_attention_on_one_rank(causal):
    q, k, v = _inputs(1, 2, 21, 4, 2, seed=5)
    out, lse = attention(q[0], k[0], v[0], causal=causal, scale=0.2)
    ring = ring_attention(q, k, v, mkernel.World.emulated(1), causal=causal, scale=0.2)
    assert out.shape == (2, 21, 4, 64) and lse.shape == (2, 4, 21)
    assert torch.equal(out, ring[0][0]) and torch.equal(lse, ring[1][0])
    _assert_attention(out[None], lse[None], q, k, v, causal, 0.2, "contiguous", "attention")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_agrees_with_the_formula(layout, causal):
    assert mkernel.reference.ring_attention is ra.reference
    q, k, v = _inputs(3, 2, 10, 4, 2, seed=7)
    world = mkernel.World.emulated(3)
    out, lse = mkernel.reference.ring_attention(q, k, v, world, causal=causal, layout=layout)
    _assert_attention(out, lse, q, k, v, causal, 1 / 8, layout, f"reference {layout} {causal}")


# -- the plan's ring ------------------------------------------------------------------------------


def _plan(W: int, S: int, causal: bool, layout: str, B: int = 1, heads=(2, 1), **sched):
    world = mkernel.World.emulated(W)
    q, k, v = _inputs(W, B, S, *heads)
    s = ra.shapes(q, k, v, world, causal, layout)
    s.setdefault("scale_bits", ra.scale_bits(1 / 8))  # the default scale at D = 64, as the API
    return mkernel.Schedule(**sched).plan("ring_attention", world, **s)


def _work(plan, rank: int) -> list[tuple[int, int]]:
    """(step, K/V rows) of each compute task of ``rank`` that is not an empty pad."""
    tiles = [plan.tiles[t.args[0]] for t in plan.roles["compute"].tasks[rank]]
    return [(ra.unpack_tag(x.tag)[1], x.cols) for x in tiles if x.rows > 0]


def _check_turns(runs: list[tuple], lag: float, what: str) -> None:
    """A unit's order against the arrival model it was planned with: block s lands at s * lag (0
    for the own block), the unit's clock adds each task's cost (key rows) and waits for a block
    that has not landed. Laws: a unit leaves a q tile before its last task only when that tile's
    next block has not landed by the clock (else the tile's state would cross memory for
    nothing), and it waits for a block only when no started or new tile's next task has landed.
    ``runs``: (tile, step, cost) per task in the unit's order, each tile's tasks in chain order."""
    landed = lambda step: 0.0 if step == 0 else step * lag  # noqa: E731
    left: dict = {}  # each tile's tasks not yet run, in order
    for tile, s, _ in runs:
        left.setdefault(tile, []).append(s)
    clock = 0.0
    for i, (tile, s, cost) in enumerate(runs):
        nexts = [steps[0] for x, steps in left.items() if steps]
        if landed(s) > clock:  # a stall: nothing else could run
            assert all(landed(n) >= landed(s) for n in nexts), f"{what}: task {i} waits needlessly"
        clock = max(clock, landed(s)) + cost
        left[tile].pop(0)
        following = runs[i + 1][0] if i + 1 < len(runs) else None
        if left[tile] and following != tile:  # the tile is left with tasks to go
            nxt = landed(left[tile][0])
            assert nxt > clock, f"{what}: task {i} leaves {tile} whose next block has landed"


def _check_plan(plan, what: str) -> None:
    """The forward plan's laws, each from the tables and the layout's positions (_positions):

    - the out tiles cut every (b, h) row range of each chunk into q tiles of ``q_tile`` rows;
    - compute unit u of a rank runs its own list (PerUnit: the rank's rows, units back to back,
      as unit_span says and the interpreter's ``tasks_of`` reads) in an order that keeps
      ``_check_turns``'s laws for the plan's lag; all tasks of a q tile (its chain) run on one
      unit, which keeps the tile's state between them, the first flag on the first task and the
      last flag on the last; no task is an empty pad;
    - a chain has exactly the (step, K/V chunk) pairs with a key its rows may see (causal: no pair
      wholly in the future), each once, the diagonal (its own chunk) first, then by step; a tile
      addresses its chunk in k / v (step 0) or in the step's slot of k_ring / v_ring;
    - a rank sends the block of step s iff a rank downstream reads it, in ``parts`` comm tasks that
      each add 1 to landed[s + 1] on the next rank; every task that reads a slot (compute tasks
      of the step, the forward) waits for landed[s] == parts, counting all of them as consumers;
      a landed flag is raised iff someone waits for it; the parts cut the block's rows."""
    z, W = plan.shapes, plan.world_size
    B, S, H, causal = z["batch"], z["seq"], z["heads"], bool(z["causal"])
    layout = "zigzag" if z["zigzag"] else "contiguous"
    # zigzag's halves are chunks of their own only under a mask and with a ring (at W = 1 they
    # are the sequence in order)
    C = 2 if causal and layout == "zigzag" and W > 1 else 1
    assert plan.extra["chunks"] == C, what
    Sc, tq, parts, units = S // C, plan.extra["q_tile"], plan.extra["parts"], plan.compute_units
    assert 1 <= parts <= min(plan.comm_units, B * S), f"{what}: {parts} parts"
    pos = [torch.tensor(p) for p in _positions(W, S, layout)]
    out_tiles = [
        (b, h, c * Sc + m0, min(tq, Sc - m0))
        for b in range(B)
        for h in range(H)
        for c in range(C)
        for m0 in range(0, Sc, tq)
    ]
    assert sorted(plan.extra["out_tiles"]) == out_tiles, what
    reads = [[0] * W for _ in range(W)]  # compute tasks of rank r, step s
    waits: dict[tuple[int, int], list] = {}  # (rank, step): the landed waits of its readers
    for r in range(W):
        role = plan.roles["compute"]
        tasks = role.tasks[r]
        per_unit = [role.unit_tasks(r, u, units) for u in range(units)]
        assert [t for m in per_unit for t in m] == tasks, f"{what}: rank {r}: units not in order"
        first = role.rows(r).start
        spans = role.tensors["unit_span"][r * units : (r + 1) * units].tolist()
        ends = [first + sum(len(m) for m in per_unit[: u + 1]) for u in range(units)]
        assert spans == [[e - len(m), e] for e, m in zip(ends, per_unit, strict=True)], what
        chains = {}  # (b, h, row0) -> [(step, ck, diag)]
        home = {}  # (b, h, row0) -> the unit of its first task
        for u in range(units):
            mine = per_unit[u]
            assert [t.id for t in mine] == plan.tasks_of("compute", r, u), what
            at = f"{what}: rank {r} unit {u}"
            steps, going = [], set()
            runs = []  # (chain, step, cost) of the unit's tasks in order, for _check_turns
            for t in mine:
                tile = plan.tiles[t.args[0]]
                assert t.raises == (), at
                assert tile.rows > 0, f"{at}: an empty task"
                key, s, diag, first, last = ra.unpack_tag(tile.tag)
                (b, h), cq, ck = divmod(key // C, H), key % C, tile.n0 % C
                chain = (b, h, cq * Sc + tile.m0)
                assert tile.m0 % tq == 0 and tile.rows == min(tq, Sc - tile.m0), at
                assert tile.cols == Sc and tile.n0 // C == (b if s == 0 else (s - 1) * B + b), at
                if first:
                    assert chain not in chains, f"{at}: q tile {chain} begins twice"
                    chains[chain], home[chain] = [], u
                    going.add(chain)
                assert home.get(chain) == u, f"{at}: task {t.id} of {chain}, not begun here"
                assert chain in going, f"{at}: task {t.id} of {chain} after its last"
                chains[chain].append((s, ck, diag))
                runs.append((chain, s, min(Sc, tile.m0 + tile.rows) if diag else Sc))
                if last:
                    going.remove(chain)
                steps.append(s)
                reads[r][s] += 1
                if s == 0:  # the own block: nothing to wait for
                    assert t.waits == (), at
                else:
                    assert [(w.pad, w.rank, w.index, w.value) for w in t.waits] == [
                        ("landed", r, (s,), parts)
                    ], at
                    waits.setdefault((r, s), []).append(t.waits[0])
            _check_turns(runs, plan.extra["lag"], at)
            assert not going, f"{at}: q tiles {sorted(going)} never end"
        if len(out_tiles) >= units:  # longest first onto the least loaded unit: none idles
            assert all(per_unit), f"{what}: idle unit"
        assert sorted(chains) == [x[:3] for x in out_tiles], f"{what}: rank {r} chains"
        for (b, h, row0), pairs in chains.items():
            at = f"{what}: rank {r} chain {(b, h, row0)}"
            rows = pos[r][row0 : row0 + min(tq, Sc - (row0 % Sc))]
            want = []
            for s in range(W):
                for ck in range(C):
                    keys = pos[(r - s) % W][ck * Sc : (ck + 1) * Sc]
                    if not causal or (keys[:, None] <= rows[None, :]).any():
                        own = causal and torch.equal(keys, pos[r][row0 - row0 % Sc :][:Sc])
                        want.append((s, ck, own))
            assert sorted(pairs) == sorted(want), at
            assert sorted(pairs[1:]) == pairs[1:] and not any(d for *_, d in pairs[1:]), at
            assert pairs[0][2] == causal, f"{at}: the diagonal is not first"
    sends = plan.extra["sends"]
    for r in range(W):
        want = [s for s in range(W - 1) if any(reads[(r + j) % W][s + j] for j in range(1, W - s))]
        assert sends[r] == want, f"{what}: rank {r} sends {sends[r]}, its downstream reads {want}"
        comm = plan.roles["comm"].tasks[r]
        assert [t.args[:2] for t in comm] == [(s, p) for s in want for p in range(parts)], what
        for s in want:  # the parts of a block: (row0, rows) cutting its B * S rows, none empty
            cut = [t.args[2:4] for t in comm if t.args[0] == s]
            assert [r0 for r0, _ in cut] == [0, *(r0 + n for r0, n in cut[:-1])], what
            assert sum(n for _, n in cut) == B * S and min(n for _, n in cut) > 0, what
        for t in comm:
            s = t.args[0]
            assert [(x.pad, x.rank, x.index, x.value, x.op) for x in t.raises] == [
                ("landed", (r + 1) % W, (s + 1,), 1, "add")
            ], what
            if s == 0:
                assert t.waits == (), what
            else:
                assert [(w.pad, w.rank, w.index, w.value) for w in t.waits] == [
                    ("landed", r, (s,), parts)
                ], what
                waits.setdefault((r, s), []).append(t.waits[0])
    for (r, s), ws in waits.items():  # each reader of the slot counts them all
        assert {w.consumers for w in ws} == {len(ws)}, f"{what}: landed[{s}] on rank {r}"
        assert s - 1 in sends[(r - 1) % W], f"{what}: rank {r} waits for a block never sent"
    raised = {((r + 1) % W, s + 1) for r in range(W) for s in sends[r]}
    assert raised == set(waits), f"{what}: landed raised {sorted(raised)}, awaited {sorted(waits)}"


@settings(max_examples=60, deadline=None)
@given(
    W=st.integers(1, 5),
    B=st.integers(1, 2),
    S=st.integers(1, 20),
    heads=st.sampled_from([(4, 2), (1, 1), (3, 1)]),
    causal=st.booleans(),
    layout=st.sampled_from(["contiguous", "zigzag"]),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    sms=st.integers(2, 9),
    rows=st.sampled_from([None, 1, 3, 64]),
)
def test_the_plan_keeps_each_q_tile_on_one_unit(W, B, S, heads, causal, layout, overlap, sms, rows):
    if layout == "zigzag":
        S += S % 2
    sched = dict(overlap=overlap, sms=sms, chunk_rows=rows)
    plan = _plan(W, S, causal, layout, B, heads, **sched)
    _check_plan(plan, f"W={W} B={B} S={S} heads={heads} causal={causal} {layout} {sched}")


_chains = st.lists(  # a unit's q tiles: each a chain of (step, cost), steps from 0, never down
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=5).map(
        lambda c: [(0, c[0][1])] + sorted(c[1:])
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(chains=_chains, lag=st.sampled_from([0.0, 0.5, 3.0, 7.5, 20.0, math.inf]))
def test_chain_order_runs_a_tile_on_until_its_next_block_is_late(chains, lag):
    ids = [[(10 * i + j, s, c) for j, (s, c) in enumerate(ch)] for i, ch in enumerate(chains)]
    order = ra.chain_order(ids, lag)
    where = {t: (i, s, c) for i, ch in enumerate(ids) for t, s, c in ch}
    assert sorted(order) == sorted(where), "every task once"
    for ch in ids:
        mine = [t for t in order if t in {x[0] for x in ch}]
        assert mine == [x[0] for x in ch], "a tile's tasks keep their order"
    _check_turns([where[t] for t in order], lag, f"lag={lag}")
    if lag == 0:  # every block is there: each tile's tasks back to back, tiles in the given order
        assert order == [t for ch in ids for t, _, _ in ch]


def test_chain_order_from_step_major_to_chains():
    a, b, c = ([(10 * i, 0, 4), (10 * i + 1, 1, 4)] for i in range(3))
    assert ra.chain_order([a, b, c], math.inf) == [0, 10, 20, 1, 11, 21]  # step-major
    assert ra.chain_order([a, b, c], 0) == [0, 1, 10, 11, 20, 21]  # chains
    assert ra.chain_order([a, b, c], 6) == [0, 10, 11, 1, 20, 21]  # A0 | B0 B1 | A1 | C0 C1
    # a tile that needs only the own block goes first while the next block travels
    assert ra.chain_order([a, [(30, 0, 4)]], 5) == [30, 0, 1]


def test_gpu_plans_estimate_when_the_next_block_lands():
    """The cost model's lag grows with the block and shrinks with the pieces carrying it (up to
    the link's ceiling); an emulated world's copies stay in one GPU's memory."""
    from mkernel.ops.ring_cost import RING_RATES, ring_block_lag

    def lag(nbytes: int, parts: int, emulated: bool = False) -> float:
        return ring_block_lag(nbytes, parts, 128, 128, emulated)

    assert lag(2 << 26, 16) == pytest.approx(2 * lag(1 << 26, 16))
    assert lag(1 << 26, 16) == pytest.approx(2 * lag(1 << 26, 32))
    capped = int(RING_RATES.tma.ceiling / RING_RATES.ring_part_gbps) + 1
    assert lag(1 << 26, capped) == pytest.approx(lag(1 << 26, 4 * capped))
    assert lag(1 << 26, 1000, emulated=True) < lag(1 << 26, 1000)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_non_causal_ring_sends_every_block_and_computes_every_step(W, layout):
    plan = _plan(W, 20, False, layout)
    assert plan.extra["chunks"] == 1  # without a mask zigzag's halves are one chunk too
    T = len(plan.extra["out_tiles"])
    for r in range(W):
        assert plan.extra["sends"][r] == list(range(W - 1))
        assert sorted(s for s, _ in _work(plan, r)) == sorted(list(range(W)) * T)
        assert {n for _, n in _work(plan, r)} == {20}  # the whole block per task
    _check_plan(plan, f"non-causal W={W} {layout}")


def test_the_landed_waits_count_every_reader_of_the_slot():
    W = 4
    plan = _plan(W, 20, False, "contiguous", overlap="intra_sm", sms=3)
    T, parts = len(plan.extra["out_tiles"]), plan.extra["parts"]
    assert parts == 3  # a comm unit each: the block of B * S = 20 rows in three copies
    for r in range(W):
        compute, comm = plan.roles["compute"].tasks[r], plan.roles["comm"].tasks[r]
        for s in range(1, W):  # r's T compute tasks of step s and, but at the last, its forward
            landed = [w for t in compute + comm for w in t.waits if w.index == (s,)]
            assert len(landed) == T + (parts if s < W - 1 else 0)
            assert {(w.pad, w.rank, w.value, w.consumers) for w in landed} == {
                ("landed", r, parts, len(landed))
            }


def test_contiguous_causal_never_wraps_the_ring():
    W = 4
    plan = _plan(W, 20, True, "contiguous")
    T = len(plan.extra["out_tiles"])
    for r in range(W):  # rank r needs the blocks of ranks 0..r: r + 1 steps, never from r + 1..
        want = list(range(r + 1)) if r < W - 1 else []
        assert plan.extra["sends"][r] == want, f"rank {r}"
        assert len(plan.roles["comm"].tasks[r]) == len(want) * plan.extra["parts"]
        steps = [s for s, _ in _work(plan, r)]
        assert sorted(steps) == sorted(list(range(r + 1)) * T), f"rank {r}"
    assert plan.roles["comm"].tasks[W - 1] == []  # the last rank sends nothing
    _check_plan(plan, "causal contiguous")


@pytest.mark.parametrize("W, S", [(2, 8), (3, 34), (4, 18)])
def test_zigzag_causal_gives_every_rank_the_same_work(W, S):
    plan = _plan(W, S, True, "zigzag")
    _check_plan(plan, f"zigzag W={W} S={S}")
    tasks = [len(_work(plan, r)) for r in range(W)]
    rows = [sum(n for _, n in _work(plan, r)) for r in range(W)]
    assert len(set(tasks)) == 1 and len(set(rows)) == 1, f"tasks {tasks}, K/V rows {rows}"
    contiguous = _plan(W, S, True, "contiguous")  # for contrast
    assert len({sum(n for _, n in _work(contiguous, r)) for r in range(W)}) == W


# -- bad input ------------------------------------------------------------------------------------


def _bad_cases():
    q, k, v = _inputs(2, 1, 6, 4, 2)
    q3, k3, v3 = _inputs(3, 1, 6, 4, 2)
    qd, kd, vd = _inputs(2, 1, 6, 4, 2, D=32)
    odd = _inputs(2, 1, 5, 4, 2)
    return [
        (dict(q=q.float()), TypeError, "q must be torch.bfloat16"),
        (dict(k=k.half()), TypeError, "k must be torch.bfloat16"),
        (dict(v=v[..., 0]), ValueError, "v must have shape"),
        (dict(v=v[:, :, :4].contiguous()), ValueError, "v has shape"),
        (dict(k=k[:, :, :4].contiguous(), v=v[:, :, :4].contiguous()), ValueError, "k is "),
        (dict(q=q3), ValueError, "q has leading dimension 3"),
        (dict(k=k3, v=v3), ValueError, "k has leading dimension 3"),
        (dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "q must be contig"),
        (dict(q=torch.empty(q.shape, dtype=q.dtype, device="meta")), ValueError, "q is on meta"),
        (dict(q=qd, k=kd, v=vd), ValueError, r"D \(last dim of q"),
        (dict(q=_inputs(2, 1, 6, 3, 1)[0]), ValueError, r"Hq \(heads of q\) = 3"),
        (dict(q=odd[0], k=odd[1], v=odd[2], layout="zigzag"), ValueError, "S_local"),
        (dict(layout="ring"), ValueError, "layout must be one of"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(scale=0.0), ValueError, "scale must be a positive"),
        (dict(scale=float("nan")), ValueError, "scale must be a positive"),
        (dict(scale="0.1"), TypeError, "scale must be a positive number"),
        (dict(scale=True), TypeError, "scale must be a positive number"),
        (dict(world="2 ranks"), TypeError, "world must be an mkernel.World"),
        (dict(schedule="fast"), TypeError, "schedule must be an mkernel.Schedule"),
    ], (q, k, v)


def test_bad_input_is_named_before_anything_runs():
    cases, (q, k, v) = _bad_cases()
    world = mkernel.World.emulated(2)
    for change, exc, match in cases:
        args = dict(q=q, k=k, v=v, world=world) | change
        with pytest.raises(exc, match=match):
            ring_attention(**args)
    assert world._plans == {} and world.signal_pads() == {}, "a bad call built or ran something"
    with pytest.raises(ValueError, match="q is on meta"):
        attention(torch.empty(q[0].shape, dtype=q.dtype, device="meta"), k[0], v[0])
    with pytest.raises(ValueError, match="D \\(last dim"):
        attention(*(x[0, ..., :32].contiguous() for x in (q, k, v)))


# -- planted protocol mistakes ---------------------------------------------------------------------


def _run(W, S, layout, causal, sched, *, edit=None, wrap=None, calls=1, seed=0):
    """One fresh plan run through run_plan as the API runs it; ``edit(plan, tasks)`` changes a deep
    copy of the tasks ({role: [W][...]}), re-encoded into the plan's tables, ``wrap(moves)`` the
    data-movement twins."""
    world = mkernel.World.emulated(W)
    q, k, v = _inputs(W, 1, S, 2, 1, seed=seed)
    plan = ra.make_plan(sched, world, **ra.shapes(q, k, v, world, causal, layout))
    if edit is not None:
        tasks = {role: copy.deepcopy(t.tasks) for role, t in plan.roles.items()}
        edit(plan, tasks)
        roles = {
            role: encode(plan.spec, plan.sizes, plan.roles[role].regroup(t))
            for role, t in tasks.items()
        }
        plan = dataclasses.replace(plan, roles=roles)
    out = torch.full((W, 1, S, 2, 64), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((W, 1, 2, S), float("nan"))
    ws = common.workspace(world, plan)
    buffers = ra.operands(plan, q, k, v, out, lse) | {
        name: b.local for name, b in ws.items() if b is not None
    }
    moves = ra.twins_of(plan) if wrap is None else wrap(ra.twins_of(plan))
    reads = lambda rank: ra.outputs(plan, rank)  # noqa: E731
    program.run_plan(world, plan, buffers, moves, seed, reads, calls=calls)
    return out, lse, world, (q, k, v)


def _sched(**kw):
    return mkernel.Schedule(overlap="intra_sm", sms=3, **kw)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_unchanged_plan_passes_over_two_calls(layout):
    for seed in range(2):
        out, lse, world, (q, k, v) = _run(4, 20, layout, True, _sched(), calls=2, seed=seed)
        _assert_attention(out, lse, q, k, v, True, 1 / 8, layout, f"two calls seed {seed}")
        assert_pads_zero(world)


def _step(plan, role: str, task) -> int:
    """The step of a task: a compute task's from its tile's tag, a comm task's args[0]."""
    if role == "comm":
        return task.args[0]
    return ra.unpack_tag(plan.tiles[task.args[0]].tag)[1]


def _drop(pad: str, role: str, rank: int, step: int):
    def edit(plan, tasks):
        hit = [t for t in tasks[role][rank] if t.waits and _step(plan, role, t) == step]
        assert hit, f"no {role} task of step {step} on rank {rank} waits"
        for t in hit:
            t.waits = tuple(w for w in t.waits if w.pad != pad)

    return edit


@pytest.mark.parametrize("seed", range(2))
def test_a_compute_task_without_its_landed_wait_is_a_race(seed):
    with pytest.raises(RaceError, match="k_ring|v_ring"):
        _run(3, 20, "contiguous", False, _sched(), edit=_drop("landed", "compute", 1, 1), seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_a_forward_without_its_landed_wait_is_a_race_on_the_slot(seed):
    # rank 1 forwards the block of step 1 from its slot before rank 0's copies into it landed
    with pytest.raises(RaceError, match="k_ring|v_ring"):
        _run(3, 20, "contiguous", False, _sched(), edit=_drop("landed", "comm", 1, 1), seed=seed)


def _tile(plan, task) -> tuple[int, int, bool, bool]:
    """(key, m0, first, last) of a compute task's q tile."""
    tile = plan.tiles[task.args[0]]
    key, _, _, first, last = ra.unpack_tag(tile.tag)
    return key, tile.m0, first, last


def _later(plan, rows: list, unit: int) -> int:
    """The row (of rank 0) of the first task of ``unit`` that continues a q tile (not its first)."""
    for i in plan.task_rows("compute", 0, unit):
        if not _tile(plan, rows[i])[2]:
            return i
    raise AssertionError(f"unit {unit} continues no q tile")


@pytest.mark.parametrize("seed", range(2))
def test_a_q_tile_split_across_units_loses_its_state(seed):
    # unit 0 runs a task of a q tile unit 1 began (and the other way round): the tile's state is
    # where unit 1 left it, unordered with unit 0's read (the engine's threads reload their own)
    def edit(plan, tasks):
        rows = tasks["compute"][0]
        i, j = _later(plan, rows, 0), _later(plan, rows, 1)
        rows[i], rows[j] = rows[j], rows[i]

    with pytest.raises(AssertionError, match="continues a q tile"):
        _run(3, 20, "contiguous", False, _sched(), edit=edit, seed=seed)


def test_a_q_tile_out_of_order_on_its_unit_loses_its_state():
    def edit(plan, tasks):  # unit 0's first q tile runs its last task first
        rows = tasks["compute"][0]
        key_m0 = _tile(plan, rows[0])[:2]
        same = [i for i in plan.task_rows("compute", 0, 0) if _tile(plan, rows[i])[:2] == key_m0]
        assert len(same) == 3 and _tile(plan, rows[same[-1]])[3]  # W = 3 steps, the last
        rows[0], rows[same[-1]] = rows[same[-1]], rows[0]

    with pytest.raises(AssertionError, match="continues a q tile"):
        _run(3, 20, "contiguous", False, _sched(), edit=edit)


def test_an_lse_tile_never_stored_is_reported(monkeypatch):
    store = twins.output_store

    def no_lse(ctx, buf, rank, rect, value, tile):
        if buf == "lse":
            return (yield from twins.bulk_wait_read(ctx))
        return (yield from store(ctx, buf, rank, rect, value, tile))

    monkeypatch.setattr(twins, "output_store", no_lse)
    with pytest.raises(TileWriteError, match="tile never written"):
        _run(2, 20, "zigzag", True, _sched())


def test_the_machine_expects_the_tiles_of_every_output_buffer():
    from mkernel.interp.machine import Machine

    m = Machine(1, {}, {"out": torch.zeros(1, 2, 2), "lse": torch.zeros(1, 1, 2)})
    m.expect_outputs(0, 0, "out", {"out": {0: (0, 2, 0, 2)}, "lse": {1: (0, 1, 0, 2)}})
    m.expect_outputs(1, 0, "out", {0: (0, 2, 0, 2)})  # the one-buffer form, as before
    assert m.expected[(0, 0)] == [("out", 0, (0, 2, 0, 2)), ("lse", 1, (0, 1, 0, 2))]
    assert m.expected[(1, 0)] == [("out", 0, (0, 2, 0, 2))]


# -- plan entry points and limits --------------------------------------------------------------


def test_schedule_plan_takes_the_operands():
    world = mkernel.World.emulated(2)
    q, k, v = _inputs(2, 1, 8, 2, 1)
    plan = mkernel.Schedule().plan("ring_attention", world, q, k, v)
    _check_plan(plan, "operands")


def test_a_world_of_17_ranks():
    plan = _plan(17, 2, False, "contiguous", heads=(1, 1), overlap="inter_sm", sms=2)
    _check_plan(plan, "W = 17")


def test_make_plan_called_directly_with_the_default_schedule():
    out, lse, world, (q, k, v) = _run(3, 20, "contiguous", False, mkernel.Schedule())
    _assert_attention(out, lse, q, k, v, False, 1 / 8, "contiguous", "direct make_plan")


def test_one_gpu_rank_with_the_default_schedule_takes_the_engines():
    """ring_attention.solo_engine: one rank on a GPU and a Schedule with nothing to observe or
    inject runs the attention engines (tests/gpu/test_ring_attention_bwd_fused_gpu.py checks the
    results); more ranks, the CPU, or a schedule that traces, injects a fault or sets the SMs or
    the overlap keeps the fused protocol."""
    from mkernel.ops.ring_attention import solo_engine

    def gpu_world(size: int) -> mkernel.World:
        w = mkernel.World(size=size, device=torch.device("cuda", 0), kind="emulated")
        w._status = types.SimpleNamespace(error=False)  # the pinned status block needs CUDA
        return w

    assert solo_engine(gpu_world(1), mkernel.Schedule(seed=3))
    keep = [
        mkernel.Schedule(trace=True),
        mkernel.Schedule(overlap="intra_sm"),
        mkernel.Schedule(overlap="inter_sm", comm_sms=2),
        mkernel.Schedule(sms=8),
        mkernel.Schedule(faults=mkernel.Faults(delay_rank=0, delay_us=5)),
    ]
    assert not any(solo_engine(gpu_world(1), s) for s in keep)
    assert not solo_engine(gpu_world(2), mkernel.Schedule())
    assert not solo_engine(mkernel.World.emulated(1), mkernel.Schedule())  # the interpreter


def test_engine_launches_take_the_raw_stream_when_the_device_is_current(monkeypatch):
    """attention_ext._enqueue: on the current device a launcher gets torch's raw current stream
    (no device switch, no Stream object); on another device it runs inside that device's context
    with that device's current stream (gpu.stream_handle of its index)."""
    import contextlib

    from mkernel import attention_ext

    switched: list[int] = []

    @contextlib.contextmanager
    def device(d):
        switched.append(torch.device(d).index)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i, raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    launch = lambda args, stream: (args, stream)  # noqa: E731
    assert attention_ext._enqueue(launch, "a", torch.device("cuda", 0)) == ("a", 1000)
    assert attention_ext._enqueue(launch, "a", torch.device("cuda")) == ("a", 1000)
    assert switched == []
    assert attention_ext._enqueue(launch, "b", torch.device("cuda", 1)) == ("b", 1001)
    assert switched == [1]


def test_the_default_schedule_follows_the_key_length():
    """attention_forward with no variant: "pingpong" up to PINGPONG_MAX_KV keys, "overlap" beyond
    (the faster measured on each side); both are correct schedules of the same engine."""
    from mkernel import attention_ext

    edge = attention_ext.PINGPONG_MAX_KV
    assert [attention_ext.default_variant(s) for s in (1, edge, edge + 1, 32768)] == [
        "pingpong",
        "pingpong",
        "overlap",
        "overlap",
    ]
    assert {attention_ext.default_variant(s) for s in range(1, 3 * edge, 97)} <= set(
        attention_ext.VARIANTS
    )
