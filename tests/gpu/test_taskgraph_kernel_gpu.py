"""TaskGraph's GPU kernel (issue 36): one persistent launch per call running the lowered plan's
tables, against the fp32 references (CompiledGraph.reference, mkernel.models.torch_decode), with
fresh random inputs and NaN-poisoned outputs (MKERNEL_POISON=1, tests/conftest.py); every op, the
GEMV at batch 1-17, the decode step for 1, 2 and 8 layers at batch 1 and 8 with TP over emulated
worlds of 2 and 4 ranks, the TP MLP, repeated calls (pads back to zero), a silent rank timing out
with the peer and the flag named, bad input before launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mkernel
from mkernel import models
from mkernel.taskgraph import TaskGraph
from mkernel.taskgraph.compiled import compile_graph
from tests.helpers import assert_pads_zero
from tests.test_taskgraph import assert_close

pytestmark = pytest.mark.gpu
bf16 = torch.bfloat16


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf16)


def on_gpu(layers, final):
    fields = [f.name for f in dataclasses.fields(models.Layer)]
    moved = [dataclasses.replace(ly, **{n: getattr(ly, n).cuda() for n in fields}) for ly in layers]
    return moved, final.cuda()


def test_one_launch_per_call():
    g = TaskGraph()
    x = g.input("x", (2, 64))
    g.output("y", g.linear(g.rmsnorm(x, randn(64, seed=1) + 1), randn(128, 64, seed=2)))
    k = g.compile()
    assert k.backend == "kernel"
    xin = randn(2, 64, seed=3)
    k(x=xin)  # built and warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        k(x=xin)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fused = [n for n in names if "persistent_kernel" in n]
    assert len(fused) == 1, names


@pytest.mark.parametrize("B", [1, 3, 8, 16, 17])
def test_linear_gemv_with_residual(B):
    K, N = 1024, 520
    g = TaskGraph()
    x = g.input("x", (B, K))
    r = g.input("r", (B, N))
    g.output("y", g.linear(x, randn(N, K, seed=B, scale=K**-0.5), residual=r))
    k = g.compile()
    xin, rin = randn(B, K, seed=100 + B), randn(B, N, seed=200 + B)
    y = k(x=xin, r=rin)["y"]
    assert_close(y, k.reference(x=xin, r=rin)["y"], 2.0**-7, f"B={B}")


@pytest.mark.parametrize("B", [1, 3, 8, 16])
def test_norm_and_silu_fused_into_the_linears_at_every_batch(B):
    """rmsnorm -> linear -> silu_mul -> linear (+ residual) lowered as norm_linear and
    silu_linear (each GEMV path: FMA at 1 row, tensor cores above), against the reference."""
    H, F = 512, 1024
    g = TaskGraph()
    x = g.input("x", (B, H))
    n = g.rmsnorm(x, randn(H, seed=1) + 1)
    s = g.silu_mul(g.linear(n, randn(2 * F, H, seed=2, scale=H**-0.5)))
    g.output("y", g.linear(s, randn(H, F, seed=3, scale=F**-0.5), residual=x))
    k = g.compile()
    assert [k.lowered.nodes[i].op for i in k.lowered.live] == ["norm_linear", "silu_linear"]
    xin = randn(B, H, seed=4)
    ref = k.reference(round_values=False, x=xin)["y"]  # fp32: the fused path rounds elsewhere
    assert_close(k(x=xin)["y"], ref, 2.0**-6, f"B={B}")


@pytest.mark.parametrize("B", [1, 8, 16])
@pytest.mark.parametrize("K", [1000, 3000, 12288, 13000])
def test_linears_at_k_past_a_stage_and_past_x_in_shared_memory(B, K):
    """Each linear kind (plain + residual, norm_linear, silu_linear) at K cut into several
    1024-wide stages with a short last one, at x's row just fitting 24 KB and past it (the weight
    ring's bounds, MK_TG_WEIGHT_RING; without it the same shapes check the plain GEMVs), output
    columns not a multiple of 16."""
    N = 200
    g = TaskGraph()
    x = g.input("x", (B, K))
    r = g.input("r", (B, N))
    n = g.rmsnorm(x, randn(K, seed=1) + 1)
    y1 = g.linear(n, randn(N, K, seed=2, scale=K**-0.5), residual=r)  # norm_linear
    u = g.input("u", (B, 2 * K))
    y2 = g.linear(g.silu_mul(u), randn(N, K, seed=3, scale=K**-0.5))  # silu_linear
    y3 = g.linear(x, randn(N, K, seed=4, scale=K**-0.5), residual=r)
    for name, v in (("y1", y1), ("y2", y2), ("y3", y3)):
        g.output(name, v)
    k = g.compile()
    ops = sorted(k.lowered.nodes[i].op for i in k.lowered.live)
    assert ops == ["linear", "norm_linear", "silu_linear"], ops
    ins = {"x": randn(B, K, seed=5), "r": randn(B, N, seed=6), "u": randn(B, 2 * K, seed=7)}
    ref = k.reference(round_values=False, **ins)
    got = k(**ins)
    for name in ("y1", "y2", "y3"):
        assert_close(got[name], ref[name], 2.0**-6, f"{name} B={B} K={K}")


@pytest.mark.parametrize(
    ("B", "Hkv", "G", "L"), [(1, 8, 4, 1024), (8, 8, 4, 4096), (1, 1, 8, 20000), (2, 2, 1, 40)]
)
def test_attention_over_chunks_matches_the_whole_cache_softmax(B, Hkv, G, L):
    """attention_decode split into partials (device.attention_chunk) and their combine, against
    the reference's one softmax over all L positions; the cache past L is NaN (never read)."""
    D = 128
    kc, vc = randn(B, Hkv, L + 8, D, seed=1), randn(B, Hkv, L + 8, D, seed=2)
    kc[:, :, L:] = float("nan")
    vc[:, :, L:] = float("nan")
    g = TaskGraph()
    q = g.input("q", (B, Hkv * G * D))
    g.output("o", g.attention_decode(q, kc, vc, L))
    k = g.compile()
    ops = [k.lowered.nodes[t.node].op for t in k.lowered.tasks[0]]
    assert ops.count("attention_combine") == B * Hkv
    qin = randn(B, Hkv * G * D, seed=3)
    assert_close(k(q=qin)["o"], k.reference(q=qin)["o"], 2.0**-7, f"B={B} Hkv={Hkv} L={L}")
    assert_pads_zero(k.world)


