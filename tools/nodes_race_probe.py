"""Probe for issue 33.1: emulated nodes on one GPU time out or return wrong results when the call
is issued while the stream still has work queued. Each case runs in a fresh process (the first
call of a world is the one that failed), with the proxy-side events logged with timestamps.

    python tools/nodes_race_probe.py [--repeats 3] [--timeout 2]        (GPU machine)

Prints one line per case: pass/fail, error, the rings' counters and the copy-stream moves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = [
    ("gemm_rs", 4, 2),
    ("gemm_ar", 4, 2),
    ("gemm_ar", 8, 2),
    ("gemm_rs", 8, 2),
    ("ag_gemm", 4, 2),
]
# How the inputs reach the call: the repro (CPU tensors moved with .cuda(), no sync), the
# same with a synchronize, tensors made on the GPU, and a stream kept busy by a sleep kernel.
MODES = ["cuda_copy", "cuda_copy_sync", "on_gpu", "busy_sleep", "back_to_back"]
# A user's session: the reference computed on the GPU right after the asynchronous call (its first
# cuBLAS / elementwise kernels load their modules while the fused kernel waits for the proxies), a
# large pageable copy queued just before the call, a call from a side stream with the default
# stream busy, and a first matmul issued while the call runs.
MODES += ["ref_gpu_nosync", "big_h2d", "side_stream", "matmul_during"]


def child(op: str, W: int, N: int, mode: str, timeout: float) -> dict:
    import torch

    import mkernel
    from mkernel import rdma_streams

    t0 = time.perf_counter()
    log: list[str] = []

    def note(what: str) -> None:
        log.append(f"{1e3 * (time.perf_counter() - t0):8.2f} ms {what}")

    orig_ensure = rdma_streams.CopyStream.ensure_independent
    orig_move = rdma_streams.CopyStream._move

    def ensure(self, compute):  # type: ignore[no-untyped-def]
        known = compute in self.independent_of
        note(f"ensure_independent(stream={compute:#x}) known={known}")
        orig_ensure(self, compute)
        note("ensure_independent done")

    def move(self):  # type: ignore[no-untyped-def]
        note("copy stream moved")
        orig_move(self)

    rdma_streams.CopyStream.ensure_independent = ensure
    rdma_streams.CopyStream._move = move

    world = mkernel.World.emulated(W, device="cuda", nodes=N, timeout_s=timeout)
    M, K, Nn = 96, 32, 48
    if op == "ag_gemm":
        shapes = ((W, M // W * 2, K * W), (W, K * W, Nn))
    else:
        shapes = ((W, M, K), (W, K, Nn))
    if mode in ("cuda_copy", "cuda_copy_sync", "back_to_back", "ref_gpu_nosync"):
        a = torch.randn(*shapes[0]).bfloat16().cuda()
        b = torch.randn(*shapes[1]).bfloat16().cuda()
        if mode == "cuda_copy_sync":
            torch.cuda.synchronize()
    else:
        a = torch.randn(*shapes[0], device="cuda").bfloat16()
        b = torch.randn(*shapes[1], device="cuda").bfloat16()
        torch.cuda.synchronize()
        if mode in ("busy_sleep", "side_stream"):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of cycles queued before the call
        if mode == "big_h2d":
            big = torch.empty(2**28, dtype=torch.uint8).cuda()  # 256 MB pageable copy queued
            del big
    note("inputs ready")
    fn = getattr(mkernel, op)
    errors: list[str] = []
    outs = []
    calls = 4 if mode == "back_to_back" else 1
    side = torch.cuda.Stream() if mode == "side_stream" else torch.cuda.current_stream()
    for _ in range(calls):
        try:
            with torch.cuda.stream(side):
                outs.append(fn(a, b, world=world))
        except Exception as e:  # noqa: BLE001 (the probe reports any failure)
            errors.append(f"call: {type(e).__name__}: {e}")
    note("calls returned")
    early_ref = None
    if mode == "ref_gpu_nosync":
        early_ref = getattr(mkernel.reference, op)(a, b, world=world).float()
        note("reference on the GPU issued during the call")
    if mode == "matmul_during":
        x = torch.randn(333, 777, device="cuda", dtype=torch.float16)
        (x @ x.T).sum()
        note("first fp16 matmul issued during the call")
    torch.cuda.current_stream().wait_stream(side)
    try:
        world.check()
    except Exception as e:  # noqa: BLE001
        errors.append(f"check: {type(e).__name__}: {e}")
    note("checked")
    ref = early_ref if early_ref is not None else getattr(mkernel.reference, op)(a, b, world=world)
    ref = ref.float()
    rel = [float((o.float() - ref).norm() / ref.norm()) for o in outs]
    rings = getattr(world, "_rdma", None)
    counters = [rings.counters(r) for r in range(W)] if rings is not None else []
    return {"rel": rel, "errors": errors, "counters": counters, "log": log}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", nargs=4)
    p.add_argument("--out", default=None)
    p.add_argument("--sequence", action="store_true", help="every case in this one process")
    args = p.parse_args()
    if args.sequence:  # as a user tries the cases one after another in one session
        for op, W, N in CASES:
            for mode in args.modes.split(","):
                res = child(op, W, N, mode, args.timeout)
                ok = not res["errors"] and res["rel"] and max(res["rel"]) < 2**-7
                print(f"seq {mode:15s} {op} W={W} N={N}: {'PASS' if ok else 'FAIL'} {res}")
        return
    if args.child:
        op, W, N, mode = args.child
        print("RESULT " + json.dumps(child(op, int(W), int(N), mode, args.timeout)))
        return
    rows = []
    for mode in args.modes.split(","):
        for op, W, N in CASES:
            for rep in range(args.repeats):
                cmd = [sys.executable, __file__, "--timeout", str(args.timeout)]
                cmd += ["--child", op, str(W), str(N), mode]
                r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    res = {"rel": [], "errors": [f"rc {r.returncode}: {r.stderr[-800:]}"]}
                else:
                    res = json.loads(line[7:])
                ok = not res["errors"] and res["rel"] and max(res["rel"]) < 2**-7
                rows.append({"op": op, "W": W, "N": N, "mode": mode, "rep": rep, "ok": ok, **res})
                print(
                    f"{mode:15s} {op} W={W} N={N} rep {rep}: {'PASS' if ok else 'FAIL'} "
                    f"rel={[round(x, 4) for x in res['rel']]} {res['errors'][:2]}",
                    flush=True,
                )
                if not ok:
                    for x in res.get("log", []):
                        print("    " + x)
                    print("    counters", res.get("counters"))
                    if r.stderr:
                        print("    stderr: " + r.stderr[-600:].replace("\n", "\n    "))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("=== summary (fails / runs)")
    for mode in args.modes.split(","):
        sel = [x for x in rows if x["mode"] == mode]
        print(f"{mode:15s} {sum(not x['ok'] for x in sel)} / {len(sel)}")


if __name__ == "__main__":
    main()
