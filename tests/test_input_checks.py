"""Bad input to the public API is refused by name before anything runs (issue 33, point 4): World
sizes and deadlines, every Schedule and Faults field, plan sizes, tile-order hooks, grouped_gemm's
arguments, the interpreter's rdma_put, Timeline.ascii's arguments and the MoE ops over several
nodes. Each case raises TypeError (a wrong type) or ValueError (a wrong value) whose message names
the argument."""

from __future__ import annotations

import math

import pytest
import torch

import mkernel
from mkernel.interp import twins
from mkernel.interp.machine import Machine
from mkernel.interp.rdma import Ring, rdma_put
from mkernel.interp.trace import Timeline
from mkernel.ops.moe_common import MoeDispatch
from mkernel.protocol import MAX_LOCAL_RANKS
from mkernel.world import MAX_CPU_RANKS
from tests.helpers import assert_pads_zero, gemm_inputs, randn_bf16

# -- World.emulated / from_process_group -----------------------------------------------------------


@pytest.mark.parametrize(
    "timeout_s, error",
    [
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (math.nan, ValueError),
        (0, ValueError),
        (-1.0, ValueError),
        ("5", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_world_timeout_must_be_finite_and_positive(timeout_s, error):
    with pytest.raises(error, match=r"timeout_s must be a finite number of seconds > 0"):
        mkernel.World.emulated(2, timeout_s=timeout_s)
    # from_process_group checks its arguments before it looks for torch.distributed
    with pytest.raises(error, match=r"timeout_s must be a finite number of seconds > 0"):
        mkernel.World.from_process_group(timeout_s=timeout_s)


def test_world_timeout_accepts_ints_and_floats():
    assert mkernel.World.emulated(2, timeout_s=3).timeout_s == 3
    assert mkernel.World.emulated(2, timeout_s=0.25).timeout_s == 0.25


@pytest.mark.parametrize("ranks", ["2", 2.0, True, None])
def test_world_ranks_must_be_an_int(ranks):
    with pytest.raises(TypeError, match="ranks must be an int"):
        mkernel.World.emulated(ranks)


@pytest.mark.parametrize("ranks", [0, -3])
def test_world_ranks_must_be_positive(ranks):
    with pytest.raises(ValueError, match=r"ranks must be in \[1, "):
        mkernel.World.emulated(ranks)


def test_world_ranks_are_bounded_on_the_cpu():
    assert mkernel.World.emulated(MAX_CPU_RANKS).size == MAX_CPU_RANKS
    for ranks in (MAX_CPU_RANKS + 1, 10**6):
        with pytest.raises(ValueError, match=rf"ranks must be in \[1, {MAX_CPU_RANKS}\]"):
            mkernel.World.emulated(ranks)


def test_world_ranks_are_bounded_by_one_launch_on_the_gpu():
    # checked before the device is looked for, so this holds on a machine without a GPU too
    with pytest.raises(ValueError, match=rf"ranks must be in \[1, {MAX_LOCAL_RANKS}\]"):
        mkernel.World.emulated(MAX_LOCAL_RANKS + 1, device="cuda")


# -- Schedule and Faults ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"seed": "x"}, TypeError, "Schedule.seed must be an int"),
        ({"seed": 1.5}, TypeError, "Schedule.seed must be an int"),
        ({"seed": True}, TypeError, "Schedule.seed must be an int"),
        ({"seed": -1}, ValueError, r"Schedule.seed must be an int in \[0, 2\*\*63\)"),
        ({"seed": 2**63}, ValueError, r"Schedule.seed must be an int in \[0, 2\*\*63\)"),
        ({"trace": "yes"}, TypeError, "Schedule.trace must be a bool"),
        ({"trace": 1}, TypeError, "Schedule.trace must be a bool"),
        ({"sms": True}, TypeError, "Schedule.sms must be an int or None"),
        ({"sms": 2.0}, TypeError, "Schedule.sms must be an int or None"),
        ({"chunk_rows": "16"}, TypeError, "Schedule.chunk_rows must be an int or None"),
        (
            {"overlap": "inter_sm", "comm_sms": True},
            TypeError,
            "Schedule.comm_sms must be an int or None",
        ),
        ({"backoff_ns": True}, TypeError, "Schedule.backoff_ns must be an int"),
        ({"backoff_ns": 64.0}, TypeError, "Schedule.backoff_ns must be an int"),
        ({"tile": ["64x128x64"]}, TypeError, "Schedule.tile must be a str or None"),
        ({"overlap": ["intra_sm"]}, TypeError, "Schedule.overlap must be a str or None"),
        ({"transfer": 1}, TypeError, "Schedule.transfer must be a str or None"),
    ],
)
def test_every_schedule_field_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        mkernel.Schedule(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"delay_us": -5}, ValueError, r"Faults.delay_us must be an int in \[0, "),
        ({"delay_us": 10**9}, ValueError, r"Faults.delay_us must be an int in \[0, "),
        ({"delay_us": "5"}, TypeError, "Faults.delay_us must be an int"),
        ({"delay_us": 1.5}, TypeError, "Faults.delay_us must be an int"),
        ({"delay_us": True}, TypeError, "Faults.delay_us must be an int"),
        ({"silent_rank": "1"}, TypeError, "Faults.silent_rank must be an int or None"),
        ({"silent_rank": True}, TypeError, "Faults.silent_rank must be an int or None"),
        ({"silent_rank": -1}, ValueError, "Faults.silent_rank must be a rank >= 0 or None"),
        ({"delay_rank": 0.0}, TypeError, "Faults.delay_rank must be an int or None"),
        ({"delay_rank": -2}, ValueError, "Faults.delay_rank must be a rank >= 0 or None"),
    ],
)
def test_every_faults_field_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        mkernel.Faults(**kwargs)


