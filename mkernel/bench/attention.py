"""The attention forward engine (issue 12) against torch SDPA's cuDNN and FlashAttention backends.

``python3 -m mkernel.bench.attention``: B=1, H=32, D=128 bf16; S in {2048, 8192} full and causal,
S=32768 causal. Every version (our three consumer schedules; SDPA cuDNN and flash, each on
transposed views of our [B, S, H, D] tensors and on contiguous [B, H, S, D] copies) is checked
against SDPA flash once, then timed INTERLEAVED: each round runs every version once per shape (one
measurement = a few back-to-back calls between CUDA events, so that it lasts >= ~2 ms), and the
result is the median over rounds. TFLOP/s counts 4 * B * H * S^2 * D for full attention and half of
that for causal. ``ratio_vs_cudnn``: cuDNN in its faster layout over our default schedule
(``attention_ext.default_variant`` of the shape, named in ``default_mk``). Prints a table and
writes attention_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results). Takes well
under a minute on an H100 / H200.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import attention_ext
from .plot import draw_run
from .timing import save, table

B, H, D = 1, 32, 128
SHAPES = [(2048, False), (2048, True), (8192, False), (8192, True), (32768, True)]
ROUNDS = 15
WARMUP = 3
TARGET_MS = 2.0  # one measurement lasts about this long


def flops(S: int, causal: bool) -> float:
    full = 4.0 * B * H * S * S * D
    return full / 2 if causal else full


def _sdpa(backend: SDPBackend, q, k, v, causal: bool) -> torch.Tensor:
    # SDPA takes [B, H, S, D]: transposed views of our [B, S, H, D] tensors (no copies).
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)


def _versions(q, k, v, causal: bool) -> dict[str, Callable[[], torch.Tensor]]:
    out = torch.empty_like(q)
    lse = torch.empty(B, H, q.shape[1], device="cuda", dtype=torch.float32)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for variant in attention_ext.VARIANTS:
        fns[f"mk_{variant}"] = lambda variant=variant: attention_ext.attention_forward(
            q, k, v, causal, None, variant=variant, out=out, lse=lse
        )[0]
    fns["cudnn"] = lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
    fns["flash"] = lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)
    # SDPA's own layout too ([B, H, S, D] contiguous, copied once here): the baselines' best case
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
    ):
        fns[f"{name}_bhsd"] = lambda backend=backend: _bhsd(backend, qh, kh, vh, causal)
    return fns


def _bhsd(backend: SDPBackend, q, k, v, causal: bool) -> torch.Tensor:
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


LEAD_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than any API's host work before its launch


def _event_ms(fn: Callable[[], object], reps: int) -> float:
    """Device ms per call of ``reps`` back-to-back calls. A sleep kernel queued before the start
    event keeps the GPU busy while the host prepares the first call, so the host's time before
    its launch (which a training loop hides behind earlier work) is not counted; host time per
    call is measured on its own (``bench host``, benchmarks/host_attention.py)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(LEAD_CYCLES)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def run_rounds(cases: list[tuple], rounds: int) -> None:
    """Interleaved timing: each round runs every version of every case once (one measurement =
    ``reps`` back-to-back calls); cases are (S, causal, fns, errs, reps, times) and each
    measurement is appended to ``times[name]``."""
    for _ in range(rounds):
        for _S, _causal, fns, _errs, reps, times in cases:
            for name, fn in fns.items():
                times[name].append(_event_ms(fn, reps[name]))


def run(save_json: bool = True) -> list[dict]:
    attention_ext.load()
    cases = []
    for S, causal in SHAPES:
        q, k, v = (torch.randn(B, S, H, D, device="cuda").bfloat16() for _ in range(3))
        fns = _versions(q, k, v, causal)
        try:
            ref = fns["flash"]().float()
        except RuntimeError:  # no flash backend: compare with cuDNN instead
            ref = fns["cudnn"]().float()
        errs, reps = {}, {}
        for name, fn in list(fns.items()):
            try:
                got = fn().float()
                errs[name] = float((got - ref).abs().max())
                for _ in range(WARMUP):
                    fn()
                reps[name] = max(1, round(TARGET_MS / max(_event_ms(fn, 1), 1e-3)))
            except RuntimeError as exc:  # a backend this torch / GPU lacks
                print(f"S={S} causal={causal}: {name} unavailable ({exc})", file=sys.stderr)
                del fns[name]
        cases.append((S, causal, fns, errs, reps, {name: [] for name in fns}))
    run_rounds(cases, ROUNDS)
    rows = []
    for S, causal, fns, errs, _reps, times in cases:
        row: dict = {"S": S, "causal": causal, "B": B, "H": H, "D": D}
        for name in fns:
            ms = statistics.median(times[name])
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops(S, causal) / ms / 1e9
            row[f"{name}_maxerr_vs_flash"] = errs[name]
        best = max((n for n in fns if n.startswith("mk_")), key=lambda n: row[f"{n}_tflops"])
        row["best_mk"] = best
        cudnn = [row[f"{n}_ms"] for n in ("cudnn", "cudnn_bhsd") if f"{n}_ms" in row]
        default = "mk_" + attention_ext.default_variant(S)
        row["default_mk"] = default
        if cudnn:  # the default schedule against cuDNN in its faster layout
            row["ratio_vs_cudnn"] = min(cudnn) / row[f"{default}_ms"]
        rows.append(row)
    names = [n for n in cases[0][2]]
    cols = ["S", "causal", *(f"{n}_tflops" for n in names), "best_mk", "default_mk"]
    cols.append("ratio_vs_cudnn")
    print(table(rows, cols))
    print("max |out - flash|:", {(r["S"], r["causal"]): _errs_of(r) for r in rows})
    if save_json:
        print("saved", save("attention", rows))
    return rows


def _errs_of(row: dict) -> dict[str, float]:
    suffix = "_maxerr_vs_flash"
    return {k[: -len(suffix)]: round(v, 4) for k, v in row.items() if k.endswith(suffix)}


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, plot=True)
    draw_run("attention", run(), args.plot)
