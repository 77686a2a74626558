"""The fused MoE kernels on ONE GPU (issue 11): what the layout phase, the template and the
token traffic cost against the unfused GPU path and the grouped GEMM alone, before any link.

``python3 -m mkernel.bench.moe_local``: an emulated world of W ranks sharing the GPU (tokens move
through local memory), per rank T tokens, H = 7168, I = 2048, E experts in all, top-k, uniform
routing (DeepSeek-V3-like widths, fewer tokens). Versions, per op (dispatch + first GEMM; second
GEMM + combine):
- ``fused``: ``mkernel.moe_dispatch_gemm`` / ``moe_gemm_combine`` (the API: its host synchronize
  for the row counts included), and ``kernel*``: the same kernel launched on prepared
  buffers (no host work: the kernel alone), under the default schedule and variants (VARIANTS:
  tile heights, overlap);
- ``unfused``: the GPU path users would write from our parts (mkernel/bench/baselines/moe_gpu.py:
  device sort, ``index_select`` expansion / weighted slot sum, our grouped GEMM per rank);
- ``gemm``: the grouped GEMM engine alone on the already expanded rows of every rank (the floor);
  ``gemm_gather_*``: the same with A's rows gathered by index (the fused dispatch's GEMM, alone).
Timed INTERLEAVED in rounds (timing.interleaved_ms). TFLOP/s counts 2 * rows * H * I over all
ranks. Writes moe_local_<date>.json under $MKERNEL_BENCH_DIR.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from .. import World, grouped_gemm, moe_dispatch_gemm, moe_gemm_combine
from ..ops import common
from ..ops import moe_dispatch_gemm as mdg
from ..ops import moe_gemm_combine as mgc
from ..schedule import Schedule
from .baselines import moe_gpu
from .plot import draw_run
from .timing import interleaved_ms, save, span_summary, table

H, INTER = 7168, 2048
VARIANTS = {  # the fused kernels alone under these schedules
    "kernel": {},  # the default: 128-row tiles at these shapes (moe_common.tile_rows)
    "kernel_64": {"chunk_rows": 64},
    "kernel_inter": {"overlap": "inter_sm"},
}


def _routing(W: int, T: int, E: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(W * T, E, generator=g, device="cuda")
    return scores.topk(k, dim=1).indices.view(W, T, k).to(torch.int32)


def _case(W: int, T: int, E: int, k: int) -> list[dict]:
    world = World.emulated(W, device="cuda")
    El = E // W
    x = torch.randn(W, T, H, device="cuda").bfloat16()
    w1 = (torch.randn(W, El, H, INTER, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(W, El, INTER, H, device="cuda") / INTER**0.5).bfloat16()
    weights = torch.rand(W, T, k, device="cuda")
    ids = _routing(W, T, E, k, 0)
    sched = Schedule()
    d = moe_dispatch_gemm(x, ids, w1, world, sched)
    h = [torch.relu(y) for y in d.y]
    rows = sum(d.rows)
    # the kernels alone: the API's buffers, launched again without its host work, under the
    # default schedule and the variants (other tile heights and overlap)
    s = mdg.shapes(x, ids, w1, world)
    R = max(d.rows)
    ops_d = {
        "x": x,
        "topk_ids": ids,
        "w1": w1.view(W, -1, INTER),
        "y": torch.empty(W, R, INTER, device="cuda", dtype=torch.bfloat16),
        "src": torch.empty(W, R, 3, device="cuda", dtype=torch.int32),
        "expert_offsets": torch.empty(W, 1, El + 1, device="cuda", dtype=torch.int32),
        "expanded": torch.empty(W, R, H, device="cuda", dtype=torch.bfloat16),
    }
    _, _, _, ops_c = mgc.prepare(h, w2, d, weights, world, sched)

    def kernels(op: str, ops: dict) -> dict[str, Callable[[], object]]:
        mod = sys.modules[(mdg if op == "dispatch" else mgc).__name__]
        shapes = s if op == "dispatch" else mgc.shapes(h, w2, d, weights, world)
        out = {}
        for name, v in VARIANTS.items():
            plan = common.cached_plan(mod.OP, Schedule(**v), world, **shapes)
            out[name] = lambda p=plan: common.run_gpu(world, p, ops)
        return out

    expanded = [
        x.view(W * T, H).index_select(0, (s[:, 0] * T + s[:, 1]).long()) for s in d.src
    ]  # every rank's rows, in row order
    ys = [torch.empty(r, INTER, device="cuda", dtype=torch.bfloat16) for r in d.rows]
    outs = [torch.empty(r, H, device="cuda", dtype=torch.float32) for r in d.rows]

    def gemm1() -> None:
        for r in range(W):
            grouped_gemm(expanded[r], w1[r], d.expert_offsets[r], out=ys[r])

    tok = [(sr[:, 0] * T + sr[:, 1]).int() for sr in d.src]  # each row's token, all ranks'

    def gemm1_gather(tile: str) -> None:  # the fused kernel's GEMM: rows gathered by index
        for r in range(W):
            grouped_gemm(
                x.view(W * T, H), w1[r], d.expert_offsets[r], out=ys[r], rows=tok[r], tile=tile
            )

    def gemm2() -> None:
        for r in range(W):
            grouped_gemm(h[r], w2[r], d.expert_offsets[r], out=outs[r], out_dtype=torch.float32)

    cases: list[tuple[str, dict[str, Callable[[], object]]]] = [
        (
            "dispatch",
            {
                "fused": lambda: moe_dispatch_gemm(x, ids, w1, world, sched),
                **kernels("dispatch", ops_d),
                "unfused": lambda: moe_gpu.dispatch(x, ids, w1, H, world),
                "gemm": gemm1,
                "gemm_gather_64": lambda: gemm1_gather("64x128x64"),
                "gemm_gather_128": lambda: gemm1_gather("128x128x64"),
            },
        ),
        (
            "combine",
            {
                "fused": lambda: moe_gemm_combine(h, w2, d, weights, world, sched),
                **kernels("combine", ops_c),
                "unfused": lambda: moe_gpu.combine(h, w2, d, weights),
                "gemm": gemm2,
            },
        ),
    ]
    out = []
    for op, fns in cases:
        ms = interleaved_ms({n: (lambda i, f=f: f()) for n, f in fns.items()}, 1, 6, 10, 2)
        for name, t in ms.items():
            out.append(
                {
                    "op": op,
                    "W": W,
                    "T": T,
                    "E": E,
                    "k": k,
                    "H": H,
                    "I": INTER,
                    "rows": rows,
                    "version": name,
                    "ms": t,
                    "tflops": 2.0 * rows * H * INTER / t / 1e9,
                    "vs_unfused": ms["unfused"] / t,
                    "vs_gemm": ms["gemm"] / t,
                }  # fmt: skip
            )
    return out


def trace(
    W: int = 2, T: int = 2048, E: int = 64, k: int = 8, overlap: str = "intra_sm"
) -> list[dict]:
    """Where the fused dispatch's time goes: one traced call (Schedule(trace=True): every task's
    start and end on the GPU), per rank and kind of task, from the launch's first task start, us:
    first start, last end, the sum of the spans and how many there are."""
    world = World.emulated(W, device="cuda")
    x = torch.randn(W, T, H, device="cuda").bfloat16()
    w1 = (torch.randn(W, E // W, H, INTER, device="cuda") / H**0.5).bfloat16()
    ids = _routing(W, T, E, k, 0)
    for _ in range(3):  # warm: the plan, the extension, the clocks
        moe_dispatch_gemm(x, ids, w1, world, Schedule(overlap=overlap))
    moe_dispatch_gemm(x, ids, w1, world, Schedule(overlap=overlap, trace=True))
    tl = world.last_timeline
    t0 = min(s.start for s in tl.spans)
    rows = []
    for r in range(W):
        mine = [s for s in tl.spans if s.rank == r]
        comm = [s for s in mine if s.unit.startswith("comm")]
        kinds = {
            "gemm tile": [s for s in mine if s.unit.startswith("compute")],
            "push": [s for s in comm if s.task == mdg.PUSH],
            "expand": [s for s in comm if s.task == mdg.EXPAND],
        }
        for kind, spans in kinds.items():
            if spans:
                rows.append({"rank": r, "tasks": kind, **span_summary(spans, t0)})
    print(overlap)
    print(table(rows, ["rank", "tasks", "n", "first_us", "last_us", "busy_us"]))
    return rows


def run(save_json: bool = True) -> list[dict]:
    rows = []
    for W, T in ((2, 2048),):
        rows += _case(W, T, 64, 8)
    print(table(rows, ["op", "W", "T", "rows", "version", "ms", "tflops", "vs_unfused", "vs_gemm"]))
    if save_json:
        print("saved", save("moe_local", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(
        __spec__.name,
        __doc__,
        {"--trace": "trace one call per overlap instead of timing"},
        plot=True,
    )
    if args.trace:
        trace(overlap="intra_sm")
        trace(overlap="inter_sm")
    else:
        draw_run("moe_local", run(), args.plot)
