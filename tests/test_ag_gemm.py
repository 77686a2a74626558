"""ag_gemm on the CPU interpreter: properties over shapes, world sizes, chunkings, schedules and
interleavings; bad input; silent and late ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.ops import ag_gemm as ag_mod
from tests.helpers import (
    assert_close_bf16,
    assert_pads_zero,
    assert_rejects_bad_dtype,
    assert_rejects_layout_and_world,
    gemm_inputs,
    poisoned,
    random_order,
)


@settings(max_examples=70, deadline=None)
@given(
    W=st.integers(1, 8),
    ms=st.integers(1, 140),
    n8=st.integers(1, 20),
    k8=st.integers(1, 6),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    tile=st.sampled_from([None, "128x128x64", "128x256x64"]),
    chunk_rows=st.sampled_from([None, 2, 7, 16, 50, 200]),
    sms=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_matches_reference(W, ms, n8, k8, overlap, tile, chunk_rows, sms, seed, shuffle):
    n, k = 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, ms, n, k, seed)
    sched = mkernel.Schedule(
        overlap=overlap,
        tile=tile,
        chunk_rows=chunk_rows,
        sms=sms,
        seed=seed,
        tile_order=random_order(seed) if shuffle else None,
    )
    out = poisoned((W, W * ms, n), "cpu")
    got = mkernel.ag_gemm(a, b, world=world, schedule=sched, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (W, W * ms, n)
    ref = mkernel.reference.ag_gemm(a, b, world=world)
    assert_close_bf16(got, ref, f"W={W} ms={ms} n={n} k={k} chunk_rows={chunk_rows}")
    assert_pads_zero(world)
    # Running twice (another interleaving) gives the same result, bit for bit: each output tile is
    # one GEMM over gathered rows, whatever order the chunks arrived in.
    again = mkernel.ag_gemm(
        a, b, world=world, schedule=mkernel.Schedule(overlap=overlap, seed=seed + 1)
    )
    assert torch.equal(again, got)
    assert_pads_zero(world)


def test_tiles_spanning_chunks_and_shards():
    # M/W = 50 rows in chunks of 10; 128-row tiles: tile 0 needs 13 chunks of 3 shards, and chunk
    # 2 of shard 2 (global rows 120..129) feeds both tile rows.
    W, ms, cr, n = 4, 50, 10, 256
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, ms, n, 16, 5)
    sched = mkernel.Schedule(tile="128x128x64", chunk_rows=cr, seed=3)
    plan = sched.plan("ag_gemm", world, m=W * ms, n=n, k=16)
    C = plan.sizes["chunks"]
    assert C == 5
    last = {t.index: ag_mod._chunk_of(t.m0 + t.rows - 1, ms, cr, C) for t in plan.tiles}
    assert max(last[i] - t.tag + 1 for i, t in enumerate(plan.tiles)) == 13
    # consumers[g] = tiles whose rows overlap chunk g, counted here from the rows themselves
    want = []
    for g in range(W * C):
        lo = g // C * ms + g % C * cr
        hi = g // C * ms + min(g % C * cr + cr, ms)
        want.append(sum(t.m0 < hi and lo < t.m0 + t.rows for t in plan.tiles))
    assert plan.extra["consumers"].tolist() == want
    assert want[2 * C + 2] == 4 and min(want) == 2
    out = mkernel.ag_gemm(a, b, world=world, schedule=sched)
    assert_close_bf16(out, mkernel.reference.ag_gemm(a, b, world=world), "spanning")
    assert_pads_zero(world)


def test_default_order_is_arrival_order():
    W, ms = 3, 256
    world = mkernel.World.emulated(W)
    plan = mkernel.Schedule(tile="128x128x64").plan("ag_gemm", world, m=W * ms, n=256, k=64)
    for r in range(W):
        shards = [plan.tiles[i].m0 // ms for i in plan.compute_order[r].tolist()]
        want = [(r + j) % W for j in range(W) for _ in range(len(shards) // W)]
        assert shards == want, f"rank {r} computes shards in order {shards}"
        # one push per (own chunk, destination): chunk-major, own copy first
        pushes = [(g, (r + j) % W) for g in (r * 2, r * 2 + 1) for j in range(W)]
        assert plan.comm_tasks[r].tolist() == [g * W + p for g, p in pushes]


def test_consumer_count_is_what_resets_the_pads(monkeypatch):
    """Counted consumers are checked before anything runs: one consumer too few would reset a
    chunk's flag while a tile still needs it, and the plan names the signal."""
    real = ag_mod.Wait

    def short_by_one(pad, rank, index, consumers=1, **kw):
        return real(pad, rank, index, consumers=consumers - (index == (0,)), **kw)

    monkeypatch.setattr(ag_mod, "Wait", short_by_one)
    W = 2
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(tile="128x128x64", chunk_rows=8)
    a, b = gemm_inputs(W, 16, 256, 8, 1)  # two tile columns: every chunk has 2 consumers
    with pytest.raises(ValueError, match=r"chunk_ready\[chunk=0\]"):
        mkernel.ag_gemm(a, b, world=world, schedule=sched)
    assert_pads_zero(world)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_silent_rank_raises_comm_timeout_naming_the_peer(overlap):
    W = 3
    world = mkernel.World.emulated(W, timeout_s=0.05)
    a, b = gemm_inputs(W, 64, 64, 16, 1)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    with pytest.raises(mkernel.CommTimeout) as e:
        mkernel.ag_gemm(a, b, world=world, schedule=sched)
    assert e.value.peer == 1
    assert "chunk_ready" in e.value.signal
    assert "peer 1" in str(e.value)
    # The failed call left the world clean: the next call is correct.
    assert_pads_zero(world)
    out = mkernel.ag_gemm(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap))
    assert_close_bf16(out, mkernel.reference.ag_gemm(a, b, world=world), "after timeout")


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_delayed_rank_leaves_result_unchanged(overlap):
    W = 4
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 40, 48, 24, 2)
    ref = mkernel.reference.ag_gemm(a, b, world=world)
    for delay_rank in (0, 3):
        faults = mkernel.Faults(delay_rank=delay_rank, delay_us=500)
        sched = mkernel.Schedule(overlap=overlap, chunk_rows=8, faults=faults)
        out = mkernel.ag_gemm(a, b, world=world, schedule=sched)
        assert_close_bf16(out, ref, f"delayed rank {delay_rank}")
        assert_pads_zero(world)


