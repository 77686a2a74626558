"""The TaskGraph kernel's extension, ``_mkernel_taskgraph`` (kernels/taskgraph.cu, its binding and
the poison kernel), built with mkernel.jit and cached on disk like the others; apart from the main
extension because a TaskGraph is no registered fused op (its spec is made per graph). Not imported
by ``import mkernel``: mkernel/taskgraph/device.py loads it at a graph's first GPU compile.

``python -m mkernel.taskgraph.kernel_ext`` writes kernels/taskgraph_args.h from device.py's
encoding (``--check``: only says whether it is current)."""

from __future__ import annotations

import argparse
import sys

from .. import jit
from .._paths import source_root
from .device import HEADER, header_text

SPEC = jit.ExtensionSpec(
    name="_mkernel_taskgraph",
    sources=("kernels/taskgraph.cu", "kernels/taskgraph_binding.cpp", "kernels/poison.cu"),
    headers=(
        "primitives/**/*.cuh",
        "primitives/**/*.h",
        "templates/**/*.cuh",
        "kernels/fused_host.cuh",
        "kernels/layouts_gen.h",
        "kernels/poison_launch.h",
        "kernels/record_binding.h",
        "kernels/taskgraph.cuh",
        HEADER,
    ),
)
load = jit.cached_loader(SPEC)  # the built module, kept after the first call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mkernel.taskgraph.kernel_ext")
    parser.add_argument("--check", action="store_true", help="only check the header is current")
    args = parser.parse_args(argv)
    path = source_root() / HEADER
    if args.check:
        ok = path.exists() and path.read_text() == header_text()
        print(f"{HEADER}: {'current' if ok else 'STALE'}")
        return 0 if ok else 1
    path.write_text(header_text())
    print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
