"""Drop-in replacements for PyTorch's async-TP fused ops, on mkernel's fused kernels.

``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` take the arguments of
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``
(torch/distributed/_symmetric_memory/__init__.py) and return what they return, with their
argument errors (ValueError, the same messages first); they run ``torch.ops.mkernel.ag_gemm`` /
``gemm_ar`` / ``gemm_rs`` / ``all_gather`` (mkernel/torch_ops.py) in the distributed world of the
process group named ``group_name`` (``World.from_process_group``, made once per group; one that
``torch_ops.world_handle`` registered for the group is used instead). What our kernels do not
serve raises TypeError / ValueError naming the argument: tensors that are not bf16 or not on a
CUDA device, and the shapes the kernels refuse (rows of 16 bytes: K and N multiples of 8; a
scatter dimension divisible by the group size). ``install()`` makes them the CUDA kernels of
PyTorch's own ops, so that code which calls those ops (inductor's micro-pipeline TP pass, which
TorchTitan's async TP turns on) runs ours, and PyTorch's for the cases ours do not serve
(docs/pytorch.md).

How each case maps (W ranks, this rank r; the leading dims are flattened as PyTorch does):

- all-gather along a dim other than the last: the shard with its gather dim moved first, flattened
  to [m, K], gathered and multiplied by ``ag_gemm`` once per B (each call gathers again: pass one
  B, e.g. the weights concatenated along N, for one gather); ``return_A``: ``all_gather`` of it.
- all-gather along the last dim: ``A_gathered @ B = sum_q A_q @ B[q*K:(q+1)*K]``, ``gemm_ar`` of
  the shard and rows r*K.. of B.
- reduce-scatter along a dim other than the last: ``gemm_rs`` of A with the scatter dim moved
  first (that dim divisible by W); along the last dim: ``gemm_rs`` of the transposes (B^T @ A^T,
  rows r*N/W.. of the sum), transposed back (three copies). ``"avg"`` divides the bf16 sum by W.

A non-contiguous operand (e.g. a transposed weight) is copied once per call (``contiguous()``).
"""

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import Tensor

from . import torch_ops

__all__ = [
    "fused_all_gather_matmul",
    "fused_matmul_reduce_scatter",
    "supports_all_gather_matmul",
    "supports_matmul_reduce_scatter",
    "install",
    "uninstall",
]

# ag_gemm, gemm_ar, gemm_rs, all_gather taking a world handle (the group's name) (tests substitute)
_kernels: Any = torch_ops
ALIGN = 8  # elements: the kernels' rows are 16-byte aligned (K and N multiples of 8)


@torch.compiler.assume_constant_result
def _group(group_name: str) -> tuple[int, int]:
    """(size, this process's rank) of the process group named ``group_name``."""
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a process group's name (str), got {group_name!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group_name names a process group: torch.distributed is not initialised")
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"group_name {group_name!r} names no process group") from e
    return dist.get_world_size(group), dist.get_rank(group)


def _check_bf16_cuda(named: Sequence[tuple[str, Tensor]]) -> None:
    """Every operand bf16 (TypeError naming the first that is not), then on a CUDA device."""
    for name, t in named:
        if t.dtype != torch.bfloat16:
            raise TypeError(
                f"{name} must be torch.bfloat16 (mkernel's fused kernels), got {t.dtype}"
            )
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(
                f"{name} is on {t.device}: mkernel's fused ops run distributed worlds on CUDA "
                "devices (one process per GPU)"
            )


def _check_aligned(name: str, value: int, what: str) -> None:
    if value <= 0 or value % ALIGN:
        raise ValueError(f"{name}={value} must be a positive multiple of {ALIGN} ({what})")


def _check_all_gather_args(A_shard: Tensor, Bs: Sequence[Tensor], gather_dim: int) -> None:
    """PyTorch's checks, in its order and with its messages, then ours."""
    if A_shard.dim() < 2:
        raise ValueError("A_shard must be a matrix")
    for B in Bs:
        if B.dim() != 2:
            raise ValueError("B must be a matrix")
    if gather_dim < 0 or gather_dim >= A_shard.dim():
        raise ValueError(f"Invalid gather_dim: {gather_dim} (A_shard has {A_shard.dim()} dims)")


def _check_reduce_scatter_args(A: Tensor, B: Tensor, reduce_op: str, scatter_dim: int) -> None:
    """PyTorch's checks, in its order and with its messages (its "Invalid gather_dim" too)."""
    if A.dim() < 2:
        raise ValueError("A_shard must be a matrix")
    if scatter_dim < 0 or scatter_dim >= A.dim():
        raise ValueError(f"Invalid gather_dim: scatter_dim={scatter_dim} (A has {A.dim()} dims)")
    if B.dim() != 2:
        raise ValueError("B must be a matrix")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be sum or avg, got {reduce_op!r}")


