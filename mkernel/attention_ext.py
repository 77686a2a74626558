"""The single-GPU attention engines (issues 12, 13) as their own extension, ``_mkernel_attention``.

Built from kernels/attention.cu, kernels/attention_bwd.cu and kernels/attention_binding.cpp with
mkernel.jit (cached on disk like the main extension, never part of it): ``load()`` returns the
module; ``attention_forward`` and ``attention_backward`` run it on torch tensors
(``attention_backward_into`` is the accumulating form the ring's blocks use).
"""

from __future__ import annotations

import math

import torch

from . import jit
from .runtime.gpu import stream_handle

__all__ = [
    "SPEC",
    "VARIANTS",
    "rows_of",
    "attention_backward",
    "attention_backward_into",
    "attention_forward",
    "delta_of",
    "load",
]

SPEC = jit.ExtensionSpec(
    name="_mkernel_attention",
    sources=("kernels/attention.cu", "kernels/attention_bwd.cu", "kernels/attention_binding.cpp"),
    headers=(
        "primitives/**/*.cuh",
        "primitives/**/*.h",
        "kernels/attention_args.h",
        "kernels/attention_bwd_args.h",
        "kernels/attention_launch.cuh",
    ),
)

# AttentionArgs.variant: the consumer schedule (primitives/attention/engine.cuh).
VARIANTS = {"pingpong": 0, "overlap": 1, "plain": 2}
# The default schedule by key length: "pingpong" up to this many keys, "overlap" beyond. Measured
# (one H200, B = 1, H = 32, D = 128, TFLOP/s pingpong / overlap, two runs of
# ``python3 -m mkernel.bench.attention`` a day apart: benchmarks/results/attention_2026-12-02_lead
# .json, attention_2026-12-02_variants.json): S = 2048 full 586 / 550, 583 / 547, causal 439 /
# 439, 437 / 430; S = 8192 full 674 / 678, 667 / 672, causal 572 / 585, 574 / 589; S = 32768
# causal 583 / 568, 585 / 583. A short key walk leaves the overlap's deeper pipeline less to hide.
PINGPONG_MAX_KV = 2048


def default_variant(s_kv: int) -> str:
    """The consumer schedule ``attention_forward`` runs when none is named, for ``s_kv`` keys."""
    return "pingpong" if s_kv <= PINGPONG_MAX_KV else "overlap"


load = jit.cached_loader(SPEC)  # the built ``_mkernel_attention`` module, kept after the first call


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
    variant: str | None = None,
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

    ``variant`` picks the consumer schedule (None: the faster measured for the key length,
    ``default_variant``; "overlap", "pingpong", "plain" by name, docs/ring_attention.md);
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
    if variant is None:
        variant = default_variant(S_kv)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)} or None, got {variant!r}")
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
    status = _enqueue(ext.launch_attention, args, q.device)
    if status != 0:
        raise RuntimeError(f"launch_attention: {ext.attention_status_string(status)}")
    return out, lse


def _check_f32(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.float32
        or tuple(t.shape) != tuple(shape)
        or not t.is_contiguous()
        or t.device != device
    ):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
        raise ValueError(
            f"{name} must be a contiguous fp32 tensor of shape {tuple(shape)} on {device}, "
            f"got {got}"
        )


def delta_of(
    dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None
) -> torch.Tensor:
    """The backward's per-row delta [B, H, S] fp32: rowsum(dout * out) in fp32, minus the gradient
    of lse when there is one (d lse / d scores is the softmax, so it enters dS with delta)."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse
    return delta.contiguous()


def attention_backward_into(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    accumulate: bool = False,
    variant: int = 0,
    probe: int = 0,
) -> None:
    """One backward launch on the current stream (kernels/attention_bwd_args.h has the meaning).

    dout, q [B, S_q, Hq, D], k, v [B, S_kv, Hkv, D]: contiguous CUDA bf16; lse, delta [B, Hq, S_q]
    fp32 (``delta_of``). dq [B, S_q, Hq, D] fp32 (16-byte aligned) is REDUCE-ADDED into (zero it,
    or pass partial sums). dk, dv [B, S_kv, Hkv, D]: bf16 (stored) or fp32 (stored, or added to
    with ``accumulate``). ``variant`` 0 (default, the faster): each consumer warp fetches its lse /
    delta rows by a bulk copy from a packed copy (``rows_of``, made here); 1: every lane loads
    them from lse and delta. ``probe`` is for measurements only (D = 128; dq is then wrong):
    kernels/attention_bwd_args.h lists them."""
    ext = load()
    args = _backward_args(ext, dout, q, k, v, lse, delta, causal, scale, dq, dk, dv, accumulate)
    args.variant, args.probe = _check_variant(variant), int(probe)
    keep = _rows_for(args, lse, delta)
    _launch(ext, "launch_attention_bwd", args, q.device)
    del keep  # NOTE: the packed rows live until the launch is enqueued (stream order keeps them)


def rows_of(lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The backward's per-q-tile rows for variant 0: [B, H, ceil(S / 64), 2, 64] fp32, lse * log2 e
    (+inf where lse is -inf or past S, NaN where it is +inf: softmax.cuh ``lse2_of``) then delta
    (0 past S), so one 512-byte bulk copy brings a step's rows."""
    B, H, S = lse.shape
    pad = -S % 64
    lse2 = torch.where(lse == math.inf, math.nan, lse * math.log2(math.e))
    lse2 = torch.where(lse == -math.inf, math.inf, lse2)
    lse2 = torch.nn.functional.pad(lse2, (0, pad), value=math.inf).view(B, H, -1, 64)
    d = torch.nn.functional.pad(delta, (0, pad), value=0.0).view(B, H, -1, 64)
    return torch.stack([lse2, d], dim=3).contiguous()