def test_good_schedules_and_faults_still_build():
    mkernel.Schedule(seed=2**63 - 1, trace=True, backoff_ns=0, sms=3, chunk_rows=16)
    mkernel.Faults(silent_rank=0, delay_rank=3, delay_us=0)


# -- Schedule.plan by sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, sizes, name",
    [
        ("gemm_rs", {"m": -4, "n": 64, "k": 64}, "m"),
        ("gemm_rs", {"m": 0, "n": 64, "k": 64}, "m"),
        ("ag_gemm", {"m": 64, "n": -8, "k": 64}, "n"),
        ("gemm_ar", {"m": 64, "n": 64, "k": 0}, "k"),
        ("gemm_ar", {"m": "64", "n": 64, "k": 64}, "m"),
        ("gemm_ar", {"m": 64.0, "n": 64, "k": 64}, "m"),
        ("gemm_ar", {"m": True, "n": 64, "k": 64}, "m"),
        ("all_gather", {"rows": 0, "cols": 16}, "rows"),
        ("all_gather", {"rows": 4, "cols": None}, "cols"),
    ],
)
def test_plan_sizes_must_be_positive_ints(op, sizes, name):
    world = mkernel.World.emulated(2)
    with pytest.raises(ValueError, match=rf"Schedule.plan\({op!r}\): {name} must be an int >= 1"):
        mkernel.Schedule().plan(op, world, **sizes)


def test_plan_sizes_that_may_be_zero_still_plan():
    # a MoE call of no tokens is a call (it launches nothing)
    world = mkernel.World.emulated(2)
    sizes = {"tokens": 0, "hidden": 16, "inter": 8, "experts": 1, "k": 1}
    assert mkernel.Schedule().plan("moe_dispatch_gemm", world, **sizes).sizes["tokens"] == 0


# -- the tile-order hook ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hook, shown",
    [
        (lambda r, t: [float(i) for i in range(len(t))], r"got \[0\.0, 1\.0"),
        (lambda r, t: [str(i) for i in range(len(t))], r"got \['0', '1'"),
    ],
)
def test_tile_order_entries_must_be_ints(hook, shown):
    world = mkernel.World.emulated(2)
    a, b = gemm_inputs(2, 128, 256, 16, 0)  # 4 tiles of 64 x 128
    sched = mkernel.Schedule(tile="64x128x64", tile_order=hook)
    want = r"Schedule\.tile_order\(rank=0.*must return a sequence of tile indices"
    with pytest.raises(ValueError, match=want + r".*permutation of range\(\d+\).*" + shown):
        mkernel.gemm_ar(a, b, world, sched)
    assert_pads_zero(world)


def test_tile_order_non_permutation_shows_what_it_returned():
    world = mkernel.World.emulated(2)
    a, b = gemm_inputs(2, 128, 256, 16, 0)  # 4 tiles of 64 x 128
    sched = mkernel.Schedule(tile="64x128x64", tile_order=lambda r, t: [0] * len(t))
    with pytest.raises(ValueError, match=r"not a permutation of range\(\d+\).*got \[0, 0"):
        mkernel.gemm_ar(a, b, world, sched)


