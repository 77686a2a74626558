import os, time, torch
os.environ["MKERNEL_GPU_NODES"] = "1"
import mkernel
from tests.helpers import randn_bf16

free = os.environ.get("MKERNEL_PROXY_COPY_SMS")
for op, W, N, rows, n, k in (("gemm_rs", 8, 2, 232, 368, 240), ("ag_gemm", 8, 4, 146, 40, 504)):
    ok, ts = 0, []
    for rep in range(8):
        world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=2.0)
        m = W * rows if op == "gemm_rs" else rows
        a = randn_bf16(W, m, k, device="cuda"); b = randn_bf16(W, k, n, device="cuda")
        torch.cuda.synchronize(); t0 = time.perf_counter()
        getattr(mkernel, op)(a, b, world=world)
        torch.cuda.synchronize(); ts.append(round((time.perf_counter() - t0) * 1e3))
        try:
            world.check(); ok += 1
        except Exception as e:
            last = str(e)[:120]
    print(f"free={free} {op} W={W} N={N}: ok {ok}/8 ms {ts}", flush=True)
