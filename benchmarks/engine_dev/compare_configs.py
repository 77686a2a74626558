"""Quick A/B of engine configs (dev build) against cuBLAS on four shapes, interleaved rounds, 4
rotated input sets; prints each config's launch grid (cluster configs depend on what fits).

    python3 benchmarks/engine_dev/compare_configs.py <build_dir> [0,103,110]
"""

import sys

import torch

sys.path.insert(0, "benchmarks/engine_dev")
from bench_gemm import time_interleaved  # noqa: E402
from common import launch, load_module, tile_order  # noqa: E402

mk = load_module(sys.argv[1])
CFGS = tuple(int(c) for c in sys.argv[2].split(",")) if len(sys.argv) > 2 else (0, 103)
for M, N, K in ((8192, 8192, 8192), (8192, 8192, 3584), (8192, 1024, 8192), (2048, 8192, 8192)):
    sets = [
        (
            torch.randn(M, K, device="cuda").bfloat16(),
            torch.randn(K, N, device="cuda").bfloat16(),
            torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(4)
    ]
    fns = {}
    for cfg in CFGS:
        o = tile_order(mk, M, N, cfg, 132)
        fns[f"cfg{cfg}"] = lambda i, cfg=cfg, o=o: launch(
            mk, *sets[i], M, N, K, config=cfg, order=o
        )
        fns[f"cfg{cfg}"](0)
        torch.cuda.synchronize()
        print(f"cfg{cfg} grid={mk.gemm_last_grid()}")
    fns["cublas"] = lambda i: torch.matmul(sets[i][0], sets[i][1], out=sets[i][2])
    t = time_interleaved(fns, rounds=4, per=10)
    print(
        f"{M}x{N}x{K}: " + "  ".join(f"{k}={2 * M * N * K / v[0] / 1e9:.0f}" for k, v in t.items()),
        flush=True,
    )
    del sets