def _check_variant(variant: int) -> int:
    if not isinstance(variant, int) or isinstance(variant, bool) or variant not in (0, 1):
        raise ValueError(f"variant must be 0 or 1, got {variant!r}")
    return variant


def _rows_for(args, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """Variant 0: the packed rows (kept by the caller until the launch is enqueued)."""
    if args.variant != 0:
        return None
    rows = rows_of(lse, delta)
    args.rows = rows.data_ptr()
    return rows


def _backward_args(ext, dout, q, k, v, lse, delta, causal, scale, dq, dk, dv, accumulate):
    """The checked AttentionBwdArgs of one backward launch (ValueError before anything runs)."""
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v)):
        _check(name, t)
    B, S_q, Hq, D = q.shape
    _, S_kv, Hkv, _ = k.shape
    if dout.shape != q.shape or v.shape != k.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"shapes do not match: dout {tuple(dout.shape)}, q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if D not in (64, 128) or Hq % Hkv:
        raise ValueError(
            f"head dim must be 64 or 128 and Hq a multiple of Hkv, got D={D}, Hq={Hq}, Hkv={Hkv}"
        )
    dev = q.device
    if not (dout.device == k.device == v.device == dev):
        raise ValueError("dout, q, k, v must be on one device")
    _check_f32("lse", lse, (B, Hq, S_q), dev)
    _check_f32("delta", delta, (B, Hq, S_q), dev)
    _check_f32("dq", dq, tuple(q.shape), dev)
    kv_f32 = dk.dtype == torch.float32
    for name, t in (("dk", dk), ("dv", dv)):
        if (
            t.dtype != (torch.float32 if kv_f32 else torch.bfloat16)
            or t.shape != k.shape
            or not t.is_contiguous()
            or t.device != dev
        ):
            raise ValueError(
                f"{name} must be a contiguous tensor of shape {tuple(k.shape)} on {dev}, bf16 or "
                f"fp32 (dk and dv alike), got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if accumulate and not kv_f32:
        raise ValueError("accumulate needs fp32 dk and dv")
    args = ext.AttentionBwdArgs()
    args.q, args.k, args.v, args.dout = q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr()
    args.lse, args.delta = lse.data_ptr(), delta.data_ptr()
    args.dq, args.dk, args.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    args.B, args.S_q, args.S_kv, args.Hq, args.Hkv, args.D = B, S_q, S_kv, Hq, Hkv, D
    args.scale = float(scale)
    args.causal = int(bool(causal))
    args.kv_f32 = int(kv_f32)
    args.kv_accumulate = int(bool(accumulate))
    return args


def _enqueue(launch, args, device: torch.device) -> int:
    """``launch(args, stream)`` with ``device``'s current stream, ``device`` being the current
    device (a kernel launches into the current context). torch's device switch and its Stream
    object took ~40 us of host time per call (profiled on the H200: half of a forward's host
    time), so both are skipped when the device is already the current one."""
    current = torch.cuda.current_device()
    if device.index is None or device.index == current:
        return launch(args, stream_handle(current))
    with torch.cuda.device(device):
        return launch(args, stream_handle(device.index))


def _launch(ext, name: str, args, device: torch.device) -> None:
    status = _enqueue(getattr(ext, name), args, device)
    if status != 0:
        raise RuntimeError(f"{name}: {ext.attention_bwd_status_string(status)}")


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    dlse: torch.Tensor | None = None,
    variant: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), bf16 like q, k, v, of ``attention_forward(q, k, v, causal, scale)``
    for the incoming ``dout`` (and ``dlse``, the gradient of lse, if any), from the forward's
    ``out`` and ``lse``. Accumulated in fp32 (dq across kv tiles by fp32 reduce-adds); GQA: dk, dv
    summed over the query heads of each kv head. Three launches: delta and a zeroed dq (one small
    kernel, which also packs variant 0's rows), the backward, dq -> bf16.
    ``variant``: as ``attention_backward_into``."""
    for name, t in (("dout", dout), ("q", q), ("out", out)):
        _check(name, t)
    if not (dout.shape == q.shape == out.shape):
        raise ValueError(
            f"shapes do not match: dout {tuple(dout.shape)}, q {tuple(q.shape)}, "
            f"out {tuple(out.shape)}"
        )
    if out.device != q.device:
        raise ValueError("out must be on the device of q")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    B, S_q, Hq, _ = q.shape
    if dlse is not None:
        _check_f32("dlse", dlse, (B, Hq, S_q), q.device)
    ext = load()
    delta = torch.empty(B, Hq, S_q, device=q.device, dtype=torch.float32)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = _backward_args(ext, dout, q, k, v, lse, delta, causal, scale, dq, dk, dv, False)
    args.variant = _check_variant(variant)  # before any launch
    args.out = out.data_ptr()
    if dlse is not None:
        args.dlse = dlse.data_ptr()
    rows = None
    if args.variant == 0:  # packed by the prep kernel, from lse and the delta it computes
        rows = torch.empty(B, Hq, -(-S_q // 64), 2, 64, device=q.device, dtype=torch.float32)
        args.rows = rows.data_ptr()
    _launch(ext, "launch_attention_bwd_prep", args, q.device)
    _launch(ext, "launch_attention_bwd", args, q.device)
    del rows  # NOTE: the stream's order keeps it alive for the enqueued launches
    return dq.to(torch.bfloat16), dk, dv
