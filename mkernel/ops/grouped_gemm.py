"""Grouped GEMM (the MoE experts' GEMM): API and reference side by side; device code in
kernels/grouped_gemm.cu (the GEMM engine with a batched B, tasks found on the device).

Unfused meaning (a [M, K], b [G, K, N], offsets [G + 1] int32 non-decreasing, offsets[0] >= 0,
offsets[G] <= M)::

    for g in range(G):
        lo, hi = offsets[g], offsets[g + 1]
        out[lo:hi] = (a[lo:hi].float() @ b[g].float()).bfloat16()

Rows outside [offsets[0], offsets[G]) are not written: a given ``out`` keeps its values there (e.g.
a slice of a larger buffer); a new one (``out=None``) is zero there wherever the host knows the
offsets (the CPU, or offsets on the CPU), unspecified for offsets on the GPU (never read by the
host: the launch stays free of host syncs, and the MoE ops' offsets always cover every row). With
``rows`` (int32 [M']), A's row m is ``a[rows[m]]`` (gathered on the device, e.g. an MoE rank's
(token, slot) rows straight from its tokens), and out and offsets count those M' rows.
"""

from __future__ import annotations

import contextlib

import torch

from .. import schedule
from .common import extension

__all__ = ["grouped_gemm", "reference"]


