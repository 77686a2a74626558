"""A decode step of 8 Qwen3-8B-shaped layers (issue 36): eager PyTorch, CUDA-graph replay,
torch.compile + CUDA graph and TaskGraph (as compiled, and with its norms and SiLUs as tasks of
their own: ``taskgraph_unfused``), against the HBM lower bound.

``python -m mkernel.bench.decode [--quick] [--autotune]``: hidden 4096, 32 query / 8 KV heads of
128, MLP 12288, 8 layers, bf16, the model of mkernel.models (pre-norm, GQA attention over the
cache, SwiGLU; no RoPE, q / k norms or K / V projection: the same step for every version); batch
1 and 8, KV cache 1024 and 4096. Each version is checked against the fp32 torch reference
(mkernel.models.torch_decode) once, then all are timed interleaved in rounds (timing.interleaved_
ms). The bound is the bytes one step must read (every weight and the attended cache, once) over
the device copy rate measured in the same run (a 1 GiB device-to-device copy, read + write
bytes). ``--quick``: batch 1, KV 1024 only; ``--cases 1x1024,8x4096``: those (batch x KV) only
(a run split over several calls). ``--autotune``: torch.compile's
max-autotune-no-cudagraphs mode (minutes of compiling) instead of its default mode. Prints a table
and writes decode_<date>.json under $MKERNEL_BENCH_DIR (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..models import DecoderConfig, Layer, decode_graph, random_decoder, torch_decode
from ..taskgraph.compiled import compile_graph
from .timing import interleaved_ms, save, table

CFG = DecoderConfig(
    hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, layers=8, eps=1e-6
)
CASES = [(1, 1024), (8, 1024), (1, 4096), (8, 4096)]
SLOW_MS = 20.0  # a version slower than this per call is timed alone, a few calls (the fallback)


def step_bytes(cfg: DecoderConfig, batch: int, length: int) -> int:
    """Bytes a decode step must read once: every weight and each layer's cache up to ``length``."""
    H, D, F_ = cfg.hidden, cfg.head_dim, cfg.intermediate
    weights = (2 * cfg.heads * D * H + 3 * F_ * H + 2 * H) * 2  # wq, wo, wg, wu, wd, two norms
    cache = 2 * batch * cfg.kv_heads * length * D * 2  # K and V
    return cfg.layers * (weights + cache) + H * 2  # and the final norm


def copy_rate() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    src.normal_()
    ms = interleaved_ms({"copy": lambda i: dst.copy_(src)}, sets=1, rounds=3, per=10, warmup=2)
    return 2 * src.numel() * 2 / (ms["copy"] * 1e-3)


def eager_step(cfg: DecoderConfig, layers: list[Layer], final: torch.Tensor, length: int):
    """The step in bf16 torch ops (what a user's model runs): [B, H] -> [B, H]."""
    D, Hq = cfg.head_dim, cfg.heads

    def norm(t, w):
        t32 = t.float()
        return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + cfg.eps)).to(t.dtype) * w

    caches = [(ly.k_cache[:, :, :length], ly.v_cache[:, :, :length]) for ly in layers]

    def step(x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        for ly, (k, v) in zip(layers, caches, strict=True):
            q = F.linear(norm(x, ly.attn_norm), ly.wq).view(B, Hq, 1, D)
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            h = x + F.linear(o.reshape(B, Hq * D), ly.wo)
            m = norm(h, ly.mlp_norm)
            x = h + F.linear(F.silu(F.linear(m, ly.wg)) * F.linear(m, ly.wu), ly.wd)
        return norm(x, final)

    return step


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
    """``fn`` captured in a CUDA graph on a static input (warmed up on a side stream first)."""
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static)

    def replay(x_: torch.Tensor) -> torch.Tensor:
        static.copy_(x_)
        g.replay()
        return out

    return replay


