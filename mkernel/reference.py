"""Unfused references of every op, in the ops' own conventions (emulated: leading rank dimension;
distributed: local tensors, gathered with torch.distributed). fp32 math, bf16 results. Each is the
``reference`` of its op's module (mkernel/ops/<op>.py), collected here by name."""

from __future__ import annotations

from .ops import registry

__all__ = registry.names()
globals().update({name: registry.get(name).reference for name in __all__})
