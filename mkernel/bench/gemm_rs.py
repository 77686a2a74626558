"""gemm_rs at W=1 against cuBLAS (torch.matmul) on the engine issue's shapes.

At W=1 gemm_rs is a plain GEMM through the persistent template (its epilogue stores bf16 straight
to the output), so the ratio measures the compute role and the template's overhead.
"""

from __future__ import annotations

import torch

import mkernel

from .timing import median_ms, rotation, save, table

SHAPES = [  # M x N x K
    (8192, 8192, 8192),
    (8192, 8192, 3584),
    (8192, 3584, 8192),
    (4096, 28672, 8192),
    (2048, 8192, 8192),
    (8192, 1024, 8192),
]


def run(shapes=SHAPES, iters: int = 20, overlap: str = "intra_sm", save_json: bool = True):
    world = mkernel.World.emulated(1, device="cuda")
    world.sync_checks = False
    rows = []
    for m, n, k in shapes:
        sets = rotation((m * k + k * n + m * n) * 2)
        a = [torch.randn(1, m, k, device="cuda").bfloat16() for _ in range(sets)]
        b = [torch.randn(1, k, n, device="cuda").bfloat16() for _ in range(sets)]
        sched = mkernel.Schedule(overlap=overlap)
        ours = median_ms(
            lambda i: mkernel.gemm_rs(a[i], b[i], world=world, schedule=sched), sets, iters
        )
        world.check()
        cublas = median_ms(lambda i: torch.matmul(a[i][0], b[i][0]), sets, iters)
        flop = 2 * m * n * k
        rows.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "overlap": overlap,
                "ms": ours,
                "cublas_ms": cublas,
                "tflops": flop / ours / 1e9,
                "cublas_tflops": flop / cublas / 1e9,
                "ratio": cublas / ours,
            }
        )
        del a, b
    print(table(rows, ["m", "n", "k", "tflops", "cublas_tflops", "ratio"]))
    if save_json:
        print("saved", save("gemm_rs_w1", rows))
    return rows
