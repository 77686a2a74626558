"""One call of the fused ring-attention backward for profilers (issue 13 diagnostics).

``python3 benchmarks/ring_bwd_one_call.py [W] [causal]``: B = 1, H = 32, D = 128, global S = 8192
split over an emulated world of W ranks (default 2; zigzag when causal, default 1), intra_sm;
two warm calls, then the profiled one (``ncu -k regex:RingAttentionBwd --launch-skip 2 -c 1``).
"""

from __future__ import annotations

import sys

import torch

from mkernel import ring_attention_backward
from mkernel.bench.ring_local_bwd import backward_args
from mkernel.schedule import Schedule

if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    causal = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True
    assert W in (1, 2), "the bench's rank split is for W = 2"
    w1, ones, w2, twos, two_layout = backward_args(causal)
    world, args, layout = (w1, ones, "contiguous") if W == 1 else (w2, twos, two_layout)
    for _ in range(3):
        ring_attention_backward(*args, world, causal, None, layout, Schedule(overlap="intra_sm"))
    torch.cuda.synchronize()
