"""Where a fused call's host time goes (GPU machine): the whole call, the Python path with the
launcher stubbed out, and the C++ launcher alone on a prebuilt record, against torch.matmul."""

from __future__ import annotations

import time

import torch

import mkernel
from mkernel.runtime import gpu

N = 2000


def per_call_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / N * 1e6


world = mkernel.World.emulated(1, device="cuda")
a = torch.randn(1, 128, 128, device="cuda").bfloat16()
b = torch.randn(1, 128, 128, device="cuda").bfloat16()
out = torch.empty(1, 128, 128, device="cuda").bfloat16()
for _ in range(50):
    mkernel.gemm_rs(a, b, world=world, out=out)
world.check()
plan = mkernel.Schedule().plan("gemm_rs", world, a, b)
rec = gpu._record(world, plan, {"a": a, "b": b, "out": out}, 1)
launch = gpu.extension().launch_gemm_rs
stream = gpu.stream_handle(world.device.index)
rows = {
    "matmul": per_call_us(lambda: torch.matmul(a[0], b[0])),
    "gemm_rs (whole call, out given)": per_call_us(lambda: mkernel.gemm_rs(a, b, world, out=out)),
    "C++ launcher on a prebuilt record": per_call_us(lambda: launch(rec.buffer_info()[0], stream)),
    "record only": per_call_us(lambda: gpu._record(world, plan, {"a": a, "b": b, "out": out}, 1)),
    "current stream": per_call_us(lambda: gpu.stream_handle(world.device.index)),
}
plan.extra["_launch"] = lambda r, s: 0  # the Python path with a no-op launcher
rows["gemm_rs, launcher stubbed"] = per_call_us(lambda: mkernel.gemm_rs(a, b, world, out=out))
world.check()
for k, v in rows.items():
    print(f"{k:40s} {v:8.2f} us")
