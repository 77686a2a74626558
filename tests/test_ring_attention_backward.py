"""ring_attention_backward on the CPU interpreter: dq, dk, dv against fp64 autograd of attention at
the layout's global positions (computed here, never from mkernel.reference), with a tolerance from
the bf16 rounding of the results and of the out / lse inputs and fp32 sums; NaN-poisoned outputs;
pads and the dK/dV workspace back to zero; two calls in a row; autograd through ring_attention
(out and lse); the reference; the plan is the forward's K/V ring plus K/V-tile compute tasks and
the dK / dV way back; bad input named before anything runs; planted protocol mistakes (races on the
K/V slots, on delta and dkv_acc, a dk tile never stored)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import mkernel
from mkernel.errors import RaceError, TileWriteError
from mkernel.interp import program, twins
from mkernel.ops import common, ring_cost
from mkernel.ops import ring_attention as ra
from mkernel.ops import ring_attention_backward as rb
from mkernel.ops.ring_attention import attention, ring_attention
from mkernel.ops.ring_attention_backward import ring_attention_backward
from mkernel.protocol import RoleTables
from tests.helpers import U_BF16, U_FP32, assert_pads_zero, assert_within
from tests.test_ring_attention import _positions as rank_positions
from tests.test_ring_attention import ring_cases


def _inputs(W: int, B: int, S: int, Hq: int, Hkv: int, D: int = 64, seed: int = 0):
    """q, k, v, dout: bf16, seeded normal values ([W, B, S, H, D])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(W, B, S, Hq, D, generator=g).bfloat16()
    k = torch.randn(W, B, S, Hkv, D, generator=g).bfloat16()
    v = torch.randn(W, B, S, Hkv, D, generator=g).bfloat16()
    dout = torch.randn(W, B, S, Hq, D, generator=g).bfloat16()
    return q, k, v, dout


def _positions(W: int, S: int, layout: str) -> torch.Tensor:
    """Global positions of the rank-major rows (the forward test's, flattened)."""
    return torch.tensor([p for rank in rank_positions(W, S, layout) for p in rank])


def _exact(
    q, k, v, dout, out, lse, causal: bool, scale: float, layout: str, dlse=None, p_bf16=False
):
    """fp64 autograd of softmax attention over every rank's rows at their global positions: per
    rank (dq, dk, dv) and their tolerances. The tolerance bounds, to first order, what an fp32
    FlashAttention backward makes of the given bf16 ``out`` and fp32 ``lse`` (their measured
    errors against fp64), plus fp32 sums and the final bf16 rounding. ``p_bf16``: P and dS are
    rounded to bf16 before they enter the products (the GPU engine's wgmma operands)."""
    W, B, S, Hq, D = q.shape
    Hkv = k.shape[3]
    group = Hq // Hkv
    n = W * S
    pos = _positions(W, S, layout)

    def rows(x):  # [W, B, S, H, D] -> [B, W * S, H, D], rank-major
        return x.double().transpose(0, 1).reshape(B, n, x.shape[3], D)

    Q, K, V, dO = (rows(x).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout)))
    Kg, Vg = K.repeat_interleave(group, 2), V.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", Q, Kg) * scale
    future = pos[None, :] > pos[:, None]  # [query, key]
    if causal:
        s = s.masked_fill(future, -math.inf)
    L = torch.logsumexp(s, dim=-1)  # [B, H, n]
    p = torch.exp(s - L[..., None])
    Out = torch.einsum("bhqk,bkhd->bqhd", p, Vg)
    loss = (Out * dO).sum()

    def lse_rows(x):  # [W, B, Hq, S] -> [B, Hq, W * S], rank-major
        return x.double().permute(1, 2, 0, 3).reshape(B, Hq, n)

    gl = None if dlse is None else lse_rows(dlse)
    if gl is not None:
        loss = loss + (L * gl).sum()
    dQ, dK, dV = torch.autograd.grad(loss, (Q, K, V))

    with torch.no_grad():  # the tolerance, from magnitudes (|x|) and the inputs' measured errors
        aQ, aK, aV, adO = Q.abs(), Kg.abs(), Vg.abs(), dO.abs()
        p, s, Out, L = p.detach(), s.detach(), Out.detach(), L.detach()
        s_err = (D + 2) * U_FP32 * scale * torch.einsum("bqhd,bkhd->bhqk", aQ, aK)
        s_err = s_err + U_FP32 * s.abs().nan_to_num(0.0, 0.0, 0.0)
        lse_in = lse_rows(lse)
        eps = s_err + ((lse_in - L).abs() + 4 * U_FP32 * (1 + L.abs()))[..., None]
        dp = torch.einsum("bqhd,bkhd->bhqk", dO, Vg)
        dp_err = (D + 2) * U_FP32 * torch.einsum("bqhd,bkhd->bhqk", adO, aV)
        out_in = rows(out)
        delta = torch.einsum("bqhd,bqhd->bhq", dO, Out)
        ddelta = (torch.einsum("bqhd,bqhd->bhq", dO, out_in - Out)).abs()
        ddelta += (D + 2) * U_FP32 * torch.einsum("bqhd,bqhd->bhq", adO, out_in.abs())
        if gl is not None:
            delta = delta - gl
        terms = n * group + D + 16  # fp32 sums over keys or queries (all heads of a group)
        ds_abs = p * (dp.abs() + delta.abs()[..., None])
        ds_err = p * ((dp - delta[..., None]).abs() * eps + ddelta[..., None] + dp_err)
        ds_err = ds_err + terms * U_FP32 * ds_abs
        p_err = p * (eps + terms * U_FP32)
        if p_bf16:
            ds_err = ds_err + U_BF16 * (p * (dp - delta[..., None]).abs() + ds_err)
            p_err = p_err + U_BF16 * p
        dq_tol = scale * torch.einsum("bhqk,bkhd->bqhd", ds_err, aK)
        dk_tol = scale * torch.einsum("bhqk,bqhd->bkhd", ds_err, aQ)
        dv_tol = torch.einsum("bhqk,bqhd->bkhd", p_err, adO)

    def fold(x):  # GQA: the K/V head's tolerance is the sum over its q heads
        return x.reshape(B, n, Hkv, group, D).sum(3)

    def per_rank(x):  # [B, n, H, D] -> [W, B, S, H, D]
        return x.reshape(B, W, S, x.shape[2], D).transpose(0, 1)

    tols = (dq_tol, fold(dk_tol), fold(dv_tol))
    grads = (dQ, dK, dV)
    return [
        (per_rank(g), per_rank(1.01 * (U_BF16 * g.abs() + t)))
        for g, t in zip(grads, tols, strict=True)
    ]


