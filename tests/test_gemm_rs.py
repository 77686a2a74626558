"""gemm_rs on the CPU interpreter: properties over shapes, world sizes, schedules and
interleavings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from tests.helpers import (
    assert_pads_zero,
    assert_rejects_bad_dtype,
    assert_rejects_layout_and_world,
    gemm_inputs,
    random_order,
)
from tests.test_laws import assert_gemm_rs


@settings(max_examples=40, deadline=None)
@given(
    W=st.integers(1, 8),
    rows=st.integers(1, 160),
    n8=st.integers(1, 40),
    k8=st.integers(1, 12),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    tile=st.sampled_from([None, "128x128x64", "128x256x64"]),
    sms=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
def test_matches_reference(W, rows, n8, k8, overlap, tile, sms, seed, shuffle):
    m, n, kl = W * rows, 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = mkernel.Schedule(
        overlap=overlap,
        tile=tile,
        sms=sms,
        seed=seed,
        tile_order=random_order(seed) if shuffle else None,
    )
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert out.shape == (W, rows, n)
    assert_gemm_rs(out, a, b, f"W={W} {m}x{n}x{kl}")
    assert_pads_zero(world)
    assert all(key[0] != ("gemm_rs", "acc") for key in world._buffers), "no fp32 accumulator"
    # Running twice (another interleaving) gives the same bits: an owner adds its peers' partials
    # in slot order, whenever they landed.
    again = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert torch.equal(again, out)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_silent_rank_raises_comm_timeout_naming_the_peer(overlap):
    W = 3
    world = mkernel.World.emulated(W, timeout_s=0.05)
    a, b = gemm_inputs(W, 3 * 64, 64, 16, 1)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(silent_rank=1))
    with pytest.raises(mkernel.CommTimeout) as e:
        mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert e.value.peer == 1
    assert e.value.rank != 1
    assert e.value.signal.startswith("partial[tile=") and "src=1]" in e.value.signal
    assert "peer 1" in str(e.value)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_delayed_rank_leaves_result_unchanged(overlap):
    W = 4
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 4 * 40, 48, 24, 2)
    sched = mkernel.Schedule(overlap=overlap, faults=mkernel.Faults(delay_rank=2, delay_us=500))
    out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
    assert_gemm_rs(out, a, b, "delayed")


def test_timeline_exports_chrome_trace(tmp_path):
    import json

    W = 2
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, 2 * 200, 300 - 300 % 8, 16, 3)
    mkernel.gemm_rs(a, b, world=world, schedule=mkernel.Schedule(tile="128x128x64"))
    tl = world.last_timeline
    path = tl.save_chrome(tmp_path / "t.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tiles = 2 * 2 * 3  # per rank: 2 owners x 2 row tiles x 3 col tiles
    assert sum(e["name"].startswith("compute") for e in spans) == W * tiles
    assert {e["pid"] for e in spans} == {0, 1}
    assert all(e["dur"] >= 1 for e in spans)
    assert "r1" in tl.ascii()


# -- bad input: clear errors before anything runs ---------------------------------------------


def _good(W=2):
    return gemm_inputs(W, W * 16, 16, 16, 0)


def test_bad_dtype():
    assert_rejects_bad_dtype(mkernel.gemm_rs, *_good(), mkernel.World.emulated(2))


def test_bad_shapes():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="M .* multiple of 2"):
        mkernel.gemm_rs(a[:, :15].contiguous(), b, world=world)
    with pytest.raises(ValueError, match="K/W differs"):
        mkernel.gemm_rs(a, b[:, :8].contiguous(), world=world)
    with pytest.raises(ValueError, match="N .* multiple of 8"):
        mkernel.gemm_rs(a, b[:, :, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="K/W .* multiple of 8"):
        mkernel.gemm_rs(a[:, :, :12].contiguous(), b[:, :12].contiguous(), world=world)
    with pytest.raises(ValueError, match="3 dims"):
        mkernel.gemm_rs(a[0], b, world=world)


def test_non_contiguous_and_wrong_world():
    world = mkernel.World.emulated(2)
    assert_rejects_layout_and_world(mkernel.gemm_rs, *_good(), *_good(4), world)


def test_bad_schedule_and_out():
    world = mkernel.World.emulated(2)
    a, b = _good()
    with pytest.raises(ValueError, match="overlap"):
        mkernel.Schedule(overlap="both")
    with pytest.raises(ValueError, match="not a permutation"):
        mkernel.gemm_rs(a, b, world=world, schedule=mkernel.Schedule(tile_order=lambda r, t: [0]))
    with pytest.raises(ValueError, match="inter_sm needs >= 2 SMs"):
        mkernel.gemm_rs(a, b, world=world, schedule=mkernel.Schedule(overlap="inter_sm", sms=1))
    with pytest.raises(ValueError, match="out must be bfloat16"):
        mkernel.gemm_rs(a, b, world=world, out=torch.empty(2, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="silent_rank"):
        mkernel.gemm_rs(
            a, b, world=world, schedule=mkernel.Schedule(faults=mkernel.Faults(silent_rank=5))
        )


def test_bad_world():
    with pytest.raises(ValueError):
        mkernel.World.emulated(0)
    with pytest.raises(ValueError):
        mkernel.World.emulated(4, nodes=3)
    with pytest.raises(ValueError):
        mkernel.World.emulated(2, device="tpu")


def test_a_raising_task_before_a_waiting_one_completes_before_it(monkeypatch):
    """The engine completes a task (its raises) in the next task's epilogue, after the next task's
    waits, unless the task raises and the next one waits. Deferring those too deadlocks gemm_rs:
    the last peer tile's partial would wait behind the own tile that waits for a peer's last
    partial (W = 8, 16 units per rank: what an H200 gives an emulated world of 8)."""
    from mkernel import schedule as sched_module
    from mkernel.interp import program
    from mkernel.ops import gemm_rs as rs

    W = 8
    a, b = gemm_inputs(W, 1144, 544, 208, 2)
    for module in (rs, sched_module):
        monkeypatch.setattr(module, "rank_sms", lambda schedule, world: 16)
    world, sched = mkernel.World.emulated(W), mkernel.Schedule(overlap="intra_sm")
    assert sched.plan("gemm_rs", world, a, b).compute_units == 16
    out = mkernel.gemm_rs(a, b, world, sched)
    assert_gemm_rs(out, a, b, "16 units per rank")
    monkeypatch.setattr(program, "may_defer_completion", lambda task, nxt: True)
    with pytest.raises(mkernel.DeadlockError, match=r"partial\[tile="):
        mkernel.gemm_rs(a, b, mkernel.World.emulated(W), mkernel.Schedule(overlap="intra_sm"))
