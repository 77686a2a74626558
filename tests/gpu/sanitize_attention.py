"""Small launches of the attention engines for compute-sanitizer (tests/gpu/test_sanitizers_gpu.py
runs it under memcheck, racecheck and synccheck; each must report 0 errors):

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_attention.py

Forward (all three schedules) and backward (every variant, or only those given as arguments), D 64
and 128, causal or not, GQA, sequence lengths off the tiles (S_q != S_kv too); the backward's
gradients are compared with fp64 torch autograd, so a launch the tool perturbs still has to be
right."""

from __future__ import annotations

import sys

import torch

from mkernel import attention_ext
from tests.gpu.test_attention_backward_gpu import _formula


def main(argv: list[str]) -> int:
    backward_variants = [int(a) for a in argv] or [0, 1]
    g = torch.Generator().manual_seed(0)
    for D in (64, 128):
        for causal in (False, True):
            for S_q, S_kv in ((130, 130), (70, 200)):
                q, dout = (torch.randn(1, S_q, 4, D, generator=g).bfloat16().cuda() for _ in "ab")
                k, v = (torch.randn(1, S_kv, 2, D, generator=g).bfloat16().cuda() for _ in "ab")
                for variant in attention_ext.VARIANTS:
                    out, lse = attention_ext.attention_forward(q, k, v, causal, variant=variant)
                want = _formula(q, k, v, dout, causal, D**-0.5)
                for variant in backward_variants:
                    grads = attention_ext.attention_backward(
                        dout, q, k, v, out, lse, causal, variant=variant
                    )
                    torch.cuda.synchronize()
                    for name, got, w in zip("dq dk dv".split(), grads, want, strict=True):
                        err = float((got.double() - w).abs().max() / w.abs().max().clamp_min(1e-6))
                        what = f"{name} D={D} causal={causal} S={S_q}/{S_kv} variant={variant}"
                        assert err < 2e-2, f"{what}: {err:.3g}"
                print(f"ok attention D={D} causal={causal} S={S_q}/{S_kv}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
