"""Which kernels cuBLAS (torch.matmul) runs on the target shapes: names from torch.profiler (tile
shape, stages and cluster shape are in the names).

    python3 benchmarks/engine_dev/cublas_kernels.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

from bench_gemm import SHAPES  # run from benchmarks/engine_dev or with it on sys.path

for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
        torch.matmul(a, b)
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            print(f"{m}x{n}x{k}: {e.name[:220]}", flush=True)
