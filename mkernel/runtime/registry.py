"""The fused ops: each op module (mkernel/ops/<name>.py, one that declares a ``SPEC``,
mkernel/protocol.py) registers itself when it is imported, under its module's name. Its module holds
the op's API, plan, data-movement twins and reference; its device code is ``kernels/<name>.cu``.
Adding an op adds no line here: its module calls ``register`` and mkernel/__init__.py exports it
(importing mkernel imports every op, so the registry is complete before anything reads it).

NOTE: passive, not discovered: a registry that imported the op modules would import upward, from
the runtime layer into mkernel/ops (tests/test_imports.py)."""

from __future__ import annotations

from types import ModuleType

from ..protocol import OpSpec

_OPS: dict[str, ModuleType] = {}


def register(module: ModuleType) -> None:
    """Called once by an op module, at the end of its import: the op joins the registry under its
    module's name (``mkernel.ops.gemm_rs`` -> ``"gemm_rs"``)."""
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, OpSpec):
        raise TypeError(f"{module.__name__} declares no SPEC (an OpSpec): not a fused op")
    name = module.__name__.rsplit(".", 1)[-1]
    other = _OPS.get(name)
    if other is not None and other is not module:
        raise ValueError(f"op {name!r} is registered already (by {other.__name__})")
    _OPS[name] = module


def _ops() -> dict[str, ModuleType]:
    return dict(sorted(_OPS.items()))


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
