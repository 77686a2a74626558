"""Per-call ms of TaskGraph's decode launch (8 Qwen3-8B-shaped layers, mkernel.bench.decode's
model) for an A/B of kernel variants (tools/ab_taskgraph.sh runs one process per tree and round,
alternating). Each case is checked once against the fp32 torch step (max abs error printed) before
it is timed. argv: tag [rounds]; prints ``TAG <tag> <case> <ms>`` and ``ERR <tag> <case> <err>``
lines. WARM=1: build and call each case once, then exit (builds of several trees in parallel).
BACKOFF="256 0": each case also with Schedule(backoff_ns=...) (the waits' longest sleep between
polls; default 2048), case name suffixed _bo<ns>."""

import os
import sys

import torch

from mkernel.bench.decode import CFG
from mkernel.models import decode_graph, torch_decode
from mkernel.schedule import Schedule
from mkernel.taskgraph.probe import _time, gpu_decoder

tag = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
CASES = [(1, 1024), (8, 1024), (1, 4096)]
torch.manual_seed(0)
fns = {}
for B, kv in CASES:
    layers, final = gpu_decoder(CFG, B, kv)
    g = decode_graph(CFG, layers, final, B, kv)
    x = (torch.randn(B, CFG.hidden, device="cuda")).bfloat16()
    want = torch_decode(CFG, layers, final, x, kv)
    for bo in [None] + [int(b) for b in os.environ.get("BACKOFF", "").split()]:
        k = g.compile(None if bo is None else Schedule(backoff_ns=bo))
        got = k(x=x)["y"].float()
        name = f"b{B}_kv{kv}" + ("" if bo is None else f"_bo{bo}")
        print(f"ERR {tag} {name} {float((got - want).abs().max()):.4f}", flush=True)
        fns[name] = lambda k=k, x=x: k(x=x)
if os.environ.get("WARM"):
    sys.exit(0)
for _ in range(rounds):
    for name, fn in fns.items():
        print(f"TAG {tag} {name} {_time(fn, 20) * 1e3:.4f}", flush=True)
