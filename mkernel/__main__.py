"""Command line: ``python -m mkernel demo`` and ``python -m mkernel bench <name>``."""

from __future__ import annotations

import argparse
import runpy
import sys
import textwrap
import time
from collections.abc import Callable

import torch

import mkernel

from . import bench as bench_pkg
from .interp.machine import Progress, RunProgress, progress_to
from .protocol import MAX_LOCAL_RANKS
from .world import MAX_CPU_RANKS

PROGRESS_EVERY_S = 2.0  # a progress line on stderr this often while the CPU interpreter runs


def _progress(what: str) -> Progress:
    """A progress report for the interpreter's run loop: one line on stderr every few seconds."""

    def report(p: RunProgress) -> None:
        of = f"/{p.total}" if p.total is not None else ""
        print(
            f"  {what}: interpreting rank tasks: {p.done}{of} done, {p.running} running, "
            f"step {p.steps}, {p.seconds:.0f} s",
            file=sys.stderr,
        )

    return report


def _run(what: str, device: str, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """``fn()`` and its wall time in seconds, reporting progress on the CPU interpreter."""
    t0 = time.perf_counter()
    if device == "cpu":
        with progress_to(_progress(what), PROGRESS_EVERY_S):
            out = fn()
    else:
        out = fn()
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _timeline(world: mkernel.World, device: str) -> None:
    if device == "cpu" and world.last_timeline is not None:
        print("  timeline of whole ranks (interpreter steps; legend first):")
        for line in world.last_timeline.ascii(60, max_rows=10).splitlines():
            print("   ", line)


def _comm_tasks(plan: mkernel.Plan) -> int:
    return sum(len(ts) for ts in plan.roles["comm"].tasks)


def _say(text: str) -> None:
    print(textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="    "))


