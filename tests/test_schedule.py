"""Schedules: validation of every knob, plans both backends run, the transfer knob on the CPU."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.helpers import assert_close_bf16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"overlap": "both"}, "overlap"),
        ({"tile": "64x64x64"}, "tile"),
        ({"sms": 0}, "sms"),
        ({"comm_sms": 4}, "applies to overlap='inter_sm' only"),
        ({"chunk_rows": -1}, "chunk_rows"),
        ({"backoff_ns": -5}, "backoff_ns"),
        ({"transfer": "rdma"}, "transfer"),
        ({"overlap": "intra_sm", "transfer": "tma"}, "needs overlap='inter_sm'"),
    ],
)
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mkernel.Schedule(**kwargs)


def test_plan_is_what_both_backends_run():
    world = mkernel.World.emulated(4)
    sched = mkernel.Schedule(overlap="inter_sm", sms=6, comm_sms=2, tile="128x128x64")
    plan = sched.plan("gemm_rs", world, m=4 * 200, n=300 - 300 % 8, k=4 * 64)
    assert plan.compute_units == 4 and plan.comm_units == 2 and plan.ctas_per_rank == 6
    per_rank = len(plan.tiles)
    for r in range(4):  # every rank computes every tile once; owners finalize their own tiles
        assert sorted(plan.compute_order[r].tolist()) == list(range(per_rank))
        assert all(plan.tiles[t].tag == r for t in plan.comm_tasks[r].tolist())
    units = [plan.tasks_of("compute", 0, u) for u in range(plan.compute_units)]
    assert sorted(sum(units, [])) == list(range(per_rank))


@pytest.mark.parametrize("transfer", ["auto", "stores", "tma"])
def test_ag_gemm_transfer_knob_keeps_the_result(transfer):
    W = 3
    world = mkernel.World.emulated(W)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(W, 40, 64, generator=g).bfloat16()
    b = torch.randn(W, 64, 48, generator=g).bfloat16()
    sched = mkernel.Schedule(overlap="inter_sm", transfer=transfer)
    out = mkernel.ag_gemm(a, b, world, sched)
    assert_close_bf16(out, mkernel.reference.ag_gemm(a, b, world), transfer)


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm", "gemm_ar"])
def test_plan_from_operands_is_the_plan_a_call_runs(op):
    W = 2
    world = mkernel.World.emulated(W)
    rows = 64 if op == "ag_gemm" else 128
    a = torch.randn(W, rows, 32).bfloat16()
    b = torch.randn(W, 32, 64).bfloat16()
    sched = mkernel.Schedule(tile="128x128x64")
    plan = sched.plan(op, world, a, b)
    k = 32 if op == "ag_gemm" else 32 * W
    m = rows * W if op == "ag_gemm" else rows
    assert plan is sched.plan(op, world, m=m, n=64, k=k)
    getattr(mkernel, op)(a, b, world, sched)
    assert world.last_timeline is not None
    with pytest.raises(TypeError, match="not both"):
        sched.plan(op, world, a, b, m=m, n=64, k=k)
    with pytest.raises(TypeError, match="needs the operands"):
        sched.plan(op, world, m=m)
    with pytest.raises(ValueError, match="unknown op"):
        sched.plan("fused_everything", world, m=m, n=64, k=k)


def test_schedule_faults_none_means_no_faults_and_a_wrong_type_is_refused():
    assert mkernel.Schedule(faults=None).faults == mkernel.Faults()
    with pytest.raises(TypeError, match="Schedule.faults must be a mkernel.Faults"):
        mkernel.Schedule(faults={"silent_rank": 1})
