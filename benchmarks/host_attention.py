"""Host time per call of the attention entry points (one H200; GPU kernels queue behind):
``python3 benchmarks/host_attention.py``. Prints microseconds of host time per call, averaged over
200 back-to-back calls (B = 1, S = 2048, H = 8, D = 128, causal), then a cProfile of
``ring_attention`` in a one-rank world (the engine path, ring_attention.solo_engine) sorted by
own time: where the Python checks and launch glue go. Results:
benchmarks/results/host_attention_2026-12-02_*.txt."""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

import mkernel
from mkernel import attention_ext
from mkernel.bench.host import _per_call_us  # 200 back-to-back calls, synchronized around


def main() -> None:
    q, k, v = (torch.randn(1, 1, 2048, 8, 128, device="cuda").bfloat16() for _ in range(3))
    w1 = mkernel.World.emulated(1, device="cuda")
    out, lse = torch.empty_like(q[0]), torch.empty(1, 8, 2048, device="cuda")
    a = torch.randn(256, 256, device="cuda").bfloat16()
    rows = {
        "ring_attention, W = 1": lambda: mkernel.ring_attention(q, k, v, w1, True),
        "attention_ext.attention_forward, out given": lambda: attention_ext.attention_forward(
            q[0], k[0], v[0], True, None, out=out, lse=lse
        ),
        "attention_ext.attention_forward": lambda: attention_ext.attention_forward(
            q[0], k[0], v[0], True
        ),
        "mkernel.attention": lambda: mkernel.attention(q[0], k[0], v[0], True),
        "torch.matmul 256^3 (yardstick)": lambda: a @ a,
    }
    for name, fn in rows.items():
        fn()  # first-call work (cuBLAS handles, plans) outside the timing
        print(f"{name:45s} {_per_call_us(fn):8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        mkernel.ring_attention(q, k, v, w1, True)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue())


if __name__ == "__main__":
    main()
