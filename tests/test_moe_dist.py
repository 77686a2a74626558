"""mkernel.bench.baselines.moe_dist (the distributed unfused MoE pair: the two-GPU benchmark's
baseline) on the CPU: W processes joined by torch.distributed (gloo), the grouped GEMM as
mkernel.grouped_gemm runs it on the CPU (its fp32 reference), so what is tested is the exchange:
each token sent once per destination rank and expanded there, the row order (local expert, source,
token, slot), src and expert_offsets, the products sent back and summed in slot order. Every rank's
results are checked with tests/test_moe.py's formulas (W 2 and 3; uniform routing with unused slots,
all tokens to one expert, all to rank 0, none routed; T = 0; k 1, 2, 8). Also the fused path's
counts exchange (moe_common.rows_per_rank) and that the public API launches the fused kernels on a
distributed GPU world."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mkernel.bench.baselines import moe_dist
from mkernel.ops.moe_common import rows_per_rank
from mkernel.world import World
from tests.helpers import assert_close_exact, gloo_world
from tests.test_moe import INTER, check_dispatch, expected_out, operands, routing
from tests.test_ring_attention_dist import _free_port

# (T, E, k, mode): the cases every process runs, in order
CASES = [(5, 2, 2, "uniform"), (4, 3, 8, "uniform"), (3, 2, 1, "one_expert"), (4, 2, 2, "rank0"),
         (3, 1, 1, "none"), (0, 2, 2, "uniform")]  # fmt: skip


def _inputs(W: int, T: int, E: int, k: int, mode: str, seed: int):
    x, w1, w2, weights = operands(W, T, E, seed)
    return x, routing(W, T, E, k, mode, seed), w1, w2, weights[..., :k].contiguous()


def _worker(rank: int, W: int, port: int, folder: str) -> None:
    with gloo_world(rank, W, port) as world:
        results = []
        for i, (T, E, k, mode) in enumerate(CASES):
            if mode == "one_expert" or k <= W * E:
                x, ids, w1, w2, weights = _inputs(W, T, E, k, mode, i)
                ids32 = ids[rank].to(torch.int32)
                d = moe_dist.dispatch(x[rank], ids32, w1[rank], world, moe_dist.engine_gemm)
                h = torch.relu(d.y[0])
                out = moe_dist.combine(h, w2[rank], d, weights[rank], world, moe_dist.engine_gemm)
                results.append((d.y[0], d.src[0], d.expert_offsets[0], out))
            else:
                results.append(None)
        torch.save(results, Path(folder) / f"rank{rank}.pt")


@pytest.mark.parametrize("W", [2, 3])
def test_every_rank_gets_its_rows_and_outputs(W, tmp_path):
    mp.spawn(_worker, args=(W, _free_port(), str(tmp_path)), nprocs=W, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(W)]
    for i, (T, E, k, mode) in enumerate(CASES):
        if per_rank[0][i] is None:
            continue
        x, ids, w1, w2, weights = _inputs(W, T, E, k, mode, i)
        what = f"W={W} T={T} E={E} k={k} {mode}"
        res = types.SimpleNamespace(
            y=[per_rank[r][i][0] for r in range(W)],
            src=[per_rank[r][i][1] for r in range(W)],
            expert_offsets=[per_rank[r][i][2] for r in range(W)],
        )
        check_dispatch(res, x, ids, w1, E, what)
        out = torch.stack([per_rank[r][i][3] for r in range(W)])
        exact, mag = expected_out([torch.relu(y) for y in res.y], w2, ids, weights, E)
        assert_close_exact(out, exact, mag, INTER + k, f"{what}: out")
        unrouted = (ids < 0).all(dim=-1)
        assert bool((out[unrouted] == 0).all()), f"{what}: a token routed nowhere is not zero"


def _counts_worker(rank: int, W: int, port: int, folder: str) -> None:
    with gloo_world(rank, W, port) as world:
        ids = routing(W, 6, 2, 2, "uniform", 1)
        got = {"rows": rows_per_rank(world, ids[rank].to(torch.int32), 2)}
        bad = ids[rank].clone()
        bad[4, 1] = 2 * W if rank == 0 else bad[4, 1]  # outside [-1, E): rank 0 names it
        for case, mine in (
            ("short", ids[rank, : 6 - (rank == W - 1)]),
            ("refused", None),
            ("bad id", bad),
        ):
            mine = None if case == "refused" and rank == 1 else ids[rank] if mine is None else mine
            try:
                rows_per_rank(world, mine, 2)
                got[case] = "no error"
            except ValueError as e:
                got[case] = str(e)
        torch.save(got, Path(folder) / f"rank{rank}.pt")


@pytest.mark.parametrize("W", [2, 3])
def test_the_rows_per_rank_exchange_counts_every_source_and_fails_on_every_rank(W, tmp_path):
    """moe_common.rows_per_rank (the fused dispatch's counts in a distributed world): each rank's
    rows are the used slots of every source routed to its experts; a rank with another T, one
    that refused its inputs (ids None) or one with an id outside [-1, E) (checked by the same
    exchange: that rank names the id) makes EVERY rank raise, naming the cause, not wait."""
    mp.spawn(_counts_worker, args=(W, _free_port(), str(tmp_path)), nprocs=W, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(W)]
    ids = routing(W, 6, 2, 2, "uniform", 1)
    want = [int(((ids >= 0) & (ids // 2 == d)).sum()) for d in range(W)]
    for r in range(W):
        assert got[r]["rows"] == want, f"rank {r}"
        assert "same number of tokens T" in got[r]["short"] and "[6, " in got[r]["short"]
        assert "rank(s) [1] refused their inputs" in got[r]["refused"], got[r]["refused"]
        want_bad = f"expert id {2 * W} of rank 0, token 4 (slot 1)" if r == 0 else "rank(s) [0]"
        assert want_bad in got[r]["bad id"], got[r]["bad id"]


def test_the_api_launches_the_fused_kernels_on_a_distributed_gpu_world(monkeypatch):
    """On a distributed world with a CUDA device, both ops launch their fused kernel with this
    rank's tensors (launches, checks and the counts exchange stubbed: no GPU, no process group):
    the dispatch's buffers have this rank's rows, its result one entry and the largest rank's
    rows as ``peak``; the combine's operands are this rank's, without a rank dimension, and its
    plan sizes the symmetric partial_peers by that peak (the per-call partial is a placeholder
    there); baselines.moe_dist (the unfused baseline) is not called."""
    import mkernel
    from mkernel.ops import moe_dispatch_gemm as mdg
    from mkernel.ops import moe_gemm_combine as mgc
    from mkernel.ops.moe_common import partial_rows
    from mkernel.runtime import run

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", rank=1)
    T, H, N, E, k = 3, 8, 16, 2, 2
    s = dict(tokens=T, hidden=H, inter=N, experts=E, k=k)
    ids = torch.tensor([[0, 3], [2, -1], [1, 2]], dtype=torch.int32)
    # the run path's operand checks and plan stubbed (the operands live on the CPU here)
    monkeypatch.setattr(mdg, "shapes", lambda *a: dict(s))
    sizes = {}

    def cached_plan(module, sched, w, **shape):
        sizes.update(shape)
        return types.SimpleNamespace(sizes={**shape, "max_rows": 12})

    monkeypatch.setattr(run, "cached_plan", cached_plan)
    monkeypatch.setattr(mdg, "rows_per_rank", lambda w, i, e: [4, 5])
    monkeypatch.setattr(moe_dist, "dispatch", None)  # the unfused path would fail
    monkeypatch.setattr(moe_dist, "combine", None)
    launched = []
    shapes = lambda ops: {n: tuple(t.shape) for n, t in ops.items()}  # noqa: E731
    monkeypatch.setattr(run, "run_gpu", lambda w, p, ops: launched.append(shapes(ops)))
    x, w1 = torch.zeros(T, H).bfloat16(), torch.zeros(E, H, N).bfloat16()
    d = mkernel.moe_dispatch_gemm(x, ids, w1, world)
    want = {"x": (T, H), "topk_ids": (T, k), "w1": (1, E * H, N), "y": (1, 5, N)}
    assert launched[0] == want | {
        "expanded": (1, 5, H),
        "src": (1, 5, 3),
        "expert_offsets": (1, 1, E + 1),
    }
    assert d.buffer_rows == [5] and d.peak == 5 and len(d.src) == len(d.expert_offsets) == 1
    h, w2 = torch.zeros(5, N).bfloat16(), torch.zeros(E, N, H).bfloat16()
    monkeypatch.setattr(mgc, "shapes", lambda *a: dict(s, partial_rows=partial_rows(d.peak)))
    out = mkernel.moe_gemm_combine(h, w2, d, torch.zeros(T, k), world)
    assert out.shape == (T, H) and sizes["partial_rows"] == partial_rows(5) == 64
    want = {"h": (5, N), "w2": (E * N, H), "src": (5, 3), "expert_offsets": (1, E + 1)}
    assert launched[1] == want | {"out": (T, H), "topk_weights": (T, k), "partial": (1, H)}


def test_a_refused_input_in_a_distributed_world_still_joins_the_counts_exchange(monkeypatch):
    """The run path's ``refused`` hook (mkernel/runtime/run.py OpDef): when a check refuses this
    rank's dispatch inputs in a distributed world, the rank still takes part in the counts
    exchange as refusing (ids None), so that its peers raise instead of waiting; then the check's
    own error propagates."""
    import mkernel
    from mkernel.ops import moe_dispatch_gemm as mdg

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", rank=0)
    joined = []
    monkeypatch.setattr(mdg, "rows_per_rank", lambda w, ids, e: joined.append((w, ids, e)))
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        mkernel.moe_dispatch_gemm(torch.zeros(2, 8), torch.zeros(2, 1), torch.zeros(1), world)
    assert joined == [(world, None, 0)]


def test_capture_in_a_distributed_world_is_refused_by_name(monkeypatch):
    """CUDA-graph capture of the MoE pair runs in emulated worlds; in a distributed one both ops
    refuse it before anything runs (no counts exchange, no plan built inside the capture)."""
    import mkernel

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", rank=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="moe_dispatch_gemm: CUDA-graph capture is supported in"):
        mkernel.moe_dispatch_gemm(torch.zeros(2, 8), torch.zeros(2, 1), torch.zeros(1), world)
    with pytest.raises(ValueError, match="moe_gemm_combine: CUDA-graph capture is supported in"):
        mkernel.moe_gemm_combine(None, None, None, None, world)