def test_tile_order_accepts_int_like_entries():
    world = mkernel.World.emulated(2)
    a, b = gemm_inputs(2, 128, 256, 16, 0)  # 4 tiles of 64 x 128
    sched = mkernel.Schedule(tile="64x128x64", tile_order=lambda r, t: torch.arange(len(t)))
    out = mkernel.gemm_ar(a, b, world, sched)
    assert not torch.isnan(out.float()).any()


# -- grouped_gemm ----------------------------------------------------------------------------------


def _grouped():
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    return randn_bf16(6, 8), randn_bf16(2, 8, 16), offsets


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a, b, o: (a, b, [0, 2, 6]), TypeError, "offsets must be a torch.Tensor"),
        (lambda a, b, o: (a.tolist(), b, o), TypeError, "a must be a torch.Tensor"),
        (lambda a, b, o: (a, None, o), TypeError, "b must be a torch.Tensor"),
        (lambda a, b, o: (a, b, o.float()), ValueError, "offsets must be int32"),
    ],
)
def test_grouped_gemm_arguments_must_be_tensors(change, error, match):
    with pytest.raises(error, match=match):
        mkernel.grouped_gemm(*change(*_grouped()))


def test_grouped_gemm_keywords_are_checked():
    a, b, o = _grouped()
    with pytest.raises(TypeError, match="rows must be a torch.Tensor or None"):
        mkernel.grouped_gemm(a, b, o, rows=[0, 1, 2, 3, 4, 5])
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None"):
        mkernel.grouped_gemm(a, b, o, out="buffer")
    with pytest.raises(TypeError, match="tile must be a str or None"):
        mkernel.grouped_gemm(a, b, o, tile=["64x128x64"])
    with pytest.raises(TypeError, match="out_dtype must be torch.bfloat16 or torch.float32"):
        mkernel.grouped_gemm(a, b, o, out_dtype="bf16")


# -- rdma_put in the interpreter -------------------------------------------------------------------

W, NODES, COLS = 4, 2, 4


def _put(**change):
    """One poster on rank 0 putting row 0 of its src into row 0 of dst on rank 2 (the other node),
    with ``change`` applied to the put's arguments; the machine, the ring and nothing run yet."""
    ring = Ring(W, 2)
    pads = {"landed": torch.zeros(W, 2, dtype=torch.int32), **ring.pads()}
    bufs = {"src": torch.ones(W, 2, COLS), "dst": torch.zeros(W, 2, COLS), **ring.buffers()}
    m = Machine(W, pads, bufs, seed=0, deadline_steps=2000, nodes=NODES)
    args = {
        "dest": 2,
        "dst_buf": "dst",
        "dst_rect": (0, 1, 0, COLS),
        "src_buf": "src",
        "src_rect": (0, 1, 0, COLS),
        "signal": None,
        **change,
    }
    if "signal" not in change:
        args["signal"] = twins.SigRef("landed", args["dest"], (0,)) if args["dest"] == 2 else None

    def poster(ctx, task):
        yield from rdma_put(ctx, ring, **args)

    m.add_agent(0, "poster", 0, [0], poster)
    return m, pads


@pytest.mark.parametrize(
    "change, match",
    [
        ({"dest": 4, "signal": None}, r"dest must be a rank in \[0, 4\)"),
        ({"dest": -1, "signal": None}, r"dest must be a rank in \[0, 4\)"),
        ({"dest": "2", "signal": None}, r"dest must be a rank in \[0, 4\)"),
        ({"dst_buf": "nowhere"}, "dst_buf 'nowhere' is not a buffer"),
        ({"src_buf": "nowhere"}, "src_buf 'nowhere' is not a buffer"),
        ({"dst_rect": (1, 2, 0, COLS)}, r"dst_rect \(1, 2, 0, 4\) is outside dst"),
        ({"dst_rect": (0, 1, 2, COLS)}, r"dst_rect \(0, 1, 2, 4\) is outside dst"),
        ({"src_rect": (-1, 1, 0, COLS)}, r"src_rect \(-1, 1, 0, 4\) is outside src"),
        ({"src_rect": (0, 1, 0)}, "src_rect must be 4 ints"),
        ({"dst_rect": (0, 2, 0, 2)}, "dst_rect is 2 x 2 but src_rect is 1 x 4"),
        ({"dst_buf": None}, "dst_buf and dst_rect must both be given"),
        ({"signal": twins.SigRef("nothing", 2, (0,))}, "signal pad 'nothing' is not a pad"),
        ({"signal": twins.SigRef("landed", 2, (5,))}, r"signal index \(5,\) is outside"),
        ({"value": 1.5}, "value must be an int"),
    ],
)
def test_rdma_put_refuses_bad_arguments_before_anything_moves(change, match):
    m, pads = _put(**change)
    with pytest.raises(ValueError, match=match):
        m.run()
    for name, pad in pads.items():  # no ticket taken, no signal raised
        assert not pad.any(), name
    assert not m.buffers["dst"].any(), "no byte moved"


