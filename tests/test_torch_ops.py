"""mkernel's custom ops (mkernel/torch_ops.py) on the CPU, in emulated worlds: torch.library.opcheck
of every op (schema, fake tensor, autograd registration, aot_dispatch_dynamic), results equal to
the Python API's (the same interpreter run), autograd of attention and ring attention equal to the
Python API's autograd, the MoE pair's worst-case layout, world handles, and torch.compile
(fullgraph) of a tensor-parallel MLP block and of an MoE layer without graph breaks, equal to
eager."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils

import mkernel
from mkernel import torch_ops
from tests.helpers import assert_close_bf16

W = 2
f32 = torch.float32
UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


@pytest.fixture(scope="module")
def world() -> mkernel.World:
    return mkernel.World.emulated(W)


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _opcheck(name: str, args: tuple) -> None:
    res = torch.library.opcheck(getattr(torch.ops.mkernel, name).default, args, test_utils=UTILS)
    assert res == dict.fromkeys(UTILS, "SUCCESS"), res


def _gemm_args(op: str):
    if op == "ag_gemm":  # a [M/W, K], b [K, N]
        return _bf16(W, 32, 64, seed=1), _bf16(W, 64, 48, seed=2)
    return _bf16(W, 64, 32, seed=1), _bf16(W, 32, 48, seed=2)  # a [M, K/W], b [K/W, N]


def _qkv(grad: bool = False, lead: tuple[int, ...] = (W,)):
    q = _bf16(*lead, 1, 16, 2, 64, seed=3)
    k, v = _bf16(*lead, 1, 16, 1, 64, seed=4), _bf16(*lead, 1, 16, 1, 64, seed=5)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _moe_inputs(T: int = 6, E: int = 2, k: int = 2, H: int = 32, inter: int = 16):
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(W * E, generator=g)[:k] for _ in range(W * T)])
    ids = ids.view(W, T, k)
    ids[0, 1, 1] = -1  # an unused slot
    x, w1 = _bf16(W, T, H, seed=8), _bf16(W, E, H, inter, seed=9, scale=0.2)
    w2 = _bf16(W, E, inter, H, seed=10, scale=0.2)
    weights = torch.rand(W, T, k, generator=g)
    return x, ids, w1, w2, weights


# -- opcheck of every op --------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm", "gemm_ar"])
def test_opcheck_gemm_ops(op, world):
    _opcheck(op, (*_gemm_args(op), torch_ops.world_handle(world)))


def test_opcheck_all_gather(world):
    _opcheck("all_gather", (_bf16(W, 16, 64, seed=0), torch_ops.world_handle(world)))


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_opcheck_ring_attention(causal, layout, world):
    _opcheck("ring_attention", (*_qkv(True), torch_ops.world_handle(world), causal, None, layout))


def test_opcheck_ring_attention_backward(world):
    h = torch_ops.world_handle(world)
    q, k, v = _qkv()
    out, lse = torch.ops.mkernel.ring_attention(q, k, v, h, True)
    dout, dlse = _bf16(*out.shape, seed=11), torch.randn(lse.shape)
    _opcheck("ring_attention_backward", (dout, q, k, v, out, lse, dlse, h, True, 0.1, "contiguous"))
    _opcheck("ring_attention_backward", (dout, q, k, v, out, lse, None, h, True))


def test_opcheck_attention():
    _opcheck("attention", (*_qkv(True, lead=()), True, None))
    q, k, v = _qkv(lead=())
    out, lse = torch.ops.mkernel.attention(q, k, v)
    dout, dlse = _bf16(*out.shape, seed=11), torch.randn(lse.shape)
    _opcheck("attention_backward", (dout, q, k, v, out, lse, dlse, False, None))


def test_opcheck_moe_pair(world):
    h = torch_ops.world_handle(world)
    x, ids, w1, w2, weights = _moe_inputs()
    _opcheck("moe_dispatch_gemm", (x, ids, w1, h))
    y, src, offsets = torch.ops.mkernel.moe_dispatch_gemm(x, ids, w1, h)
    _opcheck("moe_gemm_combine", (y, w2, src, offsets, ids, weights, h))


def test_opcheck_grouped_gemm():
    a, b = _bf16(12, 32, seed=0), _bf16(3, 32, 16, seed=1)
    offsets = torch.tensor([1, 4, 4, 10], dtype=torch.int32)
    _opcheck("grouped_gemm", (a, b, offsets))
    rows = torch.tensor([3, 0, 7, 7, 11, 2], dtype=torch.int32)
    _opcheck("grouped_gemm", (a, b, torch.tensor([0, 2, 5, 6], dtype=torch.int32), f32, rows))


def test_every_public_op_is_registered():
    names = {"gemm_rs", "ag_gemm", "gemm_ar", "all_gather", "attention", "ring_attention"}
    names |= {"moe_dispatch_gemm", "moe_gemm_combine", "grouped_gemm", "ring_attention_backward"}
    assert names | {"attention_backward"} == set(torch_ops.OPS)
    for name in names:
        assert getattr(torch.ops.mkernel, name).default.name() == f"mkernel::{name}"


# -- the same results as the Python API -----------------------------------------------------------


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm", "gemm_ar"])
def test_gemm_ops_equal_the_python_api(op, world):
    a, b = _gemm_args(op)
    got = getattr(torch_ops, op)(a, b, world)
    assert torch.equal(got, getattr(mkernel, op)(a, b, world))
    assert_close_bf16(got, getattr(mkernel.reference, op)(a, b, world=world), op)


def test_all_gather_equals_the_python_api(world):
    x = _bf16(W, 16, 64, seed=0)
    assert torch.equal(torch_ops.all_gather(x, world), mkernel.all_gather(x, world))


def test_grouped_gemm_zeros_rows_in_no_group():
    a, b = _bf16(12, 32, seed=0), _bf16(3, 32, 16, seed=1)
    offsets = torch.tensor([1, 4, 4, 10], dtype=torch.int32)
    got = torch_ops.grouped_gemm(a, b, offsets, f32)
    assert torch.equal(got, mkernel.grouped_gemm(a, b, offsets, out_dtype=f32))
    assert not got[0].any() and not got[10:].any()


# -- autograd -------------------------------------------------------------------------------------


def _grads(fn, inputs, seed: int):
    out, lse = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    loss = (out.float() * torch.randn(out.shape, generator=g)).sum() + lse.sin().sum()
    return (out, lse, *torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize("causal,layout", [(True, "contiguous"), (False, "zigzag")])
def test_ring_attention_autograd_equals_the_python_api(causal, layout, world):
    qkv = _qkv(True)
    got = _grads(lambda *t: torch_ops.ring_attention(*t, world, causal, None, layout), qkv, 0)
    ref = _grads(lambda *t: mkernel.ring_attention(*t, world, causal, None, layout), qkv, 0)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_attention_autograd_equals_the_python_api():
    qkv = _qkv(True, lead=())
    got = _grads(lambda *t: torch_ops.attention(*t, True, 0.2), qkv, 1)
    ref = _grads(lambda *t: mkernel.attention(*t, True, 0.2), qkv, 1)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_gemm_op_backward_says_no_formula(world):
    a, b = _gemm_args("gemm_rs")
    out = torch_ops.gemm_rs(a.requires_grad_(), b, world)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.float().sum().backward()


# -- MoE: the worst case's layout -----------------------------------------------------------------


def test_moe_pair_layout_and_results(world):
    x, ids, w1, w2, weights = _moe_inputs()
    T, k, E = ids.shape[1], ids.shape[2], w1.shape[1]
    y, src, offsets = torch_ops.moe_dispatch_gemm(x, ids, w1, world)
    rows = W * T * min(k, E)
    assert y.shape == (W, rows, w1.shape[-1]) and src.shape == (W, rows, 3)
    ref = mkernel.moe_dispatch_gemm(x, ids, w1, world)
    for d in range(W):
        n = int(offsets[d, -1])
        assert torch.equal(offsets[d], ref.expert_offsets[d])
        assert torch.equal(y[d, :n], ref.y[d]) and torch.equal(src[d, :n], ref.src[d])
        assert not y[d, n:].any() and bool((src[d, n:] == -1).all())
    h = torch.nn.functional.silu(y.float()).bfloat16()
    got = torch_ops.moe_gemm_combine(h, w2, src, offsets, ids, weights, world)
    hs = [torch.nn.functional.silu(t.float()).bfloat16() for t in ref.y]
    assert torch.equal(got, mkernel.moe_gemm_combine(hs, w2, ref, weights, world))


# -- world handles --------------------------------------------------------------------------------


def test_world_handles(world):
    h = torch_ops.world_handle(world)
    assert h.startswith("emulated:") and torch_ops.world_handle(world) == h
    assert torch_ops.world_handle(h) == h and torch_ops.lookup(h) is world
    other = mkernel.World.emulated(W)
    assert torch_ops.world_handle(other) != h
    with pytest.raises(TypeError, match="mkernel.World"):
        torch_ops.world_handle(3)
    with pytest.raises(ValueError, match="names no live World"):
        torch_ops.lookup("emulated:no-such-world")
    a, b = _gemm_args("gemm_rs")
    with pytest.raises(ValueError, match="names no live World"):
        torch.ops.mkernel.gemm_rs(a, b, "emulated:no-such-world")


def test_bad_input_raises_the_python_apis_error(world):
    a, b = _gemm_args("gemm_rs")
    with pytest.raises(TypeError, match="must be torch.bfloat16"):
        torch_ops.gemm_rs(a.float(), b, world)
    with pytest.raises(ValueError, match="must be a positive multiple of 2"):
        torch_ops.gemm_rs(a[:, :63].contiguous(), b, world)


# -- torch.compile --------------------------------------------------------------------------------


def tp_mlp(x, w_up, w_down, world):
    """A tensor-parallel MLP block: column-parallel up projection (all-gather + GEMM), SiLU,
    row-parallel down projection (GEMM + reduce-scatter)."""
    h = torch_ops.ag_gemm(x, w_up, world)
    h = torch.nn.functional.silu(h.float()).bfloat16()
    return torch_ops.gemm_rs(h, w_down, world)


def _compiled_without_breaks(fn, backend: str, *args):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    return got


BACKENDS = ["aot_eager"] + (["inductor"] if shutil.which("g++") or shutil.which("cc") else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_tp_mlp_block(backend, world):
    x, w_up = _bf16(W, 16, 64, seed=1), _bf16(W, 64, 64, seed=2, scale=0.2)
    w_down = _bf16(W, 64, 32, seed=3, scale=0.2)
    eager = tp_mlp(x, w_up, w_down, world)
    got = _compiled_without_breaks(tp_mlp, backend, x, w_up, w_down, world)
    assert_close_bf16(got, eager, backend)  # inductor may fuse the SiLU's rounding differently
    explained = torch._dynamo.explain(tp_mlp)(x, w_up, w_down, torch_ops.world_handle(world))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_compile_ring_attention_forward_and_backward(world):
    def step(q, k, v):
        out, lse = torch_ops.ring_attention(q, k, v, world, True)
        return out.float().square().sum() + lse.sum()

    qkv = _qkv(True)
    loss = step(*qkv)
    ref = torch.autograd.grad(loss, qkv)
    got_loss = _compiled_without_breaks(step, "aot_eager", *qkv)
    got = torch.autograd.grad(got_loss, qkv)
    assert torch.equal(got_loss, loss)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_compile_moe_layer(world):
    def layer(x, ids, w1, w2, weights):
        y, src, offsets = torch_ops.moe_dispatch_gemm(x, ids, w1, world)
        h = torch.nn.functional.silu(y.float()).bfloat16()
        return torch_ops.moe_gemm_combine(h, w2, src, offsets, ids, weights, world)

    args = _moe_inputs()
    got = _compiled_without_breaks(layer, "aot_eager", *args)
    assert torch.equal(got, layer(*args))


def test_set_schedule_is_the_worlds(world):
    a, b = _gemm_args("gemm_rs")
    sched = mkernel.Schedule(overlap="inter_sm", comm_sms=2, seed=5, trace=True)
    torch_ops.set_schedule(world, sched)
    try:
        got = torch_ops.gemm_rs(a, b, world)
        assert world.last_timeline is not None
        assert torch.equal(got, mkernel.gemm_rs(a, b, world, sched))
    finally:
        torch_ops.set_schedule(torch_ops.world_handle(world), None)
    assert torch_ops._schedules == {}
    with pytest.raises(TypeError, match="mkernel.Schedule"):
        torch_ops.set_schedule(world, "inter_sm")
