"""Unfused references of every op, in the ops' own conventions (emulated: leading rank dimension;
distributed: local tensors, gathered with torch.distributed). fp32 math, bf16 results. Each is the
``reference`` of its op's module (mkernel/ops/<op>.py), collected here by name."""

from __future__ import annotations

from .ops.grouped_gemm import reference as grouped_gemm  # a local op: no protocol, no SPEC
from .runtime import registry

__all__ = [*registry.names(), "grouped_gemm"]
globals().update({name: registry.get(name).reference for name in registry.names()})
