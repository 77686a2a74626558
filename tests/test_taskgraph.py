"""TaskGraph (issue 36) on the CPU interpreter: each op and the collectives against the plain torch
reference, per-tile dependencies, the TP MLP graph, the interpreter catching a broken dependency
as a race and a silent rank as a timeout, and every bad graph rejected before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

import mkernel
from mkernel import models
from mkernel.taskgraph import TaskGraph
from mkernel.taskgraph.compiled import compile_graph
from mkernel.taskgraph.probe import node_times
from tests.helpers import assert_pads_zero

bf16 = torch.bfloat16


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(bf16)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str = "") -> None:
    """No NaN (poison: a tile never written), and every element within ``rel`` of the
    reference's largest magnitude. bf16 stores each value with a relative error of 2^-9; the
    rounded reference (each value in bf16, as the tasks store them) differs from the tasks only
    by fp32 summation order within a tile, so a rounding flip or two: ``rel`` 2^-7 there; the
    fp32 reference is further off by the values' roundings along the chain: 2^-6."""
    assert not torch.isnan(out.float()).any(), f"{what}: NaN in the result (an unwritten tile)"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rel * scale, f"{what}: max err {err:.3g} at scale {scale:.3g}"


def mlp_graph(B=8, H=64, F=96, seed=0, world=None):
    """rmsnorm -> gate_up linear -> silu_mul -> down linear (+ residual): 24 tasks at B = 8."""
    g = TaskGraph(world)
    x = g.input("x", (B, H))
    n = g.rmsnorm(x, randn(H, seed=seed) + 1)
    s = g.silu_mul(g.linear(n, randn(2 * F, H, seed=seed + 1, scale=H**-0.5)))
    g.output("y", g.linear(s, randn(H, F, seed=seed + 2, scale=F**-0.5), residual=x))
    return g


def test_every_op_matches_the_torch_reference():
    B, H, Hq, Hkv, S, D = 3, 64, 4, 2, 12, 16
    g = TaskGraph()
    x = g.input("x", (B, H))
    n = g.rmsnorm(x, randn(H, seed=1) + 1, eps=1e-5)
    q = g.linear(n, randn(Hq * D, H, seed=2, scale=H**-0.5))
    att = g.attention_decode(q, randn(B, Hkv, S, D, seed=3), randn(B, Hkv, S, D, seed=4), 7)
    h = g.linear(att, randn(H, Hq * D, seed=5, scale=0.2), residual=x)
    s = g.silu_mul(g.linear(h, randn(128, H, seed=6, scale=0.2)))
    g.output("y", g.add(s, "x"))  # an input by its name
    g.output("h", h)
    k = g.compile(mkernel.Schedule(seed=3))
    xin = randn(B, H, seed=7)
    out = k(x=xin)
    assert set(out) == {"y", "h"} and out["y"].shape == (B, H) and out["y"].dtype == bf16
    for name in out:
        assert_close(out[name], k.reference(x=xin)[name], 2.0**-7, name)
        assert_close(out[name], k.reference(round_values=False, x=xin)[name], 2.0**-6, name)
    # another interleaving, the same bits; the pads are back to zero
    again = compile_graph(g, mkernel.Schedule(seed=11, sms=3))(x=xin)
    assert all(torch.equal(again[n], out[n]) for n in out)
    assert_pads_zero(k.world)
    assert len(k.world.last_timeline.spans) == len(k.plan.roles["compute"].tasks[0])


@pytest.mark.parametrize("W", [2, 3])
def test_collectives_match_the_reference(W):
    world = mkernel.World.emulated(W)
    g = TaskGraph(world)
    x = g.input("x", (2 * W, 40))
    weights = [randn(24, 40, seed=r, scale=0.3) for r in range(W)]  # a different shard per rank
    p = g.linear(x, weights)
    g.output("ar", g.all_reduce(p))
    g.output("rs", g.reduce_scatter(p))
    g.output("ag", g.all_gather(p))
    k = g.compile()
    xin = randn(W, 2 * W, 40, seed=9)  # per rank
    out = k(x=xin)
    assert out["ar"].shape == (W, 2 * W, 24) and out["rs"].shape == (W, 2, 24)
    assert out["ag"].shape == (W, 2 * W * W, 24)
    ref = k.reference(x=xin)
    for name in out:
        assert_close(out[name], ref[name], 2.0**-7, name)
    assert torch.equal(out["ar"][0], out["ar"][-1]), "every rank sums in rank order: same bits"
    assert_pads_zero(world)


