"""The GEMM engine against cuBLAS, and gemm_rs at W=1 against the bare engine.

``python -m mkernel bench gemm``: for each shape, our engine's TFLOP/s (the plain GEMM op of
kernels/gemm.cu), cuBLAS's (torch.matmul) and the three fused GEMM ops at W=1 (the engine as the
compute role of the persistent template), measured in the same run, interleaved (see
timing.interleaved_ms), inputs rotated over sets larger than the L2. Writes
benchmarks/results/gemm_<date>.json.
"""

from __future__ import annotations

import torch

import mkernel

from .. import schedule
from ..ops.common import extension
from .plot import draw_run
from .timing import interleaved_ms, rotation, save, table

FUSED = ("gemm_rs", "ag_gemm", "gemm_ar")  # at W=1: the engine as the template's compute role
SHAPES = [  # M x N x K
    (8192, 8192, 8192),
    (8192, 3584, 8192),
    (8192, 8192, 3584),
    (4096, 28672, 8192),
    (2048, 8192, 8192),
    (8192, 1024, 8192),
]


def engine_gemm(
    ext,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    order: torch.Tensor,
    cfg: int,
    out_kind: int = 0,
):
    """C = A @ B through the plain GEMM op (kernels/gemm_args.h; ``out_kind`` its store kind)."""
    m, k = a.shape
    n = b.shape[1]
    args = ext.GemmArgs()
    args.a, args.b, args.c = a.data_ptr(), b.data_ptr(), c.data_ptr()
    args.M, args.N, args.K, args.config = m, n, k, cfg
    args.tile_order, args.out_kind = order.data_ptr(), out_kind
    st = ext.launch_gemm(args, torch.cuda.current_stream().cuda_stream)
    if st:
        raise RuntimeError(f"launch_gemm: {ext.gemm_status_string(st)}")


def _measure(ext, world, sms: int, m: int, n: int, k: int) -> dict:
    """One shape: checks every version against cuBLAS on set 0, then times them interleaved. The
    input sets are locals, freed when this returns."""
    sets = rotation((m * k + k * n + m * n) * 2)
    a = [torch.randn(1, m, k, device="cuda").bfloat16() for _ in range(sets)]
    b = [torch.randn(1, k, n, device="cuda").bfloat16() for _ in range(sets)]
    c = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    tile = schedule.pick_tile(m, n, k, sms)  # the fused ops' heuristic and order, the same code
    cfg = schedule.TILE_CONFIG_IDS[tile.name]
    order = schedule.grouped_order(-(-m // tile.bm), -(-n // tile.bn), tile, sms)
    order = torch.tensor(order, dtype=torch.int32, device="cuda")
    # Correctness of both ours against cuBLAS on set 0 before timing.
    ref = torch.matmul(a[0][0].float(), b[0][0].float())
    engine_gemm(ext, a[0][0], b[0][0], c[0], order, cfg)
    fused_ops = {op: getattr(mkernel, op) for op in FUSED}
    fused = {op: f(a[0], b[0], world=world)[0] for op, f in fused_ops.items()}
    world.check()
    for name, got in (("engine", c[0]), *fused.items()):
        err = ((got.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise AssertionError(f"{name} {m}x{n}x{k}: relative error {err}")
    ms = interleaved_ms(
        {
            "engine": lambda i: engine_gemm(ext, a[i][0], b[i][0], c[i], order, cfg),
            "cublas": lambda i: torch.matmul(a[i][0], b[i][0], out=c[i]),
            **{op: (lambda i, f=f: f(a[i], b[i], world=world)) for op, f in fused_ops.items()},
        },
        sets,
    )
    world.check()
    flop = 2 * m * n * k
    return {
        "m": m,
        "n": n,
        "k": k,
        "config": cfg,
        "tflops": flop / ms["engine"] / 1e9,
        "cublas_tflops": flop / ms["cublas"] / 1e9,
        "ratio": ms["cublas"] / ms["engine"],
        **{f"{op}_w1_tflops": flop / ms[op] / 1e9 for op in FUSED},
        **{f"{op}_vs_engine": ms["engine"] / ms[op] for op in FUSED},
    }


def run(shapes=SHAPES, save_json: bool = True) -> list[dict]:
    ext = extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    world = mkernel.World.emulated(1, device="cuda")
    world.sync_checks = False
    rows = []
    for m, n, k in shapes:
        rows.append(_measure(ext, world, sms, m, n, k))
        print(rows[-1], flush=True)
    cols = ["m", "n", "k", "tflops", "cublas_tflops", "ratio", *(f"{op}_vs_engine" for op in FUSED)]
    print(table(rows, cols))
    if save_json:
        print("saved", save("gemm", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, plot=True)
    draw_run("gemm", run(), args.plot)
