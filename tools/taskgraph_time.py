"""Per-call ms of TaskGraph's decode launch (8 Qwen3-8B-shaped layers, mkernel.bench.decode's
model) for an A/B of kernel variants (tools/ab_taskgraph.sh runs one process per tree and round,
alternating). Each case is checked once against the fp32 torch step (max abs error printed) before
it is timed. argv: tag [rounds]; prints ``TAG <tag> <case> <ms>`` and ``ERR <tag> <case> <err>``
lines (the error once per process, before its timings). WARM=1: a small graph at batch 1 and 8
only, checked the same way (builds the extension; several trees build in parallel).
BACKOFF="256 0": each case also with Schedule(backoff_ns=...) (the waits' longest sleep between
polls; default 2048), case name suffixed _bo<ns>."""

import os
import sys

import torch

from mkernel.bench.decode import CFG
from mkernel.models import DecoderConfig, decode_graph, random_decoder, torch_decode
from mkernel.schedule import Schedule
from mkernel.taskgraph.probe import _time

tag = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
CASES = [(1, 1024), (8, 1024), (1, 4096)]
torch.manual_seed(0)
if os.environ.get("WARM"):  # a small graph at batch 1 and 8: builds the extension, little memory
    small = DecoderConfig(hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024)
    for B in (1, 8):
        layers, final = random_decoder(small, B, 256, device="cuda")
        x = torch.randn(B, small.hidden, device="cuda").bfloat16()
        got = decode_graph(small, layers, final, B, 256).compile()(x=x)["y"].float()
        err = float((got - torch_decode(small, layers, final, x, 256)).abs().max())
        print(f"ERR {tag} small_b{B} {err:.4f}", flush=True)
    sys.exit(0)
fns = {}
for B, kv in CASES:
    layers, final = random_decoder(CFG, B, kv, device="cuda")
    g = decode_graph(CFG, layers, final, B, kv)
    x = (torch.randn(B, CFG.hidden, device="cuda")).bfloat16()
    want = torch_decode(CFG, layers, final, x, kv)
    for bo in [None] + [int(b) for b in os.environ.get("BACKOFF", "").split()]:
        k = g.compile(None if bo is None else Schedule(backoff_ns=bo))
        got = k(x=x)["y"].float()
        name = f"b{B}_kv{kv}" + ("" if bo is None else f"_bo{bo}")
        print(f"ERR {tag} {name} {float((got - want).abs().max()):.4f}", flush=True)
        fns[name] = lambda k=k, x=x: k(x=x)
for _ in range(rounds):
    for name, fn in fns.items():
        print(f"TAG {tag} {name} {_time(fn, 20) * 1e3:.4f}", flush=True)
