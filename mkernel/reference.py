"""Unfused references of every op, in the ops' own conventions (emulated: leading rank dimension;
distributed: local tensors, gathered with torch.distributed). fp32 math, bf16 results."""

from __future__ import annotations

from .ops.ag_gemm import reference as ag_gemm
from .ops.gemm_ar import reference as gemm_ar
from .ops.gemm_rs import reference as gemm_rs

__all__ = ["gemm_rs", "ag_gemm", "gemm_ar"]
