"""mkernel.torch_compat on the CPU. PyTorch's symm_mem ops have no CPU kernel and mkernel's
distributed worlds need GPUs, so here: (1) the argument errors are PyTorch's (its own checks run
on the same bad arguments: the same type, its message first), and ours name the argument for what
our kernels do not serve; (2) the layout logic (gather / scatter dims, flattening, the last dim's
gemm_ar and transposed gemm_rs, return_A, avg) against PyTorch's own fallback implementation
(``_fused_*_fallback``, what its test mode runs) with 2 processes joined by gloo, our kernels
replaced by exact gloo references of their meaning (integer-valued inputs: every sum exact);
(3) install / uninstall of our CUDA kernels for torch.ops.symm_mem's ops. The real kernels
against torch.ops.symm_mem on a GPU: tests/distributed/check_torch_compat.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.multiprocessing as mp

from mkernel import torch_compat
from tests.test_ring_attention_dist import _free_port

bf16 = torch.bfloat16


def _torch_ag_error(A, Bs, gather_dim) -> Exception:
    """The error PyTorch's fused_all_gather_matmul raises for these arguments (its checks run
    before it resolves the group)."""
    with pytest.raises(Exception) as e:
        symm_mem._fused_all_gather_matmul_impl(
            torch.ops.aten.mm.out, A, Bs, None, [{} for _ in Bs], [None] * len(Bs),
            gather_dim, "no-group", True,
        )  # fmt: skip
    return e.value


def _torch_rs_error(A, B, reduce_op, scatter_dim) -> Exception:
    with pytest.raises(Exception) as e:
        symm_mem._fused_matmul_reduce_scatter_impl(
            torch.ops.aten.mm.out, A, B, {}, None, reduce_op, scatter_dim, "no-group"
        )
    return e.value


AG_BAD = [  # (A shape, B shapes, gather_dim)
    ((16,), [(16, 8)], 0),  # A not a matrix
    ((4, 16), [(16, 8), (2, 16, 8)], 0),  # a B not a matrix
    ((4, 16), [(16, 8)], 2),  # gather_dim out of range
    ((4, 16), [(16, 8)], -1),  # PyTorch refuses negative dims
]
RS_BAD = [  # (A shape, B shape, reduce_op, scatter_dim)
    ((16,), (16, 8), "sum", 0),
    ((4, 16), (16, 8), "sum", 2),
    ((4, 16), (16, 8), "sum", -1),
    ((4, 16), (2, 16, 8), "sum", 0),
    ((4, 16), (16, 8), "max", 0),
]


@pytest.mark.parametrize("case", AG_BAD)
def test_all_gather_matmul_errors_are_pytorchs(case):
    a_shape, b_shapes, gather_dim = case
    A, Bs = torch.zeros(a_shape, dtype=bf16), [torch.zeros(s, dtype=bf16) for s in b_shapes]
    theirs = _torch_ag_error(A, Bs, gather_dim)
    with pytest.raises(type(theirs), match=re.escape(str(theirs))):
        torch_compat.fused_all_gather_matmul(A, Bs, gather_dim, "no-group")


@pytest.mark.parametrize("case", RS_BAD)
def test_matmul_reduce_scatter_errors_are_pytorchs(case):
    a_shape, b_shape, reduce_op, scatter_dim = case
    A, B = torch.zeros(a_shape, dtype=bf16), torch.zeros(b_shape, dtype=bf16)
    theirs = _torch_rs_error(A, B, reduce_op, scatter_dim)
    with pytest.raises(type(theirs), match=re.escape(str(theirs))):
        torch_compat.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, "no-group")


def test_what_our_kernels_do_not_serve_is_named():
    A, B = torch.zeros(4, 16), torch.zeros(16, 8)
    with pytest.raises(TypeError, match="A_shard must be torch.bfloat16"):
        torch_compat.fused_all_gather_matmul(A, [B.bfloat16()], 0, "g")
    with pytest.raises(TypeError, match=re.escape("Bs[1] must be torch.bfloat16")):
        torch_compat.fused_all_gather_matmul(A.bfloat16(), [B.bfloat16(), B], 0, "g")
    with pytest.raises(TypeError, match="B must be torch.bfloat16"):
        torch_compat.fused_matmul_reduce_scatter(A.bfloat16(), B, "sum", 0, "g")
    with pytest.raises(ValueError, match="A_shard is on cpu: .* CUDA"):
        torch_compat.fused_all_gather_matmul(A.bfloat16(), [B.bfloat16()], 0, "g")
    with pytest.raises(ValueError, match="A is on cpu: .* CUDA"):
        torch_compat.fused_matmul_reduce_scatter(A.bfloat16(), B.bfloat16(), "avg", 1, "g")


def test_supports_is_false_off_the_gpu():
    A, B = torch.zeros(4, 16, dtype=bf16), torch.zeros(16, 8, dtype=bf16)
    assert not torch_compat.supports_all_gather_matmul(A, [B], 0, "g")
    assert not torch_compat.supports_matmul_reduce_scatter(A, B, "sum", 0, "g")


def test_install_and_uninstall_swap_the_cuda_kernels():
    def cuda_kernel(op: str) -> str:
        dump = torch._C._dispatch_dump(f"symm_mem::{op}")
        return next(line for line in dump.splitlines() if line.startswith("CUDA:"))

    ops = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
    before = {op: cuda_kernel(op) for op in ops}
    assert not torch_compat.installed()
    torch_compat.install()
    torch_compat.install()  # idempotent
    try:
        assert torch_compat.installed()
        for op in ops:
            assert "mkernel/torch_compat.py" in cuda_kernel(op)
            assert "_symmetric_memory" in before[op]
            # the fake (meta) kernel stays PyTorch's
            meta = torch._C._dispatch_dump(f"symm_mem::{op}")
            assert "mkernel" not in next(x for x in meta.splitlines() if x.startswith("Meta:"))
    finally:
        torch_compat.uninstall()
    assert not torch_compat.installed()
    assert {op: cuda_kernel(op) for op in ops} == before


# -- the layout logic against PyTorch's fallback, 2 processes (gloo) ------------------------------


class _GlooKernels:
    """The meaning of each kernel torch_compat calls, per rank, by gloo collectives (fp32 sums,
    one bf16 rounding; exact for the integer-valued inputs here)."""

    def __init__(self, group_name: str) -> None:
        self.group = dist.distributed_c10d._resolve_process_group(group_name)
        self.W, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.W)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def _sum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.is_contiguous() and b.is_contiguous()
        p = a.float() @ b.float()
        dist.all_reduce(p, group=self.group)
        return p

    def ag_gemm(self, a, b, world):
        return (self._gather(a).float() @ b.float()).bfloat16()

    def gemm_ar(self, a, b, world):
        return self._sum(a, b).bfloat16()

    def gemm_rs(self, a, b, world):
        return self._sum(a, b).chunk(self.W)[self.rank].bfloat16().contiguous()

    def all_gather(self, x, world):
        return self._gather(x)


def _ints(shape, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-1, 2, shape, generator=g).to(bf16)


AG_CASES = [  # (A_shard shape, B shapes (K' x N), gather_dim, return_A)
    ((4, 16), [(16, 8)], 0, True),
    ((4, 16), [(16, 8), (16, 24)], 0, False),
    ((2, 3, 16), [(16, 8)], 0, True),
    ((2, 3, 16), [(16, 8), (16, 16)], 1, True),
    ((2, 3, 16), [(32, 8)], 2, True),  # the last dim: B has W * K rows
    ((5, 16), [(32, 8), (32, 16)], 1, False),
]
RS_CASES = [  # (A shape, B shape, reduce_op, scatter_dim)
    ((4, 16), (16, 8), "sum", 0),
    ((4, 16), (16, 8), "avg", 0),
    ((2, 4, 16), (16, 8), "sum", 1),
    ((6, 2, 16), (16, 8), "avg", 0),
    ((8, 16), (16, 8), "sum", 1),  # the last dim: columns scattered
    ((2, 8, 16), (16, 16), "avg", 2),
]


def _worker(rank: int, W: int, port: int) -> None:
    import os

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    try:
        name = dist.group.WORLD.group_name
        torch_compat._kernels = _GlooKernels(name)
        torch_compat._check_bf16_cuda = lambda named: None  # CPU tensors stand in for CUDA ones
        g = torch.Generator().manual_seed(100 + rank)
        for a_shape, b_shapes, gather_dim, return_A in AG_CASES:
            A = _ints(a_shape, g)
            Bs = [_ints(s, torch.Generator().manual_seed(7)) for s in b_shapes]  # replicated
            got = torch_compat.fused_all_gather_matmul(A, Bs, gather_dim, name, return_A=return_A)
            ref = symm_mem._fused_all_gather_matmul_fallback(
                A, Bs, gather_dim, name, return_A=return_A
            )
            what = f"all_gather_matmul {a_shape} gather_dim={gather_dim}"
            assert (got[0] is None) == (ref[0] is None) == (not return_A), what
            for x, y in zip((got[0], *got[1]), (ref[0], *ref[1]), strict=True):
                if x is not None:
                    assert x.shape == y.shape and x.dtype == y.dtype, what
                    assert torch.equal(x, y), what
        for a_shape, b_shape, reduce_op, scatter_dim in RS_CASES:
            A, B = _ints(a_shape, g), _ints(b_shape, g)
            got = torch_compat.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, name)
            ref = symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, name)
            what = f"matmul_reduce_scatter {a_shape} {reduce_op} scatter_dim={scatter_dim}"
            assert got.shape == ref.shape and got.dtype == ref.dtype, what
            assert got.is_contiguous(), what
            assert torch.equal(got, ref), what
        with pytest.raises(ValueError, match="must divide by the group size 2"):
            torch_compat.fused_matmul_reduce_scatter(_ints((3, 16), g), B, "sum", 0, name)
        with pytest.raises(ValueError, match=r"Bs\[0\] has 16 rows, .* W \* K = 2 \* 16"):
            torch_compat.fused_all_gather_matmul(_ints((4, 16), g), [B], 1, name)
    finally:
        dist.destroy_process_group()


def test_layouts_match_pytorchs_fallback_on_two_processes():
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
