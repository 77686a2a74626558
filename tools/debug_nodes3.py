import os, sys, time, torch
os.environ["MKERNEL_GPU_NODES"] = "1"
import mkernel
from mkernel.rdma import fused_rings
from tests.helpers import randn_bf16

free = os.environ.get("MKERNEL_PROXY_COPY_SMS")
for op, rows in (("gemm_rs", 2048), ("ag_gemm", 2048), ("gemm_ar", 8192)):
    for overlap in ("intra_sm", "inter_sm"):
        W, N = 4, 2
        world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=5.0)
        m = W * rows if op == "gemm_rs" else rows
        k = 512
        a = randn_bf16(W, m, k, device="cuda"); b = randn_bf16(W, k, 4096, device="cuda")
        sched = mkernel.Schedule(overlap=overlap)
        plan = sched.plan(op, world, a, b)
        ts = []
        ok = 0
        for rep in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            getattr(mkernel, op)(a, b, world=world, schedule=sched)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
            err = world._status.t[0].item()
            try:
                world.check(); ok += 1
            except Exception as e:
                print("   ", str(e)[:150])
        print(f"free={free} {op} {overlap} ctas/rank={plan.ctas_per_rank}: ok {ok}/3, ms {[round(t*1e3,1) for t in ts]}, puts/ring {fused_rings(world).posted // 3}", flush=True)