def fused_all_gather_matmul(
    A_shard: Tensor,
    Bs: Sequence[Tensor],
    gather_dim: int,
    group_name: str,
    *,
    return_A: bool = True,
) -> tuple[Tensor | None, list[Tensor]]:
    """``torch.ops.symm_mem.fused_all_gather_matmul`` on mkernel's kernels. Unfused meaning::

        A = all_gather_single(A_shard, gather_dim, group_name)   # concatenated along gather_dim
        return (A if return_A else None), [A @ B for B in Bs]

    Args:
        A_shard: bf16 [..., K] on this process's GPU, at least 2 dims; the shards of the group's
            ranks, in rank order, are concatenated along ``gather_dim``.
        Bs: bf16 matrices [K', N_i]: K' = K, or W * K when gather_dim is the last dim; N_i and K
            multiples of 8.
        gather_dim: in [0, A_shard.dim()).
        group_name: the process group's name (``group.group_name``).
        return_A: also return the gathered A.

    Returns:
        (A or None, [A @ B for B in Bs]): bf16, A of A_shard's shape with W times the gather
        dim's extent; each product [..., N_i] (fp32 accumulation, rounded once).
    """
    Bs = list(Bs)
    _check_all_gather_args(A_shard, Bs, gather_dim)
    _check_bf16_cuda([("A_shard", A_shard), *((f"Bs[{i}]", B) for i, B in enumerate(Bs))])
    W, rank = _group(group_name)
    K = A_shard.shape[-1]
    last = gather_dim == A_shard.dim() - 1
    for i, B in enumerate(Bs):
        if B.shape[0] != (W * K if last else K):
            want = f"W * K = {W} * {K}" if last else f"K = {K}"
            raise ValueError(f"Bs[{i}] has {B.shape[0]} rows, A_shard @ B needs {want}")
    if last:  # sum over ranks q of A_q @ B's rows of q: gemm_ar
        flat = A_shard.flatten(0, -2).contiguous()  # [m, K]
        lead = A_shard.shape[:-1]
        outs = [
            _kernels.gemm_ar(flat, B[rank * K : (rank + 1) * K].contiguous(), group_name)
            for B in Bs
        ]
        outs = [o.view(*lead, -1) for o in outs]
        A = None
        if return_A:
            gathered = _kernels.all_gather(flat, group_name)  # [W * m, K]
            A = torch.cat(gathered.chunk(W), dim=-1).view(*lead, -1)
        return A, outs
    moved = A_shard.movedim(gather_dim, 0)
    leading = [W, *moved.shape[:-1]]
    flat = moved.flatten(0, -2).contiguous()  # [m, K]

    def unflatten(t: Tensor) -> Tensor:
        return t.view(*leading, -1).flatten(0, 1).movedim(0, gather_dim)

    outs = [unflatten(_kernels.ag_gemm(flat, B.contiguous(), group_name)) for B in Bs]
    A = unflatten(_kernels.all_gather(flat, group_name)) if return_A else None
    return A, outs


