"""The static protocol check (protocol.check_protocol, run by schedule.build_plan before anything
runs): a toy op's task lists, each with one planted mistake, are refused with a ValueError naming
the signal as both backends print it (``flag[i=1, src=0] on rank 1``); the same lists without the
mistake pass."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.protocol import Buffer, OpSpec, Pad, Raise, Task, Wait, check_protocol, encode
from mkernel.schedule import TILE_CONFIGS, build_plan

SPEC = OpSpec(
    name="toy",
    buffers=(Buffer("x", "input", torch.float32, ("n", "n")),),
    pads=(
        Pad("flag", ("i", "src"), ("n", "W")),
        Pad("ready", ("i",), ("n",), counted=True),
    ),
    scalars=("n",),
)
W, N = 2, 4
SIZES = {"W": W, "n": N}
FLAG = r"flag\[i=1, src=0\] on rank 1"
READY = r"ready\[i=2\] on rank 0"


def _plan(compute, comm):
    """build_plan of the toy op over an emulated world of W ranks."""
    world = mkernel.World.emulated(W)
    tile = TILE_CONFIGS["64x128x64"]
    return build_plan(SPEC, mkernel.Schedule(), world, tile, {}, {"n": N}, [], compute, comm)


def _check(compute, comm):
    """encode + check_protocol directly (what build_plan runs)."""
    roles = {"compute": encode(SPEC, SIZES, compute), "comm": encode(SPEC, SIZES, comm)}
    check_protocol(SPEC, SIZES, roles)


def _both(compute, comm, match):
    for run in (_plan, _check):
        with pytest.raises(ValueError, match=match):
            run(compute, comm)


def _raise_flag(task_id=0, value=1, op="set"):
    """Rank 0 raises flag[i=1, src=0] on rank 1."""
    return Task(task_id, (task_id,), raises=(Raise("flag", 1, (1, 0), value, op),))


def _wait_flag(task_id=0, value=1, consumers=1):
    """Rank 1 waits for flag[i=1, src=0] on its own pad."""
    return Task(task_id, (task_id,), waits=(Wait("flag", 1, (1, 0), value, consumers),))


def _wait_ready(task_id, consumers, value=1):
    """Rank 0's ready[i=2], one of ``consumers`` counted consumers."""
    return Task(task_id, (task_id,), waits=(Wait("ready", 0, (2,), value, consumers),))


def test_a_correct_toy_plan_passes_and_names_the_raiser_as_peer():
    plan = _plan([[_raise_flag()], [_wait_flag()]], [[], []])
    (w,) = plan.roles["compute"].tasks[1][0].waits
    assert w.peer == 0
    # counted: two adds, two consumers that count themselves, in either role
    adds = [Task(i, (i,), raises=(Raise("ready", 0, (2,), 1, "add"),)) for i in range(2)]
    _plan([adds, [_wait_ready(0, 2, 2)]], [[_wait_ready(1, 2, 2)], []])
    _check([adds, [_wait_ready(0, 2, 2)]], [[_wait_ready(1, 2, 2)], []])


def test_a_wait_whose_value_is_never_raised():
    _both([[], [_wait_flag()]], [[], []], FLAG + " expects 1, raises give 0")


def test_a_wait_for_another_value_than_the_raises_give():
    _both([[_raise_flag(value=2)], [_wait_flag()]], [[], []], FLAG + " expects 1, raises give 2")
    adds = [Task(i, (i,), raises=(Raise("flag", 1, (1, 0), 1, "add"),)) for i in range(3)]
    _both([adds, [_wait_flag(value=2)]], [[], []], FLAG + " expects 2, raises give 3")


def test_a_flag_raised_twice_with_set():
    _both(
        [[_raise_flag(0), _raise_flag(1)], [_wait_flag()]],
        [[], []],
        FLAG + " is set more than once",
    )
    # the second raise from another role and rank is the same signal
    _both([[_raise_flag()], [_wait_flag()]], [[], [_raise_flag()]], FLAG + " is set more than once")


def test_a_flag_set_and_added():
    adds = [_raise_flag(0), _raise_flag(1, op="add")]
    _both([adds, [_wait_flag(value=2)]], [[], []], FLAG + r" is set more than once \(or set and")


def test_a_flag_raised_and_never_waited():
    _both([[_raise_flag()], []], [[], []], FLAG + " is raised but nobody waits for it")
    # a wait for the same index on the raiser's own pad is another signal
    wrong_rank = Task(0, (0,), waits=(Wait("flag", 0, (1, 0)),))
    _both([[_raise_flag()], []], [[wrong_rank], []], r"flag\[i=1, src=0\] on rank 0 expects 1")


def test_two_single_consumer_waits_on_one_flag():
    _both(
        [[_raise_flag()], [_wait_flag(0)]],
        [[], [_wait_flag(1)]],
        FLAG + " is reset by 2 of its waits, expected exactly one consumer",
    )


def test_a_flag_nobody_resets():
    _both(
        [[_raise_flag()], [_wait_flag(consumers=0)]],
        [[], []],
        FLAG + " is reset by 0 of its waits",
    )


def test_counted_consumers_that_disagree():
    adds = [Task(0, (0,), raises=(Raise("ready", 0, (2,)),))]
    _both(
        [adds, [_wait_ready(0, 2)]],
        [[_wait_ready(1, 3)], []],
        READY + " disagree on their consumers",
    )


def test_counted_consumers_fewer_than_they_count():
    adds = [Task(0, (0,), raises=(Raise("ready", 0, (2,)),))]
    _both([adds, [_wait_ready(0, 3)]], [[_wait_ready(1, 3)], []], READY + " is reset by 2 of")
    _both(
        [adds, [_wait_ready(0, 2)]],
        [[_wait_ready(1, 2), _wait_ready(2, 2)], []],
        READY + " is reset by 3 of",
    )


def test_an_index_outside_its_pad_and_too_many_args():
    outside = Task(0, (0,), raises=(Raise("flag", 1, (N, 0)),))
    with pytest.raises(ValueError, match=r"index \[4, 0\] outside pad flag of shape \(4, 2\)"):
        _plan([[outside], []], [[], []])
    with pytest.raises(ValueError, match="task 3 has more than 4 args"):
        _plan([[Task(3, (0, 1, 2, 3, 4))], []], [[], []])
    with pytest.raises(KeyError, match="declares no signal pad 'flags'"):
        _plan([[Task(0, (0,), raises=(Raise("flags", 1, (0, 0)),))], []], [[], []])


def test_op_specs_that_do_not_fit_the_launch_record():
    pads = tuple(Pad(f"p{i}", ("i",), ("n",)) for i in range(8))
    with pytest.raises(ValueError, match="more than 8 pads"):
        OpSpec(name="big", buffers=(), pads=pads, scalars=())
    with pytest.raises(ValueError, match="more than 8 scalars"):
        OpSpec(name="big", buffers=(), pads=(), scalars=tuple("abcdefghi"))
