"""Benchmarks: tables against the baselines (cuBLAS, NCCL, PyTorch's fused ops), JSON results.

Every benchmark module runs as ``python -m mkernel.bench.<name>`` (or ``python -m mkernel bench
<name>``); ``--help`` works on any machine, and without a CUDA GPU (or, for the distributed ones,
outside torchrun) a benchmark says so in one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import torch

HELPERS = frozenset({"timing", "plot"})  # modules of this package that are not benchmarks
PLOT_INSTALL = "pip install mkernel[plot]"  # matplotlib: an optional extra, for --plot only


def names() -> dict[str, str]:
    """The benchmarks of this package: module name -> the first sentence of its docstring, cut
    to 80 characters (read from the source, so nothing is imported)."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.stem.startswith("_") or path.stem in HELPERS:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph
        out[path.stem] = textwrap.shorten(first.split(". ")[0].rstrip(":"), 80, placeholder="...")
    return out


def require_gpu(prog: str, *, torchrun: bool = False) -> None:
    """Exit with one line on stderr (status 1) where the benchmark cannot run: no CUDA GPU, or,
    with ``torchrun``, not launched one process per GPU under torchrun."""
    if not torch.cuda.is_available():
        sys.exit(f"{prog}: needs a CUDA GPU and torch sees none (--help works anywhere)")
    if torchrun and "LOCAL_RANK" not in os.environ:
        sys.exit(f"{prog}: runs one process per GPU: torchrun --nproc_per_node=W -m {prog}")


def cli(
    prog: str,
    doc: str | None,
    flags: dict[str, str] | None = None,
    *,
    gpu: bool = True,
    torchrun: bool = False,
    plot: bool = False,
) -> argparse.Namespace:
    """The first line of a benchmark's ``__main__`` block: ``--help`` prints the module's
    docstring and ``flags`` (name -> help text, each a switch), then ``require_gpu``. Options
    it does not know are left in ``sys.argv`` for the module to read. ``plot``: the benchmark
    takes ``--plot PATH`` (``args.plot``, None when absent; mkernel.bench.plot draws it), and
    without matplotlib it exits (one line, status 1) before the GPU check, before any timing."""
    p = argparse.ArgumentParser(
        prog=f"python -m {prog}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, text in (flags or {}).items():
        p.add_argument(flag, action="store_true", help=text)
    if plot:
        p.add_argument(
            "--plot",
            metavar="PATH",
            help="also draw ours vs the baselines across shapes as a PNG at PATH (needs "
            f"matplotlib: {PLOT_INSTALL})",
        )
    args, _ = p.parse_known_args()
    if plot and args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        sys.exit(f"{prog}: --plot needs matplotlib, which is not installed: {PLOT_INSTALL}")
    if gpu:
        require_gpu(prog, torchrun=torchrun)
    return args
