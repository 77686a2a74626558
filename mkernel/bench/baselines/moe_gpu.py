"""The MoE pair on the GPU, unfused: the routing sorted on the device, the dispatch as a row
gather, each rank's experts on the grouped GEMM engine (kernels/grouped_gemm.cu), the combine as a
weighted sum in fp32 in slot order. Same results and row order as the interpreter's protocol
(mkernel/ops/moe_dispatch_gemm.py, moe_gemm_combine.py); no communication overlaps a GEMM here,
which is what the fused kernels of issue 11 are for. Emulated worlds on one GPU; a baseline (the
API runs the fused kernels), which mkernel.bench.moe_local times them against.

Row order (mkernel/ops/moe_common.py): the rows of rank d are the (source, token, slot) entries
routed to its experts, by local expert, then source, token, slot. With the routing ids flattened to
f = (s * T + t) * k + j and g = the global expert id (d * E_local + e), that is the order of the
key g * (W * T * k) + f: one sort gives every rank's rows, and its position p in the sorted order
is the row's place in the concatenation of all ranks' rows.
"""

from __future__ import annotations

import torch

from mkernel.ops.grouped_gemm import grouped_gemm
from mkernel.ops.moe_common import MoeDispatch


class DeviceRouting:
    """Every rank's rows, from the routing ids [W, T, k] on the device (one host read: the counts,
    which size each rank's rows)."""

    def __init__(self, ids: torch.Tensor, experts: int) -> None:
        W, T, k = ids.shape
        flat = ids.reshape(-1).long()
        n_all = flat.numel()
        valid = flat >= 0
        key = torch.where(valid, flat * n_all + torch.arange(n_all, device=ids.device), -1)
        counts = torch.bincount(flat[valid], minlength=W * experts)  # rows per global expert
        ordered = key.sort().values  # the -1s (unused slots) first, then the rows
        per_expert = counts.tolist()  # NOTE: the one host synchronize: it sizes the results
        self.order = ordered[n_all - sum(per_expert) :] % n_all  # f of each row, in row order
        self.shape = (W, T, k)
        self.starts = [0]  # first row of each rank in the concatenation
        self.offsets: list[list[int]] = []
        for d in range(W):
            mine = per_expert[d * experts : (d + 1) * experts]
            offs = [0]
            for c in mine:
                offs.append(offs[-1] + c)
            self.offsets.append(offs)
            self.starts.append(self.starts[-1] + offs[-1])

    def rows_of(self, d: int) -> torch.Tensor:
        """f = (s * T + t) * k + j of rank d's rows, in row order."""
        return self.order[self.starts[d] : self.starts[d + 1]]

    def src_of(self, d: int) -> torch.Tensor:
        """[R_d, 3] int32 (source rank, token, slot) of rank d's rows."""
        _, T, k = self.shape
        f = self.rows_of(d)
        return torch.stack((f // (T * k), f // k % T, f % k), dim=1).to(torch.int32)


def slot_rows(d: MoeDispatch) -> torch.Tensor:
    """[W * T, k] int64: the position, in the concatenation of all ranks' rows, of each (source,
    token, slot) of the dispatch ``d`` (from its ``src``: no second sort); -1 for an unused slot."""
    W, T, k = d.topk_ids.shape
    src = torch.cat(list(d.src)).long()  # [rows of all ranks, 3], in the concatenation's order
    pos = torch.full((W * T * k,), -1, dtype=torch.long, device=src.device)
    pos[(src[:, 0] * T + src[:, 1]) * k + src[:, 2]] = torch.arange(src.shape[0], device=src.device)
    return pos.view(W * T, k)


def dispatch(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, hidden: int, world
) -> MoeDispatch:
    """moe_dispatch_gemm in an emulated world on the GPU (checked inputs: x [W, T, H], ids
    [W, T, k] int32, w1 [W, E_local, H, I])."""
    W, T, _ = x.shape
    E, k = w1.shape[1], ids.shape[2]
    r = DeviceRouting(ids, E)
    tokens = x.reshape(W * T, hidden)
    ys, srcs, offsets = [], [], []
    for d in range(W):
        offs = torch.tensor(r.offsets[d], dtype=torch.int32, device=x.device)
        # NOTE: an expanded copy, then the grouped GEMM: measured faster than gathering the rows in
        # the engine's A loads (grouped_gemm rows=, 0.78x torch's index_select + _grouped_mm at
        # the DeepSeek-like shape, against 1.1x for the plain grouped GEMM: docs/moe.md)
        a = tokens.index_select(0, r.rows_of(d) // k)
        ys.append(grouped_gemm(a, w1[d], offs))
        srcs.append(r.src_of(d))
        offsets.append(offs)
    return MoeDispatch(ys, srcs, offsets, world, ids.clone(), hidden)


def combine(
    h: list[torch.Tensor], w2: torch.Tensor, d: MoeDispatch, topk_weights: torch.Tensor
) -> torch.Tensor:
    """moe_gemm_combine in an emulated world on the GPU (checked inputs): every row's fp32 product
    (the grouped GEMM engine, fp32 out), then per token the weighted sum over its slots in slot
    order (deterministic), one bf16 rounding; zero for a token routed nowhere."""
    W, T, k = d.topk_ids.shape
    H = d.hidden
    acc = torch.zeros(W * T, H, dtype=torch.float32, device=w2.device)
    if sum(s.shape[0] for s in d.src) == 0:  # every slot unused: all tokens routed nowhere
        return acc.bfloat16().view(W, T, H)
    products = torch.cat(
        [
            grouped_gemm(h[q].contiguous(), w2[q], d.expert_offsets[q], out_dtype=torch.float32)
            for q in range(W)
        ]
    )  # [rows of all ranks, H] fp32, in the concatenation's order
    where = slot_rows(d)
    weights = topk_weights.reshape(W * T, k)
    for j in range(k):
        used = (where[:, j] >= 0)[:, None]
        rows = products.index_select(0, where[:, j].clamp(min=0))
        acc += torch.where(used, weights[:, j, None] * rows, 0.0)
    return acc.bfloat16().view(W, T, H)
