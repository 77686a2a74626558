"""The MoE pair over a distributed world (one process per GPU), unfused: tokens go to the ranks of
their experts by ``all_to_all_single`` (each token once per destination rank, expanded to its
(token, slot) rows there), each rank's experts run on the grouped GEMM engine, and the combine
sends every row's fp32 product back to its source, where the weighted sum runs in slot order.
Same rows, row order and results as the emulated world's paths (moe_gpu.py, the interpreter's
protocol). The API runs the fused kernels in distributed worlds; this is the unfused baseline
(all-to-all, then grouped GEMM) that mkernel.bench.moe measures them against.

In a distributed world every tensor is this rank's: x [T, H], topk_ids [T, k], w1 [E_local, H, I];
the MoeDispatch holds one-element lists (this rank's y, src, expert_offsets) and this rank's
routing ids [T, k]. Row order on rank d: local expert, then source rank, token, slot.

The grouped GEMM is an argument (``gemm(a, w, offsets, out_dtype) -> rows``; ``engine_gemm``:
mkernel.grouped_gemm, which runs its fp32 reference on CPU tensors), so the exchange logic runs on
the CPU too (tests) and benchmarks can swap the GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mkernel.ops.grouped_gemm import grouped_gemm
from mkernel.ops.moe_common import MoeDispatch

Gemm = Callable[..., torch.Tensor]


def engine_gemm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out_dtype) -> torch.Tensor:
    """mkernel.grouped_gemm: the engine on CUDA tensors, its fp32 reference on CPU ones (tests)."""
    return grouped_gemm(a.contiguous(), w, offsets, out_dtype=out_dtype)


def _all_to_all(world: Any, send: torch.Tensor, splits: list[int], recv_splits: list[int]):
    """Rows of ``send`` (splits[d] of them to rank d) -> the rows every rank sent here."""
    import torch.distributed as dist

    # NOTE: bf16 travels as its bytes (uint8 rows): gloo (the CPU tests) moves no bf16 or int16
    bf16 = send.dtype == torch.bfloat16
    wire = send.contiguous().view(torch.uint8) if bf16 else send.contiguous()
    recv = wire.new_empty((sum(recv_splits), *wire.shape[1:]))
    dist.all_to_all_single(recv, wire, recv_splits, splits, group=world.group)
    return recv.view(torch.bfloat16) if bf16 else recv


def _counts(world: Any, counts: torch.Tensor) -> torch.Tensor:
    """[W, c] int64 counts for each destination -> [W, c] counts from each source."""
    ones = [1] * world.size
    return _all_to_all(world, counts, ones, ones)


def dispatch(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, world: Any, gemm: Gemm
) -> MoeDispatch:
    """moe_dispatch_gemm on this rank (checked inputs: x [T, H], ids [T, k] int32, w1 [E, H, I])."""
    W, E = world.size, w1.shape[0]
    T, k = ids.shape
    dev = x.device
    flat = ids.long()
    dest = torch.where(flat >= 0, flat // E, -1)  # [T, k] destination rank of each slot
    t_of = torch.arange(T, device=dev)[:, None].expand(T, k)
    j_of = torch.arange(k, device=dev)[None, :].expand(T, k)
    tokens, entries, n_tok, n_ent = [], [], [], []
    for d in range(W):
        to_d = dest == d
        sent = to_d.any(dim=1)  # each token once per destination rank
        local = torch.cumsum(sent.long(), 0) - 1  # its row among the tokens sent to d
        tokens.append(x[sent])
        t, j = t_of[to_d], j_of[to_d]  # row-major: by token, then slot
        entries.append(torch.stack((local[t], t, j, flat[to_d] % E), dim=1))
        n_tok.append(int(sent.sum()))
        n_ent.append(int(t.numel()))
    counts = torch.tensor([n_tok, n_ent], dtype=torch.long).T.contiguous().to(dev)
    got = _counts(world, counts).cpu()  # [W, 2]: tokens, entries from each source
    r_tok, r_ent = got[:, 0].tolist(), got[:, 1].tolist()
    recv_x = _all_to_all(world, torch.cat(tokens), n_tok, r_tok)
    recv_e = _all_to_all(world, torch.cat(entries), n_ent, r_ent)
    src_rank = torch.repeat_interleave(torch.arange(W, device=dev), torch.tensor(r_ent, device=dev))
    base = torch.tensor([0, *r_tok[:-1]], device=dev).cumsum(0)  # first received token per source
    row_of = base[src_rank] + recv_e[:, 0]
    t, j, e = recv_e[:, 1], recv_e[:, 2], recv_e[:, 3]
    key = ((e * W + src_rank) << 40) | (t * k + j)  # local expert, source, token, slot
    order = torch.argsort(key)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.bincount(e, minlength=E).cumsum(0).to(torch.int32)
    a = recv_x.index_select(0, row_of[order])
    y = gemm(a, w1, offsets, torch.bfloat16)
    src = torch.stack((src_rank, t, j), dim=1)[order].to(torch.int32)
    return MoeDispatch([y], [src], [offsets], world, ids.clone(), x.shape[-1])


def combine(
    h: torch.Tensor, w2: torch.Tensor, d: MoeDispatch, weights: torch.Tensor, world: Any, gemm: Gemm
) -> torch.Tensor:
    """moe_gemm_combine on this rank (checked inputs: h [R, I], w2 [E, I, H], weights [T, k]
    fp32): every row's fp32 product goes back to its source; there, per slot in order, out[t] +=
    weight[t, slot] * row; one bf16 rounding; zero for tokens routed nowhere."""
    W = world.size
    T, k = d.topk_ids.shape
    H = d.hidden
    src = d.src[0].long()
    products = gemm(h, w2, d.expert_offsets[0], torch.float32)  # [R, H] fp32, in row order
    back = torch.argsort(src[:, 0], stable=True)  # rows grouped by source rank
    n_back = torch.bincount(src[:, 0], minlength=W)
    r_back = _counts(world, n_back[:, None]).cpu()[:, 0].tolist()
    rows = _all_to_all(world, products[back], n_back.tolist(), r_back)
    meta = _all_to_all(world, src[back][:, 1:], n_back.tolist(), r_back)  # (token, slot)
    out = torch.zeros(T, H, dtype=torch.float32, device=h.device)
    for j in range(k):  # slot order: the same sums as the emulated paths
        mine = meta[:, 1] == j
        t = meta[mine, 0]
        out.index_add_(0, t, weights[t, j, None] * rows[mine])  # one row per (token, slot)
    return out.to(torch.bfloat16)
