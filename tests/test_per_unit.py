"""Explicit per-unit task lists (protocol.PerUnit) and the shared placement helper
(schedule.least_loaded): a role given unit by unit is encoded with each unit's rows (unit_span),
read back the same by the plan (the interpreter's tasks_of) and kept through an edit; build_plan
refuses a unit count the schedule does not give; least_loaded places every item once onto the
least loaded unit, longest first."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.protocol import Buffer, OpSpec, Pad, PerUnit, Raise, Task, Wait, encode
from mkernel.schedule import TILE_CONFIGS, build_plan, least_loaded

SPEC = OpSpec(
    name="toy_units",
    buffers=(Buffer("x", "input", torch.float32, ("n", "n")),),
    pads=(Pad("ready", ("i",), ("n",), counted=True),),
    scalars=("n",),
)
N = 8


def _lists(W: int, counts: list[int]) -> PerUnit:
    """Rank r's unit u runs ``counts[u]`` tasks with ids numbered across the rank's units."""
    lists = []
    for _ in range(W):
        ids = iter(range(sum(counts)))
        lists.append([[Task(next(ids), (u,)) for _ in range(n)] for u, n in enumerate(counts)])
    return PerUnit(lists)


def test_each_unit_gets_its_own_rows_and_no_unit_is_padded():
    W, counts = 2, [3, 0, 1, 2]
    t = encode(SPEC, {"W": W, "n": N}, _lists(W, counts))
    # rank r's rows: task_span r; its units back to back in unit_span (W * units rows)
    assert t.tensors["task_span"].tolist() == [[0, 6], [6, 12]]
    assert t.tensors["unit_span"].tolist() == [
        [0, 3], [3, 3], [3, 4], [4, 6], [6, 9], [9, 9], [9, 10], [10, 12],
    ]  # fmt: skip
    for r in range(W):
        for u, n in enumerate(counts):
            got = t.unit_tasks(r, u, len(counts))
            assert len(got) == n and all(x.args == (u,) for x in got), (r, u)
        assert t.unit_tasks(r, len(counts), len(counts)) == []  # a unit beyond the lists


def test_a_plain_role_keeps_the_stride_rule_and_an_empty_unit_span():
    tasks = [[Task(i, (i,)) for i in range(5)] for _ in range(2)]
    t = encode(SPEC, {"W": 2, "n": N}, tasks)
    assert t.tensors["unit_span"].shape == (0, 2) and t.unit_counts is None
    assert [x.id for x in t.unit_tasks(1, 1, 2)] == [1, 3]
    assert t.unit_rows(1, 0, 2) == [5, 7, 9]


def test_per_unit_needs_the_same_number_of_units_on_every_rank():
    with pytest.raises(ValueError, match="same number"):
        PerUnit([[[Task(0, (0,))]], [[Task(0, (0,))], []]])
    with pytest.raises(ValueError, match="same number"):
        PerUnit([[], []])


def test_regroup_gives_back_the_units_after_an_edit_and_refuses_a_changed_count():
    t = encode(SPEC, {"W": 1, "n": N}, _lists(1, [2, 1]))
    flat = [list(t.tasks[0])]
    flat[0][0], flat[0][2] = flat[0][2], flat[0][0]  # swap across units
    again = t.regroup(flat)
    assert isinstance(again, PerUnit) and again.counts() == [[2, 1]]
    assert [x.id for x in again.lists[0][1]] == [0]
    with pytest.raises(ValueError, match="regroup"):
        t.regroup([flat[0][:2]])


def _build(compute, sms: int = 4):
    world = mkernel.World.emulated(1)
    sched = mkernel.Schedule(overlap="intra_sm", sms=sms)
    tile = TILE_CONFIGS["64x128x64"]
    comm = [[]]
    return build_plan(SPEC, sched, world, tile, {}, {"n": N}, [], compute, comm)


def test_build_plan_takes_per_unit_lists_and_the_plan_reads_them_per_unit():
    # unit 0 waits for what unit 1 raises, and unit 1 runs three tasks: the stride rule over the
    # same flat rows would put task 1 (the raiser) on unit 1 and task 2 on unit 0 instead
    ready = ("ready", 0, (2,))
    lists = [
        [Task(0, (0,), waits=(Wait(*ready, value=1, consumers=1),))],
        [Task(1, (1,)), Task(2, (2,)), Task(3, (3,), raises=(Raise(*ready, op="add"),))],
    ]
    plan = _build(PerUnit([lists]), sms=2)
    assert plan.compute_units == 2
    assert plan.tasks_of("compute", 0, 0) == [0]
    assert plan.tasks_of("compute", 0, 1) == [1, 2, 3]
    assert plan.task_rows("compute", 0, 1) == [1, 2, 3]
    assert plan.roles["compute"].tasks[0][0].waits[0].peer == 0  # the raiser found, as for lists


def test_build_plan_refuses_per_unit_lists_for_more_units_than_the_schedule_gives():
    with pytest.raises(ValueError, match="3 units, the schedule 2"):
        _build(PerUnit([[[Task(0, (0,))], [Task(1, (1,))], []]]), sms=2)


def test_least_loaded_longest_first_onto_the_least_loaded_unit():
    lists = least_loaded([("a", 1), ("b", 5), ("c", 3), ("d", 3)], 2)
    assert lists == [["b", "a"], ["c", "d"]]  # b; c, d (ties keep order) on 1; a onto 0 (5 < 6)
    load = [4.0, 0.0]
    assert least_loaded([("x", 1), ("y", 2)], 2, load, longest_first=False) == [[], ["x", "y"]]
    assert load == [4.0, 3.0]
    with pytest.raises(ValueError, match="loads for 3 units"):
        least_loaded([], 3, [0.0])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50), max_size=30),
    st.integers(1, 6),
    st.booleans(),
)
def test_least_loaded_places_every_item_once_and_evens_the_load(costs, units, longest):
    items = list(enumerate(costs))
    load = [0.0] * units
    lists = least_loaded(items, units, load, longest_first=longest)
    assert sorted(i for x in lists for i in x) == list(range(len(costs)))
    assert load == [sum(costs[i] for i in x) for x in lists]
    # greedy onto the least loaded: no unit ends more than one item above another
    assert max(load) - min(load) <= max(costs, default=0)
    if longest:
        for x in lists:
            assert [costs[i] for i in x] == sorted((costs[i] for i in x), reverse=True)


# The ops whose kernels declare kComputePerUnit (templates/persistent.cuh): the template compiles
# their compute list for unit_span alone, so each of their plans must give the role PerUnit.
# The fused backward's plans give PerUnit too, but its kernel runs them by the runtime rule
# (unit_tasks): with the trait it ran 6-8% slower (kernels/ring_attention_backward.cu).
PER_UNIT_KERNELS = {"kernels/ring_attention.cu": "ring_attention"}
PER_UNIT_PLANS = set(PER_UNIT_KERNELS.values()) | {"ring_attention_backward"}


def test_the_kernels_compiled_per_unit_are_the_ones_listed():
    root = Path(__file__).resolve().parents[1]
    declared = {
        str(p.relative_to(root))
        for p in sorted((root / "kernels").glob("*.cu"))
        if "kComputePerUnit = true" in p.read_text()
    }
    assert declared == set(PER_UNIT_KERNELS)


@pytest.mark.parametrize("module", sorted(PER_UNIT_PLANS))
@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_every_plan_of_a_kernel_compiled_per_unit_gives_each_unit_its_list(
    module, W, causal, overlap
):
    op = importlib.import_module(f"mkernel.ops.{module}")
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(overlap=overlap, sms=4)
    plan = op.make_plan(sched, world, 1, 192, 2, 1, 64, causal, causal)
    counts = plan.roles["compute"].unit_counts
    assert counts is not None, f"{module}: a plan without unit_span runs no compute task"
    assert len(counts) == W and all(len(c) == plan.compute_units for c in counts)
