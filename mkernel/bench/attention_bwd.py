"""The attention backward engine (issue 13, W = 1) against torch SDPA's cuDNN and FlashAttention
backward.

``python3 -m mkernel.bench.attention_bwd``: B=1, H=32, D=128 bf16; S in {2048, 8192}, full and
causal. Each version is timed on the backward alone (the forward ran once, outside the timing):
- ``mk``: ``attention_ext.attention_backward`` as a user calls it: the prep kernel (delta =
  rowsum(dO * O), a zeroed fp32 dq, the packed lse / delta rows), the kernel, dq -> bf16;
- ``mk_rows_lanes``: the same with variant 1 (every lane loads and stages its lse / delta rows;
  the default, variant 0, fetches them by one bulk copy per warp from rows the prep packed);
- ``mk_kernel``: the kernel launch alone (delta and dq made once; dq keeps accumulating, so its
  values are meaningless: this row only shows what the torch glue around the kernel costs);
- ``cudnn`` / ``flash``: ``torch.autograd.grad`` through SDPA with that backend on [B, H, S, D]
  contiguous tensors (their own preprocessing included, as ours is in ``mk``).
Gradients are checked against cuDNN's once (max |error| / max |cudnn|). Versions run INTERLEAVED:
each round runs every version once per shape (one measurement = back-to-back calls between CUDA
events lasting >= ~2 ms); the median over rounds is reported. TFLOP/s counts 2.5x the forward's
4 * B * H * S^2 * D (half for causal). ``ratio_vs_cudnn`` = cuDNN's time / ours (``mk``). Writes
attention_bwd_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import attention_ext
from .attention import _event_ms, run_rounds
from .plot import draw_run
from .timing import save, table

B, H, D = 1, 32, 128
SHAPES = [(2048, False), (2048, True), (8192, False), (8192, True)]
ROUNDS = 10
WARMUP = 2
TARGET_MS = 2.0


def flops(S: int, causal: bool) -> float:
    fwd = 4.0 * B * H * S * S * D
    return 2.5 * (fwd / 2 if causal else fwd)


def _sdpa_backward(backend: SDPBackend, q, k, v, dout, causal: bool):
    """A closure that runs SDPA's backward (its forward graph built once here)."""
    leaves = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    g = dout.transpose(1, 2).contiguous()

    def run():
        return [x.transpose(1, 2) for x in torch.autograd.grad(out, leaves, g, retain_graph=True)]

    return run


def _versions(q, k, v, dout, causal: bool) -> dict[str, Callable[[], object]]:
    out, lse = attention_ext.attention_forward(q, k, v, causal)
    delta = attention_ext.delta_of(dout, out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scale = 1.0 / D**0.5
    fns: dict[str, Callable[[], object]] = {
        "mk": lambda: attention_ext.attention_backward(dout, q, k, v, out, lse, causal),
        "mk_rows_lanes": lambda: attention_ext.attention_backward(
            dout, q, k, v, out, lse, causal, variant=1
        ),
        "mk_kernel": lambda: attention_ext.attention_backward_into(
            dout, q, k, v, lse, delta, causal, scale, dq, dk, dv
        ),
    }
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
    ):
        try:
            fns[name] = _sdpa_backward(backend, q, k, v, dout, causal)
        except RuntimeError as exc:  # a backend this torch / GPU lacks
            print(f"{name} unavailable ({exc})", file=sys.stderr)
    return fns


def _rel_err(got, ref) -> float:
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        for a, b in zip(got, ref, strict=True)
    )


def run(save_json: bool = True) -> list[dict]:
    attention_ext.load()
    cases = []
    for S, causal in SHAPES:
        q, k, v, dout = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(4))
        fns = _versions(q, k, v, dout, causal)
        errs = {}
        if "cudnn" in fns:
            errs["mk_vs_cudnn"] = _rel_err(fns["mk"](), fns["cudnn"]())
            if "flash" in fns:
                errs["flash_vs_cudnn"] = _rel_err(fns["flash"](), fns["cudnn"]())
        reps = {}
        for name, fn in fns.items():
            for _ in range(WARMUP):
                fn()
            reps[name] = max(1, round(TARGET_MS / max(_event_ms(fn, 1), 1e-3)))
        cases.append((S, causal, fns, errs, reps, {name: [] for name in fns}))
    run_rounds(cases, ROUNDS)
    rows = []
    for S, causal, fns, errs, _reps, times in cases:
        row: dict = {"S": S, "causal": causal, "B": B, "H": H, "D": D, **errs}
        for name in fns:
            ms = statistics.median(times[name])
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops(S, causal) / ms / 1e9
        if "cudnn_ms" in row:
            row["ratio_vs_cudnn"] = row["cudnn_ms"] / row["mk_ms"]
        rows.append(row)
    names = list(cases[0][2])
    cols = ["S", "causal", *(f"{n}_tflops" for n in names), "ratio_vs_cudnn", "mk_vs_cudnn"]
    print(table(rows, cols))
    if save_json:
        print("saved", save("attention_bwd", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, plot=True)
    draw_run("attention_bwd", run(), args.plot)
