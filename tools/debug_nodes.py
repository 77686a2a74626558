import os, sys, torch
os.environ["MKERNEL_GPU_NODES"] = "1"
import mkernel
from mkernel.rdma import fused_rings
from tests.helpers import randn_bf16

def run(op, W, N, rows, n, k, overlap, tile=None):
    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=1.0)
    g = torch.Generator().manual_seed(0)
    if op == "ag_gemm":
        a = randn_bf16(W, rows, k, device="cuda", generator=g)
    elif op == "gemm_rs":
        a = randn_bf16(W, W * rows, k, device="cuda", generator=g)
    else:
        a = randn_bf16(W, rows, k, device="cuda", generator=g)
    b = randn_bf16(W, k, n, device="cuda", generator=g)
    sched = mkernel.Schedule(overlap=overlap, tile=tile)
    out = getattr(mkernel, op)(a, b, world=world, schedule=sched)
    torch.cuda.synchronize()
    ref = getattr(mkernel.reference, op)(a, b, world=world).float()
    err = (out.float() - ref).abs()
    bad = err > ref.abs() * 2**-7 + ref.abs().max() * 2**-12
    rings = fused_rings(world)
    print(f"== {op} W={W} N={N} rows={rows} n={n} k={k} {overlap} tile={tile}: bad {int(bad.sum())} of {bad.numel()}")
    print("  counters", [rings.counters(r) for r in range(W)], "errors", rings.errors())
    st = world._status.t.tolist()
    print("  status", st)
    if bad.any():
        plan = next(iter(world._plans.values()))
        for t in plan.tiles[:64]:
            for r in range(W):
                if op == "gemm_ar" or op == "ag_gemm":
                    blk = bad[r, t.m0:t.m0+t.rows, t.n0:t.n0+t.cols]
                else:
                    ms = plan.sizes["rows_per_rank"]
                    if t.tag != r: continue
                    blk = bad[r, t.m0 - r*ms: t.m0 - r*ms + t.rows, t.n0:t.n0+t.cols]
                if blk.any(): print(f"  tile {t.index} tag {t.tag} rank {r}: bad {int(blk.sum())}/{blk.numel()}")
        for key, pad in world.signal_pads().items():
            if pad.abs().sum():
                print("  pad", key, pad.nonzero().tolist()[:20])
    try:
        world.check()
    except Exception as e:
        print("  check:", e)

CASES = [
    ("gemm_rs", 8, 4, 146, 40, 504, "intra_sm"),
    ("gemm_rs", 8, 2, 75, 504, 304, "intra_sm"),
    ("gemm_rs", 4, 2, 146, 40, 504, "intra_sm"),
    ("gemm_rs", 8, 4, 128, 128, 64, "inter_sm", "128x128x64"),
    ("ag_gemm", 8, 4, 146, 40, 504, "intra_sm"),
    ("ag_gemm", 4, 2, 146, 40, 504, "intra_sm"),
    ("gemm_ar", 2, 2, 72, 256, 32, "intra_sm"),
    ("gemm_ar", 2, 2, 128, 128, 64, "inter_sm", "128x128x64"),
    ("gemm_ar", 4, 2, 128, 128, 64, "inter_sm", "128x128x64"),
]
for args in CASES:
    try:
        run(*args)
    except Exception as e:
        print("  raised", type(e).__name__, e)