# -- Timeline.ascii --------------------------------------------------------------------------------


def _timeline() -> Timeline:
    tl = Timeline()
    for r in range(4):
        tl.add(r, "compute0", r, 0, 10)
    return tl


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ranks": [10]}, ValueError, r"ranks: rank 10 has no tasks in this timeline \(ranks 0..3"),
        ({"ranks": [0, -1]}, ValueError, "ranks: rank -1 has no tasks"),
        ({"ranks": 2}, TypeError, "ranks must be an iterable of ints or None"),
        ({"ranks": ["0"]}, TypeError, "ranks must be an iterable of ints or None"),
        ({"ranks": [True]}, TypeError, "ranks must be an iterable of ints or None"),
        ({"max_rows": 0}, ValueError, "max_rows must be an int >= 1 or None"),
        ({"max_rows": "3"}, TypeError, "max_rows must be an int >= 1 or None"),
        ({"width": 0}, ValueError, "width must be an int >= 1"),
        ({"width": 7.5}, TypeError, "width must be an int >= 1"),
        ({"legend": "yes"}, TypeError, "legend must be a bool"),
    ],
)
def test_timeline_ascii_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        _timeline().ascii(**kwargs)


def test_timeline_ascii_good_arguments_still_print():
    text = _timeline().ascii(8, ranks=(1, 3), max_rows=1, legend=False)
    assert text.startswith("r1 ")


# -- ops over several nodes ------------------------------------------------------------------------


def test_all_gather_over_nodes_is_refused_as_a_value_error():
    world = mkernel.World.emulated(4, nodes=2)
    x = torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"all_gather has no plan for a world of 2 nodes"):
        mkernel.all_gather(x, world=world)


def _moe(W: int, T: int = 3, E: int = 1):
    x = randn_bf16(W, T, 16)
    ids = torch.zeros(W, T, 1, dtype=torch.int64)
    w1, w2 = randn_bf16(W, E, 16, 8), randn_bf16(W, E, 8, 16)
    return x, ids, w1, w2, torch.ones(W, T, 1)


def test_moe_dispatch_over_nodes_is_refused_before_anything_runs():
    world = mkernel.World.emulated(4, nodes=2)
    x, ids, w1, _, _ = _moe(4)
    with pytest.raises(ValueError, match=r"moe_dispatch_gemm has no plan for a world of 2 nodes"):
        mkernel.moe_dispatch_gemm(x, ids, w1, world)
    assert world.last_timeline is None and not world.signal_pads()


def test_moe_combine_over_nodes_is_refused_before_anything_runs():
    flat = mkernel.World.emulated(4)
    x, ids, w1, w2, weights = _moe(4)
    d = mkernel.moe_dispatch_gemm(x, ids, w1, flat)
    world = mkernel.World.emulated(4, nodes=2)
    moved = MoeDispatch(d.y, d.src, d.expert_offsets, world, d.topk_ids, d.hidden)
    with pytest.raises(ValueError, match=r"moe_gemm_combine has no plan for a world of 2 nodes"):
        mkernel.moe_gemm_combine(d.y, w2, moved, weights, world)
    assert world.last_timeline is None and not world.signal_pads()


@pytest.mark.parametrize(
    "op, sizes, match",
    [
        ("moe_dispatch_gemm", {"k": 3}, r"k \(columns of topk_ids\)=3 must be in \[1, E=2\]"),
        ("moe_dispatch_gemm", {"hidden": 12}, r"H \(columns of x\)=12 must be a positive multiple"),
        ("moe_gemm_combine", {"inter": 4}, r"I \(columns of h\)=4 must be a positive multiple"),
        ("moe_gemm_combine", {"k": 3}, r"k=3 must be in \[1, E=2\]"),
    ],
)
def test_moe_plan_sizes_get_the_ops_own_checks(op, sizes, match):
    world = mkernel.World.emulated(2)
    base = {"tokens": 2, "hidden": 16, "inter": 8, "experts": 1, "k": 1}
    if op == "moe_gemm_combine":
        base["partial_rows"] = 0
    with pytest.raises(ValueError, match=match):
        mkernel.Schedule().plan(op, world, **{**base, **sizes})
