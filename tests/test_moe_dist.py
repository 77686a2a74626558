"""moe_dist (the distributed, not yet fused MoE pair) on the CPU: W processes joined by
torch.distributed (gloo), the grouped GEMM as mkernel.grouped_gemm runs it on the CPU (its fp32
reference), so what is tested is the exchange: each token sent once per destination rank and
expanded there, the row order (local expert, source, token, slot), src and expert_offsets, the
products sent back and summed in slot order. Every rank's results are checked with
tests/test_moe.py's formulas (W 2 and 3; uniform routing with unused slots, all tokens to one
expert, all to rank 0, none routed; T = 0; k 1, 2, 8), and the public API's dispatch to this path
on a distributed GPU world."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mkernel.ops import moe_dist
from mkernel.world import World
from tests.helpers import assert_close_exact
from tests.test_moe import INTER, check_dispatch, expected_out, operands, routing
from tests.test_ring_attention_dist import _free_port

# (T, E, k, mode): the cases every process runs, in order
CASES = [(5, 2, 2, "uniform"), (4, 3, 8, "uniform"), (3, 2, 1, "one_expert"), (4, 2, 2, "rank0"),
         (3, 1, 1, "none"), (0, 2, 2, "uniform")]  # fmt: skip


def _inputs(W: int, T: int, E: int, k: int, mode: str, seed: int):
    x, w1, w2, weights = operands(W, T, E, seed)
    return x, routing(W, T, E, k, mode, seed), w1, w2, weights[..., :k].contiguous()


def _worker(rank: int, W: int, port: int, folder: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    try:
        world = World(size=W, device=torch.device("cpu"), kind="distributed", rank=rank,
                      group=dist.group.WORLD)  # fmt: skip
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
    finally:
        dist.destroy_process_group()


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


def test_the_api_takes_this_path_on_a_distributed_gpu_world(monkeypatch):
    import mkernel
    from mkernel.ops import moe_dispatch_gemm as mdg

    world = World(size=2, device=torch.device("cuda", 0), kind="distributed", rank=0)
    calls = []
    monkeypatch.setattr(mdg, "shapes", lambda *a: {})
    monkeypatch.setattr(moe_dist, "dispatch", lambda *a: calls.append(a[3:]) or "d")
    monkeypatch.setattr(moe_dist, "check_combine", lambda h, *a: h)
    monkeypatch.setattr(moe_dist, "combine", lambda *a: calls.append(a[4:]) or "c")
    ids = torch.zeros(1, 1, dtype=torch.int32)
    assert mkernel.moe_dispatch_gemm(torch.zeros(1), ids, torch.zeros(1), world) == "d"
    assert mkernel.moe_gemm_combine("h", "w2", "disp", "wt", world) == "c"
    assert calls == [(world, moe_dist.engine_gemm), (world, moe_dist.engine_gemm)]