def reference(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """fp32 products per group, rounded to ``out_dtype``; rows in no group are zero."""
    offs = [int(x) for x in offsets.tolist()]
    out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
    for g in range(b.shape[0]):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            out[lo:hi] = (a[lo:hi].float() @ b[g].float()).to(out_dtype)
    return out


def _check(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    rows: torch.Tensor | None,
) -> None:
    forms = {"a": "[M, K] bf16", "b": "[G, K, N] bf16", "offsets": "[G + 1] int32"}
    for name, x in (("a", a), ("b", b), ("offsets", offsets)):
        if not isinstance(x, torch.Tensor):
            got = type(x).__name__
            raise TypeError(f"grouped_gemm: {name} must be a torch.Tensor {forms[name]}, got {got}")
    for name, x in (("rows", rows), ("out", out)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(
                f"grouped_gemm: {name} must be a torch.Tensor or None, got {type(x).__name__}"
            )
    for name, x in (("a", a), ("b", b)):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"grouped_gemm: {name} must be torch.bfloat16, got {x.dtype}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"grouped_gemm: a must be [M, K] and b [G, K, N], got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    m, k = a.shape
    if rows is not None:
        if rows.dtype != torch.int32 or rows.dim() != 1:
            raise ValueError(
                f"grouped_gemm: rows must be int32 [M'], got {rows.dtype} {tuple(rows.shape)}"
            )
        if rows.device.type == "cpu" and rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= m:
                raise ValueError(f"grouped_gemm: rows must index a's {m} rows, got [{lo}, {hi}]")
        elif rows.device.type != "cpu" and rows.device != a.device:
            raise ValueError(f"grouped_gemm: rows on {rows.device}, a on {a.device}")
        if rows.numel() and m == 0:
            raise ValueError("grouped_gemm: rows index an empty a")
        m = rows.numel()
    g, kb, n = b.shape
    if kb != k:
        raise ValueError(f"grouped_gemm: a is [M, {k}] but b is [G, {kb}, N]: K must agree")
    if g < 1 or n < 1 or k < 1:
        raise ValueError(f"grouped_gemm: G, N and K must be >= 1, got G={g}, N={n}, K={k}")
    if offsets.dtype != torch.int32 or offsets.shape != (g + 1,):
        raise ValueError(
            f"grouped_gemm: offsets must be int32 [G + 1] = [{g + 1}], got {offsets.dtype} "
            f"{tuple(offsets.shape)}"
        )
    if offsets.device.type == "cpu":  # checkable without a device synchronize
        offs = offsets.tolist()
        if (
            offs[0] < 0
            or offs[-1] > m
            or any(x > y for x, y in zip(offs[:-1], offs[1:], strict=True))
        ):
            raise ValueError(
                f"grouped_gemm: offsets must be non-decreasing within [0, M={m}], got {offs}"
            )
    elif offsets.device != a.device:
        raise ValueError(f"grouped_gemm: offsets on {offsets.device}, a on {a.device}")
    if b.device != a.device:
        raise ValueError(f"grouped_gemm: a on {a.device}, b on {b.device}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f"grouped_gemm: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype!r}"
        )
    if out is not None and (
        out.shape != (m, n) or out.dtype != out_dtype or out.device != a.device
    ):
        raise ValueError(
            f"grouped_gemm: out must be {out_dtype} [{m}, {n}] on {a.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    for name, x in (("a", a), ("b", b), ("out", out)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"grouped_gemm: {name} must be contiguous")
    if a.is_cuda and (n % 8 or k % 8):
        raise ValueError(f"grouped_gemm: N and K must be multiples of 8 on the GPU, got {n}, {k}")


def _new_out(
    offsets: torch.Tensor, m: int, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The result when no ``out`` is given: zero where the groups leave rows, as the CPU's
    reference (offsets the host can read; device offsets are not read: no synchronize)."""
    if offsets.device.type == "cpu" and offsets.numel() and (offsets[0] > 0 or offsets[-1] < m):
        return torch.zeros(m, n, dtype=dtype, device=device)
    return torch.empty(m, n, dtype=dtype, device=device)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    rows: torch.Tensor | None = None,
    tile: str | None = None,
) -> torch.Tensor:
    """out[offsets[g]:offsets[g+1]] = a[offsets[g]:offsets[g+1]] @ b[g] for every group g.

    a: [M, K] bf16, rows grouped (e.g. an MoE dispatch's rows, expert-major); b: [G, K, N] bf16,
    one matrix per group; offsets: [G + 1] int32 row starts (``MoeDispatch.expert_offsets``), on
    the CPU (checked) or on a's device (never read by the host: no synchronize, CUDA-graph safe;
    out-of-range values are clamped on the device, so nothing outside a, b, out is touched).
    Returns out [M, N] of ``out_dtype`` (bf16, or fp32: the accumulators unrounded), fp32
    accumulation. offsets: non-decreasing, offsets[0] >= 0, offsets[G] <= M (checked when on the
    CPU, else clamped); rows in no group are not written: a given ``out`` keeps them, a new one
    is zero there when offsets are on the CPU, unspecified when they are on the GPU. On the
    GPU one launch of the GEMM engine; ``tile`` names a ``TILE_CONFIGS`` entry (default:
    ``schedule.pick_grouped_tile``). On the CPU: the reference. ``rows`` (int32 [M'], on the CPU
    (checked) or on a's device (clamped into a's rows there)): gather A's rows by index; out is
    then [M', N] and offsets count those rows.
    """
    _check(a, b, offsets, out, out_dtype, rows)
    if tile is not None and not isinstance(tile, str):
        raise TypeError(f"grouped_gemm: tile must be a str or None, got {type(tile).__name__}")
    if tile is not None and tile not in schedule.TILE_CONFIGS:
        known = list(schedule.TILE_CONFIGS)
        raise ValueError(f"grouped_gemm: tile {tile!r} unknown; known: {known}")
    k = a.shape[1]
    m = a.shape[0] if rows is None else rows.numel()
    g, _, n = b.shape
    if not a.is_cuda:
        if rows is not None:
            a = a[rows.long()]
        ref = reference(a, b, offsets, out_dtype)
        if out is None:
            return ref
        offs = offsets.tolist()
        out[offs[0] : offs[-1]] = ref[offs[0] : offs[-1]]
        return out
    if out is None:
        out = _new_out(offsets, m, n, out_dtype, a.device)
    # NOTE: the kernel reads offsets and rows by raw pointer: a strided view must be packed
    offsets = offsets.to(a.device, non_blocking=True).contiguous()
    if rows is not None:
        rows = rows.to(a.device, non_blocking=True).contiguous()
    if m == 0:
        return out
    ext = extension()
    cfg = schedule.TILE_CONFIGS[tile] if tile else schedule.pick_grouped_tile(m, n, k, g)
    workspace = torch.empty(g + 1, dtype=torch.int32, device=a.device)
    args = ext.GroupedGemmArgs()
    args.a, args.b, args.c = a.data_ptr(), b.data_ptr(), out.data_ptr()
    args.offsets, args.workspace = offsets.data_ptr(), workspace.data_ptr()
    args.M, args.N, args.K, args.G = m, n, k, g
    if rows is not None:
        args.a_rows, args.a_src_rows = rows.data_ptr(), a.shape[0]
    args.config = schedule.TILE_CONFIG_IDS[cfg.name]
    args.out_kind = 0 if out_dtype == torch.bfloat16 else 2  # DestKind kStoreBF16 / kStoreF32
    # NOTE: the launch goes to the current device; switch only when a lives elsewhere (host time)
    here = a.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if here else torch.cuda.device(a.device):
        st = ext.launch_grouped_gemm(args, torch.cuda.current_stream().cuda_stream)
    if st:
        raise RuntimeError(f"grouped_gemm: {ext.grouped_gemm_status_string(st)}")
    return out
