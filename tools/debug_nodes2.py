import os, sys, time, torch
os.environ["MKERNEL_GPU_NODES"] = "1"
import mkernel
from tests.helpers import randn_bf16

def trial(op, W, N, rows, n, k, overlap, sms, reps=4):
    fails = 0
    t0 = time.time()
    for rep in range(reps):
        world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=1.0)
        g = torch.Generator().manual_seed(rep)
        m = W * rows if op == "gemm_rs" else rows
        a = randn_bf16(W, m, k, device="cuda", generator=g)
        b = randn_bf16(W, k, n, device="cuda", generator=g)
        out = getattr(mkernel, op)(a, b, world=world, schedule=mkernel.Schedule(overlap=overlap, sms=sms))
        torch.cuda.synchronize()
        ok = world._status.t[0].item() == 0
        fails += not ok
        try:
            world.check()
        except Exception:
            pass
    print(f"{op} W={W} N={N} {overlap} sms={sms}: {fails}/{reps} timed out ({time.time()-t0:.1f}s)", flush=True)

for sms in (None, 31):
    trial("ag_gemm", 4, 2, 2048, 4096, 512, "intra_sm", sms, reps=2)
    trial("gemm_rs", 4, 2, 2048, 4096, 512, "intra_sm", sms, reps=2)
    trial("gemm_ar", 4, 2, 8192, 4096, 512, "intra_sm", sms, reps=2)
    trial("ag_gemm", 4, 2, 2048, 4096, 512, "inter_sm", sms, reps=2)
