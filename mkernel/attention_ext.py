"""The single-GPU attention forward engine (issue 12) as its own extension, ``_mkernel_attention``.

Built from kernels/attention.cu and kernels/attention_binding.cpp with mkernel.jit (cached on disk
like the main extension, never part of it): ``load()`` returns the module, ``attention_forward``
runs it on torch tensors.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from . import jit

__all__ = ["SPEC", "VARIANTS", "attention_forward", "load"]

SPEC = jit.ExtensionSpec(
    name="_mkernel_attention",
    sources=("kernels/attention.cu", "kernels/attention_binding.cpp"),
    headers=("primitives/**/*.cuh", "primitives/**/*.h", "kernels/attention_args.h"),
)

# AttentionArgs.variant: the consumer schedule (primitives/attention/engine.cuh).
VARIANTS = {"pingpong": 0, "overlap": 1, "plain": 2}


_EXT: ModuleType | None = None


def load(*, verbose: bool = False) -> ModuleType:
    """The built ``_mkernel_attention`` module (built on the first call, then cached).
    NOTE: kept here after the first call: jit.load hashes every source (milliseconds of host
    time), which a per-call path cannot afford."""
    global _EXT
    if _EXT is None:
        _EXT = jit.load(SPEC, verbose=verbose)
    return _EXT


def _check(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != 4 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 4-D CUDA bfloat16 tensor [B, S, H, D], got "
            f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    variant: str = "overlap",
    num_sms: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_f32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention forward on the current CUDA stream.

    q: [B, S_q, Hq, D] bf16, k and v: [B, S_kv, Hkv, D] bf16, all contiguous CUDA tensors,
    D in {64, 128}, Hq a multiple of Hkv (GQA: query head h reads kv head h // (Hq // Hkv)).
    scale: softmax scale (> 0), default 1 / sqrt(D). causal: key position j > query position i is
    masked (top-left aligned). Returns (out [B, S_q, Hq, D] bf16, lse [B, Hq, S_q] fp32), with the
    unfused meaning (computed in fp32)::

        kk = k.repeat_interleave(Hq // Hkv, dim=2); vv = v.repeat_interleave(Hq // Hkv, dim=2)
        s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale          # [B, Hq, S_q, S_kv]
        if causal: s = s.masked_fill(j > i, -inf)
        lse = torch.logsumexp(s, dim=-1)                           # [B, Hq, S_q]
        out = torch.einsum("bhij,bjhd->bihd", torch.exp(s - lse[..., None]), vv)

    ``variant`` picks the consumer schedule ("overlap": the fastest measured, see
    docs/ring_attention.md; "pingpong", "plain": for measurements);
    ``num_sms`` caps the persistent grid (0: every SM); ``out`` / ``lse`` are optional
    preallocated results (contiguous, shapes and dtypes as returned); ``out_f32`` (fp32, q's
    shape) also receives O unrounded, for partial results merged by lse later (ring steps).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t)
    B, S_q, Hq, D = q.shape
    Bk, S_kv, Hkv, Dk = k.shape
    if v.shape != k.shape or Bk != B or Dk != D:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    ext = load()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 tensor of shape {tuple(q.shape)}")
    if lse is None:
        lse = torch.empty(B, Hq, S_q, device=q.device, dtype=torch.float32)
    elif lse.shape != (B, Hq, S_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous fp32 tensor of shape {(B, Hq, S_q)}")
    if out_f32 is not None and (
        out_f32.shape != q.shape or out_f32.dtype != torch.float32 or not out_f32.is_contiguous()
    ):
        raise ValueError(f"out_f32 must be a contiguous fp32 tensor of shape {tuple(q.shape)}")
    if out.device != q.device or lse.device != q.device:
        raise ValueError("out and lse must be on the device of q")
    args = ext.AttentionArgs()
    args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.o, args.lse = out.data_ptr(), lse.data_ptr()
    if out_f32 is not None:
        args.o_f32 = out_f32.data_ptr()
    args.B, args.S_q, args.S_kv, args.Hq, args.Hkv, args.D = B, S_q, S_kv, Hq, Hkv, D
    args.scale = scale
    args.causal = int(bool(causal))
    args.num_sms = num_sms
    args.variant = VARIANTS[variant]
    with torch.cuda.device(q.device):
        status = ext.launch_attention(args, torch.cuda.current_stream().cuda_stream)
    if status != 0:
        raise RuntimeError(f"launch_attention: {ext.attention_status_string(status)}")
    return out, lse
