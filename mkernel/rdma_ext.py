"""The ``proxy`` transport of rdma_put (issue 14) as its own extension, ``_mkernel_rdma``.

Built from kernels/rdma_test.cu, rdma_proxy.cpp, rdma_streams.cpp and rdma_binding.cpp with
mkernel.jit (cached on disk like the main extension, never part of it). ``load()`` returns the
module; mkernel/rdma.py is the Python API over it.
"""

from __future__ import annotations

from . import jit

__all__ = ["SPEC", "load"]

SPEC = jit.ExtensionSpec(
    name="_mkernel_rdma",
    sources=(
        "kernels/rdma_test.cu",
        "kernels/rdma_proxy.cpp",
        "kernels/rdma_streams.cpp",
        "kernels/rdma_binding.cpp",
    ),
    headers=(
        "primitives/rdma/*.h",
        "primitives/rdma/put.cuh",  # (put_nvshmem.cuh is the nvshmem extension's)
        "primitives/signal.cuh",
        "primitives/comm.cuh",
        "primitives/protocol_gen.h",
        "primitives/host/device.h",
        "primitives/host/driver_entry.h",
        "kernels/rdma_*.h",
    ),
)

load = jit.cached_loader(SPEC)  # the built ``_mkernel_rdma`` module, kept after the first call