def demo(ranks: int = 4, device: str | None = None) -> int:
    """GEMM+ReduceScatter in an emulated world of ``ranks`` ranks, on the GPU when there is one
    (else on the CPU interpreter), checked against the unfused reference, both schedules; then
    AllGather+GEMM with comm CTAs (inter_sm), the op whose inter_sm schedule gives them work."""
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

    def check(name: str, out: torch.Tensor, ref: torch.Tensor, dt: float) -> None:
        nonlocal ok
        err = ((out.float() - ref).norm() / ref.norm()).item()
        pads_clear = all(int(p.abs().sum()) == 0 for p in world.signal_pads().values())
        good = err < 1e-2 and not torch.isnan(out.float()).any().item() and pads_clear
        ok &= good
        print(
            f"  {name:9s} rel. error vs reference {err:.2e}  signal pads reset: {pads_clear}  "
            f"{dt * 1e3:8.1f} ms  {'OK' if good else 'FAILED'}"
        )

    for overlap in ("intra_sm", "inter_sm"):
        sched = mkernel.Schedule(overlap=overlap)
        plan = sched.plan("gemm_rs", world, a, b)
        if overlap == "intra_sm":
            _say(
                f"intra_sm: {plan.compute_units} CTAs per rank compute tiles; a tile's epilogue "
                "stores each peer's fp32 partial into its owner's stage, and the owner adds them "
                "in its own tiles' epilogue: the reduction needs no comm task"
            )
        elif _comm_tasks(plan) == 0:
            _say(
                f"inter_sm: the same compute tasks on {plan.compute_units} CTAs per rank, plus "
                f"{plan.comm_units} comm CTA(s) that gemm_rs gives no task (they stay idle: the "
                "epilogue stores above are the whole reduction), so for gemm_rs inter_sm only "
                "means fewer compute SMs"
            )
        out, dt = _run(
            overlap, device, lambda s=sched: mkernel.gemm_rs(a, b, world=world, schedule=s)
        )
        check(overlap, out, ref, dt)
        _timeline(world, device)

    # AllGather+GEMM: here inter_sm's comm CTAs do the all-gather while the compute CTAs multiply
    a2 = torch.randn(ranks, m // ranks, kl, generator=g).bfloat16().to(device)
    ref2 = mkernel.reference.ag_gemm(a2, b, world=world).float()
    sched = mkernel.Schedule(overlap="inter_sm", comm_sms=2)
    plan = sched.plan("ag_gemm", world, a2, b)
    print(f"mkernel demo: ag_gemm, per rank: all_gather(a [{m // ranks}, {kl}]) @ b [{kl}, {n}]")
    _say(
        f"inter_sm: {plan.compute_units} compute CTAs + {plan.comm_units} comm CTAs per rank; "
        f"the comm CTAs push the rank's shard, chunk by chunk, into every rank's gather buffer "
        f"({_comm_tasks(plan)} comm tasks in all) while the compute CTAs multiply the chunks "
        "that have landed"
    )
    out, dt = _run("ag_gemm", device, lambda: mkernel.ag_gemm(a2, b, world=world, schedule=sched))
    check("inter_sm", out, ref2, dt)
    _timeline(world, device)
    print("demo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def bench(name: str, args: list[str]) -> int:
    """Runs ``python -m mkernel.bench.<name> <args>`` (its ``--help`` works anywhere; without a
    GPU it says so in one line)."""
    argv = sys.argv
    sys.argv = [f"mkernel.bench.{name}", *args]
    try:
        runpy.run_module(f"mkernel.bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = argv
    return 0


def _ranks(text: str) -> int:
    ranks = int(text) if text.lstrip("-").isdigit() else None
    if ranks is None or ranks < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return ranks


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line and its demo subcommand (whose errors name it)."""
    p = argparse.ArgumentParser(
        prog="python -m mkernel", description="mkernel: fused communication + computation kernels."
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,bench}")
    d = sub.add_parser(
        "demo",
        help="gemm_rs (both schedules) and ag_gemm in an emulated world, checked against the "
        "unfused reference",
        description="GEMM+ReduceScatter in an emulated world of RANKS ranks under both schedules, "
        "then AllGather+GEMM with comm CTAs, each checked against the unfused reference. On the "
        "GPU when there is one, else on the CPU interpreter (its time grows about as RANKS**2: "
        "a minute or more at 32 ranks; progress goes to stderr).",
    )
    d.add_argument(
        "--ranks",
        type=_ranks,
        default=4,
        help=f"ranks of the emulated world, 1 to {MAX_CPU_RANKS} on the CPU, 1 to "
        f"{MAX_LOCAL_RANKS} on a GPU (what one launch serves) (default: %(default)s)",
    )
    d.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="cpu: the CPU interpreter; cuda: one GPU (default: cuda when there is one)",
    )
    known = bench_pkg.names()
    b = sub.add_parser(
        "bench",
        help="benchmarks against the baselines (a GPU; --help of each works anywhere)",
        description=textwrap.fill(
            "Runs python -m mkernel.bench.NAME ARGS: a table against the baselines, results "
            "saved as JSON under benchmarks/results. Benchmarks need a CUDA GPU; the distributed "
            "ones run one process per GPU under torchrun "
            "(torchrun --nproc_per_node=W -m mkernel.bench.NAME).",
            79,
        ),
        epilog="benchmarks:\n" + "\n".join(f"  {k:15s} {v}" for k, v in known.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "name", metavar="NAME", choices=sorted(known), help="one of: " + ", ".join(known)
    )
    b.add_argument(
        "rest", nargs=argparse.REMAINDER, help="passed to the benchmark (NAME --help lists them)"
    )
    return p, d


def main(argv: list[str] | None = None) -> int:
    p, d = _parser()
    args = p.parse_args(argv)
    if args.cmd == "demo":
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        most = MAX_LOCAL_RANKS if device == "cuda" else MAX_CPU_RANKS
        if args.ranks > most:
            where = (
                "an emulated GPU world (one launch)" if device == "cuda" else "the CPU interpreter"
            )
            d.error(f"argument --ranks: {where} serves at most {most} ranks, got {args.ranks}")
        if device == "cuda" and not torch.cuda.is_available():
            d.error("argument --device: cuda asked for, but torch sees no CUDA device")
        return demo(args.ranks, device)
    return bench(args.name, args.rest)


if __name__ == "__main__":
    sys.exit(main())