def test_distinct_b_per_rank():
    # Every rank multiplies the same gathered A by its own B: results differ per rank.
    W = 3
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 10, 16, 8, 4)
    out = mkernel.ag_gemm(a, b, world=world)
    full_a = a.reshape(W * 10, 8).float()
    for r in range(W):
        assert_close_bf16(out[r], (full_a @ b[r].float()).bfloat16(), f"rank {r}")
    assert not torch.equal(out[0], out[1])


# -- bad input: clear errors before anything runs ---------------------------------------------


def _good(W=2):
    return gemm_inputs(W, 16, 16, 16, 0)


def test_bad_dtype():
    assert_rejects_bad_dtype(mkernel.ag_gemm, *_good(), mkernel.World.emulated(2))


def test_bad_shapes():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="K differs"):
        mkernel.ag_gemm(a, b[:, :8].contiguous(), world=world)
    with pytest.raises(ValueError, match="N .* multiple of 8"):
        mkernel.ag_gemm(a, b[:, :, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="K .* multiple of 8"):
        mkernel.ag_gemm(a[:, :, :12].contiguous(), b[:, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="M/W"):
        mkernel.ag_gemm(a[:, :0].contiguous(), b, world=world)
    with pytest.raises(ValueError, match="3 dims"):
        mkernel.ag_gemm(a[0], b, world=world)


def test_non_contiguous_and_wrong_world():
    world = mkernel.World.emulated(2)
    assert_rejects_layout_and_world(mkernel.ag_gemm, *_good(), *_good(4), world)


def test_bad_schedule_and_out():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="not a permutation"):
        mkernel.ag_gemm(
            a, b, world=world, schedule=mkernel.Schedule(tile_order=lambda r, t: [0, 0])
        )
    with pytest.raises(ValueError, match="chunk_rows"):
        mkernel.Schedule(chunk_rows=0)
    with pytest.raises(ValueError, match="out must be bfloat16"):
        mkernel.ag_gemm(a, b, world=world, out=torch.empty(2, 16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="delay_rank"):
        faults = mkernel.Faults(delay_rank=2)
        mkernel.ag_gemm(a, b, world=world, schedule=mkernel.Schedule(faults=faults))
    assert_pads_zero(world)  # nothing ran
