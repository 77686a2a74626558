"""NaN and Inf through the GPU attention engines (issue 33), with the contract and helpers of
tests/test_attention_nan.py: a NaN or +inf element of q, k or v is NaN in out, lse and the
gradients wherever the exact answer has one, within the reference's NaN pattern (forward), the
reference's exactly without a mask; lse +inf where the reference's is; finite elements close.

mkernel.attention on CUDA (the engines' own launches: kernels/attention.cu, attention_bwd.cu,
through autograd) and mkernel.ring_attention / ring_attention_backward in emulated GPU worlds
(the fused kernels, kernels/ring_attention.cu and ring_attention_backward.cu; a Schedule with an
overlap keeps them at W = 1 too). Small: one head pair, S_local 128 or 130."""

from __future__ import annotations

import pytest
import torch

import mkernel
from tests.test_attention_nan import (
    IDS,
    POISONS,
    D,
    check_backward,
    check_forward,
    inputs,
    poison,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("poison_", POISONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_engine_propagates_nan_and_inf(poison_, causal):
    q, k, v, _ = poison(*inputs(1, S=130), *poison_, "contiguous")
    leaves = [x[0].cuda().requires_grad_() for x in (q, k, v)]
    out, lse = mkernel.attention(*leaves, causal)
    assert out.is_cuda
    world = mkernel.World.emulated(1)
    check_forward(out.detach().cpu()[None], lse.detach().cpu()[None], q, k, v, world, causal,
                  "contiguous", "engine")  # fmt: skip
    dout = inputs(1, S=130, seed=1)[0]
    out.backward(dout[0].cuda())
    grads = [x.grad.cpu()[None] for x in leaves]
    check_backward(grads, q, k, v, dout, world, causal, "contiguous", "engine")


@pytest.mark.parametrize("poison_", POISONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("W", "layout"), [(1, "contiguous"), (2, "contiguous"), (2, "zigzag")])
def test_fused_ring_attention_propagates_nan_and_inf(poison_, causal, W, layout):
    world = mkernel.World.emulated(W, device="cuda")
    sched = mkernel.Schedule(overlap="intra_sm")  # the fused kernels, at W = 1 too
    q, k, v, _ = poison(*inputs(W, S=128), *poison_, layout)
    dout = inputs(W, S=128, seed=1)[0]
    qg, kg, vg, dg = (x.cuda() for x in (q, k, v, dout))
    out, lse = mkernel.ring_attention(qg, kg, vg, world, causal, None, layout, sched)
    grads = mkernel.ring_attention_backward(dg, qg, kg, vg, out, lse, world, causal, None, layout,
                                            sched)  # fmt: skip
    torch.cuda.synchronize()
    world.check()
    what = f"fused W={W} {layout}"
    check_forward(out.cpu(), lse.cpu(), q, k, v, world, causal, layout, what)
    check_backward([g.cpu() for g in grads], q, k, v, dout, world, causal, layout, what)


def test_attention_on_cuda_names_a_wrong_rank_operand_as_passed():
    q, k, v = (x[0].cuda() for x in inputs(1))
    with pytest.raises(ValueError, match=r"^q must have shape \[B, S, Hq, D\] \(4 dims\), got "
                       rf"\(1, 1, 32, 2, {D}\)"):  # fmt: skip
        mkernel.attention(q[None], k, v)
