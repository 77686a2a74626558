"""Command line: ``python -m mkernel demo`` and ``python -m mkernel bench <name>``."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def demo(ranks: int = 4, device: str | None = None) -> int:
    """GEMM+ReduceScatter in an emulated world of ``ranks`` ranks, on the GPU when there is one
    (else on the CPU interpreter), checked against the unfused reference, both schedules."""
    import mkernel

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = mkernel.World.emulated(ranks, device=device)
    m, n, kl = (ranks * 1024, 2048, 512) if device == "cuda" else (ranks * 128, 256, 64)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(ranks, m, kl, generator=g).bfloat16().to(device)
    b = torch.randn(ranks, kl, n, generator=g).bfloat16().to(device)
    ref = mkernel.reference.gemm_rs(a, b, world=world).float()
    backend = torch.cuda.get_device_name() if device == "cuda" else "CPU interpreter"
    print(f"mkernel demo: gemm_rs, emulated world of {ranks} ranks on {backend}")
    print(
        f"  per rank: a [{m}, {kl}] @ b [{kl}, {n}] -> reduce-scatter -> [{m // ranks}, {n}] bf16"
    )
    ok = True
    for overlap in ("intra_sm", "inter_sm"):
        sched = mkernel.Schedule(overlap=overlap)
        t0 = time.perf_counter()
        out = mkernel.gemm_rs(a, b, world=world, schedule=sched)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        err = ((out.float() - ref).norm() / ref.norm()).item()
        pads_clear = all(int(p.abs().sum()) == 0 for p in world.signal_pads().values())
        good = err < 1e-2 and not torch.isnan(out.float()).any().item() and pads_clear
        ok &= good
        print(
            f"  {overlap:9s} rel. error vs reference {err:.2e}  signal pads reset: {pads_clear}  "
            f"{dt * 1e3:8.1f} ms  {'OK' if good else 'FAILED'}"
        )
        if device == "cpu" and world.last_timeline is not None:
            print("  timeline of whole ranks (interpreter steps; legend first):")
            for line in world.last_timeline.ascii(60, max_rows=10).splitlines():
                print("   ", line)
    print("demo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def bench(name: str, args: list[str]) -> int:
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    if name == "gemm":
        from .bench import gemm

        gemm.run()
        return 0
    if name == "grouped":
        from .bench import grouped

        grouped.run()
        return 0
    if name == "host":
        from .bench import host

        host.run()
        return 0
    if name == "p2p":
        from .bench import p2p

        # under torchrun: python -m torch.distributed.run --nproc_per_node=2 -m mkernel bench p2p
        p2p.main()
        return 0
    print(
        f"unknown benchmark {name!r} "
        "(known: gemm, grouped, host, p2p; tp runs under torchrun: -m mkernel.bench.tp)",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mkernel")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo", help="gemm_rs in an emulated 4-rank world, checked against the reference"
    )
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--device", choices=["cpu", "cuda"], default=None)
    b = sub.add_parser("bench", help="benchmarks against the baselines (GPU)")
    b.add_argument("name")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return demo(args.ranks, args.device)
    return bench(args.name, args.rest)


if __name__ == "__main__":
    sys.exit(main())
