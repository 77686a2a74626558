"""Probe of the fused GEMM ops over virtual nodes on one GPU (docs/rdma.md "On the GPU"): per op,
``--calls`` calls in one emulated world of W = 4 ranks on 2 nodes at a shape where every CTA
waits for puts, each synchronized and checked for a timeout; prints how many completed and the
milliseconds of each. ``MKERNEL_PROXY_COPY_SMS`` sets the SMs the kernel leaves free for the
proxy's copies (default mkernel.schedule.PROXY_COPY_SMS).

    MKERNEL_PROXY_COPY_SMS=4 python3 tools/nodes_probe.py --calls 25
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import mkernel
from tests.helpers import randn_bf16

SHAPES = {"gemm_rs": 2048, "gemm_ar": 8192, "ag_gemm": 2048}  # rows of a per rank; N 4096, K 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--overlap", default="intra_sm")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    free = os.environ.get("MKERNEL_PROXY_COPY_SMS", "default")
    W, N = 4, 2
    for op, rows in SHAPES.items():
        world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=args.timeout)
        m = W * rows if op == "gemm_rs" else rows
        a = randn_bf16(W, m, 512, device="cuda")
        b = randn_bf16(W, 512, 4096, device="cuda")
        sched = mkernel.Schedule(overlap=args.overlap)
        ok, ms = 0, []
        for _ in range(args.calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            getattr(mkernel, op)(a, b, world=world, schedule=sched)
            torch.cuda.synchronize()
            ms.append(round((time.perf_counter() - t0) * 1e3))
            try:
                world.check()
                ok += 1
            except mkernel.CommTimeout:
                pass
        print(
            f"free SMs {free} {op} {args.overlap}: {ok}/{args.calls} completed, ms {ms}", flush=True
        )


if __name__ == "__main__":
    main()
