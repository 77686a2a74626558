"""One call of the fused ring-attention backward for profilers (issue 13 diagnostics).

``python3 benchmarks/ring_bwd_one_call.py [W] [causal]``: B = 1, H = 32, D = 128, global S = 8192
split over an emulated world of W ranks (default 2; zigzag when causal, default 1), intra_sm;
two warm calls, then the profiled one (``ncu -k regex:RingAttentionBwd --launch-skip 2 -c 1``).
"""

from __future__ import annotations

import sys

import torch

from mkernel import World, attention_ext, ring_attention, ring_attention_backward
from mkernel.bench.ring_local import B, D, H, S, rank_rows
from mkernel.schedule import Schedule

if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    causal = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    if W == 1:
        out, lse = attention_ext.attention_forward(q, k, v, causal)
        args, layout = (dout[None], q[None], k[None], v[None], out[None], lse[None]), "contiguous"
        world = World.emulated(1, device="cuda")
    else:
        assert W == 2, "the bench's rank split is for W = 2"
        layout = "zigzag" if causal else "contiguous"
        rq, rk, rv, rdo = rank_rows((q, k, v, dout), causal)
        world = World.emulated(2, device="cuda")
        rout, rlse = ring_attention(rq, rk, rv, world, causal, None, layout)
        args = (rdo, rq, rk, rv, rout, rlse)
    for _ in range(3):
        ring_attention_backward(*args, world, causal, None, layout, Schedule(overlap="intra_sm"))
    torch.cuda.synchronize()
