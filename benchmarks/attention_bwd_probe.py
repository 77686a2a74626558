"""Where the attention backward kernel's time goes (issue 13 diagnostics, one GPU).

``python3 benchmarks/attention_bwd_probe.py [S ...]``: B=1, H=32, D=128, full and causal; times the
kernel launch alone (``attention_backward_into``) with ``probe`` 0 (the real kernel), 2 (no dQ
reduce-adds nor staging), 1 (no dQ at all: no barrier, MMA or reduce-adds), 3 (Q loaded alone and
used as dO: half the per-step L2 reads), 4 (dQ staged, no reduce-add issued) and 5 (reduce-adds
issued from an unwritten staging tile), interleaved in rounds, and prints TFLOP/s counting the full
backward's 2.5x forward FLOPs in every row (so the rows compare times).
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
    return lambda probe: attention_ext.attention_backward_into(
        dout, q, k, v, lse, delta, causal, D**-0.5, dq, dk, dv, probe=probe
    )


# probe -> column (kernels/attention_bwd_args.h: what each probe leaves out)
PROBES = {0: "real", 2: "no_red", 1: "no_dq", 3: "half_loads", 4: "no_tma_red", 5: "no_stage"}


def main(argv: list[str]) -> None:
    if "--ncu" in argv:
        fn = setup(int(argv[argv.index("--ncu") + 1]), False)
        fn(0)
        torch.cuda.synchronize()
        return
    sizes = [int(a) for a in argv] or [8192]
    rows = []
    for S in sizes:
        for causal in (False, True):
            fn = setup(S, causal)
            flops = 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)
            times: dict[int, list[float]] = {pr: [] for pr in PROBES}
            for pr in times:
                fn(pr)
            for _ in range(8):
                for pr in times:
                    times[pr].append(_event_ms(lambda pr=pr, fn=fn: fn(pr), 5))
            rows.append((S, causal, *(flops / statistics.median(times[pr]) / 1e9 for pr in PROBES)))
    print("   S  causal  " + "  ".join(f"{n:>10}" for n in PROBES.values()) + "  (TFLOP/s)")
    for S, causal, *tf in rows:
        print(f"{S:5d}  {causal!s:6}  " + "  ".join(f"{x:10.0f}" for x in tf))


if __name__ == "__main__":
    main(sys.argv[1:])
