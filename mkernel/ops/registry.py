"""The fused ops: every module of ``mkernel/ops`` that declares a ``SPEC`` (mkernel/protocol.py) is
one, named by its module. Its module holds the op's API, plan, data-movement twins and reference;
its device code is ``kernels/<name>.cu``. Adding an op adds no line here."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from ..protocol import OpSpec


@functools.cache
def _ops() -> dict[str, ModuleType]:
    from .. import ops

    found = {}
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"{ops.__name__}.{info.name}")
        if hasattr(module, "SPEC"):
            found[info.name] = module
    return dict(sorted(found.items()))


def names() -> list[str]:
    return list(_ops())


def device_specs() -> dict[str, OpSpec]:
    """The declarations with a device kernel by kernel name (``kernels/<kernel>.cu``): each op's
    ``SPEC``, and its ``SPEC_NODES`` (the plan over several nodes) where that has one."""
    found = {}
    for module in _ops().values():
        for spec in (module.SPEC, getattr(module, "SPEC_NODES", None)):
            if spec is not None and spec.device:
                found[spec.kernel_name] = spec
    return dict(sorted(found.items()))


def kernel_names() -> list[str]:
    """The kernels the build compiles and binds (device_specs' names)."""
    return list(device_specs())


def nodes_kernel_names() -> list[str]:
    """The kernels of the plans over several nodes (each op's ``SPEC_NODES`` with a device kernel):
    what the nvshmem extension builds again for distributed worlds (mkernel/nvshmem_ext.py)."""
    found = []
    for module in _ops().values():
        spec = getattr(module, "SPEC_NODES", None)
        if spec is not None and spec.device:
            found.append(spec.kernel_name)
    return sorted(found)


def device_names() -> list[str]:
    """The ops with a device kernel for a world of one node (each op's ``SPEC``)."""
    return [name for name, module in _ops().items() if module.SPEC.device]


def get(op: str) -> ModuleType:
    ops = _ops()
    if op not in ops:
        raise ValueError(f"unknown op {op!r}; known: {sorted(ops)}")
    return ops[op]