def _assert_grads(
    got, q, k, v, dout, out, lse, causal, scale, layout, what, dlse=None, p_bf16=False
) -> None:
    want = _exact(q, k, v, dout, out, lse, causal, scale, layout, dlse, p_bf16)
    for name, g, x, (exact, tol) in zip("dq dk dv".split(), got, (q, k, v), want, strict=True):
        assert g.shape == x.shape and g.dtype == torch.bfloat16, f"{what}: {name}"
        assert not torch.isnan(g.float()).any(), f"{what}: NaN in {name} (an unwritten tile)"
        assert_within(g, exact, tol, f"{what}: {name}")


def _assert_workspace_zero(world) -> None:
    assert_pads_zero(world)
    for key, b in world._buffers.items():
        if "dkv_acc" in str(key):
            assert not b.local.any(), "dkv_acc not back to zero"


@ring_cases(max_examples=20)
def test_every_rank_gets_its_gradients(W, B, S, heads, causal, layout, overlap, sms, seed):
    if layout == "zigzag":
        S += S % 2  # zigzag needs an even S_local
    Hq, Hkv = heads
    world = mkernel.World.emulated(W)
    q, k, v, dout = _inputs(W, B, S, Hq, Hkv, seed=seed)
    out, lse = ring_attention(q, k, v, world, causal=causal, layout=layout)
    sched = mkernel.Schedule(overlap=overlap, sms=sms, seed=seed)
    what = f"W={W} B={B} S={S} Hq={Hq} Hkv={Hkv} causal={causal} {layout} {overlap} sms={sms}"
    args = (dout, q, k, v, out, lse, world)
    got = ring_attention_backward(*args, causal=causal, layout=layout, schedule=sched)
    _assert_grads(got, q, k, v, dout, out, lse, causal, 1 / 8, layout, what)
    _assert_workspace_zero(world)
    # the same interleaving again gives the same bits (nothing of the first call is left over);
    # another one may sum the dK / dV contributions in another order (fp32 adds, like red.add)
    again = ring_attention_backward(*args, causal=causal, layout=layout, schedule=sched)
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True)), f"{what}: 2nd call"
    _assert_workspace_zero(world)


@pytest.mark.parametrize(
    "W, S, D, layout, causal, scale",
    [
        (8, 4, 64, "zigzag", True, None),  # the one W = 8 case: small
        (2, 20, 128, "zigzag", True, None),
        (3, 9, 128, "contiguous", False, 0.3),
    ],
)
def test_wide_worlds_head_dim_128_and_scales(W, S, D, layout, causal, scale):
    q, k, v, dout = _inputs(W, 1, S, 2, 1, D, seed=W + S)
    world = mkernel.World.emulated(W)
    out, lse = ring_attention(q, k, v, world, causal=causal, scale=scale, layout=layout)
    got = ring_attention_backward(dout, q, k, v, out, lse, world, causal, scale, layout)
    s = 1 / math.sqrt(D) if scale is None else scale
    _assert_grads(got, q, k, v, dout, out, lse, causal, s, layout, f"W={W} S={S} D={D} {layout}")
    _assert_workspace_zero(world)


# -- autograd and the reference --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_q_tile_height_is_a_schedule_knob(layout):
    W, S, rows = 3, 10, 3
    q, k, v, dout = _inputs(W, 1, S, 2, 1, seed=S)
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(chunk_rows=rows, seed=1)
    out, lse = ring_attention(q, k, v, world, causal=True, layout=layout, schedule=sched)
    got = ring_attention_backward(
        dout, q, k, v, out, lse, world, True, None, layout, schedule=sched
    )
    _assert_grads(got, q, k, v, dout, out, lse, True, 1 / 8, layout, f"rows={rows} {layout}")
    _assert_workspace_zero(world)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_out_backward_is_ring_attention_backward(layout):
    W, causal = 3, True
    q, k, v, dout = _inputs(W, 2, 10, 4, 2, seed=3)
    world = mkernel.World.emulated(W)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ring_attention(*leaves, world, causal=causal, scale=0.2, layout=layout)
    assert out.requires_grad and out.dtype == torch.bfloat16
    out.backward(dout)
    want = ring_attention_backward(
        dout, q, k, v, out.detach(), lse.detach(), world, causal, 0.2, layout
    )
    for leaf, w, name in zip(leaves, want, "qkv", strict=True):
        assert torch.equal(leaf.grad, w), f"{name}.grad differs from ring_attention_backward"
    assert_pads_zero(world)


