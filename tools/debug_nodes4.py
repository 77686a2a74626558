import os, sys, time, torch
os.environ["MKERNEL_GPU_NODES"] = "1"
import mkernel
from tests.helpers import randn_bf16

conn = os.environ.get("MKERNEL_PROXY_COPY_SMS")
for op, rows, reps in (("gemm_ar", 8192, 25), ("gemm_rs", 2048, 15)):
    W, N = 4, 2
    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=2.0)
    m = W * rows if op == "gemm_rs" else rows
    a = randn_bf16(W, m, 512, device="cuda"); b = randn_bf16(W, 512, 4096, device="cuda")
    sched = mkernel.Schedule(overlap="intra_sm")
    ok, ts = 0, []
    for rep in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        getattr(mkernel, op)(a, b, world=world, schedule=sched)
        torch.cuda.synchronize(); ts.append(round((time.perf_counter() - t0) * 1e3))
        try:
            world.check(); ok += 1
        except Exception as e:
            pass
    print(f"free={conn} {op}: ok {ok}/{reps} ms {ts}", flush=True)