def fused_matmul_reduce_scatter(
    A: Tensor, B: Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> Tensor:
    """``torch.ops.symm_mem.fused_matmul_reduce_scatter`` on mkernel's kernels. Unfused meaning::

        reduce_scatter_single(A @ B, reduce_op, scatter_dim, group_name)

    i.e. this rank's 1/W of ``sum over ranks of A_q @ B_q`` (``"avg"``: divided by W) along
    ``scatter_dim``.

    Args:
        A: bf16 [..., K] on this process's GPU, at least 2 dims; K a multiple of 8.
        B: bf16 [K, N]; N a multiple of 8 (scatter along the last dim: N / W and the rows of A).
        reduce_op: "sum" or "avg".
        scatter_dim: in [0, A.dim()); A.shape[scatter_dim] (N for the last dim) divisible by W.
        group_name: the process group's name.

    Returns:
        bf16 [..., N] with the scatter dim's extent divided by W, contiguous; fp32 accumulation
        of the ranks' partials, rounded once (``"avg"``: then divided by W in bf16).
    """
    _check_reduce_scatter_args(A, B, reduce_op, scatter_dim)
    _check_bf16_cuda([("A", A), ("B", B)])
    W, _ = _group(group_name)
    if B.shape[0] != A.shape[-1]:
        raise ValueError(f"B has {B.shape[0]} rows, A has K = {A.shape[-1]} columns: must agree")
    if scatter_dim == A.dim() - 1:  # columns: rows of (B^T @ A^T), transposed back
        N = B.shape[1]
        if N % W:
            raise ValueError(f"N (columns of B) = {N} must divide by the group size {W}")
        flat = A.flatten(0, -2)
        out_t = _kernels.gemm_rs(B.t().contiguous(), flat.t().contiguous(), group_name)
        out = out_t.t().contiguous().view(*A.shape[:-1], N // W)
    else:
        d = A.shape[scatter_dim]
        if d % W:
            raise ValueError(
                f"A.shape[scatter_dim={scatter_dim}] = {d} must divide by the group size {W}"
            )
        moved = A.movedim(scatter_dim, 0)
        lead = [d // W, *moved.shape[1:-1]]
        out = _kernels.gemm_rs(moved.flatten(0, -2).contiguous(), B.contiguous(), group_name)
        out = out.view(*lead, -1).movedim(0, scatter_dim).contiguous()
    return out / W if reduce_op == "avg" else out


# -- which calls our kernels serve (install's dispatch) -------------------------------------------


def supports_all_gather_matmul(
    A_shard: Tensor, Bs: Sequence[Tensor], gather_dim: int, group_name: str
) -> bool:
    """Whether ``fused_all_gather_matmul`` serves this call (else it raises; ``install``'s kernel
    runs PyTorch's instead): valid arguments, bf16 CUDA tensors, K and each N multiples of 8."""
    try:
        _check_all_gather_args(A_shard, Bs, gather_dim)
        _check_bf16_cuda([("A_shard", A_shard), *((f"Bs[{i}]", B) for i, B in enumerate(Bs))])
        W, _ = _group(group_name)
        K = A_shard.shape[-1]
        last = gather_dim == A_shard.dim() - 1
        _check_aligned("K", K, "16-byte rows")
        for B in Bs:
            _check_aligned("N", B.shape[1], "16-byte rows")
            if B.shape[0] != (W * K if last else K):
                return False
        return A_shard.numel() > 0
    except (TypeError, ValueError):
        return False


def supports_matmul_reduce_scatter(
    A: Tensor, B: Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> bool:
    """Whether ``fused_matmul_reduce_scatter`` serves this call: valid arguments, bf16 CUDA
    tensors, K and N multiples of 8, the scattered extent divisible by W (the last dim: N / W
    and A's rows multiples of 8 too, as the transposed GEMM's K and N)."""
    try:
        _check_reduce_scatter_args(A, B, reduce_op, scatter_dim)
        _check_bf16_cuda([("A", A), ("B", B)])
        W, _ = _group(group_name)
        K, N = A.shape[-1], B.shape[1]
        if B.shape[0] != K or A.numel() == 0:
            return False
        _check_aligned("K", K, "16-byte rows")
        _check_aligned("N", N, "16-byte rows")
        if scatter_dim == A.dim() - 1:
            _check_aligned("M", A.numel() // K, "the transposed GEMM's N")
            return N % W == 0
        return A.shape[scatter_dim] % W == 0
    except (TypeError, ValueError):
        return False


# -- install: ours as the CUDA kernels of torch.ops.symm_mem's fused ops ---------------------------

_torch_all_gather_matmul = symm_mem._fused_all_gather_matmul  # PyTorch's CUDA kernels
_torch_matmul_reduce_scatter = symm_mem._fused_matmul_reduce_scatter
_library: torch.library.Library | None = None
_IMPL_HAS_OVERRIDE = "allow_override" in inspect.signature(torch.library.Library.impl).parameters


def _all_gather_matmul_kernel(
    A_shard: Tensor, Bs: list[Tensor], gather_dim: int, group_name: str, *, return_A: bool = True
) -> tuple[Tensor | None, list[Tensor]]:
    if supports_all_gather_matmul(A_shard, Bs, gather_dim, group_name):
        return fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A)
    return _torch_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A)


def _matmul_reduce_scatter_kernel(
    A: Tensor, B: Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> Tensor:
    if supports_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
        return fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)
    return _torch_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)


def install() -> None:
    """Makes mkernel's kernels the CUDA kernels of ``torch.ops.symm_mem.fused_all_gather_matmul``
    and ``fused_matmul_reduce_scatter`` (calls ours do not serve, ``supports_*`` False, run
    PyTorch's). Their fake (meta) kernels stay PyTorch's: the results' shapes and strides are
    the same. ``uninstall()`` restores PyTorch's. Idempotent."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("symm_mem", "IMPL")
    # PyTorch registers these CUDA kernels from Python; Library.impl refuses to override such a
    # kernel unless told (allow_override, False by default before torch 2.13, absent earlier)
    kw = {"allow_override": True} if _IMPL_HAS_OVERRIDE else {}
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("fused_all_gather_matmul", _all_gather_matmul_kernel, "CUDA", **kw)
        lib.impl("fused_matmul_reduce_scatter", _matmul_reduce_scatter_kernel, "CUDA", **kw)
    _library = lib


def uninstall() -> None:
    """Gives ``torch.ops.symm_mem``'s fused ops their PyTorch CUDA kernels back."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    return _library is not None