@pytest.mark.parametrize("fuse", [True, False])
def test_every_op_matches_the_reference(fuse):
    """Every op (fuse: the norm computed by the q projection's tasks, norm_linear; the SiLU has
    another reader, so it is not fused), against the fp32 reference."""
    B, H, Hq, Hkv, S, D = 3, 256, 8, 2, 300, 128
    g = TaskGraph()
    x = g.input("x", (B, H))
    n = g.rmsnorm(x, randn(H, seed=1) + 1, eps=1e-5)
    q = g.linear(n, randn(Hq * D, H, seed=2, scale=H**-0.5))
    kc, vc = randn(B, Hkv, S, D, seed=3), randn(B, Hkv, S, D, seed=4)
    att = g.attention_decode(q, kc, vc, 257)
    h = g.linear(att, randn(H, Hq * D, seed=5, scale=0.05), residual=x)
    s = g.silu_mul(g.linear(h, randn(1024, H, seed=6, scale=H**-0.5)))
    g.output("y", g.add(s, g.input("z", (B, 512))))
    g.output("h", h)
    k = compile_graph(g, fuse=fuse)
    ops = {k.lowered.nodes[i].op for i in k.lowered.live}
    assert ("norm_linear" in ops) == fuse and ("rmsnorm" in ops) != fuse
    ins = {"x": randn(B, H, seed=7), "z": randn(B, 512, seed=8)}
    out, ref = k(**ins), k.reference(**ins)
    for name in ("y", "h"):
        assert_close(out[name], ref[name], 2.0**-6, name)


@pytest.mark.parametrize(
    "layers, batch, W",
    [(1, 1, None), (2, 8, None), (8, 1, None), (1, 8, 2), (2, 1, 2), (1, 1, 4), (2, 8, 4)],
)
def test_decode_step_matches_torch(layers, batch, W):
    cfg = models.DecoderConfig(
        hidden=256, heads=8, kv_heads=4, head_dim=32, intermediate=512, layers=layers
    )
    weights, final = models.random_decoder(cfg, batch, seq=64, seed=layers + batch)
    ref_in = torch.randn(batch, cfg.hidden, generator=torch.Generator().manual_seed(7)).to(bf16)
    ref = models.torch_decode(cfg, weights, final, ref_in, length=50)
    weights, final = on_gpu(weights, final)
    world = mkernel.World.emulated(W, device="cuda") if W else None
    g = models.decode_graph(cfg, weights, final, batch, length=50, world=world)
    k = g.compile()
    assert k.backend == "kernel"
    y = k(x=ref_in.cuda())["y"]
    ranks = [y] if W is None else list(y)
    for r, yr in enumerate(ranks):
        assert_close(yr.cpu(), ref, 2.0**-6 * (1 + layers / 4), f"L={layers} B={batch} rank {r}")
    if world is not None:
        torch.cuda.synchronize()
        assert_pads_zero(world)
        assert all(torch.equal(y[0], y[r]) for r in range(W)), "the ranks agree bit for bit"


