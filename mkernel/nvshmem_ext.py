"""The ``nvshmem`` transport of rdma_put (issue 14) as its own extension, ``_mkernel_nvshmem``.

Built from kernels/nvshmem_test.cu, kernels/nvshmem_binding.cpp and the fused ops' kernels over
several nodes (kernels/<op>_nodes.cu, compiled again with MK_RDMA_NVSHMEM: their raises across
nodes become NVSHMEM puts, for distributed worlds of several nodes) with relocatable device code,
linked with NVSHMEM's device library (libnvshmem_device.a: the device calls) and host library
(libnvshmem_host.so.3: bootstrap, symmetric heap). NVSHMEM is found at ``$MKERNEL_NVSHMEM_HOME``
(include/ and lib/), else in the ``nvidia-nvshmem-cu13`` wheel (``nvidia/nvshmem`` on sys.path).
Without it ``SPEC`` is None, ``ABSENT`` says why, and ``load()`` raises RuntimeError.
mkernel/rdma_nvshmem.py is the Python API over it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from . import jit
from .runtime import registry

__all__ = ["ABSENT", "SPEC", "load", "nvshmem_home"]


def nvshmem_home() -> Path | None:
    """NVSHMEM's folder (include/nvshmem.h and lib/libnvshmem_device.a), or None."""
    candidates = []
    if os.environ.get("MKERNEL_NVSHMEM_HOME"):
        candidates.append(Path(os.environ["MKERNEL_NVSHMEM_HOME"]))
    # NOTE: `nvidia` is a namespace package of many wheels: look for the folder, import nothing
    candidates += [Path(p) / "nvidia" / "nvshmem" for p in sys.path if p]
    for home in candidates:
        if (home / "include" / "nvshmem.h").is_file() and (
            home / "lib" / "libnvshmem_device.a"
        ).is_file():
            return home.absolute()
    return None


def _nodes_sources() -> tuple[str, ...]:
    """kernels/<op>_nodes.cu of every op with a plan over several nodes (MK_NODES_OPS)."""
    return tuple(f"kernels/{name}.cu" for name in registry.nodes_kernel_names())


def _spec(home: Path) -> jit.ExtensionSpec:
    lib = home / "lib"
    host = next(iter(sorted(lib.glob("libnvshmem_host.so*"))), None)
    return jit.ExtensionSpec(
        name="_mkernel_nvshmem",
        sources=("kernels/nvshmem_test.cu", "kernels/nvshmem_binding.cpp", *_nodes_sources()),
        # the nodes kernels reach the template, the engines and every primitive
        headers=jit.MAIN_HEADERS,
        defines=(("MK_RDMA_NVSHMEM", "1"),),
        rdc=True,
        extra_cuda_flags=(f"-I{home / 'include'}",),
        extra_link_flags=(
            f"-L{lib}",
            "-lnvshmem_device",
            # NOTE: the wheel ships only the versioned name; the rpath finds it (and the bootstrap
            # plugins beside it) at import
            f"-l:{host.name}" if host is not None else "-lnvshmem_host",
            f"-Xlinker=-rpath={lib}",
        ),
    )


_HOME = nvshmem_home()
SPEC: jit.ExtensionSpec | None = _spec(_HOME) if _HOME is not None else None
ABSENT = (
    ""
    if _HOME is not None
    else "NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set MKERNEL_NVSHMEM_HOME)"
)
_load = jit.cached_loader(SPEC) if SPEC is not None else None


def load() -> ModuleType:
    """The built ``_mkernel_nvshmem`` module (kept after the first call)."""
    if _load is None:
        raise RuntimeError(f"the nvshmem transport needs NVSHMEM: {ABSENT}")
    return _load()
