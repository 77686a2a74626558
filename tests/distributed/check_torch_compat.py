"""mkernel.torch_compat against PyTorch's own torch.ops.symm_mem fused ops, one process per rank
(torchrun; two processes may share one GPU: run.sh). Every rank draws all ranks' inputs from the
same seeds, so the fp32 reference needs no communication. Per case: the same shapes, dtypes and
strides as PyTorch's results, the gathered A equal to PyTorch's, the products within bf16
rounding of the fp32 reference (ours) and close to PyTorch's (whose partials are summed in bf16);
then ``install()``: torch.ops.symm_mem's ops run ours (equal to the direct call) and PyTorch's
for a case ours do not serve (fp16); then torch.compile(fullgraph=True) of an all-gather-matmul
and matmul-reduce-scatter pair on ours, equal to eager. Prints PASS / FAIL lines on rank 0.

  CHECK=check_torch_compat.py bash tests/distributed/run.sh 2 --sms 60     # one GPU, 2 processes
  torchrun --nproc_per_node=2 tests/distributed/check_torch_compat.py      # two GPUs
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mkernel  # noqa: E402
from mkernel import torch_compat, torch_ops  # noqa: E402
from tests.distributed._common import rel_err, report, start  # noqa: E402
from tests.helpers import assert_close_bf16  # noqa: E402

AG_CASES = [  # (A_shard shape, B shapes, gather_dim, return_A)
    ((512, 256), [(256, 512)], 0, True),
    ((2, 128, 256), [(256, 256), (256, 128)], 1, True),
    ((4, 64, 256), [(256, 384)], 0, False),
    ((256, 128), [("W", 256)], 1, True),  # the last dim: B has W * K rows
]
RS_CASES = [  # (A shape, B shape, reduce_op, scatter_dim)
    ((512, 256), (256, 512), "sum", 0),
    ((512, 256), (256, 512), "avg", 0),
    ((2, 256, 128), (128, 256), "sum", 1),
    ((256, 256), (256, 512), "sum", 1),  # the last dim: columns scattered
    ((4, 64, 256), (256, 256), "avg", 0),
]
TOL = 2.0**-6  # ours against PyTorch's: its partials are bf16, summed in bf16 (W roundings)


def _all_ranks(shape, W: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(W, *shape, generator=g) / shape[-1] ** 0.25).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> bool:
    """Within bf16 rounding of the fp32 reference (assert_close_bf16), as a flag: a rank that
    raised would leave its peer waiting in report()'s all_reduce."""
    try:
        assert_close_bf16(got, want, what)
    except AssertionError as e:
        print(f"rank {dist.get_rank()}: {e}", flush=True)
        return False
    return True


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def check_all_gather_matmul(world, name: str, case, seed: int) -> tuple[bool, str]:
    a_shape, b_shapes, gather_dim, return_A = case
    W, r, dev = world.size, world.rank, world.device
    shards = _all_ranks(a_shape, W, seed)
    b_shapes = [(W * a_shape[-1] if s[0] == "W" else s[0], s[1]) for s in b_shapes]
    Bs = [_all_ranks(s, 1, seed + 1 + i)[0].to(dev) for i, s in enumerate(b_shapes)]
    A = shards[r].to(dev)
    ours = torch_compat.fused_all_gather_matmul(A, Bs, gather_dim, name, return_A=return_A)
    theirs = torch.ops.symm_mem.fused_all_gather_matmul(A, Bs, gather_dim, name, return_A=return_A)
    full = torch.cat(list(shards.unbind(0)), dim=gather_dim).to(dev)  # all_gather's meaning
    ok = (ours[0] is None) == (theirs[0] is None) == (not return_A)
    if return_A:
        ok &= _same_meta(ours[0], theirs[0]) and torch.equal(ours[0], theirs[0])
        ok &= torch.equal(ours[0], full)
    errs = []
    for o, t, B in zip(ours[1], theirs[1], Bs, strict=True):
        ok &= _same_meta(o, t)
        ok &= _close(o, (full.float() @ B.float()).bfloat16(), f"all_gather_matmul {case}")
        errs.append(rel_err(o, t))
        ok &= errs[-1] < TOL
    return ok, f"fused_all_gather_matmul {a_shape} gather_dim={gather_dim} rel err {errs}"


