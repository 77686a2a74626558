"""One attention-engine call for one rank (what ring_attention.py runs for a world of one); the
unfused ring baselines moved to mkernel/bench/baselines/ (ring_gpu.py, ring_dist.py)."""

# TODO(issue 34): the fused op stops importing this; then delete the file

from __future__ import annotations

import torch


def attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention on the GPU (checked operands [B, S, H, D]): one engine call."""
    # NOTE: imported on first use: mkernel.attention_ext -> mkernel.jit -> the op registry, which
    # imports ring_attention.py (which imports this module) while it is being imported.
    from .. import attention_ext

    return attention_ext.attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), causal, scale
    )