@pytest.mark.parametrize("W", [2, 4])
def test_tp_mlp_graph_matches_torch(W):
    H, F, rows = 32, 64, 3
    wg, wu = randn(F, H, seed=1, scale=H**-0.5), randn(F, H, seed=2, scale=H**-0.5)
    wd = randn(H, F, seed=3, scale=F**-0.5)
    world = mkernel.World.emulated(W)
    k = models.tp_mlp_graph(world, rows, wg, wu, wd).compile()
    ops = [k.lowered.nodes[i].op for i in k.lowered.live]
    assert ops == ["all_gather", "linear", "silu_mul", "linear", "reduce_scatter"]
    x = randn(W, rows, H, seed=4)
    y = k(x=x)["y"]
    ref = models.torch_mlp(x.reshape(W * rows, H), wg, wu, wd).reshape(W, rows, H)
    assert_close(y, ref, 2.0**-6, f"W={W}")
    assert_pads_zero(world)


def test_per_rank_tensors_may_come_stacked_on_a_leading_rank_dimension():
    W, B, H, N, Hkv, S, D = 2, 2, 32, 16, 2, 8, 16
    world = mkernel.World.emulated(W)
    w = randn(W, N, H, seed=1, scale=H**-0.5)
    k_c, v_c = randn(W, B, Hkv, S, D, seed=2), randn(W, B, Hkv, S, D, seed=3)
    norm = 1 + 0.1 * randn(W, H, seed=4)
    outs = []
    for stacked in (True, False):
        g = TaskGraph(world)
        x = g.input("x", (B, H))
        n = g.rmsnorm(x, norm if stacked else list(norm))
        q = g.linear(n, w if stacked else list(w))  # [B, N]: 1 query head of 16 per kv head
        q2 = g.linear(n, randn(Hkv * 2 * D, H, seed=5, scale=H**-0.5))  # the same on every rank
        a = g.attention_decode(q2, k_c if stacked else list(k_c), v_c if stacked else list(v_c), 5)
        g.output("q", q)
        g.output("a", a)
        outs.append(g.compile()(x=randn(B, H, seed=6)))
    for name in ("q", "a"):
        assert torch.equal(outs[0][name], outs[1][name]), name
    assert not torch.equal(outs[0]["q"][0], outs[0]["q"][1])  # each rank its own shard
    g = TaskGraph(world)
    with pytest.raises(ValueError, match=r"TaskGraph.linear: weight must be \[N, K=32\]"):
        g.linear(g.input("x", (B, H)), randn(W + 1, N, H))  # a leading dim that is not W


