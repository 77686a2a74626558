"""The fused GEMM ops over several nodes on one GPU (issue 14), next to the same ops in a world of
one node and to the unfused computation, interleaved in one run.

``python3 -m mkernel.bench.nodes [--save]``: an emulated world of W = 4 ranks on one GPU, split
into N = 2 virtual nodes (cross-node steps: rdma puts through each rank's ring and host proxy
thread, docs/rdma.md "On the GPU") or left as one node (every step over the emulated NVLink
path); the unfused row is the per-rank GEMMs as one batched matmul plus the collective's data
movement as torch ops on the same GPU. Each version is checked against the reference first.

The proxy copies within one GPU here, so this measures what the hierarchical protocol costs
over the one-node one on the same device (the ring, the proxy thread's copies and
synchronizes, the node sums' extra pass), not a network. ``--save`` writes
nodes_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mkernel

from . import require_gpu
from .timing import interleaved_ms, save, table

W, NODES = 4, 2
SHAPES = [(2048, 4096, 2048), (8192, 4096, 2048)]  # global M x N x K
# NOTE: few calls: a put through the host proxy costs ~0.1-0.4 ms (nodes_probe_2026-12-01.json),
# so a call over nodes at these shapes takes tens of ms
ROUNDS, PER_ROUND = 3, 4
OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


def operands(op: str, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank operands of ``op`` for the global GEMM m x n x k, stacked on the rank dim."""
    if op == "ag_gemm":  # a: [M/W, K] shards, b: [K, N]
        shape_a, shape_b = (W, m // W, k), (W, k, n)
    else:  # a: [M, K/W], b: [K/W, N]
        shape_a, shape_b = (W, m, k // W), (W, k // W, n)
    a = torch.randn(shape_a, device="cuda").bfloat16()
    return a, torch.randn(shape_b, device="cuda").bfloat16()


def unfused(op: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[int], object]:
    """The per-rank GEMMs as one batched matmul and the collective as torch ops (one GPU)."""
    if op == "ag_gemm":
        return lambda _: torch.matmul(a.reshape(1, -1, a.shape[-1]), b)  # all_gather, then GEMMs
    if op == "gemm_rs":
        rows = a.shape[1] // W
        return lambda _: torch.matmul(a, b).sum(0).view(W, rows, -1)  # GEMMs, reduce, scatter
    return lambda _: torch.matmul(a, b).sum(0).expand(W, -1, -1).contiguous()  # + broadcast


def measure(op: str, m: int, n: int, k: int) -> dict:
    a, b = operands(op, m, n, k)
    worlds = {
        "nodes": mkernel.World.emulated(W, device="cuda", nodes=NODES),
        "one_node": mkernel.World.emulated(W, device="cuda"),
    }
    call = getattr(mkernel, op)
    ref = getattr(mkernel.reference, op)(a, b, world=worlds["one_node"]).float()
    fns: dict[str, Callable[[int], object]] = {}
    for name, world in worlds.items():
        world.sync_checks = False
        got = call(a, b, world=world).float()
        err = ((got - ref).norm() / ref.norm()).item()
        if not err < 2**-7:
            raise AssertionError(f"{op} {name} {m}x{n}x{k}: relative error {err:.3g}")
        fns[name] = lambda _, world=world: call(a, b, world=world)
    fns["unfused"] = unfused(op, a, b)
    ms = interleaved_ms(fns, sets=1, rounds=ROUNDS, per=PER_ROUND, warmup=1)
    for world in worlds.values():
        world.check()
    rec = {"op": op, "m": m, "n": n, "k": k, "W": W, "nodes": NODES}
    rec.update({f"{name}_ms": round(v, 4) for name, v in ms.items()})
    rec["nodes_over_one_node"] = round(ms["nodes"] / ms["one_node"], 3)
    rec["nodes_over_unfused"] = round(ms["nodes"] / ms["unfused"], 3)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m mkernel.bench.nodes", description=__doc__)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    require_gpu(__spec__.name)
    rows = [measure(op, *shape) for op in OPS for shape in SHAPES]
    cols = ["op", "m", "n", "k", "nodes_ms", "one_node_ms", "unfused_ms", "nodes_over_one_node"]
    print(table(rows, cols))
    if args.save:
        print("saved", save("nodes", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
