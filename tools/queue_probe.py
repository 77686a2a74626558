"""Probe: do the rdma proxies' copies wait behind work queued after a fused kernel over nodes?
(docs/rdma.md "On the GPU"). CUDA feeds streams to the GPU through a few hardware queues
(CUDA_DEVICE_MAX_CONNECTIONS, default 8); a command that must wait (the next launch, an event
record, a copy of the result, all behind the fused kernel in its stream) holds up every later
command of its queue, whatever their stream. A proxy stream sharing that queue cannot run the copy
the kernel waits for: a deadlock until the deadline.

Each number of connections runs in its own process, because CUDA reads it when it starts. Per
connections and mode it prints how many calls completed and how many timed out (or "refused":
the RuntimeError of ProxyRing.ensure_independent, when no proxy stream can leave the launching
stream's queue). Measured on the H200 (benchmarks/results/queue_probe_2026-12-01.json):
before ensure_independent, 1 connection stalled every asynchronous mode, 8 stalled w8, 32 none
(priority of the proxy streams changed nothing); with one stream per proxy, each checked against
the launching stream, w8 still stalled at 8 connections and w16 at 16, not at 16 and 32
respectively: two proxy streams in one queue stall too. Hence one copy stream per GPU.

    sync    calls with world.sync_checks (the host waits after each)
    queued  each call followed at once by a matmul on the same stream, then a synchronize
    async   200 calls without waiting (world.sync_checks = False), then world.check()
    w8      as async, W = 8 ranks on 2 nodes (8 proxy streams)
    w8s     as w8, launched from a stream of torch's pool instead of the legacy default stream
    w16     as async, W = 16
    reprobe8  W = 8, synchronized calls, each followed by a probe of the proxies' copy stream
            against the legacy default stream: "shared" counts the probes that found it there

    python3 tools/queue_probe.py            # all configurations
    python3 tools/queue_probe.py --child    # one, from the environment
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import torch  # (importing starts no CUDA: each child process starts its own)

import mkernel
from tests.helpers import randn_bf16

CONNECTIONS = ["", "16", "32"]  # "" = CUDA's default (8); 1 is refused (ensure_independent)


def _world(W: int) -> tuple[mkernel.World, torch.Tensor, torch.Tensor]:
    """W ranks on 2 nodes, deadline 1 s, and gemm_rs operands at a small shape."""
    world = mkernel.World.emulated(W, device="cuda", nodes=2, timeout_s=1.0)
    return world, randn_bf16(W, W * 256, 128, device="cuda"), randn_bf16(W, 128, 512, device="cuda")


def _reprobe(W: int, calls: int) -> dict:
    """Calls one by one (synchronized), and after each the probe of the proxies' copy stream
    against the legacy default stream again: counts the probes that find it in that queue (a
    queue binding that changes after ensure_independent settled it)."""
    world, a, b = _world(W)
    world.sync_checks = True
    shared = 0
    for _ in range(calls):
        mkernel.gemm_rs(a, b, world=world)
        rings = world._rdma
        shared += not rings.ext.stream_independent(rings.copy_stream.handle, 0, 0, 20_000)
    return {"mode": f"reprobe{W}", "calls": calls, "ok": calls, "timeouts": 0, "shared": shared}


def _mode(name: str, W: int, calls: int, how: str, side_stream: bool = False) -> dict:
    world, a, b = _world(W)
    side = torch.randn(1024, 1024, device="cuda")
    world.sync_checks = how == "sync"
    ok = timeouts = 0
    t0 = time.perf_counter()
    with torch.cuda.stream(torch.cuda.Stream()) if side_stream else contextlib.nullcontext():
        try:
            mkernel.gemm_rs(a, b, world=world)  # the first call settles the proxies' streams
            torch.cuda.synchronize()
        except RuntimeError as e:
            return {"mode": name, "calls": calls, "ok": 0, "timeouts": 0, "s": 0, "refused": str(e)}
        for _ in range(calls):
            try:
                mkernel.gemm_rs(a, b, world=world)
                if how == "queued":
                    side = side @ side / 32
                if how != "async":
                    torch.cuda.synchronize()
                    world.check()
                ok += 1
            except mkernel.CommTimeout:
                timeouts += 1
                if timeouts >= 3:
                    break
        if how == "async":
            try:
                world.check()
            except mkernel.CommTimeout:
                timeouts += 1
                ok = 0
    return {
        "mode": name,
        "calls": calls,
        "ok": ok,
        "timeouts": timeouts,
        "s": round(time.perf_counter() - t0, 2),
    }


def child() -> None:
    rows = [
        _mode("sync", 4, 20, "sync"),
        _mode("queued", 4, 20, "queued"),
        _mode("async", 4, 200, "async"),
        _mode("w8", 8, 100, "async"),
        _mode("w8s", 8, 100, "async", side_stream=True),
        _mode("w16", 16, 100, "async"),
        _reprobe(8, 30),
    ]
    print(json.dumps(rows))


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    table = []
    for conn in CONNECTIONS:
        env = dict(os.environ)
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if conn:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = conn
        p = subprocess.run(
            [sys.executable, __file__, "--child"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        last = p.stdout.strip().splitlines()[-1:] or ["[]"]
        try:
            rows = json.loads(last[0])
        except json.JSONDecodeError:
            rows = []
            print(p.stdout[-2000:], p.stderr[-3000:], flush=True)
        for r in rows:
            table.append({"connections": conn or "default", **r})
            print(table[-1], flush=True)
    print("\nconnections mode ok/calls timeouts seconds")
    for r in table:
        print(
            f"{r['connections']:>11} {r['mode']:>6} {r['ok']}/{r['calls']} {r['timeouts']} "
            f"{r.get('s', '')}{' refused' if 'refused' in r else ''} {r.get('shared', '')}"
        )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "queue_probe.json"), "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
