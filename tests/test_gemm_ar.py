"""gemm_ar on the CPU interpreter: properties over shapes, world sizes, schedules and interleavings;
bad input; silent and late ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from tests.helpers import (
    assert_close_bf16,
    assert_pads_zero,
    assert_rejects_bad_dtype,
    assert_rejects_layout_and_world,
    gemm_inputs,
    poisoned,
    random_order,
)


def _clean(world, m, n):
    assert_pads_zero(world)
    acc = world._buffers[(("gemm_ar", "acc"), (m, n), torch.float32)].local
    assert int((acc != 0).sum()) == 0, "accumulators not zeroed for the next call"


@settings(max_examples=150, deadline=None)
@given(
    W=st.integers(1, 8),
    m=st.integers(1, 300),
    n8=st.integers(1, 40),
    k8=st.integers(1, 6),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    tile=st.sampled_from([None, "128x128x64", "128x256x64"]),
    sms=st.integers(2, 8),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_matches_reference(W, m, n8, k8, overlap, tile, sms, seed, shuffle):
    n, kl = 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = mkernel.Schedule(
        overlap=overlap,
        tile=tile,
        sms=sms,
        seed=seed,
        tile_order=random_order(seed) if shuffle else None,
    )
    out = poisoned((W, m, n), "cpu")
    got = mkernel.gemm_ar(a, b, world=world, schedule=sched, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (W, m, n)
    assert_close_bf16(got, mkernel.reference.gemm_ar(a, b, world=world), f"W={W} {m}x{n}x{kl}")
    # Every rank holds the same bits: the owner wrote one bf16 tile into all of them.
    assert all(torch.equal(got[r], got[0]) for r in range(W))
    _clean(world, m, n)
    again = mkernel.gemm_ar(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap, seed=7))
    # W <= 2: 0 + x + y == 0 + y + x exactly; beyond, the fp32 add order may differ by a rounding.
    assert torch.equal(again, got) or W > 2
    assert_close_bf16(again, got, "second call")
    _clean(world, m, n)


def test_owners_are_balanced_and_finalizes_come_first():
    W = 3
    world = mkernel.World.emulated(W)
    plan = mkernel.Schedule(tile="128x128x64").plan("gemm_ar", world, m=512, n=640, k=3 * 64)
    T = len(plan.tiles)
    assert T == 20 and [t.tag for t in plan.tiles] == [i % W for i in range(T)]
    for r in range(W):
        tasks = plan.comm_tasks[r].tolist()
        owned = [t for t in tasks if t < T]
        assert owned == [t for t in range(T) if t % W == r]
        assert tasks[: len(owned)] == owned  # every comm unit reaches its finalizes first
        assert sorted(t - T for t in tasks[len(owned) :]) == [t for t in range(T) if t % W != r]


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_many_comm_units_few_tiles(overlap):
    # More comm units than tiles: most units hold only waits, still no deadlock.
    W = 4
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 100, 136, 8, 3)
    sched = mkernel.Schedule(overlap=overlap, sms=8, comm_sms=4 if overlap == "inter_sm" else None)
    out = mkernel.gemm_ar(a, b, world=world, schedule=sched)
    assert_close_bf16(out, mkernel.reference.gemm_ar(a, b, world=world), "few tiles")
    _clean(world, 100, 136)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
@pytest.mark.parametrize("silent", [0, 2])
def test_silent_rank_raises_comm_timeout_naming_the_peer(overlap, silent):
    W = 3
    world = mkernel.World.emulated(W, timeout_s=0.05)
    a, b = gemm_inputs(W, 200, 64, 16, 1)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=silent))
    with pytest.raises(mkernel.CommTimeout) as e:
        mkernel.gemm_ar(a, b, world=world, schedule=sched)
    assert e.value.peer == silent
    assert "tile_flag" in e.value.signal
    assert f"peer {silent}" in str(e.value)
    # The failed call left the world clean: the next call is correct.
    _clean(world, 200, 64)
    out = mkernel.gemm_ar(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap))
    assert_close_bf16(out, mkernel.reference.gemm_ar(a, b, world=world), "after timeout")


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_delayed_rank_leaves_result_unchanged(overlap):
    W = 4
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 160, 48, 24, 2)
    ref = mkernel.reference.gemm_ar(a, b, world=world)
    for delay_rank in (0, 3):
        faults = mkernel.Faults(delay_rank=delay_rank, delay_us=500)
        out = mkernel.gemm_ar(
            a, b, world=world, schedule=mkernel.Schedule(overlap=overlap, faults=faults)
        )
        assert_close_bf16(out, ref, f"delayed rank {delay_rank}")
        _clean(world, 160, 48)


# -- bad input: clear errors before anything runs ---------------------------------------------


def _good(W=2):
    return gemm_inputs(W, 16, 16, 16, 0)


def test_bad_dtype():
    assert_rejects_bad_dtype(mkernel.gemm_ar, *_good(), mkernel.World.emulated(2))


def test_bad_shapes():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="K/W differs"):
        mkernel.gemm_ar(a, b[:, :8].contiguous(), world=world)
    with pytest.raises(ValueError, match="N .* multiple of 8"):
        mkernel.gemm_ar(a, b[:, :, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="K/W .* multiple of 8"):
        mkernel.gemm_ar(a[:, :, :12].contiguous(), b[:, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="M "):
        mkernel.gemm_ar(a[:, :0].contiguous(), b, world=world)
    with pytest.raises(ValueError, match="3 dims"):
        mkernel.gemm_ar(a, b[0], world=world)
    # Any M works (no divisibility by W): 15 rows over 2 ranks.
    out = mkernel.gemm_ar(a[:, :15].contiguous(), b, world=world)
    assert out.shape == (2, 15, 16)


def test_non_contiguous_and_wrong_world():
    world = mkernel.World.emulated(2)
    assert_rejects_layout_and_world(mkernel.gemm_ar, *_good(), *_good(4), world)


def test_bad_schedule_and_out():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="not a permutation"):
        mkernel.gemm_ar(a, b, world=world, schedule=mkernel.Schedule(tile_order=lambda r, t: []))
    with pytest.raises(TypeError, match="schedule must be"):
        mkernel.gemm_ar(a, b, world=world, schedule="fast")
    with pytest.raises(ValueError, match="out must be bfloat16"):
        mkernel.gemm_ar(a, b, world=world, out=torch.empty(16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be bfloat16"):
        mkernel.gemm_ar(a, b, world=world, out=torch.empty(2, 16, 16))
    with pytest.raises(ValueError, match="silent_rank"):
        faults = mkernel.Faults(silent_rank=-1)
        mkernel.gemm_ar(a, b, world=world, schedule=mkernel.Schedule(faults=faults))
    assert_pads_zero(world)  # nothing ran