@pytest.mark.parametrize(("length", "chunk"), [(70, 32), (70, 7), (5, 32), (64, 64)])
def test_attention_is_split_over_chunks_of_the_cache_and_combined(length, chunk):
    """attention_decode lowered as partials over ``chunk`` cached positions (the last one
    shorter) and their combine: each (sequence, kv head) has ceil(length / chunk) partial tasks,
    the combine waits once for their group, and the result is the whole-cache softmax's."""
    B, Hq, Hkv, S, D = 2, 8, 2, 80, 16
    g = TaskGraph()
    q = g.input("q", (B, Hq * D))
    kc, vc = randn(B, Hkv, S, D, seed=1), randn(B, Hkv, S, D, seed=2)
    kc[:, :, length:] = float("nan")  # past `length`: never read
    g.output("o", g.attention_decode(q, kc, vc, length))
    k = compile_graph(g, blocks=mkernel.taskgraph.ops.Blocks(4, chunk))
    low, tasks = k.lowered, k.plan.roles["compute"].tasks[0]
    ops = [low.nodes[t.node].op for t in low.tasks[0]]
    chunks = -(-length // min(chunk, length))
    assert ops.count("attention_partial") == B * Hkv * chunks
    assert ops.count("attention_combine") == B * Hkv
    for i, op in enumerate(ops):
        if op == "attention_combine" and chunks > 1:
            assert [(w.pad, w.value) for w in tasks[i].waits] == [("ready_group", chunks)]
    qin = randn(B, Hq * D, seed=3)
    out = k(q=qin)["o"]
    ref = k.reference(q=qin)["o"]
    assert_close(out, ref, 2.0**-7, f"length {length} chunk {chunk}")
    assert_pads_zero(k.world)


def test_an_attention_partial_waits_once_for_the_q_tiles_of_its_heads():
    """q's linear tiles are 32 columns, a kv head's G = 4 query heads of 16 are 64: each partial
    reads two q tiles and waits once, for their group's count (not once per tile)."""
    B, H, Hq, Hkv, S, D = 2, 64, 8, 2, 40, 16
    g = TaskGraph()
    x = g.input("x", (B, H))
    q = g.linear(x, randn(Hq * D, H, seed=1, scale=H**-0.5))
    g.output(
        "o", g.attention_decode(q, randn(B, Hkv, S, D, seed=2), randn(B, Hkv, S, D, seed=3), 40)
    )
    k = g.compile()
    low, tasks = k.lowered, k.plan.roles["compute"].tasks[0]
    partial = [i for i, t in enumerate(low.tasks[0]) if low.nodes[t.node].op == "attention_partial"]
    assert len(partial) == B * Hkv * 2  # 40 positions in chunks of 32
    for i in partial:
        assert len(low.deps[0][i]) == (Hq // Hkv) * D // 32  # two q tiles
        assert [(w.pad, w.value) for w in tasks[i].waits] == [("ready_group", 2)]
    xin = randn(B, H, seed=4)
    assert_close(k(x=xin)["o"], k.reference(x=xin)["o"], 2.0**-7)
    assert_pads_zero(k.world)


def test_dependencies_are_per_tile_not_per_op():
    k = mlp_graph().compile()  # blocks of 4 rows x 32 cols: B = 8 is two row blocks
    low, tasks = k.lowered, k.plan.roles["compute"].tasks[0]
    of = lambda op: [i for i, t in enumerate(low.tasks[0]) if low.nodes[t.node].op == op]  # noqa: E731
    waits = {i: {j for _, j in d} for i, d in enumerate(low.deps[0])}
    linear = of("linear")
    gate_up, down = linear[:12], linear[12:]
    for i in of("silu_mul"):  # a SiLU tile reads one gate tile and one up tile
        r0, _, c0, _ = low.tasks[0][i].rect
        want = {j for j in gate_up if low.tasks[0][j].rect[0] == r0}
        want = {j for j in want if low.tasks[0][j].rect[2] in (c0, 96 + c0)}
        assert waits[i] == want and len(want) == 2
    silu_rows = {j: low.tasks[0][j].rect[0] for j in of("silu_mul")}
    for i in down:  # a down tile waits only for the SiLU tiles of its rows (and nothing else)
        r0 = low.tasks[0][i].rect[0]
        assert waits[i] == {j for j, r in silu_rows.items() if r == r0}
    assert not any(t.raises for t in tasks if t.id in down), "outputs: read by the kernel end"
    assert "silu_mul" in k.describe(of("silu_mul")[0])
    for i in down:  # ... as one wait: the count of its rows' SiLU tiles (a group)
        assert [(w.pad, w.value) for w in tasks[i].waits] == [("ready_group", 3)]


def test_a_read_of_several_tiles_is_one_counted_wait_and_of_one_tile_its_flag():
    g = TaskGraph()
    x = g.input("x", (8, 64))
    h = g.linear(x, randn(96, 64, seed=1, scale=0.125))  # 2 row blocks x 3 column blocks
    g.output("n", g.rmsnorm(h, randn(96, seed=2)))  # reads whole rows: a group of 3 tiles
    g.output("s", g.add(h, h))  # reads one tile: that tile
    k = g.compile()
    low, tasks = k.lowered, k.plan.roles["compute"].tasks[0]
    lin = [i for i, t in enumerate(low.tasks[0]) if low.nodes[t.node].op == "linear"]
    for i, t in enumerate(low.tasks[0]):
        op, rows = low.nodes[t.node].op, t.rect[:2]
        same = {j for j in lin if low.tasks[0][j].rect[:2] == rows}
        if op == "rmsnorm":
            assert {j for _, j in low.deps[0][i]} == same and len(same) == 3
            (w,) = tasks[i].waits
            assert (w.pad, w.value, w.consumers) == ("ready_group", 3, 1)
        elif op == "add":
            (w,) = tasks[i].waits
            assert w.pad == "ready" and {w.index[0]} == {j for _, j in low.deps[0][i]}
        else:  # a linear tile: its tile's flag for the add, its group's count for the norm
            assert sorted(r.pad for r in tasks[i].raises) == ["ready", "ready_group"]
            assert [r.op for r in tasks[i].raises if r.pad == "ready_group"] == ["add"]
    x_ = randn(8, 64, seed=3)
    out = k(x=x_)
    h_ = x_.float() @ randn(96, 64, seed=1, scale=0.125).float().T
    assert_close(out["s"], 2 * h_, 2.0**-6, "add")
    assert_pads_zero(k.world)


def test_a_dropped_wait_is_caught_as_a_race():
    g = mlp_graph()
    clean = compile_graph(g)
    low = clean.lowered
    ops = [low.nodes[t.node].op for t in low.tasks[0]]
    consumer = ops.index("linear", ops.index("silu_mul"))  # the first down-projection tile
    silu = [j for j, op in enumerate(ops) if op == "silu_mul"]
    units = clean.plan.compute_units
    producer = next(j for j in silu if j % units != consumer % units)  # on another unit

    def drop(rank, task, peer, j):
        return task == consumer and j == producer

    broken = compile_graph(g, drop=drop)
    assert (0, producer) not in broken.lowered.deps[0][consumer]
    waits = broken.plan.roles["compute"].tasks[0][consumer].waits
    # the read waits for the count of the two tiles left: the dropped one is no member
    assert [(w.pad, w.value) for w in waits] == [("ready_group", 2)]
    with pytest.raises(mkernel.RaceError) as e:
        broken(x=randn(8, 64, seed=5))
    assert e.value.rank == 0 and {e.value.task, e.value.other[3]} == {consumer, producer}
    assert "no completed wait covers it" in str(e.value)
    clean(x=randn(8, 64, seed=5))  # the plan as lowered has no race


def test_a_silent_rank_times_out_naming_the_peer_and_the_tile():
    world = mkernel.World.emulated(2, timeout_s=0.05)
    g = TaskGraph(world)
    x = g.input("x", (4, 32))
    g.output("y", g.all_reduce(g.linear(x, [randn(32, 32, seed=r) for r in range(2)])))
    sched = mkernel.Schedule(faults=mkernel.Faults(silent_rank=1))
    with pytest.raises(mkernel.CommTimeout) as e:
        g.compile(sched)(x=randn(4, 32))
    assert e.value.peer == 1 and e.value.signal.startswith("ready[task=")


def test_the_gpu_fallback_computes_the_interpreters_bits():
    # the fallback a GPU runs (torch ops per task in plan order), here on the CPU
    world = mkernel.World.emulated(2)
    cfg = models.DecoderConfig(layers=2)
    layers, final = models.random_decoder(cfg, batch=2, seq=8, seed=2)
    g = models.decode_graph(cfg, layers, final, batch=2, length=5, world=world)
    x = randn(2, cfg.hidden, seed=3)
    y = g.compile()(x=x)["y"]
    assert torch.equal(compile_graph(g, backend="eager")(x=x)["y"], y)


@pytest.mark.gpu
def test_decode_on_a_gpu_matches_torch():
    cfg = models.DecoderConfig(layers=2)
    layers, final = models.random_decoder(cfg, batch=8, seq=16, seed=1)
    cuda = lambda t: t.cuda()  # noqa: E731
    for ly in layers:
        for name, t in vars(ly).items():
            setattr(ly, name, cuda(t))
    g = models.decode_graph(cfg, layers, cuda(final), batch=8, length=9)
    x = randn(8, cfg.hidden, seed=2).cuda()
    y = g.compile()(x=x)["y"]
    assert y.device.type == "cuda"
    assert_close(y, models.torch_decode(cfg, layers, final.cuda(), x, 9), 2.0**-6)


@pytest.mark.parametrize("W", [None, 2])
def test_norms_and_silus_fused_into_the_linears_that_alone_read_them(W):
    """fuse=True (the GPU kernel's default): the decode step's norms (but the final one, an
    output) and SiLUs are computed by the linears' tasks, and the step still matches torch; the
    fallback computes the interpreter's bits."""
    world = mkernel.World.emulated(W) if W else None
    cfg = models.DecoderConfig(layers=2)
    layers, final = models.random_decoder(cfg, batch=3, seq=40, seed=4)
    g = models.decode_graph(cfg, layers, final, batch=3, length=37, world=world)
    k = compile_graph(g, fuse=True)
    ops = [k.lowered.nodes[i].op for i in k.lowered.live]
    assert ops.count("norm_linear") == 2 * cfg.layers and ops.count("silu_linear") == cfg.layers
    assert ops.count("rmsnorm") == 1 and "silu_mul" not in ops  # the final norm: an output
    x = randn(3, cfg.hidden, seed=5)
    y = k(x=x)["y"]
    ref = models.torch_decode(cfg, layers, final, x, 37)
    assert_close(y if W is None else y[1], ref, 2.0**-6, f"W={W}")
    assert torch.equal(compile_graph(g, fuse=True, backend="eager")(x=x)["y"], y)
    if world is not None:
        assert_pads_zero(world)


def test_a_norm_or_silu_read_twice_or_given_out_is_not_fused():
    g = TaskGraph()
    x = g.input("x", (4, 64))
    n = g.rmsnorm(x, randn(64, seed=1) + 1)
    g.output("n", n)  # an output: computed as it is
    s = g.silu_mul(g.linear(n, randn(64, 64, seed=2, scale=0.125)))
    g.output("a", g.linear(s, randn(32, 32, seed=3, scale=0.2)))
    g.output("b", g.add(s, s))  # s has another reader
    k = compile_graph(g, fuse=True)
    ops = [k.lowered.nodes[i].op for i in k.lowered.live]
    assert ops == ["rmsnorm", "linear", "silu_mul", "linear", "add"]
    xin = randn(4, 64, seed=4)
    out, ref = k(x=xin), k.reference(x=xin)
    for name in ("n", "a", "b"):
        assert_close(out[name], ref[name], 2.0**-7, name)


def test_compile_device_picks_where_the_graph_runs():
    world = mkernel.World.emulated(2)
    g = mlp_graph(B=4, world=world)
    k = g.compile(device="cpu")
    assert k.backend == "interp" and k.world.size == 2
    x = randn(2, 4, 64, seed=6)
    assert_close(k(x=x)["y"], k.reference(x=x)["y"], 2.0**-7)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        g.compile(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            g.compile(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_graph_compiled_for_the_cpu_and_back():
    g = mlp_graph(B=4)  # CPU tensors
    k = g.compile(device="cuda")
    assert k.backend == "kernel"
    x = randn(4, 64, seed=7)
    y = k(x=x.cuda())["y"]
    assert y.device.type == "cuda"
    assert_close(y.cpu(), g.compile()(x=x)["y"], 2.0**-6)


def test_dead_ops_are_not_lowered_and_the_export():
    assert mkernel.TaskGraph is TaskGraph
    g = TaskGraph()
    x = g.input("x", (4, 32))
    g.silu_mul(x)  # never read by an output
    g.output("y", g.add(x, x))
    k = g.compile()
    assert [k.lowered.nodes[i].op for i in k.lowered.live] == ["add"]
    xin = randn(4, 32)
    assert torch.equal(k(x=xin)["y"], (xin.float() * 2).bfloat16())


# -- bad graphs: TypeError / ValueError naming the op and the argument, before any launch ----------

W8, X = randn(16, 32), None


def _g(world=None):
    g = TaskGraph(world)
    return g, g.input("x", (4, 32))


def _other_graph_value():
    g, _ = _g()
    _, other = _g()
    g.silu_mul(other)


def _no_output():
    g, x = _g()
    g.silu_mul(x)
    g.compile()


def _output_is_an_input():
    g, x = _g()
    g.output("y", x)


BAD = [
    (ValueError, "TaskGraph.linear: weight", lambda: _g()[0].linear("x", randn(16, 8))),
    (TypeError, "TaskGraph.linear: weight", lambda: _g()[0].linear("x", torch.randn(16, 32))),
    (ValueError, "TaskGraph.linear: residual", lambda: _g()[0].linear("x", W8, residual="x")),
    (ValueError, "TaskGraph.add: b", lambda: (lambda g, x: g.add(x, g.silu_mul(x)))(*_g())),
    (ValueError, "TaskGraph.rmsnorm: weight", lambda: _g()[0].rmsnorm("x", randn(31))),
    (ValueError, "TaskGraph.rmsnorm: eps", lambda: _g()[0].rmsnorm("x", randn(32), eps=0.0)),
    (
        ValueError,
        "TaskGraph.silu_mul: x",
        lambda: TaskGraph().silu_mul(TaskGraph().input("x", (2, 3))),
    ),
    (
        ValueError,
        "TaskGraph.attention_decode: q",
        lambda: _g()[0].attention_decode("x", randn(4, 3, 8, 16), randn(4, 3, 8, 16), 4),
    ),
    (
        ValueError,
        "TaskGraph.attention_decode: k_cache",
        lambda: _g()[0].attention_decode("x", randn(2, 2, 8, 16), randn(2, 2, 8, 16), 4),
    ),
    (
        ValueError,
        "TaskGraph.attention_decode: v_cache",
        lambda: _g()[0].attention_decode("x", randn(4, 2, 8, 16), randn(4, 2, 9, 16), 4),
    ),
    (
        ValueError,
        "TaskGraph.attention_decode: length",
        lambda: _g()[0].attention_decode("x", randn(4, 2, 8, 16), randn(4, 2, 8, 16), 9),
    ),
    (ValueError, "used before it is defined", lambda: _g()[0].silu_mul("h")),
    (ValueError, "of another TaskGraph", _other_graph_value),
    (ValueError, "no output", _no_output),
    (ValueError, "no op produces it", _output_is_an_input),
    (TypeError, "TaskGraph.input: dtype", lambda: TaskGraph().input("x", (2, 2), torch.float32)),
    (ValueError, "TaskGraph.input: shape", lambda: TaskGraph().input("x", (2, 2, 2))),
    (
        ValueError,
        "TaskGraph.linear: weight",
        lambda: _g(mkernel.World.emulated(2))[0].linear("x", [W8]),
    ),
    (
        ValueError,
        "TaskGraph.reduce_scatter: x",
        lambda: _g(mkernel.World.emulated(3))[0].reduce_scatter("x"),
    ),
]


@pytest.mark.parametrize("exc, words, build", BAD, ids=[b[1] for b in BAD])
def test_a_bad_graph_raises_naming_the_op_and_argument(exc, words, build):
    with pytest.raises(exc, match=words):
        build()


@pytest.mark.parametrize(
    "exc, words, inputs",
    [
        (ValueError, "input 'x' is missing", {}),
        (TypeError, "unexpected input", {"x": randn(4, 32), "z": randn(4, 32)}),
        (TypeError, "input 'x' must be torch.bfloat16", {"x": torch.randn(4, 32)}),
        (ValueError, "input 'x' must be of shape", {"x": randn(4, 31)}),
        (ValueError, "input 'x' must be of shape", {"x": randn(2, 4, 32)}),  # no World: no [W, ...]
    ],
)
def test_a_bad_call_raises_before_anything_runs(exc, words, inputs):
    g, x = _g()
    g.output("y", g.silu_mul(x))
    k = g.compile()
    with pytest.raises(exc, match=words):
        k(**inputs)


def test_node_times_writes_the_launch_as_a_chrome_trace_of_named_tasks(tmp_path):
    g = mlp_graph()
    path = tmp_path / "trace.json"
    node_times(g, {"x": randn(8, 64)}, chrome=path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    k = compile_graph(g)
    assert sorted(e["args"]["task"] for e in events) == list(range(len(k.lowered.tasks[0])))
    assert {e["name"].split()[0] for e in events} == {"rmsnorm", "linear", "silu_mul"}


def test_node_times_covers_every_live_node_and_its_stages_add_up_to_the_launch():
    cfg = models.DecoderConfig(layers=1)
    layers, final = models.random_decoder(cfg, 2, 40)
    g = models.decode_graph(cfg, layers, final, 2, 33)
    for fuse in (False, True):
        rows = node_times(g, {"x": randn(2, cfg.hidden)}, fuse=fuse)
        k = compile_graph(g, fuse=fuse)
        assert [r["node"] for r in rows] == sorted({t.node for t in k.lowered.tasks[0]})
        assert sum(r["tasks"] for r in rows) == len(k.lowered.tasks[0])
        assert sum(r["adds_ns"] for r in rows) == max(r["last_end_ns"] for r in rows)
        for r in rows:
            assert 0 <= r["run_median_ns"] <= r["run_max_ns"]
            assert r["late_median_ns"] >= 0 and r["waited_median_ns"] >= 0