def _one_ms(fn: Callable[[], object], n: int = 3) -> float:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_case(batch: int, length: int, rate: float, mode: str) -> dict:
    layers, final = random_decoder(CFG, batch, length, seed=0, device="cuda")
    xs = [torch.randn(batch, CFG.hidden, device="cuda").bfloat16() for _ in range(2)]
    want = torch_decode(CFG, layers, final, xs[0], length).cpu()  # fp32 (no TF32: torch's default)
    step = eager_step(CFG, layers, final, length)
    versions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager": step,
        "cuda_graph": graphed(step, xs[0]),
        "compile_graph": graphed(torch.compile(step, mode=mode, dynamic=False), xs[0]),
    }
    graph = decode_graph(CFG, layers, final, batch, length)
    kernel = graph.compile()
    versions["taskgraph"] = lambda x: kernel(x=x)["y"]
    unfused = compile_graph(graph, fuse=False)  # norms and SiLUs as their own tasks
    versions["taskgraph_unfused"] = lambda x: unfused(x=x)["y"]
    row: dict = {"batch": batch, "kv": length, "layers": CFG.layers, "compile_mode": mode}
    row["taskgraph_backend"] = getattr(kernel, "backend", "?")
    fast, slow = {}, {}
    for name, fn in versions.items():
        got = fn(xs[0]).float().cpu()
        row[f"{name}_maxerr"] = float((got - want).abs().max())
        ms = _one_ms(lambda fn=fn: fn(xs[1]))
        (slow if ms > SLOW_MS else fast)[name] = fn
    times = interleaved_ms({k: (lambda i, f=f: f(xs[i])) for k, f in fast.items()}, sets=2)
    times |= {k: _one_ms(lambda f=f: f(xs[1])) for k, f in slow.items()}
    bound = step_bytes(CFG, batch, length) / rate * 1e3
    row["bytes_read"] = step_bytes(CFG, batch, length)
    row["bound_ms"] = bound
    for name in versions:
        row[f"{name}_ms"] = times[name]
        row[f"{name}_x_bound"] = times[name] / bound
    row["taskgraph_vs_compile_graph"] = times["compile_graph"] / times["taskgraph"]
    return row


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``--cases`` text: comma-separated BATCHxKV (e.g. ``1x1024,8x4096``)."""
    cases = []
    for item in text.split(","):
        b, sep, kv = item.strip().partition("x")
        if not (sep and b.isdigit() and kv.isdigit() and int(b) > 0 and int(kv) > 0):
            raise ValueError(f"--cases: {item!r} is not BATCHxKV (e.g. 1x1024)")
        cases.append((int(b), int(kv)))
    return cases


def run(
    save_json: bool = True,
    quick: bool = False,
    autotune: bool = False,
    cases: list[tuple[int, int]] | None = None,
) -> list[dict]:
    """Every case of ``cases`` (default CASES; ``quick``: the first only), one row each."""
    mode = "max-autotune-no-cudagraphs" if autotune else "default"
    if cases is None:
        cases = CASES[:1] if quick else CASES
    rate = copy_rate()
    print(f"device copy: {rate / 1e12:.2f} TB/s (read + write)", file=sys.stderr)
    rows = []
    for batch, length in cases:
        rows.append(run_case(batch, length, rate, mode) | {"copy_tbps": rate / 1e12})
        print(f"batch {batch} kv {length}: done", file=sys.stderr)
    cols = ["batch", "kv", "bound_ms", "eager_ms", "cuda_graph_ms", "compile_graph_ms"]
    cols += ["taskgraph_unfused_ms", "taskgraph_ms", "taskgraph_x_bound", "compile_graph_x_bound"]
    cols += ["taskgraph_vs_compile_graph"]
    print(table(rows, cols))
    errs = [{k: round(v, 4) for k, v in r.items() if k.endswith("_maxerr")} for r in rows]
    print("max |y - fp32 reference|:", errs)
    if save_json:
        print("saved", save("decode", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(
        __spec__.name,
        __doc__,
        {"--quick": "batch 1, KV 1024 only", "--autotune": "torch.compile max-autotune mode"},
    )
    extra = argparse.ArgumentParser()
    extra.add_argument("--cases", type=parse_cases, default=None)
    more, _ = extra.parse_known_args()
    run(quick=args.quick, autotune=args.autotune, cases=more.cases)
