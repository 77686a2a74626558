"""Ring attention's backward in an emulated world on one GPU, unfused: a baseline (the API's
emulated GPU path is the fused kernel, kernels/ring_attention_backward.cu). The backward engine
(primitives/attention/bwd_engine.cuh, ``mkernel.attention_ext``) runs on the blocks each query
chunk sees; the block gradients sum in fp32 (with the GLOBAL lse and delta every block's P and dS
are already the final ones). ``_call``, ``_merge``, ``block_backward`` and ``chunks`` also serve
the distributed unfused ring (ring_dist.py), the two-GPU benchmark's baseline.
Emulated worlds on one GPU; the K/V blocks do not travel a ring here (every rank's blocks are in
one memory).

Chunks (mkernel/ops/ring_attention.py ``positions``): "contiguous" gives rank r one chunk, global
index r, of S_local rows; "zigzag" gives it chunks r and 2W-1-r of S_local / 2 rows (local rows
[0, S/2) and [S/2, S)). Causal: a query chunk sees the key chunks of lower global index in full and
its own chunk causally (the diagonal, top-left aligned since both have the same length), none
above.
"""

from __future__ import annotations

import torch

from mkernel import attention_ext
from mkernel.ops.ring_attention import positions, segments


def chunks(rank: int, world_size: int, seq: int, zigzag: bool) -> list[tuple[int, int, int]]:
    """(global chunk index, first local row, rows) of each chunk rank ``rank`` holds: the layout's
    segments, indexed by their first global position (mkernel/ops/ring_attention.py, the one
    definition)."""
    pos = positions(rank, world_size, seq, zigzag)
    return [(int(pos[r0]) // n, r0, n) for r0, n in segments(seq, zigzag)]


def _merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys (o [B, n, H, D] fp32 normalised, lse [B, H, n]) as
    one: weights exp(lse_i - lse), fp32."""
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(1, 2).unsqueeze(-1)  # [B, n, H, 1]
    w2 = torch.exp(l2 - lse).transpose(1, 2).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def _call(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One engine call: (o fp32 [B, n, Hq, D], lse [B, Hq, n])."""
    o32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _, lse = attention_ext.attention_forward(q, k, v, causal, scale, out_f32=o32)
    return o32, lse


def _kv_blocks(W: int, S: int, zigzag: bool) -> dict[int, tuple[int, int, int]]:
    """global chunk index -> (rank, first local row, rows) of the K/V chunk."""
    return {g: (p, r0, n) for p in range(W) for g, r0, n in chunks(p, W, S, zigzag)}


def block_backward(bwd, dout, q, lse, delta, causal: bool, scale: float, dq, views, **kw) -> None:
    """One backward engine call over the K/V rows of ``views`` [(k, v, dk, dv)] (row ranges
    [B, m, H, D], concatenated in order; dk, dv fp32 accumulators the call's gradients are added
    to); dq (fp32) is reduce-added by the call. ``kw`` goes to ``bwd`` as it is."""
    kf = torch.cat([x[0] for x in views], dim=1).contiguous()
    vf = torch.cat([x[1] for x in views], dim=1).contiguous()
    dkf = torch.empty(kf.shape, dtype=torch.float32, device=kf.device)
    dvf = torch.empty_like(dkf)
    bwd(dout, q, kf, vf, lse, delta, causal, scale, dq, dkf, dvf, **kw)
    at = 0
    for _, _, dk, dv in views:
        m = dk.shape[1]
        dk += dkf[:, at : at + m]
        dv += dvf[:, at : at + m]
        at += m


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    zigzag: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ring_attention_backward in an emulated world on the GPU, unfused (the API runs the fused
    kernel; checked operands [W, B, S, H, D];
    lse, dlse [W, B, Hq, S]). Per query chunk: at most two backward calls (the chunks it sees in
    full, concatenated; its own chunk causally), dq reduce-added in fp32, each call's fp32 dk, dv
    added to the owners' rows."""
    W, B, S, Hq, D = q.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    blocks = _kv_blocks(W, S, zigzag)
    order = sorted(blocks)
    for r in range(W):
        delta = attention_ext.delta_of(dout[r], out[r], None if dlse is None else dlse[r])
        for g, r0, n in chunks(r, W, S, zigzag):
            rows = slice(r0, r0 + n)
            qc, doc = q[r, :, rows].contiguous(), dout[r, :, rows].contiguous()
            lc, dc = lse[r, :, :, rows].contiguous(), delta[:, :, rows].contiguous()
            dqc = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
            seen = [c for c in order if c < g] if causal else order
            calls = [(seen, False)] if seen else []
            if causal:
                calls.append(([g], True))
            for group, diag in calls:
                at = [(p, slice(a, a + m)) for p, a, m in (blocks[c] for c in group)]
                views = [(k[p, :, i], v[p, :, i], dk[p, :, i], dv[p, :, i]) for p, i in at]
                bwd = attention_ext.attention_backward_into
                block_backward(bwd, doc, qc, lc, dc, diag, scale, dqc, views)
            dq[r, :, rows] = dqc
    return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16)