def check_matmul_reduce_scatter(world, name: str, case, seed: int) -> tuple[bool, str]:
    a_shape, b_shape, reduce_op, scatter_dim = case
    W, r, dev = world.size, world.rank, world.device
    As, Bs = _all_ranks(a_shape, W, seed), _all_ranks(b_shape, W, seed + 1)
    A, B = As[r].to(dev), Bs[r].to(dev)
    ours = torch_compat.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, name)
    theirs = torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, name)
    full = sum(As[q].float() @ Bs[q].float() for q in range(W))
    if reduce_op == "avg":
        full = full / W
    want = full.chunk(W, dim=scatter_dim)[r].contiguous().bfloat16().to(dev)
    ok = _close(ours, want, f"matmul_reduce_scatter {case}")
    err = rel_err(ours, theirs)
    ok &= _same_meta(ours, theirs) and ours.is_contiguous() and err < TOL
    return (
        ok,
        f"fused_matmul_reduce_scatter {a_shape} {reduce_op} dim={scatter_dim} rel err {err:.2g}",
    )


def check_install(world, name: str) -> list[tuple[bool, str]]:
    dev = world.device
    A, B = _all_ranks((256, 256), 1, 5)[0].to(dev), _all_ranks((256, 512), 1, 6)[0].to(dev)
    direct = torch_compat.fused_all_gather_matmul(A, [B], 0, name)
    direct_rs = torch_compat.fused_matmul_reduce_scatter(A, B, "sum", 0, name)
    torch_compat.install()
    try:
        via = torch.ops.symm_mem.fused_all_gather_matmul(A, [B], 0, name)
        via_rs = torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", 0, name)
        same = torch.equal(via[0], direct[0]) and torch.equal(via[1][0], direct[1][0])
        same &= torch.equal(via_rs, direct_rs)
        # fp16: not ours to serve, PyTorch's kernel runs
        h = torch.ops.symm_mem.fused_matmul_reduce_scatter(A.half(), B.half(), "sum", 0, name)
        fallback = h.dtype == torch.float16 and rel_err(h, direct_rs) < TOL
    finally:
        torch_compat.uninstall()
    return [
        (same, "install(): torch.ops.symm_mem's fused ops run mkernel's kernels"),
        (fallback, "install(): fp16 (not served by ours) runs PyTorch's kernel"),
    ]


def check_compile(world, name: str) -> tuple[bool, str]:
    dev = world.device

    def block(x, w_up, w_down):
        _, (h,) = torch_compat.fused_all_gather_matmul(x, [w_up], 0, name, return_A=False)
        h = torch.nn.functional.silu(h.float()).bfloat16()
        return torch_compat.fused_matmul_reduce_scatter(h, w_down, "sum", 0, name)

    x = _all_ranks((128, 256), world.size, 7)[world.rank].to(dev)
    w_up, w_down = _all_ranks((256, 512), 1, 8)[0].to(dev), _all_ranks((512, 256), 1, 9)[0]
    w_down = w_down.to(dev)
    eager = block(x, w_up, w_down)
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True)(x, w_up, w_down)
    err = rel_err(got, eager)
    return err < 2.0**-7, f"torch.compile(fullgraph=True) of ag-matmul, SiLU, matmul-rs: {err:.2g}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sms", type=int, default=None, help="SMs per rank (processes sharing a GPU)")
    p.add_argument("--loop", type=int, default=2, help="calls per case")
    args = p.parse_args()
    world = start()
    name = torch_ops.world_handle(world)  # the group's name: torch_compat finds this World
    assert name == dist.group.WORLD.group_name
    if args.sms is not None:
        torch_ops.set_schedule(world, mkernel.Schedule(sms=args.sms))
    failed = False
    for i, case in enumerate(AG_CASES):
        runs = [check_all_gather_matmul(world, name, case, 10 * i + it) for it in range(args.loop)]
        failed |= report(world, all(ok for ok, _ in runs), runs[-1][1])
    for i, case in enumerate(RS_CASES):
        seeds = range(100 + 10 * i, 100 + 10 * i + args.loop)
        runs = [check_matmul_reduce_scatter(world, name, case, seed) for seed in seeds]
        failed |= report(world, all(ok for ok, _ in runs), runs[-1][1])
    for ok, line in check_install(world, name):
        failed |= report(world, ok, line)
    try:  # (a rank that raised would leave its peer waiting in report())
        ok, line = check_compile(world, name)
    except Exception as e:  # noqa: BLE001
        ok, line = False, f"torch.compile(fullgraph=True) of the pair raised {e!r}"[:400]
    failed |= report(world, ok, line)
    world.check()
    dist.barrier()
    dist.destroy_process_group()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
