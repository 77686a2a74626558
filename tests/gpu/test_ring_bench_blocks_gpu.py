"""The two-GPU ring benchmark's cuDNN block functions (mkernel/bench/ring.py: the unfused baseline)
compute what our engines compute: the forward block's out and lse, the backward block's dq, dk, dv
given the global out and lse. Checked on one GPU, so that a two-GPU run compares like with like."""

from __future__ import annotations

import pytest
import torch

from mkernel import attention_ext
from mkernel.bench.ring import cudnn_block, cudnn_bwd_block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_cudnn_blocks_agree_with_our_engines(causal, heads):
    Hq, Hkv = heads
    g = torch.Generator(device="cuda").manual_seed(Hq + causal)
    B, S, D, scale = 1, 384, 128, 128**-0.5
    q, dout = (torch.randn(B, S, Hq, D, device="cuda", generator=g).bfloat16() for _ in "ab")
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", generator=g).bfloat16() for _ in "ab")
    out, lse = attention_ext.attention_forward(q, k, v, causal, scale)
    o32, lse_c = cudnn_block(q, k, v, causal, scale)
    torch.testing.assert_close(lse_c, lse, atol=2e-3, rtol=0)
    torch.testing.assert_close(o32, out.float(), atol=2e-2, rtol=0)
    delta = attention_ext.delta_of(dout, out)
    want = [torch.zeros(x.shape, dtype=torch.float32, device="cuda") for x in (q, k, v)]
    attention_ext.attention_backward_into(dout, q, k, v, lse, delta, causal, scale, *want)
    got = [torch.full_like(w, float("nan")) for w in want]
    got[0].zero_()  # dq is added into; dk, dv are stored (poisoned: unwritten rows fail)
    cudnn_bwd_block(dout, q, k, v, lse, delta, causal, scale, *got, out=out)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 2e-2, f"{name}: max error {err:.3g} of max |grad|"
