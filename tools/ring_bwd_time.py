"""Per-call ms of the fused ring backward (issue 34's regression A/B): the engine's own backward,
the fused kernel at W = 1 and emulated W = 2 (intra_sm), full and causal, mkernel.bench.ring_local
shapes. The tree measured is the one on PYTHONPATH, so tools/ab_ring_bwd.sh runs one process per
tree and round, alternating. argv: tag [rounds]; prints ``TAG <tag> <version> <ms>`` lines.
WARM=1: build and call each version once, then exit (the builds of several trees in parallel)."""

import functools
import os
import sys

import torch

from mkernel import World, attention_ext, ring_attention, ring_attention_backward
from mkernel.bench.attention import _event_ms
from mkernel.bench.ring_local import B, D, H, S, rank_rows
from mkernel.schedule import Schedule

try:
    from mkernel.ops.ring_cost import RING_OVERLAP
except ImportError:
    from mkernel.cost import RING_OVERLAP

tag = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
attention_ext.load()
torch.manual_seed(0)
fns = {}
for causal in (False, True):
    name = "causal" if causal else "full"
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    w1, w2 = World.emulated(1, device="cuda"), World.emulated(2, device="cuda")
    if not causal:
        engine = (dout, q, k, v, out, lse, causal)
        fns[f"engine_{name}"] = functools.partial(attention_ext.attention_backward, *engine)
    ones = (dout[None], q[None], k[None], v[None], out[None], lse[None], w1, causal, None)
    fused = Schedule(overlap=RING_OVERLAP)  # the fused kernel at W = 1 (not solo_engine)
    fns[f"w1fused_{name}"] = functools.partial(ring_attention_backward, *ones, "contiguous", fused)
    layout = "zigzag" if causal else "contiguous"
    rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
    rout, rlse = ring_attention(rq, rk, rv, w2, causal, None, layout)
    two = (rdo, rq, rk, rv, rout, rlse, w2, causal, None, layout, Schedule(overlap="intra_sm"))
    fns[f"w2intra_{name}"] = functools.partial(ring_attention_backward, *two)
for fn in fns.values():
    fn()
torch.cuda.synchronize()
if os.environ.get("WARM") == "1":
    from mkernel.runtime import gpu

    print("warm", tag, gpu.extension().__file__)  # which build is this tree's (sass_spills.sh)
    sys.exit(0)
for fn in fns.values():
    fn()
for _ in range(rounds):
    for name, fn in fns.items():
        print("TAG", tag, name, round(_event_ms(fn, 6), 4), flush=True)
