"""Which kernels cuBLAS (torch.matmul) runs on the target shapes: names from torch.profiler, with the
grid each got (the tile shape, cluster and split / stream-K choices are in the names)."""

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = [
    (8192, 8192, 8192),
    (8192, 3584, 8192),
    (8192, 8192, 3584),
    (4096, 28672, 8192),
    (2048, 8192, 8192),
    (8192, 1024, 8192),
]
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
