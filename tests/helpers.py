"""Shared test helpers: tolerance from the reference's own rounding, poisoned outputs."""

from __future__ import annotations

import torch


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """``ref`` is the bf16 rounding of an fp32 reference; our result differs from it only by fp32
    summation order, which can flip the final bf16 rounding: allow one bf16 ulp of the magnitude
    (2^-8 relative) plus the fp32 accumulation error, and never a NaN (poison)."""
    assert not torch.isnan(out.float()).any(), f"{what}: NaN in the result (an unwritten tile)"
    o, r = out.float(), ref.float()
    scale = r.abs().max().item() + 1e-6
    err = (o - r).abs()
    tol = r.abs() * 2.0**-7 + scale * 2.0**-12
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off; "
        f"max err {err.max().item():.3g} at scale {scale:.3g}"
    )


def randn_bf16(*shape: int, device="cpu", generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)


def poisoned(shape, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
