"""Where the attention backward kernel's time goes (issue 13 diagnostics, one GPU).

``python3 benchmarks/attention_bwd_probe.py [S ...]``: B=1, H=32, D=128, full and causal; times the
kernel launch alone (``attention_backward_into``): the real kernel as CTA pairs (variant 0) and
one CTA per dQ reduce (variant 1), and the one-CTA kernel with ``probe`` 2 (no dQ reduce-adds)
and 1 (no dQ at all: no barrier, MMA or reduce-adds), interleaved in rounds; prints TFLOP/s
counting the full backward's 2.5x forward FLOPs in every column (so the columns compare times).
``--ncu``: one real launch only (for ``ncu -k regex:attention_bwd -c 1``).
"""

from __future__ import annotations

import statistics
import sys

import torch

from mkernel import attention_ext
from mkernel.bench.attention import _event_ms

B, H, D = 1, 32, 128


def setup(S: int, causal: bool):
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    delta = attention_ext.delta_of(dout, out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    return lambda variant, probe: attention_ext.attention_backward_into(
        dout, q, k, v, lse, delta, causal, D**-0.5, dq, dk, dv, variant=variant, probe=probe
    )


KINDS = {"pair": (0, 0), "single": (1, 0), "no_red": (1, 2), "no_dq": (1, 1)}


def main(argv: list[str]) -> None:
    if "--ncu" in argv:
        fn = setup(int(argv[argv.index("--ncu") + 1]), False)
        fn(0, 0)
        torch.cuda.synchronize()
        return
    sizes = [int(a) for a in argv] or [8192]
    rows = []
    for S in sizes:
        for causal in (False, True):
            fn = setup(S, causal)
            flops = 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for kind in times:
                fn(*KINDS[kind])
            for _ in range(8):
                for kind in times:
                    times[kind].append(_event_ms(lambda a=KINDS[kind], fn=fn: fn(*a), 5))
            rows.append((S, causal, *(flops / statistics.median(times[k]) / 1e9 for k in KINDS)))
    print("   S  causal  " + "  ".join(f"{k:>6}" for k in KINDS) + "   (TFLOP/s, full bwd FLOPs)")
    for S, causal, *tf in rows:
        print(f"{S:5d}  {causal!s:6}  " + "  ".join(f"{x:6.0f}" for x in tf))


if __name__ == "__main__":
    main(sys.argv[1:])
