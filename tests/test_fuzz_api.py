"""Fuzzing the public API on the CPU (issue 33, point 7): random valid and invalid arguments for
every public op, Schedule (construction and plan) and World.emulated. Each call either returns the
reference's result (mkernel.reference, fp32 math, within bf16 rounding) or raises TypeError /
ValueError; any other exception fails, and so does a call that runs past LIMIT_S (a hang).

Invalid inputs are one argument changed from a valid call: a wrong dtype, a tensor on another
device (meta: this machine has no GPU), a leading dimension other than W, a non-contiguous view,
a dimension too few or too many, a last dimension cut by one (sizes that do not divide or agree),
a Python object where a tensor goes, and wrong Python types and values for the keywords. The
changes that can only be wrong (all but the cut) must raise, naming the argument.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import mkernel
from mkernel.ops import common
from tests.helpers import assert_close_bf16 as _close_bf16

# the attention tests' fp64 expectations with tolerances from fp32 sums and bf16 rounding
from tests.test_ring_attention import _assert_attention as assert_attention
from tests.test_ring_attention_backward import _assert_grads as assert_grads

LIMIT_S = 20  # one call on these tiny shapes takes well under a second; past this it hangs
FUZZ = settings(
    max_examples=100,
    deadline=None,  # LIMIT_S bounds a call instead: a deadline only reports after it returns
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class Hang(Exception):
    """A call ran past LIMIT_S."""


@contextlib.contextmanager
def bounded(seconds: float = LIMIT_S) -> Iterator[None]:
    """Raises Hang in the body after ``seconds`` (SIGALRM: the interpreter is Python code)."""

    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"the call ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Exception | None]:
    """(result, None) or (None, the TypeError / ValueError); anything else propagates."""
    with bounded():
        try:
            return fn(*args, **kwargs), None
        except (TypeError, ValueError) as e:
            return None, e


# -- invalid arguments ---------------------------------------------------------------------------

# Each makes a tensor argument wrong whatever the op; "cut" may still leave a valid call.
TENSOR_CHANGES = ("dtype", "device", "ranks", "strided", "fewer_dims", "more_dims", "cut", "object")
SURELY_WRONG = set(TENSOR_CHANGES) - {"cut"}


def changed(t: torch.Tensor, how: str, emulated: bool = True) -> Any:
    """``t`` changed ``how`` (TENSOR_CHANGES); None when that change cannot apply to it."""
    if how == "dtype":
        return t.float() if t.dtype in (torch.bfloat16, torch.int32, torch.int64) else t.double()
    if how == "device":
        return t.to("meta")
    if how == "ranks":
        if not emulated or t.dim() == 0:
            return None
        return t[:-1].contiguous() if t.shape[0] > 1 else torch.cat([t, t])
    if how == "strided":
        if t.dim() == 0 or t.shape[-1] < 2:
            return None  # torch calls a view of one column contiguous
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        view = wide[..., ::2]
        view.copy_(t)
        return view
    if how == "fewer_dims":
        if t.dim() >= 2:
            return t.flatten(0, 1)
        return t[0] if t.numel() else None
    if how == "more_dims":
        return t.unsqueeze(1)
    if how == "cut":
        return t[..., :-1].contiguous() if t.dim() and t.shape[-1] > 1 else None
    return "a tensor"  # "object"


def apply_change(draw: Callable, args: dict[str, Any], tensors: list[str], emulated: bool = True):
    """One argument of ``args`` changed (or none): (args, the argument's name, how) or
    (args, None, None)."""
    if draw(st.integers(0, 2)) == 0:  # a third of the examples are valid calls
        return args, None, None
    name = draw(st.sampled_from(tensors))
    how = draw(st.sampled_from(TENSOR_CHANGES))
    new = changed(args[name], how, emulated)
    assume(new is not None)
    return {**args, name: new}, name, how


def check_refused(err: Exception | None, name: str | None, how: str | None) -> bool:
    """True when the call was refused: never a valid call (``how`` None); always one with a
    surely wrong argument, whose error names it."""
    event(f"{how or 'valid'}: {'refused' if err else 'ran'}")  # --hypothesis-show-statistics
    if how is None:
        assert err is None, f"a valid call was refused: {err!r}"
    if how in SURELY_WRONG:
        assert err is not None, f"{name} changed by {how!r} was accepted"
        assert re.search(rf"\b{re.escape(name)}\b", str(err)), f"{how}: {name} not in: {err}"
    return err is not None


WORLDS = st.sampled_from([1, 2, 3])
SEEDS = st.integers(0, 2**16)


def schedules() -> st.SearchStrategy:
    """Valid schedules: either overlap, a few virtual SMs, any interleaving seed."""
    return st.builds(
        lambda overlap, sms, seed: mkernel.Schedule(overlap=overlap, sms=sms, seed=seed),
        st.sampled_from([None, "intra_sm", "inter_sm"]),
        st.sampled_from([None, 2, 3]),
        SEEDS,
    )


BAD_WORLDS = ("2 ranks", 2, None, True)
BAD_SCHEDULES = ("fast", 3, {"sms": 2})


def keyword_change(
    draw: Callable, kwargs: dict[str, Any], bad: dict[str, tuple], changed_arg: str | None
):
    """Maybe one keyword argument set to a wrong value from ``bad`` (not when ``changed_arg``
    already is wrong: one wrong argument per call): (kwargs, name)."""
    if changed_arg is not None or draw(st.integers(0, 2)):
        return kwargs, None
    name = draw(st.sampled_from(sorted(bad)))
    return {**kwargs, name: draw(st.sampled_from(bad[name]))}, name


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """tests/helpers.py's bf16 tolerance, for empty results too (no rows routed, no group)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    if out.numel():
        _close_bf16(out, ref, what)


def randn(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


# -- the GEMM ops and all_gather -------------------------------------------------------------------


@FUZZ
@given(
    op=st.sampled_from(["gemm_rs", "ag_gemm", "gemm_ar"]),
    W=WORLDS,
    rows=st.integers(1, 20),
    n=st.sampled_from([8, 16, 24]),
    k=st.sampled_from([8, 16]),
    seed=SEEDS,
    schedule=schedules(),
    data=st.data(),
)
def test_gemm_ops(op, W, rows, n, k, seed, schedule, data):
    if op == "gemm_rs":
        rows *= W  # M splits over the ranks
    world = mkernel.World.emulated(W)
    # per rank: a [rows, k], b [k, n] (ag_gemm: rows = M/W, k = K; the others: rows = M, k = K/W)
    valid = {"a": randn(W, rows, k, seed=seed), "b": randn(W, k, n, seed=seed + 1)}
    args, name, how = apply_change(data.draw, valid, ["a", "b"])
    kwargs, bad_kw = keyword_change(
        data.draw,
        {"world": world, "schedule": schedule},
        {"world": BAD_WORLDS, "schedule": BAD_SCHEDULES},
        name,
    )
    out, err = outcome(getattr(mkernel, op), **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    ref = getattr(mkernel.reference, op)(args["a"], args["b"], world)
    assert_close_bf16(out, ref, f"{op} W={W}")


@FUZZ
@given(W=WORLDS, rows=st.integers(1, 12), cols=st.sampled_from([8, 16]), seed=SEEDS, data=st.data())
def test_all_gather(W, rows, cols, seed, data):
    world = mkernel.World.emulated(W)
    args, name, how = apply_change(data.draw, {"x": randn(W, rows, cols, seed=seed)}, ["x"])
    bad_out = {"out": ("x", torch.zeros(W, rows, cols), torch.zeros(1, dtype=torch.bfloat16))}
    kwargs, bad_kw = keyword_change(
        data.draw, {"world": world}, {"world": BAD_WORLDS, **bad_out}, name
    )
    out, err = outcome(mkernel.all_gather, **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    assert torch.equal(out, mkernel.reference.all_gather(args["x"], world))


# -- grouped_gemm ----------------------------------------------------------------------------------


@FUZZ
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    k=st.integers(1, 12),
    n=st.integers(1, 12),
    seed=SEEDS,
    data=st.data(),
)
def test_grouped_gemm(sizes, k, n, seed, data):
    m = sum(sizes)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    valid = {"a": randn(m, k, seed=seed), "b": randn(len(sizes), k, n, seed=seed + 1)}
    valid["offsets"] = offsets
    # a 2-D a has no rank dimension: "ranks" does not apply (emulated=False)
    args, name, how = apply_change(data.draw, valid, ["a", "b", "offsets"], emulated=False)
    if name == "offsets" and how in ("strided", "cut"):
        assume(False)  # a strided view of good offsets is good; a cut one is too short (checked)
    bad = {"out_dtype": ("bf16", torch.float16, None), "tile": (["64x128x64"], 3, "huge")}
    bad["rows"] = ([0, 1], torch.zeros(m, dtype=torch.int64))
    kwargs, bad_kw = keyword_change(data.draw, {}, bad, name)
    out, err = outcome(mkernel.grouped_gemm, **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    a, b = args["a"], args["b"]
    exact = torch.zeros(m, b.shape[2], dtype=torch.float64)
    for g, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        exact[lo:hi] = a[lo:hi].double() @ b[g].double()
    assert_close_bf16(out, exact.bfloat16(), "grouped_gemm")


# -- MoE dispatch and combine ----------------------------------------------------------------------

H, INTER = 16, 8


def _routing(W: int, T: int, E: int, k: int, seed: int) -> torch.Tensor:
    """[W, T, k] int64 distinct global expert ids per token, some slots -1."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(W * E, generator=g)[:k] for _ in range(W * T)]
    ids = torch.stack(rows).reshape(W, T, k) if T else torch.zeros(W, 0, k, dtype=torch.int64)
    return torch.where(torch.rand(W, T, k, generator=g) < 0.2, -1, ids)


@FUZZ
@given(
    W=st.sampled_from([1, 2]),
    T=st.integers(0, 4),
    E=st.integers(1, 2),
    k=st.integers(1, 2),
    seed=SEEDS,
    schedule=schedules(),
    data=st.data(),
)
def test_moe_dispatch_and_combine(W, T, E, k, seed, schedule, data):
    k = min(k, W * E)
    world = mkernel.World.emulated(W)
    valid = {
        "x": randn(W, T, H, seed=seed),
        "topk_ids": _routing(W, T, E, k, seed),
        "w1": randn(W, E, H, INTER, seed=seed + 1),
    }
    args, name, how = apply_change(data.draw, valid, sorted(valid))
    if T == 0 and how == "strided" and name != "w1":
        assume(False)  # a strided view of no rows is contiguous
    d, err = outcome(mkernel.moe_dispatch_gemm, **args, world=world, schedule=schedule)
    if check_refused(err, name, how):
        return
    ref = mkernel.reference.moe_dispatch_gemm(args["x"], args["topk_ids"], args["w1"], world)
    for r in range(W):
        assert torch.equal(d.src[r], ref.src[r]) and torch.equal(
            d.expert_offsets[r], ref.expert_offsets[r]
        )
        assert_close_bf16(d.y[r], ref.y[r], f"moe dispatch rank {r}")
    # the combine, on that dispatch
    k = d.topk_ids.shape[-1]  # (a cut topk_ids may have left fewer slots: still valid)
    valid = {"w2": randn(W, E, INTER, H, seed=seed + 2), "topk_weights": torch.rand(W, T, k)}
    args, name, how = apply_change(data.draw, valid, sorted(valid))
    if T == 0 and how == "strided" and name == "topk_weights":
        assume(False)
    h = [torch.nn.functional.gelu(y.float()).bfloat16() for y in d.y]
    if data.draw(st.booleans()) and not name:  # h itself wrong: a tensor, a short list
        bad_h = data.draw(st.sampled_from(["tensor", "short", "dtype"]))
        h = {"tensor": torch.zeros(1), "short": h[:-1], "dtype": [y.float() for y in h]}[bad_h]
        name, how = "h", "object"
    kwargs, bad_kw = keyword_change(
        data.draw,
        {"dispatch": d, "world": world},
        {"dispatch": ("d", None), "world": (*BAD_WORLDS, mkernel.World.emulated(W))},
        name,
    )
    out, err = outcome(mkernel.moe_gemm_combine, h, **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    ref = mkernel.reference.moe_gemm_combine(h, args["w2"], d, args["topk_weights"], world)
    assert_close_bf16(out, ref, "moe combine")


# -- attention, ring attention and its backward ----------------------------------------------------

D = 64
BAD_ATTENTION = {
    "causal": ("yes", 1, None),
    "scale": ("1", -1.0, math.nan, math.inf, 0.0, True),
    "layout": ("zz", 1, None),
}


def _qkv(lead: tuple[int, ...], S: int, Hq: int, Hkv: int, seed: int) -> dict[str, torch.Tensor]:
    return {
        "q": randn(*lead, 1, S, Hq, D, seed=seed),
        "k": randn(*lead, 1, S, Hkv, D, seed=seed + 1),
        "v": randn(*lead, 1, S, Hkv, D, seed=seed + 2),
    }


@FUZZ
@given(
    S=st.integers(1, 6),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    causal=st.booleans(),
    seed=SEEDS,
    data=st.data(),
)
def test_attention(S, heads, causal, seed, data):
    args, name, how = apply_change(
        data.draw, _qkv((), S, *heads, seed), ["q", "k", "v"], emulated=False
    )
    assume(how != "device")  # attention on a meta tensor: test_attention_on_meta below
    bad = {k: v for k, v in BAD_ATTENTION.items() if k != "layout"}
    kwargs, bad_kw = keyword_change(data.draw, {"causal": causal}, bad, name)
    res, err = outcome(mkernel.attention, **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    out, lse = (t[None] for t in res)  # as one rank's
    lift = [args[n][None] for n in ("q", "k", "v")]
    assert_attention(out, lse, *lift, causal, 1 / math.sqrt(D), "contiguous", "attention")


def test_attention_on_meta():
    args = _qkv((), 2, 1, 1, 0)
    with pytest.raises(ValueError, match=r"\bq\b"):
        mkernel.attention(args["q"].to("meta"), args["k"], args["v"])


@FUZZ
@given(
    W=st.sampled_from([1, 2]),
    S=st.sampled_from([2, 4]),
    heads=st.sampled_from([(1, 1), (2, 1)]),
    causal=st.booleans(),
    layout=st.sampled_from(["contiguous", "zigzag"]),
    seed=SEEDS,
    data=st.data(),
)
def test_ring_attention(W, S, heads, causal, layout, seed, data):
    world = mkernel.World.emulated(W)
    args, name, how = apply_change(data.draw, _qkv((W,), S, *heads, seed), ["q", "k", "v"])
    kwargs, bad_kw = keyword_change(
        data.draw,
        {"world": world, "causal": causal, "layout": layout},
        {**BAD_ATTENTION, "world": BAD_WORLDS, "schedule": BAD_SCHEDULES},
        name,
    )
    res, err = outcome(mkernel.ring_attention, **args, **kwargs)
    if bad_kw:
        assert err is not None and bad_kw in str(err), (bad_kw, err)
        return
    if check_refused(err, name, how):
        return
    qkv = (args["q"], args["k"], args["v"])
    assert_attention(*res, *qkv, causal, 1 / math.sqrt(D), layout, f"ring_attention W={W}")


@FUZZ
@given(
    W=st.sampled_from([1, 2]),
    heads=st.sampled_from([(1, 1), (2, 1)]),
    causal=st.booleans(),
    seed=SEEDS,
    data=st.data(),
)
def test_ring_attention_backward(W, heads, causal, seed, data):
    world = mkernel.World.emulated(W)
    qkv = _qkv((W,), 2, *heads, seed)
    out, lse = mkernel.reference.ring_attention(**qkv, world=world, causal=causal)
    valid = {"dout": randn(*out.shape, seed=seed + 3), **qkv, "out": out, "lse": lse}
    args, name, how = apply_change(data.draw, valid, sorted(valid))
    res, err = outcome(mkernel.ring_attention_backward, **args, world=world, causal=causal)
    if check_refused(err, name, how):
        return
    a = args
    grads = (a["q"], a["k"], a["v"], a["dout"], a["out"], a["lse"])
    assert_grads(res, *grads, causal, 1 / math.sqrt(D), "contiguous", f"backward W={W}")


# -- Schedule, Schedule.plan and World.emulated ----------------------------------------------------

FIELD_VALUES = {
    "overlap": (None, "intra_sm", "inter_sm", "both", 1, ["intra_sm"]),
    "sms": (None, 1, 4, 0, -2, True, 2.0, "4"),
    "comm_sms": (None, 1, 0, True),
    "tile": (None, "64x128x64", "huge", ["64x128x64"], 64),
    "tile_order": (None, lambda r, t: list(range(len(t)))[::-1], "reverse", 3),
    "chunk_rows": (None, 16, 0, -1, 2.5, "16"),
    "faults": (None, mkernel.Faults(), {"silent_rank": 1}, "none"),
    "seed": (0, 7, -1, 2**64, "x", 1.5, True, None),
    "backoff_ns": (0, 2048, -5, 10**7, True, 64.0, None),
    "trace": (False, True, "yes", 1, None),
    "transfer": (None, "auto", "stores", "tma", "rdma", 1),
}
SIZE_VALUES = st.one_of(st.integers(-3, 40), st.sampled_from(["8", 8.0, None, True, 2**70, [8]]))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_schedule_construction(data):
    fields = data.draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=4))
    kwargs = {f: data.draw(st.sampled_from(FIELD_VALUES[f])) for f in fields}
    sched, err = outcome(mkernel.Schedule, **kwargs)
    if err is not None:
        return
    # what was accepted is of the documented form
    assert sched.overlap in (None, "intra_sm", "inter_sm")
    for f in ("sms", "comm_sms", "chunk_rows"):
        v = getattr(sched, f)
        assert v is None or (type(v) is int and v >= 1), f
    assert type(sched.seed) is int and 0 <= sched.seed < 2**63
    assert type(sched.backoff_ns) is int and type(sched.trace) is bool
    assert isinstance(sched.faults, mkernel.Faults)


PLAN_SIZES = {
    "gemm_rs": ("m", "n", "k"),
    "ag_gemm": ("m", "n", "k"),
    "gemm_ar": ("m", "n", "k"),
    "all_gather": ("rows", "cols"),
}


def operand_path_takes(op: str, W: int, sizes: dict[str, int]) -> bool:
    """Whether operands of these global sizes pass the op's own checks (its shapes()): M split
    over W (gemm_rs, ag_gemm), K over W (gemm_rs, gemm_ar), 16-byte rows."""
    if op == "all_gather":
        return sizes["cols"] % 8 == 0
    m, n, k = sizes["m"], sizes["n"], sizes["k"]
    if op != "gemm_ar" and m % W:
        return False
    kl = k if op == "ag_gemm" else k // W
    return n % 8 == 0 and (op == "ag_gemm" or k % W == 0) and kl % 8 == 0 and kl > 0


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(sorted(PLAN_SIZES)), W=WORLDS, data=st.data())
def test_schedule_plan_by_sizes(op, W, data):
    world = mkernel.World.emulated(W)
    sizes = {n: data.draw(SIZE_VALUES) for n in PLAN_SIZES[op]}
    bad = [n for n, v in sizes.items() if type(v) is not int or not 1 <= v < 2**63]
    # sizes the operand path refuses but plan() by name takes: test_plan_sizes_... below
    assume(bad or operand_path_takes(op, W, sizes))
    plan, err = outcome(mkernel.Schedule().plan, op, world, **sizes)
    if bad:
        assert err is not None, f"{op} planned with {sizes}"
        assert any(re.search(rf"\b{n}\b", str(err)) for n in bad), err
    else:
        assert err is None, f"{op} {sizes} W={W}: {err!r}"
        assert isinstance(plan, mkernel.Plan) and plan.world_size == W
        # all_gather has no GEMM tiles (its comm role moves every row); a GEMM plan has some
        assert plan.tiles or op == "all_gather", f"{op} {sizes} W={W}: a plan of no tiles"


@pytest.mark.parametrize("op, W, m", [("gemm_rs", 4, 2), ("ag_gemm", 2, 3), ("ag_gemm", 4, 2)])
def test_plan_sizes_the_operand_path_refuses(op, W, m):
    world = mkernel.World.emulated(W)
    with pytest.raises(ValueError, match=r"\bM\b|\bm\b"):
        mkernel.Schedule().plan(op, world, m=m, n=8, k=8 * W)


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.one_of(st.integers(-2, 70), st.sampled_from([10**6, "2", 2.0, True, None])),
    device=st.sampled_from(["cpu", "cuda", "tpu", 3, None]),
    nodes=st.one_of(st.integers(0, 4), st.sampled_from(["1", 1.0, True])),
    timeout_s=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["5", True, None, 5])
    ),
)
def test_world_emulated(ranks, device, nodes, timeout_s):
    world, err = outcome(
        mkernel.World.emulated, ranks, device=device, nodes=nodes, timeout_s=timeout_s
    )
    if err is not None:
        return
    assert world.size == ranks and world.nodes == nodes and world.device.type == "cpu"
    assert 1 <= ranks <= 64 and math.isfinite(world.timeout_s) and world.timeout_s > 0


def test_unsupported_world_is_a_value_error_and_not_implemented():
    # the shared refusal of a world an op cannot serve, as the fuzz's contract needs it
    assert issubclass(common.UnsupportedWorld, ValueError)
    assert issubclass(common.UnsupportedWorld, NotImplementedError)
