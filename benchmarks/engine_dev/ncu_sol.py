"""One launch of ours and one of cuBLAS per target shape, for a profiler to compare (e.g. under
`ncu --section SpeedOfLight --clock-control base`, which fixes the clock so that durations compare
cycles, not the power state).

    ncu --section SpeedOfLight python3 benchmarks/engine_dev/ncu_sol.py <build_dir>
"""

import sys

import torch

from bench_gemm import SHAPES
from common import launch, load_module, pick_config, tile_order

mk = load_module(sys.argv[1])
for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cfg = pick_config(m, n, k, 132)
    launch(mk, a, b, c, m, n, k, config=cfg, order=tile_order(mk, m, n, cfg, 132))
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    print(f"shape {m}x{n}x{k} done", flush=True)
