"""Host time per call: the fused ops' Python checks + cached plan + launch, against one
``torch.matmul`` in the same run (``python -m mkernel bench host``).

Small shapes, so that the GPU finishes each kernel faster than the host enqueues the next and the
wall time per call is the host's cost. Calls are asynchronous (no synchronize per call); every
version takes turns in rounds (timing.interleaved-style), and the median round is reported."""

from __future__ import annotations

import statistics
import time

import torch

import mkernel

from .timing import save, table

SHAPES = [(128, 128, 128), (256, 512, 256)]  # M x N x K (per rank)
CALLS, ROUNDS = 200, 7


def _per_call_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / CALLS * 1e6


def _versions(world: mkernel.World, m: int, n: int, k: int) -> dict:
    a = torch.randn(1, m, k, device="cuda").bfloat16()
    b = torch.randn(1, k, n, device="cuda").bfloat16()
    x = torch.randn(1, m, k, device="cuda").bfloat16()
    return {
        "matmul": lambda: torch.matmul(a[0], b[0]),
        "gemm_rs": lambda: mkernel.gemm_rs(a, b, world=world),
        "ag_gemm": lambda: mkernel.ag_gemm(a, b, world=world),
        "gemm_ar": lambda: mkernel.gemm_ar(a, b, world=world),
        "all_gather": lambda: mkernel.all_gather(x, world=world),
    }


def run(save_json: bool = True) -> list[dict]:
    world = mkernel.World.emulated(1, device="cuda")
    world.sync_checks = False  # the default: calls enqueue and return
    rows = []
    for m, n, k in SHAPES:
        fns = _versions(world, m, n, k)
        for f in fns.values():  # build, plan, workspace, warm
            for _ in range(20):
                f()
        world.check()
        times = {name: [] for name in fns}
        for r in range(ROUNDS):
            names = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for name in names:
                times[name].append(_per_call_us(fns[name]))
        world.check()
        row = {"m": m, "n": n, "k": k}
        for name, ts in times.items():
            row[f"{name}_us"] = statistics.median(ts)
        for name in fns:
            if name != "matmul":
                row[f"{name}/matmul"] = row[f"{name}_us"] / row["matmul_us"]
        rows.append(row)
    ratios = [f"{n}/matmul" for n in fns if n != "matmul"]
    cols = ["m", "n", "k", *(f"{n}_us" for n in fns), *ratios]
    print(table(rows, cols))
    if save_json:
        print("saved", save("host", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    cli(__spec__.name, __doc__)
    run()
