"""Probe (issue 10): what the GEMM engine's epilogue costs when its tiles leave for the peer GPU.

Run on two GPUs: ``torchrun --nproc_per_node=2 benchmarks/rs_epilogue_probe.py``. Both ranks run the
same plain engine GEMM (kernels/gemm.cu, the gemm_rs shape of one rank at M tokens: a [M, 14336] @
b [14336, 8192]) at the same time, with its tiles going to: a local bf16 C (the bare engine), a
local fp32 C by red.add (kind 1) and by TMA bulk reduce (kind 3), the PEER's fp32 C by red.add
and bulk reduce (today's gemm_rs epilogue), and the PEER's bf16 C (the bf16-partials design).
Times are interleaved in rounds (every version once per round, both ranks together); prints ms
and ms over the local bf16 engine, and writes benchmarks/results/rs_epilogue_probe_<date>.json.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from mkernel import schedule
from mkernel.bench.gemm import engine_gemm
from mkernel.bench.timing import save, table
from mkernel.ops.common import extension

K, N = 14336, 8192


def _measure(ext, m: int, peer: int) -> dict:
    """One M: every destination's median ms (the slower rank's), interleaved in rounds."""
    a = torch.randn(m, K, device="cuda").bfloat16()
    b = torch.randn(K, N, device="cuda").bfloat16()
    sym32 = symm_mem.empty((m, N), dtype=torch.float32, device="cuda")
    peer32 = symm_mem.rendezvous(sym32, dist.group.WORLD).get_buffer(peer, (m, N), torch.float32)
    sym16 = symm_mem.empty((m, N), dtype=torch.bfloat16, device="cuda")
    peer16 = symm_mem.rendezvous(sym16, dist.group.WORLD).get_buffer(peer, (m, N), torch.bfloat16)
    local16 = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
    local32 = torch.zeros(m, N, device="cuda")
    tile = schedule.pick_tile(m, N, K, 132)
    cfg = schedule.TILE_CONFIG_IDS[tile.name]
    order = schedule.grouped_order(-(-m // tile.bm), -(-N // tile.bn), tile, 132)
    order = torch.tensor(order, dtype=torch.int32, device="cuda")

    def run(c: torch.Tensor, kind: int) -> None:
        engine_gemm(ext, a, b, c, order, cfg, kind)

    versions = {
        "local_bf16": (local16, 0),
        "local_f32_red": (local32, 1),
        "local_f32_bulk_red": (local32, 3),
        "peer_f32_red": (peer32, 1),
        "peer_f32_bulk_red": (peer32, 3),
        "peer_bf16": (peer16, 0),
    }
    times: dict[str, list[float]] = {k: [] for k in versions}
    for c, kind in versions.values():
        run(c, kind)
    torch.cuda.synchronize()
    names = list(versions)
    for r in range(6):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                run(*versions[k])
            e1.record()
            torch.cuda.synchronize()
            times[k].append(e0.elapsed_time(e1) / 10)
    med = {k: statistics.median(v) for k, v in times.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, med)
    med = {k: max(w[k] for w in every) for k in med}
    row = {"m": m, **{k: round(v, 4) for k, v in med.items()}}
    return row | {f"{k}/bare": round(v / med["local_bf16"], 3) for k, v in med.items()}


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    ext = extension()
    rows = [_measure(ext, m, 1 - rank) for m in (2048, 8192)]
    if rank == 0:
        print(table(rows, list(rows[0])))
        print("saved", save("rs_epilogue_probe", rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
