"""mkernel.bench.baselines.ring_dist (the distributed unfused ring) on the CPU: W processes joined
by torch.distributed (gloo), the block functions in fp32 torch instead of the GPU engines, so what
is tested is the ring itself: which block each step holds, what each query chunk sees (contiguous /
zigzag, causal or not), the double-buffered K/V sends, the lse merges, and the dK / dV accumulators
that travel with their blocks and come home. Every rank's out, lse, dq, dk, dv are checked against
the fp64 formulas of tests/test_ring_attention{,_backward}.py (their tolerances, no bf16 rounding of
P); and that the public API launches the fused kernels on a distributed GPU world (ring_dist is the
two-GPU benchmark's unfused baseline)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mkernel.bench.baselines import ring_dist as rd
from mkernel.world import World
from tests.helpers import gloo_world
from tests.test_ring_attention import _assert_attention
from tests.test_ring_attention_backward import _assert_grads, _inputs

CASES = [(layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)]
SCALE = 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, W: int, port: int, folder: str, B: int, S: int, heads: tuple) -> None:
    with gloo_world(rank, W, port) as world:
        q, k, v, dout = (x[rank] for x in _inputs(W, B, S, *heads, seed=W))
        results = {}
        for layout, causal in CASES:
            zigzag = layout == "zigzag"
            out, lse = rd.forward(q, k, v, world, causal, SCALE, zigzag, rd.torch_fwd_block)
            grads = rd.backward(
                dout, q, k, v, out, lse, None, world, causal, SCALE, zigzag, rd.torch_bwd_block
            )
            results[(layout, causal)] = (out, lse, *grads)
        torch.save(results, Path(folder) / f"rank{rank}.pt")


@pytest.mark.parametrize(("W", "B", "S", "heads"), [(2, 1, 12, (2, 1)), (3, 2, 10, (4, 2))])
def test_every_rank_gets_the_ring_results(W, B, S, heads, tmp_path):
    mp.spawn(_worker, args=(W, _free_port(), str(tmp_path), B, S, heads), nprocs=W, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(W)]
    q, k, v, dout = _inputs(W, B, S, *heads, seed=W)
    for layout, causal in CASES:
        out, lse, dq, dk, dv = (
            torch.stack([per_rank[r][(layout, causal)][i] for r in range(W)]) for i in range(5)
        )
        what = f"W={W} B={B} S={S} {heads} {layout} causal={causal}"
        _assert_attention(out, lse, q, k, v, causal, SCALE, layout, what)
        _assert_grads((dq, dk, dv), q, k, v, dout, out, lse, causal, SCALE, layout, what)


def test_the_api_takes_these_paths_on_a_distributed_gpu_world(monkeypatch):
    """On a distributed world with a CUDA device, ring_attention and ring_attention_backward each
    launch their fused kernel with this rank's tensors (the launches stubbed here: no GPU, no
    process group); the unfused ring (baselines.ring_dist) is not called."""
    import dataclasses

    import mkernel
    from mkernel.ops import ring_attention as ra
    from mkernel.ops import ring_attention_backward as rb
    from mkernel.runtime import run

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", rank=1)
    calls = []
    monkeypatch.setattr(rd, "gpu_engines", lambda: ("fwd", "bwd"))
    monkeypatch.setattr(rd, "forward", lambda *a: calls.append(("unfused forward",)) or "f")
    monkeypatch.setattr(rd, "backward", lambda *a: calls.append(("backward", a[7:])) or "b")
    sizes = dict(batch=1, seq=4, heads=2, kv_heads=1, head_dim=64, causal=1, zigzag=1)
    for m, extra in ((ra, dict(scale_bits=0)), (rb, {})):  # the run path's operand checks
        fake = lambda *a, extra=extra, **kw: dict(sizes, **extra)  # noqa: E731
        monkeypatch.setattr(m, "OP", dataclasses.replace(m.OP, shapes=fake))
    monkeypatch.setattr(run, "cached_plan", lambda module, sched, w, **s: ("plan", s))
    monkeypatch.setattr(
        run, "run_gpu", lambda w, plan, ops: calls.append(("fused", plan, sorted(ops)))
    )
    x = torch.zeros(1)
    out, lse = mkernel.ring_attention(x, x, x, world, True, 0.5, "zigzag")
    assert out.shape == (1, 4, 2, 64) and lse.shape == (1, 2, 4)  # this rank's, no rank dim
    grads = mkernel.ring_attention_backward(x, x, x, x, x, x, world, True, None, "zigzag")
    assert [g.shape for g in grads] == [x.shape] * 3  # dq, dk, dv like q, k, v: this rank's
    plan = ("plan", dict(sizes, scale_bits=ra.scale_bits(0.5)))
    assert calls[0] == ("fused", plan, ["k", "lse", "out", "q", "v"])
    plan_b = ("plan", dict(sizes, scale_bits=ra.scale_bits(0.125)))
    ops_b = ["dk", "dlse", "dout", "dq", "dv", "k", "lse", "out", "q", "v"]
    assert calls[1] == ("fused", plan_b, ops_b)
    assert len(calls) == 2  # neither unfused function ran


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize(("layout", "causal"), CASES)
def test_the_emulated_gpu_backward_path_with_the_engine_contract_on_the_cpu(W, layout, causal):
    """baselines.ring_gpu.backward (the unfused emulated backward: which key chunks each query
    chunk sees, at most two engine calls, dk / dv added to their owners' rows) with the backward
    engine's contract computed in torch on the CPU."""
    import types
    import unittest.mock

    import mkernel
    from mkernel import attention_ext
    from mkernel.bench.baselines import ring_gpu

    q, k, v, dout = _inputs(W, 2, 10, 4, 2, seed=W + 7)
    out, lse = mkernel.ring_attention(q, k, v, mkernel.World.emulated(W), causal, SCALE, layout)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(W))
    fake = types.SimpleNamespace(
        attention_backward_into=rd.torch_bwd_block, delta_of=attention_ext.delta_of
    )
    zigzag = layout == "zigzag"
    with unittest.mock.patch.object(ring_gpu, "attention_ext", fake):
        got = ring_gpu.backward(dout, q, k, v, out, lse, dlse, causal, SCALE, zigzag)
    what = f"emulated gpu path W={W} {layout} causal={causal}"
    _assert_grads(got, q, k, v, dout, out, lse, causal, SCALE, layout, what, dlse)


@pytest.mark.parametrize("op", ["ring_attention", "gemm_rs", "all_gather"])
def test_a_distributed_cpu_world_is_refused_by_name(op):
    """The interpreter runs emulated worlds; a distributed world runs on GPUs: on the CPU every
    fused op says so before anything runs (not a symmetric-memory or reshape error)."""
    import mkernel

    world = World(size=2, device=torch.device("cpu"), kind="distributed", rank=0)
    x = torch.randn(8, 8).bfloat16()
    q = torch.randn(1, 8, 2, 64).bfloat16()
    args = {"ring_attention": (q, q, q), "gemm_rs": (x, x), "all_gather": (x,)}[op]
    with pytest.raises(NotImplementedError, match="emulated worlds"):
        getattr(mkernel, op)(*args, world)