@pytest.mark.parametrize("W", [2, 4])
def test_tp_mlp_in_one_launch(W):
    world = mkernel.World.emulated(W, device="cuda")
    H, F, rows = 128, 256, 8
    wg, wu = randn(F, H, seed=1, scale=H**-0.5), randn(F, H, seed=2, scale=H**-0.5)
    wd = randn(H, F, seed=3, scale=F**-0.5)
    k = models.tp_mlp_graph(world, rows, wg, wu, wd).compile()
    x = randn(W, rows, H, seed=4)
    y = k(x=x)["y"]
    ref = models.torch_mlp(x.reshape(W * rows, H), wg, wu, wd).reshape(W, rows, H)
    assert_close(y, ref, 2.0**-6, f"W={W}")
    torch.cuda.synchronize()
    assert_pads_zero(world)


def test_repeated_calls_are_stable_and_reset_their_pads():
    world = mkernel.World.emulated(2, device="cuda")
    cfg = models.DecoderConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    weights, final = on_gpu(*models.random_decoder(cfg, 4, seq=32, seed=1))
    k = models.decode_graph(cfg, weights, final, 4, 20, world).compile()
    xs = [randn(4, cfg.hidden, seed=s) for s in range(3)]
    first = [k(x=x)["y"].clone() for x in xs]
    for _ in range(50):
        for x, y0 in zip(xs, first, strict=True):
            assert torch.equal(k(x=x)["y"], y0)
    torch.cuda.synchronize()
    assert_pads_zero(world)


def test_kernel_and_eager_fallback_agree():
    cfg = models.DecoderConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    weights, final = on_gpu(*models.random_decoder(cfg, 2, seq=32, seed=2))
    g = models.decode_graph(cfg, weights, final, 2, 17)
    x = randn(2, cfg.hidden, seed=5)
    y = g.compile()(x=x)["y"]
    e = compile_graph(g, backend="eager")(x=x)["y"]
    assert_close(y, e.float(), 2.0**-6, "kernel vs eager")


def test_a_silent_rank_times_out_naming_the_peer_and_the_flag():
    world = mkernel.World.emulated(2, device="cuda", timeout_s=0.2)
    world.sync_checks = True
    g = TaskGraph(world)
    x = g.input("x", (4, 64))
    g.output("y", g.all_reduce(g.linear(x, [randn(64, 64, seed=r) for r in range(2)])))
    k = g.compile(mkernel.Schedule(faults=mkernel.Faults(silent_rank=1)))
    with pytest.raises(mkernel.CommTimeout) as e:
        k(x=randn(4, 64, seed=1))
    assert e.value.peer == 1 and e.value.signal.startswith(("ready[task=", "ready_group[group="))


def test_bad_input_raises_before_launch():
    g = TaskGraph()
    x = g.input("x", (2, 64))
    g.output("y", g.linear(x, randn(64, 64)))
    k = g.compile()
    with pytest.raises(TypeError, match="bfloat16"):
        k(x=randn(2, 64).float())
    with pytest.raises(ValueError, match="shape"):
        k(x=randn(3, 64))
    with pytest.raises(ValueError, match="must be on"):
        k(x=randn(2, 64).cpu())


def test_a_shape_the_kernel_cannot_serve_is_refused_at_compile():
    g = TaskGraph()
    x = g.input("x", (2, 60))
    g.output("y", g.linear(x, randn(64, 60)))
    with pytest.raises(ValueError, match="multiples of 8"):
        g.compile()


def _small_decode(world=None, batch=2):
    cfg = models.DecoderConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    weights, final = on_gpu(*models.random_decoder(cfg, batch, seq=32, seed=3))
    return cfg, models.decode_graph(cfg, weights, final, batch, 21, world)


def test_trace_records_every_task():
    world = mkernel.World.emulated(2, device="cuda")
    _, g = _small_decode(world)
    k = g.compile(mkernel.Schedule(trace=True))
    k(x=randn(2, 128, seed=1))
    spans = world.last_timeline.spans
    assert sorted((s.rank, s.task) for s in spans) == [
        (r, t) for r in range(2) for t in range(len(k.lowered.tasks[0]))
    ]
    assert all(s.end >= s.start for s in spans)


def test_a_late_rank_changes_nothing():
    world = mkernel.World.emulated(2, device="cuda")
    _, g = _small_decode(world)
    x = randn(2, 128, seed=2)
    y = g.compile()(x=x)["y"]
    late = g.compile(mkernel.Schedule(faults=mkernel.Faults(delay_rank=1, delay_us=20)))
    assert torch.equal(late(x=x)["y"], y)


def test_cuda_graph_replay_with_new_inputs():
    _, g = _small_decode()
    k = g.compile()
    static = randn(2, 128, seed=3)
    k(x=static)  # warm: built, attributes set, poison kernel loaded
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k(x=static)["y"]
    for seed in (4, 5):
        x = randn(2, 128, seed=seed)
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, k(x=x)["y"]), f"seed {seed}"
