"""The fused ops: every module of ``mkernel/ops`` that declares a ``SPEC`` (mkernel/protocol.py) is
one, named by its module. Its module holds the op's API, plan, data-movement twins and reference;
its device code is ``kernels/<name>.cu``. Adding an op adds no line here."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType


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


def device_names() -> list[str]:
    """The ops with a device kernel (``kernels/<name>.cu``): what the build compiles and binds."""
    return [name for name, module in _ops().items() if module.SPEC.device]


def get(op: str) -> ModuleType:
    ops = _ops()
    if op not in ops:
        raise ValueError(f"unknown op {op!r}; known: {sorted(ops)}")
    return ops[op]
