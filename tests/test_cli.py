"""The command line (issue 33, point 5): argparse errors, help texts, benchmarks' --help on any
machine, one-line errors without a GPU, progress of long interpreter runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mkernel
from mkernel import __main__ as cli
from mkernel.bench import HELPERS
from mkernel.interp.machine import RunProgress, progress_to

REPO = Path(__file__).parents[1]
# every module of mkernel/bench but its declared helpers (timing, plot), read from the folder
BENCHMARKS = sorted(
    p.stem
    for p in (REPO / "mkernel" / "bench").glob("*.py")
    if not p.stem.startswith("_") and p.stem not in HELPERS
)
# NOTE: a benchmark run twice in one process (here, by runpy) warns that it is already imported
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")


def _exit(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)``'s exit status (returned or raised as SystemExit), stdout and stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_unknown_name_is_an_argparse_error(capsys) -> None:
    code, _, err = _exit(["bench", "foo"], capsys)
    assert code == 2
    assert "invalid choice: 'foo'" in err and "GPU" not in err
    for name in BENCHMARKS:
        assert repr(name) in err, name


def test_bench_help_lists_every_benchmark(capsys) -> None:
    code, out, _ = _exit(["bench", "--help"], capsys)
    assert code == 0
    for name in BENCHMARKS:
        assert f"\n  {name} " in out, name


@pytest.mark.parametrize("ranks", ["0", "-1", "two"])
def test_demo_bad_ranks_is_an_argparse_error(ranks: str, capsys) -> None:
    code, out, err = _exit(["demo", "--ranks", ranks, "--device", "cpu"], capsys)
    assert code == 2 and out == ""
    assert "python -m mkernel demo: error: argument --ranks: must be an int >= 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("device, most", [("cuda", 16), ("cpu", 64)])
def test_demo_ranks_over_the_world_limit_is_an_argparse_error(
    device: str, most: int, capsys
) -> None:
    code, out, err = _exit(["demo", "--ranks", str(most + 1), "--device", device], capsys)
    assert code == 2 and out == ""
    assert (
        "error: argument --ranks: " in err and f"serves at most {most} ranks, got {most + 1}" in err
    )


def test_every_subcommand_and_option_has_a_help_text() -> None:
    parser, _ = cli._parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in subs._choices_actions} == set(subs.choices)
    assert all(c.help for c in subs._choices_actions)
    for name, sub in subs.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_help_works_without_a_gpu(name: str, capsys) -> None:
    code, out, err = _exit(["bench", name, "--help"], capsys)
    assert code == 0, err
    assert out.startswith("usage: python") and f"mkernel.bench.{name}" in out


def test_python_m_bench_tp_help() -> None:
    """The reported crash, as a user runs it: a fresh ``python -m mkernel.bench.tp --help``."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkernel.bench.tp", "--help"],
        cwd=REPO,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torchrun --nproc_per_node=W -m mkernel.bench.tp" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_without_a_gpu_says_so_in_one_line(name: str, capsys) -> None:
    code, out, err = _exit(["bench", name], capsys)
    assert code == 1 and out == ""
    # NOTE: in-process, runpy warns when an earlier test imported the module (a fresh
    # `python -m mkernel bench` never does)
    err = "\n".join(line for line in err.splitlines() if "<frozen runpy>" not in line)
    assert (
        err.strip()
        == f"mkernel.bench.{name}: needs a CUDA GPU and torch sees none (--help works anywhere)"
    )


def test_demo_reports_progress_on_stderr(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)  # a line at every check: the run is short
    code, out, err = _exit(["demo", "--ranks", "2", "--device", "cpu"], capsys)
    assert code == 0 and "demo passed" in out
    assert "interpreting" not in out
    lines = err.splitlines()
    for what, total in (("intra_sm", 16), ("inter_sm", 16), ("ag_gemm", 24)):
        mine = [line for line in lines if line.startswith(f"  {what}: interpreting rank tasks: ")]
        assert mine and mine[-1].startswith(
            f"  {what}: interpreting rank tasks: {total}/{total} done, 0 running, step "
        )


def test_demo_says_what_inter_sm_means_for_gemm_rs(capsys) -> None:
    code, out, _ = _exit(["demo", "--ranks", "2", "--device", "cpu"], capsys)
    assert code == 0
    gemm_rs, ag_gemm = out.split("mkernel demo: ag_gemm")
    assert "that gemm_rs gives no task (they stay idle" in " ".join(gemm_rs.split())
    assert "comm0 |" not in gemm_rs  # no comm row in gemm_rs's timelines ...
    assert "comm0 |" in ag_gemm  # ... and ag_gemm's comm CTAs run its all-gather tasks


def test_progress_hook_reports_tasks_done_and_is_off_outside_it() -> None:
    world = mkernel.World.emulated(2)
    a, b = torch.randn(2, 256, 64).bfloat16(), torch.randn(2, 64, 128).bfloat16()
    seen: list[RunProgress] = []
    with progress_to(seen.append, every_s=0.0):
        mkernel.gemm_rs(a, b, world=world)
    assert seen and seen[-1].done == seen[-1].total == len(world.last_timeline.spans)
    assert seen[-1].running == 0 and 0 < max(p.running for p in seen) <= 2 * 8
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert [p.steps for p in seen] == sorted(p.steps for p in seen)
    n = len(seen)
    mkernel.gemm_rs(a, b, world=world)
    assert len(seen) == n  # outside the block nothing reports
