"""Distributed-world checks, one process per rank (launch with torchrun; see run.sh beside this).

Every rank draws all ranks' inputs from the same seeds, so the reference needs no communication:
rank r checks its own result against the emulated-convention reference. Prints one line per check
on rank 0 and exits non-zero on any failure.

  torchrun --nproc_per_node=2 tests/distributed/check_ops.py --ops gemm_rs --loop 1000 --sms 60

Also the fused ring attention forward and backward (``--no-ring`` skips them): symmetric memory
and gloo, so they run with two processes on one GPU too (run.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mkernel  # noqa: E402
from mkernel.schedule import TILE_CONFIG_IDS, pick_tile  # noqa: E402
from tests.distributed._common import rel_err  # noqa: E402
from tests.helpers import assert_close_bf16  # noqa: E402

SHAPES = {  # op -> (global m, n, k), per-rank shards derived below
    "gemm_rs": lambda W: (W * 512, 1024, W * 256),
    "ag_gemm": lambda W: (W * 256, 1024, 512),
    "gemm_ar": lambda W: (640, 1024, W * 256),
    "all_gather": lambda W: (W * 200, 1032, 0),  # rows per rank not a tile multiple
}


def inputs(op: str, W: int, rank: int, seed: int):
    """All ranks' inputs in the emulated convention (leading rank dim) and rank's own shards."""
    m, n, k = SHAPES[op](W)
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    if op == "all_gather":  # one operand: b is None
        x = torch.randn(W, m // W, n, generator=g).bfloat16()
        return x, None, x[rank].to(dev).contiguous(), None
    if op == "ag_gemm":
        a = torch.randn(W, m // W, k, generator=g)
        b = torch.randn(1, k, n, generator=g).expand(W, k, n)
    else:
        a = torch.randn(W, m, k // W, generator=g)
        b = torch.randn(W, k // W, n, generator=g)
    a, b = a.bfloat16(), b.bfloat16().contiguous()
    return a, b, a[rank].to(dev).contiguous(), b[rank].to(dev).contiguous()


def reference(op: str, a, b, W: int, rank: int) -> torch.Tensor:
    emu = mkernel.World.emulated(W)
    operands = (a,) if b is None else (a, b)
    return getattr(mkernel.reference, op)(*operands, world=emu)[rank]


def call(fn, a, b, world, schedule):
    """An op with one operand (all_gather) or two."""
    operands = (a,) if b is None else (a, b)
    return fn(*operands, world=world, schedule=schedule)


PEER_CHECKS = ("bf16 store into a peer", "fp32 TMA + atomic reduce-add into rank 0")


def check_engine_peer_epilogue(world, W: int, rank: int) -> list[tuple[str, bool, str]]:
    """The GEMM engine's epilogue writing into OTHER ranks' memory through the symmetric mapping:
    rank r stores bf16 A_r @ B_r into rank r+1's buffer (Dest kind 0: TMA tensor stores through a
    map of the peer buffer for full tiles, row copies at the edges) and reduce-adds it in fp32 into
    rank 0's accumulator twice, once by TMA reduce-add (kind 3) and once by atomics (kind 1). Every
    rank checks its bf16 buffer; rank 0 checks prefill + 2 * sum_r A_r @ B_r (the other ranks report
    that check as passed). Returns {check name: (ok, detail)} with the PEER_CHECKS names."""
    ext = mkernel.ops.common.extension()
    m, n, k = 520, 776, 264  # remainder tiles in every dimension
    gen = torch.Generator().manual_seed(77)
    a_all = [torch.randn(m, k, generator=gen).bfloat16() for _ in range(W)]
    b_all = [torch.randn(k, n, generator=gen).bfloat16() for _ in range(W)]
    prefill = torch.randn(m, n, generator=gen)
    dev = torch.device("cuda", torch.cuda.current_device())
    a, b = a_all[rank].to(dev), b_all[rank].to(dev)
    dst = world.symmetric(("engine_peer_bf16",), (m, n), torch.bfloat16)
    acc = world.symmetric(("engine_peer_f32",), (m, n), torch.float32)
    dst.local.fill_(float("nan"))
    acc.local.copy_(prefill.to(dev))
    torch.cuda.synchronize()
    dist.barrier()
    ptrs = dst.peer_ptrs.tolist(), acc.peer_ptrs.tolist()
    stream = torch.cuda.current_stream().cuda_stream
    for c_ptr, kind in ((ptrs[0][(rank + 1) % W], 0), (ptrs[1][0], 3), (ptrs[1][0], 1)):
        args = ext.GemmArgs()
        args.a, args.b, args.c = a.data_ptr(), b.data_ptr(), c_ptr
        args.M, args.N, args.K, args.out_kind = m, n, k, kind
        # The launcher has no heuristic: the caller picks the config (the package's one rule).
        args.config = TILE_CONFIG_IDS[
            pick_tile(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count).name
        ]
        st = ext.launch_gemm(args, stream)
        if st:
            return dict.fromkeys(PEER_CHECKS, (False, f"launch: {ext.gemm_status_string(st)}"))
    torch.cuda.synchronize()
    dist.barrier()
    src = (rank - 1) % W
    want = a_all[src].float() @ b_all[src].float()
    got = dst.local.float().cpu()
    rel = ((got - want).norm() / want.norm()).item()
    bf16 = (bool(torch.isfinite(got).all()) and rel < 1e-2, f"rel err {rel:.2e}")
    fp32 = (True, "")
    if rank == 0:
        want32 = prefill + 2 * sum(x.float() @ y.float() for x, y in zip(a_all, b_all, strict=True))
        got32 = acc.local.cpu()
        rel32 = ((got32 - want32).norm() / want32.norm()).item()
        fp32 = (rel32 < 1e-5, f"rel err {rel32:.2e}")
    return dict(zip(PEER_CHECKS, (bf16, fp32), strict=True))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="gemm_rs,ag_gemm,gemm_ar,all_gather")
    p.add_argument("--loop", type=int, default=100)
    p.add_argument("--sms", type=int, default=None, help="SMs per rank (processes sharing a GPU)")
    p.add_argument("--device", type=int, default=None, help="GPU index (default: local rank)")
    p.add_argument("--no-ring", dest="ring", action="store_false", help="skip ring attention")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(
        args.device if args.device is not None else local % torch.cuda.device_count()
    )
    backend = "gloo" if torch.cuda.device_count() < int(os.environ["WORLD_SIZE"]) else "nccl"
    dist.init_process_group(backend)
    world = mkernel.World.from_process_group(timeout_s=5.0)
    W, rank = world.size, world.rank
    failures = 0

    def report(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        flags = torch.tensor([0 if ok else 1], device="cpu" if backend == "gloo" else "cuda")
        dist.all_reduce(flags)
        bad = int(flags.item())
        failures += bad > 0
        if rank == 0:
            print(f"{'PASS' if bad == 0 else 'FAIL'} W={W} {name} {detail}", flush=True)

    try:
        results = check_engine_peer_epilogue(world, W, rank)
    except Exception as e:  # noqa: BLE001 - reported, counted, and the run goes on
        results = dict.fromkeys(PEER_CHECKS, (False, repr(e)[:300]))
    for name, (ok, detail) in results.items():
        report(f"engine epilogue: {name}", ok, detail)  # every rank takes part in the all_reduce
    for op in args.ops.split(","):
        fn = getattr(mkernel, op)
        # ag_gemm also with its TMA push (inter_sm comm CTAs, primitives/bulk_ring.cuh)
        modes = [("intra_sm", None), ("inter_sm", None)]
        modes += [("inter_sm", "tma")] if op == "ag_gemm" else []
        for overlap, transfer in modes:
            sched = mkernel.Schedule(overlap=overlap, sms=args.sms, transfer=transfer)
            label = overlap if transfer is None else f"{overlap} {transfer}"
            a, b, la, lb = inputs(op, W, rank, seed=1)
            ref = reference(op, a, b, W, rank)
            try:
                out = call(fn, la, lb, world, sched)
                assert_close_bf16(out.cpu(), ref, op)
                report(f"{op} {label} correct", True)
            except Exception as e:  # noqa: BLE001 - reported, counted, and the run goes on
                report(f"{op} {label} correct", False, repr(e)[:300])
                continue
            world.sync_checks = False
            t0 = time.perf_counter()
            for _ in range(args.loop):
                out = call(fn, la, lb, world, sched)
            try:
                world.check()
                assert_close_bf16(out.cpu(), ref, op)
                ok, detail = True, f"{(time.perf_counter() - t0) / args.loop * 1e6:.0f} us/call"
            except Exception as e:  # noqa: BLE001
                ok, detail = False, repr(e)[:300]
            world.sync_checks = True
            report(f"{op} {label} loop x{args.loop}", ok, detail)
            late = mkernel.Schedule(
                overlap=overlap,
                sms=args.sms,
                transfer=transfer,
                faults=mkernel.Faults(delay_rank=W - 1, delay_us=300),
            )
            try:
                out = call(fn, la, lb, world, late)
                assert_close_bf16(out.cpu(), ref, op)
                report(f"{op} {label} straggler rank {W - 1}", True)
            except Exception as e:  # noqa: BLE001
                report(f"{op} {label} straggler", False, repr(e)[:300])
    if args.ring:
        for name, ok, detail in check_ring_attention(world, W, rank, args.sms, args.loop):
            report(name, ok, detail)
        for name, ok, detail in check_ring_backward(world, W, rank, args.sms, args.loop):
            report(name, ok, detail)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


def check_ring_attention(world, W: int, rank: int, sms, loop: int):
    """The fused ring attention kernel (kernels/ring_attention.cu) through symmetric memory: every
    layout, causal or not, both overlaps, S_local off the 128-row tile, GQA; this rank's out and
    lse against the fp32 reference of the emulated convention; then a loop of calls and a
    straggler rank. Yields (name, ok, detail)."""
    B, S, Hq, Hkv, D = 1, 200, 4, 2, 128
    g = torch.Generator().manual_seed(5)
    q = torch.randn(W, B, S, Hq, D, generator=g).bfloat16()
    k, v = (torch.randn(W, B, S, Hkv, D, generator=g).bfloat16() for _ in range(2))
    dev = torch.device("cuda", torch.cuda.current_device())
    mine = [x[rank].to(dev).contiguous() for x in (q, k, v)]
    emu = mkernel.World.emulated(W)
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            want, want_lse = mkernel.reference.ring_attention(q, k, v, emu, causal, None, layout)
            for overlap in ("intra_sm", "inter_sm"):
                label = f"ring_attention {layout} causal={causal} {overlap}"
                for faults, what in ((None, "correct"), ("late", "straggler"), ("loop", "loop")):
                    sched = mkernel.Schedule(overlap=overlap, sms=sms)
                    if faults == "late":
                        late = mkernel.Faults(delay_rank=W - 1, delay_us=300)
                        sched = mkernel.Schedule(overlap=overlap, sms=sms, faults=late)
                    try:
                        n = loop if faults == "loop" else 1
                        for _ in range(n):
                            out, lse = mkernel.ring_attention(*mine, world, causal, None, layout,
                                                              sched)  # fmt: skip
                        world.check()
                        # P is rounded to bf16 before P V (the engine's operand): 2% of the
                        # largest |out| (tests/gpu/ derive the exact bound; this is a smoke
                        # check of the distributed path)
                        err = rel_err(out, want[rank])
                        assert not torch.isnan(out).any() and err < 2e-2, f"out off by {err:.2e}"
                        err = float((lse.cpu() - want_lse[rank]).abs().max())
                        assert err < 1e-2, f"lse off by {err:.2e}"
                        yield f"{label} {what}" + (f" x{n}" if n > 1 else ""), True, ""
                    except Exception as e:  # noqa: BLE001 - reported, counted, the run goes on
                        yield f"{label} {what}", False, repr(e)[:300]


def check_ring_backward(world, W: int, rank: int, sms, loop: int):
    """The fused ring attention backward (kernels/ring_attention_backward.cu) through symmetric
    memory: every layout, causal or not, both overlaps, S_local off the tile, GQA; this rank's dq,
    dk, dv against the fp32 reference's autograd; through ``out.backward`` (the autograd path)
    once, then a loop of direct calls and a straggler rank. Yields (name, ok, detail)."""
    B, S, Hq, Hkv, D = 1, 200, 4, 2, 128
    g = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(W, B, S, Hq, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(W, B, S, Hkv, D, generator=g).bfloat16() for _ in range(2))
    dev = torch.device("cuda", torch.cuda.current_device())
    mine = [x[rank].to(dev).contiguous() for x in (q, k, v, dout)]
    emu = mkernel.World.emulated(W)
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            out_r, lse_r = mkernel.reference.ring_attention(q, k, v, emu, causal, None, layout)
            want = mkernel.reference.ring_attention_backward(
                dout, q, k, v, out_r, lse_r, emu, causal, None, layout
            )
            for overlap in ("intra_sm", "inter_sm"):
                label = f"ring_attention_backward {layout} causal={causal} {overlap}"
                for what in ("autograd", "straggler", "loop"):
                    sched = mkernel.Schedule(overlap=overlap, sms=sms)
                    if what == "straggler":
                        late = mkernel.Faults(delay_rank=W - 1, delay_us=300)
                        sched = mkernel.Schedule(overlap=overlap, sms=sms, faults=late)
                    try:
                        if what == "autograd":
                            leaves = [x.clone().requires_grad_() for x in mine[:3]]
                            out, _ = mkernel.ring_attention(*leaves, world, causal, None, layout,
                                                            sched)  # fmt: skip
                            out.backward(mine[3])
                            got = [x.grad for x in leaves]
                            n = 1
                        else:
                            out, lse = mkernel.ring_attention(*mine[:3], world, causal, None,
                                                              layout, sched)  # fmt: skip
                            n = loop if what == "loop" else 1
                            for _ in range(n):
                                got = mkernel.ring_attention_backward(
                                    mine[3], *mine[:3], out, lse, world, causal, None, layout,
                                    sched,
                                )  # fmt: skip
                        world.check()
                        for name, x, w in zip(("dq", "dk", "dv"), got, want, strict=True):
                            err = rel_err(x, w[rank])  # bf16 P and dS: a smoke bound, as above
                            assert not torch.isnan(x).any() and err < 2e-2, f"{name} off {err:.2e}"
                        yield f"{label} {what}" + (f" x{n}" if n > 1 else ""), True, ""
                    except Exception as e:  # noqa: BLE001 - reported, counted, the run goes on
                        yield f"{label} {what}", False, repr(e)[:300]


if __name__ == "__main__":
    sys.exit(main())
