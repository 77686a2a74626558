"""Ring attention over a distributed world (one process per GPU), unfused: K/V blocks travel the
ring by torch.distributed point-to-point sends (NCCL on GPUs) while the attention engines
(mkernel.attention_ext) compute on the block each rank holds; the forward merges blocks by
log-sum-exp in fp32, the backward sends each block's fp32 dK / dV accumulator along with it and
brings it home after the last step. The API runs the fused kernel of issue 12 (blocks moved by
the kernel itself, consumed tile by tile); this is the unfused baseline mkernel.bench.ring
measures it against.

Step s on rank r (W ranks): rank r holds the K/V block of rank o = (r - s) mod W and, while it
computes on it, sends it to r + 1 and receives block o - 1 from r - 1 (double-buffered). Causal:
a query chunk sees the key chunks of lower global index in full and its own chunk causally
(``chunks``: the layout's segments); blocks it cannot see are skipped (a step may compute
nothing, the block still travels). Backward: at step s rank r adds its contributions into block
o's dK / dV accumulator, then passes the accumulator on (W passes: the last one lands at o).

The block engines are arguments so the ring logic runs on the CPU with torch math (tests) and on
the GPU with the engines: ``gpu_engines()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mkernel import attention_ext

from .ring_gpu import _call, _merge, block_backward, chunks

# fwd(q, k, v, causal, scale) -> (o fp32 [B, n, Hq, D], lse [B, Hq, n])
FwdBlock = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# bwd(dout, q, k, v, lse, delta, causal, scale, dq32 (added into), dk32, dv32 (stored)) -> None
BwdBlock = Callable[..., None]


def gpu_engines() -> tuple[FwdBlock, BwdBlock]:
    """The attention engines as block functions (ring_gpu.py's contract)."""
    return _call, attention_ext.attention_backward_into


def _exchange(world: Any, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
    """Send ``send`` to rank + 1 and receive ``recv`` from rank - 1 (group ranks), asynchronously;
    the caller waits on the returned works before touching either buffer."""
    import torch.distributed as dist

    W, r = world.size, world.rank
    glob = lambda p: dist.get_global_rank(world.group, p) if world.group is not None else p  # noqa: E731
    ops = [
        dist.P2POp(dist.isend, send, glob((r + 1) % W), world.group),
        dist.P2POp(dist.irecv, recv, glob((r - 1) % W), world.group),
    ]
    return dist.batch_isend_irecv(ops)


def _visible(g: int, owner: int, W: int, S: int, zigzag: bool, causal: bool):
    """The key chunks (first local row, rows) of block ``owner`` that query chunk ``g`` sees in
    full, and whether it sees one of them causally (its own chunk: the diagonal)."""
    full, diag = [], None
    for gk, a, m in chunks(owner, W, S, zigzag):
        if not causal or gk < g:
            full.append((a, m))
        elif gk == g:
            diag = (a, m)
    return full, diag


def _rows(x: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """The concatenated row ranges ``parts`` of x [B, S, H, D] (dim 1), contiguous. Adjacent
    ranges are one slice (zigzag's two chunks of a block seen in full: the whole block), and a
    slice that is already contiguous (B = 1, or all rows) is not copied."""
    merged: list[list[int]] = []
    for a, m in parts:
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1][1] += m
        else:
            merged.append([a, m])
    if len(merged) == 1:
        a, m = merged[0]
        return x[:, a : a + m].contiguous()
    return torch.cat([x[:, a : a + m] for a, m in merged], dim=1)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: Any,
    causal: bool,
    scale: float,
    zigzag: bool,
    fwd: FwdBlock,
    move: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out bf16 [B, S, Hq, D], lse fp32 [B, Hq, S]) of ring attention. ``move``
    False keeps the first block for every step (measurements: the compute alone; the results are
    then not ring attention's)."""
    W, r = world.size, world.rank
    B, S, Hq, D = q.shape
    kv = torch.stack([k, v]).contiguous()  # one message per step
    spare = torch.empty_like(kv)
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for s in range(W):
        owner = (r - s) % W
        works = _exchange(world, kv, spare) if move and s + 1 < W else []
        for g, r0, n in chunks(r, W, S, zigzag):
            qc = q[:, r0 : r0 + n].contiguous()
            full, diag = _visible(g, owner, W, S, zigzag, causal)
            parts = []
            if full:
                parts.append(fwd(qc, _rows(kv[0], full), _rows(kv[1], full), False, scale))
            if diag is not None:
                parts.append(fwd(qc, _rows(kv[0], [diag]), _rows(kv[1], [diag]), True, scale))
            for o32, ls in parts:
                acc[g] = (o32, ls) if g not in acc else _merge(*acc[g], o32, ls)
        for w in works:
            w.wait()
        if move:
            kv, spare = spare, kv
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    for g, r0, n in chunks(r, W, S, zigzag):
        o32, ls = acc[g]  # every chunk sees at least itself (causal) or every block
        out[:, r0 : r0 + n] = o32.to(torch.bfloat16)
        lse[:, :, r0 : r0 + n] = ls
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    world: Any,
    causal: bool,
    scale: float,
    zigzag: bool,
    bwd: BwdBlock,
    move: bool = True,
    pass_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (dq, dk, dv), bf16, of ring attention's backward (global lse and delta: every
    block's P and dS are final, so block gradients only add). ``move`` False keeps the first block
    and its accumulator for every step (measurements: the compute alone). ``pass_out`` gives
    ``bwd`` the query chunk's rows of ``out`` as keyword ``out`` (a block function that computes
    delta itself, as cuDNN's backward does)."""
    W, r = world.size, world.rank
    S = q.shape[1]
    delta = attention_ext.delta_of(dout, out, dlse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    spare = torch.empty_like(kv)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
    dkv_spare = torch.empty_like(dkv)
    for s in range(W):
        owner = (r - s) % W
        works = _exchange(world, kv, spare) if move and s + 1 < W else []
        for g, r0, n in chunks(r, W, S, zigzag):
            rows = slice(r0, r0 + n)
            qc, doc = q[:, rows].contiguous(), dout[:, rows].contiguous()
            kw = {"out": out[:, rows].contiguous()} if pass_out else {}
            lc, dc = lse[:, :, rows].contiguous(), delta[:, :, rows].contiguous()
            dqc = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
            full, diag = _visible(g, owner, W, S, zigzag, causal)
            calls = ([(full, False)] if full else []) + ([([diag], True)] if diag else [])
            for parts, is_diag in calls:
                at = [slice(a, a + m) for a, m in parts]
                views = [(kv[0][:, i], kv[1][:, i], dkv[0][:, i], dkv[1][:, i]) for i in at]
                block_backward(bwd, doc, qc, lc, dc, is_diag, scale, dqc, views, **kw)
            dq[:, rows] += dqc
        for w in works:
            w.wait()
        if not move:
            continue
        kv, spare = spare, kv
        if W > 1:  # block owner's accumulator on to r + 1; block owner - 1's arrives from r - 1
            for w in _exchange(world, dkv, dkv_spare):
                w.wait()
            dkv, dkv_spare = dkv_spare, dkv
    # after W passes the accumulator of this rank's own block is home
    return dq.to(torch.bfloat16), dkv[0].to(torch.bfloat16), dkv[1].to(torch.bfloat16)


# -- block functions in torch (fp32), for the CPU tests of the ring logic -------------------------


def _scores(q, k, causal, scale):
    group = q.shape[2] // k.shape[2]
    kk = k.float().repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if causal:
        i = torch.arange(s.shape[2], device=s.device)[:, None]
        j = torch.arange(s.shape[3], device=s.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s, group


def torch_fwd_block(q, k, v, causal, scale):
    """The engine's block contract in fp32 torch: (o [B, n, Hq, D] fp32, lse [B, Hq, n])."""
    s, group = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(group, 2))
    return o, lse


def torch_bwd_block(dout, q, k, v, lse, delta, causal, scale, dq, dk, dv):
    """The backward engine's contract in fp32 torch: dq += block's dQ; dk, dv = block's dK, dV."""
    s, group = _scores(q, k, causal, scale)
    p = torch.exp(s - lse[..., None])
    vv = v.float().repeat_interleave(group, 2)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout.float(), vv)
    ds = p * (dp - delta[..., None]) * scale
    kk = k.float().repeat_interleave(group, 2)
    dq += torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    B, n, Hkv, D = k.shape
    dk.copy_(torch.einsum("bhqk,bqhd->bkhd", ds, q.float()).reshape(B, n, Hkv, group, D).sum(3))
    dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, dout.float()).reshape(B, n, Hkv, group, D).sum(3))
