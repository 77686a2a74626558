"""Probe: does the first launch of a kernel (CUDA lazy loading) while a fused kernel over nodes
waits for its puts stall it? (docs/rdma.md "On the GPU"). Loading a kernel may synchronize the
context; the rdma proxies' copies, issued by host threads through the same driver, then wait for
the fused kernel that waits for them.

Per CUDA_MODULE_LOADING (LAZY, CUDA's default, and EAGER) and kind of new op (none; a torch op
compiled at run time, whose module loads at its first call; a precompiled torch op not launched
before), in its own process: an emulated world of W = 8 on 2 nodes, asynchronous gemm_rs calls,
and after the fifth the new op; prints whether the calls completed or timed out.

    python3 tools/lazy_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch  # (importing starts no CUDA: each child process starts its own)

import mkernel
from tests.helpers import randn_bf16

NEW_OPS = {
    "none": None,
    # runtime-compiled by torch (jiterator, NVRTC): its module is loaded at the first call
    "jiterator": torch.special.bessel_j0,
    # a precompiled kernel of torch's library not launched before in the process
    "aten": lambda x: torch.cumprod(x, 0),
}


def child(new_op: str) -> None:
    W = 8
    world = mkernel.World.emulated(W, device="cuda", nodes=2, timeout_s=2.0)
    a = randn_bf16(W, W * 64, 64, device="cuda")
    b = randn_bf16(W, 64, 256, device="cuda")
    want = mkernel.reference.gemm_rs(a, b, world=world)
    x = torch.rand(4096, device="cuda")
    mkernel.gemm_rs(a, b, world=world)
    torch.cuda.synchronize()
    out = None
    for i in range(20):
        out = mkernel.gemm_rs(a, b, world=world)
        if i == 5 and NEW_OPS[new_op] is not None:
            x = NEW_OPS[new_op](x)  # first launch of these kernels in the process
    try:
        world.check()
        ok = bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-1))
        print("RESULT completed", "right" if ok else "WRONG")
    except mkernel.CommTimeout as e:
        print("RESULT timed out:", str(e)[:120])


def main() -> None:
    if "--child" in sys.argv:
        try:
            child(sys.argv[-1])
        except mkernel.CommTimeout as e:  # raised by a call after the one that timed out
            print("RESULT timed out (raised by a later call):", str(e)[:120])
        return
    for loading in ("LAZY", "EAGER"):
        for new_op in NEW_OPS:
            env = dict(os.environ, CUDA_MODULE_LOADING=loading)
            p = subprocess.run(
                [sys.executable, __file__, "--child", new_op],
                env=env,
                capture_output=True,
                text=True,
                timeout=280,
            )
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
            print(f"{loading} {new_op}: {lines[-1] if lines else p.stderr[-600:]}", flush=True)


if __name__ == "__main__":
    main()
