"""Op name -> module (each module: make_plan, the op function, its reference, its program twins)."""

from __future__ import annotations

from types import ModuleType


def get(op: str) -> ModuleType:
    from . import ag_gemm, gemm_ar, gemm_rs

    ops = {"gemm_rs": gemm_rs, "ag_gemm": ag_gemm, "gemm_ar": gemm_ar}
    if op not in ops:
        raise ValueError(f"unknown op {op!r}; known: {sorted(ops)}")
    return ops[op]