def test_the_gradient_of_lse_enters_as_the_softmax():
    W, S, layout = 2, 12, "zigzag"
    q, k, v, dout = _inputs(W, 1, S, 2, 1, seed=9)
    dlse = torch.randn(W, 1, 2, S, generator=torch.Generator().manual_seed(1))
    world = mkernel.World.emulated(W)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ring_attention(*leaves, world, causal=True, layout=layout)
    torch.autograd.backward((out, lse), (dout, dlse))
    got = [x.grad for x in leaves]
    _assert_grads(got, q, k, v, dout, out.detach(), lse.detach(), True, 1 / 8, layout, "dlse", dlse)
    # lse alone: dout is None in the Function's backward
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _, lse = ring_attention(*leaves, world, causal=True, layout=layout)
    lse.backward(dlse)
    zero = torch.zeros_like(dout)
    got = [x.grad for x in leaves]
    _assert_grads(got, q, k, v, zero, out.detach(), lse.detach(), True, 1 / 8, layout, "lse", dlse)


def test_attention_is_differentiable():
    q, k, v, dout = _inputs(1, 1, 21, 2, 2, seed=4)
    leaves = [x[0].clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention(*leaves, causal=True)
    out.backward(dout[0])
    world = mkernel.World.emulated(1)
    ring = ring_attention(q, k, v, world, causal=True)
    want = ring_attention_backward(dout, q, k, v, *ring, world, causal=True)
    for leaf, w in zip(leaves, want, strict=True):
        assert torch.equal(leaf.grad, w[0])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_agrees_with_the_formula(layout, causal):
    assert mkernel.reference.ring_attention_backward is rb.reference
    q, k, v, dout = _inputs(3, 2, 10, 4, 2, seed=7)
    world = mkernel.World.emulated(3)
    out, lse = mkernel.reference.ring_attention(q, k, v, world, causal=causal, layout=layout)
    got = mkernel.reference.ring_attention_backward(
        dout, q, k, v, out, lse, world, causal, None, layout
    )
    # the reference recomputes out and lse in fp32: the inputs' rounding does not enter
    x_out, x_lse = mkernel.reference.ring_attention(q, k, v, world, causal=causal, layout=layout)
    _assert_grads(got, q, k, v, dout, x_out, x_lse, causal, 1 / 8, layout, f"reference {layout}")


# -- the plan -------------------------------------------------------------------------------------


def _plan(W: int, S: int, causal: bool, layout: str, batch=1, heads=2, kv_heads=1, **sched):
    world = mkernel.World.emulated(W)
    q, k, v, dout = _inputs(W, batch, S, heads, kv_heads)
    out = torch.zeros_like(q)
    lse = torch.zeros(W, batch, heads, S)
    s = rb.shapes(dout, q, k, v, out, lse, world, causal, layout)
    return mkernel.Schedule(**sched).plan("ring_attention_backward", world, **s)


def _comm(plan, r: int, *kinds: int):
    return [t for t in plan.roles["comm"].tasks[r] if t.args[1] in kinds]


def _tile_step(plan, task) -> int:
    return ra.unpack_tag(plan.tiles[task.args[0]].tag)[1]


def _kind(plan, task) -> int | None:
    """The kind of a compute-role row task (PREP, DQ, FINISH: an AUX tile), else None."""
    tile = plan.tiles[task.args[0]]
    return ra.unpack_tag(tile.tag)[0] if tile.rows and tile.tag & rb.AUX else None


def _rows(plan, r: int, *kinds: int):
    return [t for t in plan.roles["compute"].tasks[r] if _kind(plan, t) in kinds]


def _group(plan, task) -> int:
    """The tail group of a K/V tile task (its key's (b, K/V head)) or of a tail part (its rows'
    b and first K/V head)."""
    tile, Hkv = plan.tiles[task.args[0]], plan.shapes["kv_heads"]
    if tile.tag & rb.AUX:
        bh = tile.m0 // plan.shapes["seq"] * Hkv + tile.n0
    else:
        b, hk, _, _ = rb.unpack_key(ra.unpack_tag(tile.tag)[0], plan.extra["chunks"], Hkv)
        bh = b * Hkv + hk
    return plan.extra["group_of"][bh]


def _count(plan, r: int, s: int, g: int) -> int:
    """Rank r's K/V tile tasks of step s and tail group g."""
    tasks = plan.roles["compute"].tasks[r]
    return sum(_step(plan, t) == s and _group(plan, t) == g for t in tasks)


def test_contiguous_causal_partials_go_down_the_ring_and_home():
    W = 4
    plan = _plan(W, 20, True, "contiguous", batch=2, heads=6, kv_heads=3)
    G, n_parts = plan.extra["groups"], [len(c) for c in plan.extra["tail_cuts"]]
    assert G == 6, "2 x 3 (b, K/V head) pairs, a tail group each (causal: up to TAIL_GROUPS)"
    for r in range(W):  # rank r holds blocks r, r-1, .., 0 at steps 0..r
        grads = _comm(plan, r, rb.GRAD, rb.HOME)
        dests = {(t.args[0], t.args[1], t.raises[0].rank, t.raises[0].index) for t in grads}
        want = {(s, rb.GRAD, r + 1, (s + 1, 0)) for s in range(r + 1) if r < W - 1}
        assert dests == want, f"rank {r}"
        assert len(grads) == len(want) * plan.extra["gparts"], "one grad send per part"
        # the last rank returns each block's sum to its owner (dkv_home, dlanded[0, g]): row tasks
        homes = _rows(plan, r, rb.HOME)
        got = {(_tile_step(plan, t), t.raises[0].rank, t.raises[0].index) for t in homes}
        want = {(s, r - s, (0, g)) for s in range(1, r + 1) for g in range(G)}
        assert got == (want if r == W - 1 else set()), f"rank {r}: home"
        assert len(homes) == (r == W - 1) * r * sum(n_parts), "one home task per part"
        for t in homes:
            s, g = _tile_step(plan, t), _group(plan, t)
            assert t.raises[0].index == (0, g)
            assert [(w.pad, w.index, w.value) for w in t.waits] == [
                ("computed", (s, g), _count(plan, r, s, g)),
                ("dlanded", (s, 0), plan.extra["gparts"]),
            ]
        finishes = _rows(plan, r, rb.FINISH)
        direct = [
            plan.tiles[t.args[0]].tag & rb.DIRECT != 0
            for t in plan.roles["compute"].tasks[r]
            if _step(plan, t) == 0 and _kind(plan, t) is None
        ]
        if r == W - 1:  # the last rank's block stays at home: the engine stores its dk, dv
            assert plan.extra["direct"][r] and direct and all(direct) and finishes == []
            continue
        assert not plan.extra["direct"][r] and not any(direct)
        assert len(finishes) == sum(n_parts)
        for finish in finishes:
            g = _group(plan, finish)
            assert [(w.pad, w.index, w.value) for w in finish.waits] == [
                ("dlanded", (0, g), n_parts[g])
            ]


def _step(plan, task) -> int | None:
    """The step of a compute task (its tile's tag); None for an empty task that pads a unit or a
    row task (prep, dq, finish)."""
    tile = plan.tiles[task.args[0]]
    return ra.unpack_tag(tile.tag)[1] if tile.rows and not tile.tag & rb.AUX else None


def test_every_grad_send_waits_for_all_its_steps_contributions():
    W = 3
    plan = _plan(W, 20, False, "zigzag", heads=4, kv_heads=2)
    G = plan.extra["groups"]
    assert G == 2
    for r in range(W):
        sends = [(t.args[0], t) for t in _comm(plan, r, rb.GRAD)]
        homes = [(_tile_step(plan, t), t) for t in _rows(plan, r, rb.HOME)]
        assert {s for s, _ in sends + homes} == set(range(W)), "every step's partial goes on"
        for s, t in sends:  # a grad send: every group's count of its step
            got = [(w.index, w.value) for w in t.waits if w.pad == "computed"]
            assert got == [((s, g), _count(plan, r, s, g)) for g in range(G)]
        for s, t in homes:  # a home part: its group's
            g = _group(plan, t)
            got = [(w.index, w.value) for w in t.waits if w.pad == "computed"]
            assert got == [((s, g), _count(plan, r, s, g))]


def _keys(plan, r: int) -> dict[int, tuple]:
    """make_plan's deadlock argument, restated: the key of every task of rank r by table row
    (compute) or by -1 - index (comm)."""
    G, W = plan.extra["groups"], plan.world_size
    readers = plan.extra["readers"]
    last = [max(s for s in range(W) if readers[q][s]) for q in range(W)]
    holder = {
        (q - s) % W: q
        for q in range(W)
        for s in range(1, W)
        if plan.extra["holds"][q][s] and s not in plan.extra["sends"][q]
    }
    keys = {}
    for i, t in enumerate(plan.roles["compute"].tasks[r]):
        tile = plan.tiles[t.args[0]]
        assert tile.rows, f"rank {r} row {i}: an empty task"
        kind, s = _kind(plan, t), ra.unpack_tag(tile.tag)[1]
        if kind is None:
            keys[i] = (s, _group(plan, t), 0)
        elif kind == rb.PREP:
            keys[i] = (-2,)
        elif kind == rb.HOME:
            keys[i] = (last[r], G, 1)
        elif kind == rb.DQ:
            keys[i] = (last[r], G, 2)
        else:  # FINISH: after its group's home at the block's last holder
            keys[i] = (last[r], G, 3) if last[holder[r]] <= last[r] else (W, 0, 3)
    for i, t in enumerate(plan.roles["comm"].tasks[r]):
        s, kind = t.args[:2]
        keys[-1 - i] = (-1, s) if kind < rb.GRAD else (s, G, 0)
    return keys


@pytest.mark.parametrize(
    "W, S, causal, layout, B, Hkv",
    [
        (4, 20, True, "zigzag", 2, 3),
        (3, 17, True, "contiguous", 1, 4),
        (2, 16, False, "zigzag", 1, 6),
    ],
)
def test_no_wait_is_for_a_later_key_and_units_run_keys_in_order(W, S, causal, layout, B, Hkv):
    """make_plan's NOTE (no deadlock): every wait is for tasks of a smaller key, and each unit runs
    its tasks in non-decreasing key order; with several tail groups (contiguous causal: homes of
    several steps on one rank, finishes of ranks whose last step comes before their holder's)."""
    plan = _plan(W, S, causal, layout, batch=B, heads=2 * Hkv, kv_heads=Hkv, sms=9)
    keys = [_keys(plan, r) for r in range(W)]
    units = plan.compute_units
    raisers: dict[tuple, list[tuple]] = {}  # (pad, rank, index) -> keys of the tasks raising it
    for r in range(W):
        for role, sign in (("compute", 1), ("comm", -1)):
            for i, t in enumerate(plan.roles[role].tasks[r]):
                at = i if sign == 1 else -1 - i
                for x in t.raises if at in keys[r] else ():
                    raisers.setdefault((x.pad, x.rank, x.index), []).append(keys[r][at])
    for r in range(W):
        for role, sign in (("compute", 1), ("comm", -1)):
            tasks = plan.roles[role].tasks[r]
            for i, t in enumerate(tasks):
                at = i if sign == 1 else -1 - i
                if at not in keys[r]:
                    continue
                for w in t.waits:
                    for k in raisers[(w.pad, w.rank, w.index)]:
                        assert k < keys[r][at], f"rank {r} {role} {i}: {w.pad}{w.index}"
        for u in range(units):
            base = plan.roles["compute"].rows(r).start
            rows = [i - base for i in plan.task_rows("compute", r, u)]
            mine = [keys[r][i] for i in rows if i in keys[r]]
            assert mine == sorted(mine), f"rank {r} unit {u}"


@pytest.mark.parametrize(
    "W, S, causal, layout, sched",
    [
        (4, 20, True, "zigzag", dict(overlap="intra_sm", sms=3)),
        (3, 17, True, "contiguous", dict(overlap="inter_sm", sms=9, chunk_rows=5)),
        (2, 8, False, "zigzag", dict(overlap="intra_sm", sms=2)),
        (1, 5, True, "contiguous", dict()),
    ],
)
def test_the_plan_is_the_forwards_ring_plus_the_way_back(W, S, causal, layout, sched):
    """Compute role, per unit: its prep part first (row 0; each adds 1 to landed[0]), then its
    K/V tile tasks step-major and by tail group within a step (every K/V tile of every (q chunk,
    K/V chunk) pair a rank sees once, a unit's last of a (step, group) adding the unit's count to
    computed[step, group], the unit's first waiting for every prep), then the tails: home parts
    (computed[s, g], the previous holders' dlanded[s, 0]), dq parts (computed[*, g]) and finish
    parts (dlanded[0, g]; none where the engine stores the block's dk, dv: DIRECT), each part's rows
    and heads covered once; comm tasks: the forward's K/V sends (the same rows, destinations and
    signals; only the consumer counts of landed differ), then the grad sends by step (the order that
    cannot deadlock, make_plan).
    """
    back = _plan(W, S, causal, layout, heads=4, kv_heads=2, **sched)
    world = mkernel.World.emulated(W)
    fwd = mkernel.Schedule(**sched).plan("ring_attention", world, **back.shapes)
    C, tk, units = back.extra["chunks"], back.extra["kv_tile"], back.compute_units
    preps, G = back.extra["preps"], back.extra["groups"]
    Hkv, D, group = back.shapes["kv_heads"], back.shapes["head_dim"], 2
    for r in range(W):
        seen, direct = [], back.extra["direct"][r]
        assert direct == (W == 1 or (layout == "contiguous" and causal and r == W - 1))
        homes = [s for s in range(1, W) if back.extra["holds"][r][s]
                 and s not in back.extra["sends"][r]]  # fmt: skip
        for u in range(units):
            mine = back.roles["compute"].unit_tasks(r, u, units)
            assert all(back.tiles[t.args[0]].rows for t in mine), f"rank {r} unit {u}: a pad"
            kinds = [_kind(back, t) for t in mine]
            assert (kinds[:1] == [rb.PREP]) == (u < preps) and rb.PREP not in kinds[1:]
            sg = [(_step(back, t), _group(back, t)) for t in mine if _kind(back, t) is None]
            assert sg == sorted(sg), f"rank {r} unit {u}: not step-major, then by group"
            tail = [k not in (None, rb.PREP) for k in kinds]
            assert tail == sorted(tail), f"rank {r} unit {u}: the tails after every K/V tile"
            tiles_here = [t for t in mine if _kind(back, t) is None]
            for t in mine:
                tile, s, kind = back.tiles[t.args[0]], _step(back, t), _kind(back, t)
                waits = [(w.pad, w.index) for w in t.waits]
                raises = [(x.pad, x.rank, x.index, x.op) for x in t.raises]
                if kind == rb.PREP:
                    assert (waits, raises) == ([], [("landed", r, (0,), "add")])
                    continue
                if kind is not None:
                    g = _group(back, t)
                if kind == rb.DQ:
                    assert raises == [] and waits == [
                        ("computed", (s, g)) for s in range(W) if back.extra["readers"][r][s]
                    ]
                    continue
                if kind == rb.FINISH:
                    assert (waits, raises) == ([("dlanded", (0, g))], [])
                    continue
                if kind == rb.HOME:
                    hs = _tile_step(back, t)
                    assert hs in homes and waits == [("computed", (hs, g)), ("dlanded", (hs, 0))]
                    assert raises == [("dlanded", (r - hs) % W, (0, g), "add")]
                    continue
                # the unit's last task of a (step, group) raises for its tasks of it, no other
                g = _group(back, t)
                same = [x for x in tiles_here if (_step(back, x), _group(back, x)) == (s, g)]
                want_raise = [("computed", r, (s, g), "add", len(same))] if same[-1] is t else []
                assert [(*x, y.value) for x, y in zip(raises, t.raises, strict=True)] == want_raise
                want = ({("landed", (0,))} if t is tiles_here[0] else set()) | (
                    {("landed", (s,))} if s else set()
                )
                assert set(waits) == want, f"rank {r} unit {u} task {t.id}"
                assert (tile.tag & rb.DIRECT != 0) == (direct and s == 0)
                key = ra.unpack_tag(tile.tag)[0]
                seen.append((s, rb.unpack_key(key, C, Hkv), tile.m0))
        # every element of the tails' rectangles once: prep's delta tiles; dq's rows x q heads,
        # the finish's and each home step's rows x K/V heads
        prep_parts = sorted((back.tiles[t.args[0]].m0, back.tiles[t.args[0]].rows)
                            for t in _rows(back, r, rb.PREP))  # fmt: skip
        assert (
            len(prep_parts) == preps and sum(m for _, m in prep_parts) == back.sizes["delta_rows"]
        )
        pairs = zip(prep_parts, prep_parts[1:], strict=False)
        assert all(a + m == b for (a, m), (b, _) in pairs), "contiguous parts"
        kinds = [(rb.DQ, None, group), (rb.FINISH, None, 1)] + [(rb.HOME, s, 1) for s in homes]
        for kind, step, per in kinds:
            if kind == rb.FINISH and direct:
                assert _rows(back, r, kind) == []
                continue
            cover = torch.zeros(back.sizes["rows"], Hkv * per * D, dtype=torch.int32)
            for t in _rows(back, r, kind):
                tile = back.tiles[t.args[0]]
                if step is None or _tile_step(back, t) == step:
                    cols = slice(tile.n0 * per * D, (tile.n0 + tile.cols) * per * D)
                    cover[tile.m0 : tile.m0 + tile.rows, cols] += 1
            assert (cover == 1).all(), f"rank {r}: {kind} parts cover every element once"
        # every K/V tile of every pair the forward computes on this rank, once
        want, pairs = [], set()  # the (step, q chunk, K/V chunk) pairs the forward computes
        for t in fwd.roles["compute"].tasks[r]:
            ft = fwd.tiles[t.args[0]]
            if ft.rows:
                v = ra.task_view(fwd, ft)
                pairs.add((v.step, v.b, v.hk, v.q0 // (S // C), v.k0 // (S // C)))
        Sc = S // C
        for s, b, hk, cq, ck in sorted(pairs):
            for m0 in range(0, Sc, tk):
                want.append((s, (b, hk, cq, ck), m0))
        assert sorted(seen) == sorted(want), f"rank {r}: K/V tiles"
        assert G == 2
        comm = back.roles["comm"].tasks[r]
        kinds = [t.args[1] for t in comm]
        sends = [t for t in comm if t.args[1] < rb.GRAD]
        strip = lambda t: (t.id, t.args, t.raises, [(w.pad, w.index, w.value) for w in t.waits])  # noqa: E731
        assert [strip(t) for t in sends] == [strip(t) for t in fwd.roles["comm"].tasks[r]]
        assert set(kinds) <= set(range(rb.GRAD)) | {rb.GRAD}, "comm: K/V sends and grad sends"
        order = [0 if k < rb.GRAD else 1 for k in kinds]
        assert order == sorted(order), f"rank {r}: comm order"
        grad_steps = [t.args[0] for t in comm if t.args[1] == rb.GRAD]
        assert grad_steps == sorted(grad_steps)
        assert set(grad_steps) == {s for s in range(W) if s in back.extra["sends"][r]}


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_named_before_anything_runs():
    W = 2
    q, k, v, dout = _inputs(W, 1, 6, 4, 2)
    world = mkernel.World.emulated(W)
    out, lse = torch.zeros_like(q), torch.zeros(W, 1, 4, 6)
    cases = [
        (dict(dout=dout.float()), TypeError, "dout must be torch.bfloat16"),
        (dict(dout=dout[:, :, :4].contiguous()), ValueError, "dout has shape"),
        (dict(dout="g"), TypeError, "dout must be a torch.Tensor"),
        (dict(out=out.half()), TypeError, "out must be torch.bfloat16"),
        (dict(out=out[..., :2, :].contiguous()), ValueError, "out has shape"),
        (dict(lse=lse.bfloat16()), TypeError, "lse must be torch.float32"),
        (dict(lse=lse[..., :5].contiguous()), ValueError, "lse must have shape"),
        (dict(lse=lse.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "lse must be con"),
        (dict(lse=None), TypeError, "lse must be a torch.Tensor"),
        (dict(q=q.float()), TypeError, "q must be torch.bfloat16"),
        (dict(k=k[:, :, :4].contiguous(), v=v[:, :, :4].contiguous()), ValueError, "k is "),
        (dict(layout="ring"), ValueError, "layout must be one of"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(scale=-1.0), ValueError, "scale must be a positive"),
        (dict(world=3), TypeError, "world must be an mkernel.World"),
        (dict(schedule="fast"), TypeError, "schedule must be an mkernel.Schedule"),
    ]
    for change, exc, match in cases:
        args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, world=world) | change
        with pytest.raises(exc, match=match):
            ring_attention_backward(**args)
    assert world._plans == {} and world.signal_pads() == {}, "a bad call built or ran something"


# -- planted protocol mistakes ---------------------------------------------------------------------


def _run(W, S, layout, causal, *, edit=None, calls=1, seed=0):
    """One fresh backward plan through run_plan as the API runs it; ``edit(plan, tasks)`` changes a
    deep copy of the tasks ({role: [W][...]})."""
    world = mkernel.World.emulated(W)
    q, k, v, dout = _inputs(W, 1, S, 2, 1, seed=seed)
    out, lse = ring_attention(q, k, v, world, causal=causal, layout=layout)
    sched = mkernel.Schedule(overlap="intra_sm", sms=3, seed=seed)
    shapes = rb.shapes(dout, q, k, v, out, lse, world, causal, layout)
    plan = rb.make_plan(sched, world, **shapes)
    if edit is not None:
        tasks = {role: copy.deepcopy(t.tasks) for role, t in plan.roles.items()}
        edit(plan, tasks)
        roles = {
            r: RoleTables(tasks=t, unit_counts=plan.roles[r].unit_counts) for r, t in tasks.items()
        }
        plan = dataclasses.replace(plan, roles=roles)
    grads = [torch.full(x.shape, float("nan"), dtype=torch.bfloat16) for x in (q, k, v)]
    ws = common.workspace(world, plan)
    views = rb.operands(plan, dout, q, k, v, out, lse, torch.zeros_like(lse), *grads)
    buffers = views | {name: b.local for name, b in ws.items() if b is not None}
    reads = lambda rank: rb.outputs(plan, rank)  # noqa: E731
    program.run_plan(world, plan, buffers, rb.twins_of(plan), seed, reads, calls=calls)
    return grads, world, (q, k, v, dout, out, lse)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_unchanged_plan_passes_over_two_calls(layout):
    got, world, (q, k, v, dout, out, lse) = _run(4, 20, layout, True, calls=2)
    _assert_grads(got, q, k, v, dout, out, lse, True, 1 / 8, layout, "two calls")
    _assert_workspace_zero(world)


def test_grad_parts_are_capped_and_the_gradients_stay_right(monkeypatch):
    """GRAD_PARTS below the comm units (GPU worlds: 24 of 66 units): each step's grad sends come
    in that many parts, each waited for by the next holder, and the gradients are unchanged."""
    monkeypatch.setattr(rb, "GRAD_PARTS", 2)
    got, world, (q, k, v, dout, out, lse) = _run(3, 20, "contiguous", False)
    sched = mkernel.Schedule(overlap="intra_sm", sms=3)
    plan = rb.make_plan(sched, world, **rb.shapes(dout, q, k, v, out, lse, world, False))
    assert plan.extra["gparts"] == 2 < plan.comm_units
    for r in range(3):
        by_step: dict[int, int] = {}
        for t in _comm(plan, r, rb.GRAD):
            by_step[t.args[0]] = by_step.get(t.args[0], 0) + 1
        assert by_step and set(by_step.values()) == {2}, f"rank {r}: {by_step}"
    _assert_grads(got, q, k, v, dout, out, lse, False, 1 / 8, "contiguous", "2 grad parts")
    _assert_workspace_zero(world)


@pytest.mark.parametrize("causal, layout", [(False, "contiguous"), (True, "zigzag")])
def test_units_hosting_copies_get_less_compute(causal, layout, monkeypatch):
    """intra_sm: comm unit u runs on compute unit u's SM, so the LPT starts that unit with the cost
    of the copies it hosts (ring_cost.spare_copy_rows of their bytes read + written). Recomputed
    here: each unit's K/V tile costs (q rows walked + ring_cost.item_rows) and tail parts'
    (tail_costs) plus its hosted copies end within one task's cost of each other, where the copies
    alone outweigh a task (grad sends in 3 parts, so 3 of the 8 units host them)."""
    monkeypatch.setattr(rb, "GRAD_PARTS", 3)
    W, S, Hkv, D = 2, 2048, 8, 128  # a grad part: 256 rows x 8 heads of fp32 dK | dV
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(overlap="intra_sm")
    shapes = dict(batch=1, seq=S, heads=Hkv, kv_heads=Hkv, head_dim=D, scale_bits=0)
    plan = sched.plan(
        "ring_attention_backward", world, causal=int(causal), zigzag=int(layout == "zigzag"),
        **shapes,
    )  # fmt: skip
    units, tk = plan.compute_units, plan.extra["kv_tile"]
    item = ring_cost.item_rows(tk, D)
    for r in range(W):
        hosted = [0.0] * units
        for i, t in enumerate(plan.roles["comm"].tasks[r]):
            per_row = 24 * Hkv * D if t.args[1] == rb.GRAD else 8 * Hkv * D
            hosted[i % units] += ring_cost.spare_copy_rows(per_row * t.args[3], tk, D)
        work, biggest = [0.0] * units, 0.0
        tails = rb.tail_costs(plan.tiles, 1, D, tk)  # home, dq, finish parts (row tasks)
        for u in range(units):
            for t in plan.roles["compute"].unit_tasks(r, u, units):
                tile = plan.tiles[t.args[0]]
                if tile.rows and not tile.tag & rb.AUX:
                    c = (tile.cols - tile.m0 if tile.tag & 1 else tile.cols) + item
                else:
                    c = tails.get(tile.index, 0.0)
                work[u] += c
                biggest = max(biggest, c)
        assert max(hosted) > biggest, "the case must make the copies matter"
        total = [w + h for w, h in zip(work, hosted, strict=True)]
        assert max(total) - min(total) <= biggest + 1e-6, f"rank {r}: {total}"
        host = max(range(units), key=hosted.__getitem__)
        idle = min(range(units), key=hosted.__getitem__)
        assert work[host] < work[idle], f"rank {r}: {work}, hosted {hosted}"


def _drop(pad: str, rank: int, kind: int, step: int):
    def edit(plan, tasks):
        for t in tasks["comm"][rank]:
            if t.args[:2] == (step, kind):
                t.waits = tuple(w for w in t.waits if w.pad != pad)
        for t in tasks["compute"][rank]:  # the row tasks (prep, dq, home, finish)
            if _kind(plan, t) == kind and ra.unpack_tag(plan.tiles[t.args[0]].tag)[1] == step:
                t.waits = tuple(w for w in t.waits if w.pad != pad)

    return edit


@pytest.mark.parametrize("seed", range(2))
def test_a_compute_task_without_its_landed_wait_is_a_race_on_the_slot(seed):
    def edit(plan, tasks):
        hit = [t for t in tasks["compute"][1] if t.waits]
        assert hit, "no compute task of rank 1 waits"
        for t in hit:
            t.waits = tuple(w for w in t.waits if w.pad != "landed")

    with pytest.raises(RaceError, match="k_ring|v_ring"):
        _run(3, 20, "contiguous", False, edit=edit, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_compute_tasks_that_do_not_wait_for_the_prep_race_on_delta(seed):
    def edit(plan, tasks):
        for t in tasks["compute"][1]:
            t.waits = tuple(w for w in t.waits if w.index != (0,))

    with pytest.raises(RaceError, match="delta"):
        _run(3, 20, "contiguous", False, edit=edit, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_a_partial_sent_before_its_step_is_computed_is_a_race(seed):
    with pytest.raises(RaceError, match="dkv_acc"):
        _run(3, 20, "contiguous", False, edit=_drop("computed", 1, rb.GRAD, 1), seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_a_partial_sent_before_the_previous_one_landed_is_a_race(seed):
    with pytest.raises(RaceError, match="dkv_acc"):
        _run(3, 20, "zigzag", True, edit=_drop("dlanded", 2, rb.GRAD, 1), seed=seed)


def test_a_home_sent_before_the_previous_partial_landed_is_a_race():
    with pytest.raises(RaceError, match="dkv_acc"):
        _run(3, 20, "zigzag", True, edit=_drop("dlanded", 0, rb.HOME, 2))


def test_a_dq_store_before_every_step_is_computed_is_a_race():
    with pytest.raises(RaceError, match="dq_acc"):
        _run(2, 20, "contiguous", False, edit=_drop("computed", 1, rb.DQ, 0))


def test_a_finish_that_does_not_wait_for_its_gradient_is_a_race():
    with pytest.raises(RaceError, match="dkv_home"):
        _run(2, 20, "contiguous", False, edit=_drop("dlanded", 0, rb.FINISH, 0))


def test_a_dk_tile_never_stored_is_reported(monkeypatch):
    store = twins.output_store

    def no_dk(ctx, buf, rank, rect, value, tile):
        if buf == "dk":
            return (yield from twins.bulk_wait_read(ctx))
        return (yield from store(ctx, buf, rank, rect, value, tile))

    monkeypatch.setattr(twins, "output_store", no_dk)
    with pytest.raises(TileWriteError, match="tile never written"):
        _run(2, 20, "zigzag", True)


def test_a_late_rank_changes_nothing():
    W, S, layout = 3, 12, "zigzag"
    q, k, v, dout = _inputs(W, 1, S, 2, 1, seed=11)
    world = mkernel.World.emulated(W)
    out, lse = ring_attention(q, k, v, world, causal=True, layout=layout)
    late = mkernel.Schedule(faults=mkernel.Faults(delay_rank=1, delay_us=200), seed=2)
    got = ring_attention_backward(dout, q, k, v, out, lse, world, True, None, layout, late)
    _assert_grads(got, q, k, v, dout, out, lse, True, 1 / 8, layout, "rank 1 late")
    _assert_workspace_zero(world)


def test_the_backward_engine_variants_are_0_1_and_nothing_else():
    # checked before anything is loaded or launched (mkernel/attention_ext.py)
    from mkernel.attention_ext import _check_variant

    assert [_check_variant(v) for v in (0, 1)] == [0, 1]
    for bad in (2, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="variant must be 0 or 1"):
            _check_variant(bad)


def test_the_plan_refuses_more_kv_pieces_than_the_kernel_tells_from_grad_sends(monkeypatch):
    """A K/V piece's index is its comm task's args[1]; the kernel reads GRAD and up as a grad
    send, so a plan with more pieces than GRAD would send some K/V rows as gradients."""
    plan = _plan(2, 64, False, "contiguous")
    assert 1 < plan.extra["parts"] <= rb.GRAD
    # (the interpreter's worlds have few comm units: a smaller kind id stands in for more units)
    monkeypatch.setattr(rb, "GRAD", plan.extra["parts"] - 1)
    with pytest.raises(AssertionError, match="grad sends"):
        _plan(2, 64, False, "contiguous")


@pytest.mark.parametrize(
    "B, S, Hkv, group, G, tails",
    [
        (1, 1 << 21, 64, 1, 1, 1),
        (2, 3 << 18, 8, 8, 8, 66),
        (3, 5, 2, 1, 6, 132),
        (1, 1, 1, 1, 1, 1),
    ],
)
def test_tail_parts_cover_each_group_once_within_int32_elements(B, S, Hkv, group, G, tails):
    """tail_parts: each group's parts cover its (b, K/V head) pairs' rows once, each within one b,
    and count fewer than 2**31 16-byte elements (the device loops count them in int32: home's dK |
    dV fp32 and dq's q heads per row), however long the sequence."""
    D = 128
    cuts = rb.tail_parts(B, S, Hkv, group, D, G, tails)
    assert len(cuts) == G
    seen = torch.zeros(B * S, Hkv, dtype=torch.int8)
    for g, (first, n) in enumerate(ra.row_parts(B * Hkv, G)):
        pairs = set(range(first, first + n))
        for m0, rows, hk0, nh in cuts[g]:
            b = m0 // S
            assert rows > 0 and (m0 + rows - 1) // S == b, "a part's rows are within one b"
            assert {b * Hkv + h for h in range(hk0, hk0 + nh)} <= pairs
            assert rows * nh * D * max(2, group) // 4 < 2**31
            seen[m0 : m0 + rows, hk0 : hk0 + nh] += 1
    assert (seen == 1).all()
