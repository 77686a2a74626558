"""Small launches of the attention engines for compute-sanitizer (tests/gpu/test_sanitizers_gpu.py
runs it under memcheck, racecheck and synccheck; each must report 0 errors):

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_attention.py

Forward (all three schedules) and backward, D 64 and 128, causal or not, GQA, sequence lengths off
the tiles (S_q != S_kv too); the backward's gradients are compared with torch autograd in fp32, so
a launch the tool perturbs still has to be right."""

from __future__ import annotations

import sys

import torch

from mkernel import attention_ext


def _grads_fp32(q, k, v, dout, causal, scale):
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    Q, K, V = leaves
    group = Q.shape[2] // K.shape[2]
    K, V = K.repeat_interleave(group, 2), V.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K) * scale
    if causal:
        i = torch.arange(s.shape[2], device=s.device)[:, None]
        s = s.masked_fill(torch.arange(s.shape[3], device=s.device)[None, :] > i, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), V)
    return torch.autograd.grad(out, leaves, dout.float())


def main() -> int:
    g = torch.Generator().manual_seed(0)
    for D in (64, 128):
        for causal in (False, True):
            for S_q, S_kv in ((130, 130), (70, 200)):
                q, dout = (torch.randn(1, S_q, 4, D, generator=g).bfloat16().cuda() for _ in "ab")
                k, v = (torch.randn(1, S_kv, 2, D, generator=g).bfloat16().cuda() for _ in "ab")
                for variant in attention_ext.VARIANTS:
                    out, lse = attention_ext.attention_forward(q, k, v, causal, variant=variant)
                dq, dk, dv = attention_ext.attention_backward(dout, q, k, v, out, lse, causal)
                torch.cuda.synchronize()
                want = _grads_fp32(q, k, v, dout, causal, D**-0.5)
                for name, got, w in zip("dq dk dv".split(), (dq, dk, dv), want, strict=True):
                    err = float((got.float() - w).abs().max() / w.abs().max().clamp_min(1e-6))
                    assert err < 2e-2, f"{name} D={D} causal={causal} S={S_q}/{S_kv}: {err:.3g}"
                print(f"ok attention D={D} causal={causal} S={S_q}/{S_kv}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
