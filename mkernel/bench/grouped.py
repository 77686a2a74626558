"""The grouped GEMM (MoE experts) against torch._grouped_mm on one GPU.

``python -m mkernel bench grouped``: per shape, our grouped_gemm's TFLOP/s and torch._grouped_mm's
on the same rows, groups and weights, interleaved in rounds (timing.interleaved_ms), both checked
against each other first. Shapes: the dense-like 8 x 2048 rows (7168 -> 2048) and 16 x 1024
(4096 -> 1408) of FACTS.md, and the DeepSeek-V3-like expert layer (4096 tokens x top-8 = 32768
rows per rank, H = 7168, I = 2048) with the experts of one rank at W = 1 (256) and W = 2 (128),
uniform and Zipf-skewed routing, up (H -> I) and down (I -> H) projections, and rows gathered
from the tokens by index (ours in the A loads, torch by index_select first). Writes
benchmarks/results/grouped_<date>.json. ``--tiles``: every tile config of ours too, in the same
interleaved rounds (``tile_ms`` per config, ``best_tile``): the data against which the cost
model's pick (``schedule.pick_grouped_tile``, the ``tile`` column) is checked.
"""

from __future__ import annotations

import torch

import mkernel

from .. import schedule
from .plot import draw_run
from .timing import interleaved_ms, rotation, save, table

# name, groups, rows in all, K, N, routing
SHAPES = [
    ("8x2048", 8, 8 * 2048, 7168, 2048, "even"),
    ("16x1024", 16, 16 * 1024, 4096, 1408, "even"),
    ("moe_e256_up", 256, 32768, 7168, 2048, "uniform"),
    ("moe_e256_up_zipf", 256, 32768, 7168, 2048, "zipf"),
    ("moe_e128_up", 128, 32768, 7168, 2048, "uniform"),
    ("moe_e128_up_zipf", 128, 32768, 7168, 2048, "zipf"),
    ("moe_e128_down", 128, 32768, 2048, 7168, "uniform"),
    ("moe_e128_up_gather", 128, 32768, 7168, 2048, "gather"),
]


def group_sizes(groups: int, rows: int, routing: str, seed: int = 0) -> list[int]:
    """Rows per group: equal ("even"), or the counts of top-8 routing of rows / 8 tokens over the
    groups with uniform or Zipf (weight 1 / (rank + 1)) expert popularity."""
    if routing == "gather":
        routing = "uniform"
    if routing == "even":
        return [rows // groups] * groups
    g = torch.Generator().manual_seed(seed)
    weights = torch.ones(groups)
    if routing == "zipf":
        weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64)
    picks = torch.multinomial(weights.expand(rows // 8, groups), 8, generator=g)
    return torch.bincount(picks.flatten(), minlength=groups).tolist()


def _measure(
    name: str, groups: int, rows: int, k: int, n: int, routing: str, tiles: bool = False
) -> dict:
    sizes = group_sizes(groups, rows, routing)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    offsets = offsets.cuda()
    ends = offsets[1:].contiguous()
    sets = rotation((rows * k + groups * k * n + rows * n) * 2)
    a = [torch.randn(rows, k, device="cuda").bfloat16() for _ in range(sets)]
    b = [torch.randn(groups, k, n, device="cuda").bfloat16() for _ in range(sets)]
    c = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    gather = None
    if routing == "gather":  # rows gathered from rows / 4 tokens: ours by the engine's A loads,
        # torch's by index_select first (the unfused MoE dispatch's permutation)
        tokens = [torch.randn(rows // 4, k, device="cuda").bfloat16() for _ in range(sets)]
        gather = torch.randint(0, rows // 4, (rows,), device="cuda", dtype=torch.int32)
        index = gather.long()

        def ours_fn(i, tile=None):
            return mkernel.grouped_gemm(tokens[i], b[i], offsets, out=c[i], rows=gather, tile=tile)

        def torch_fn(i):
            return torch._grouped_mm(tokens[i].index_select(0, index), b[i], offs=ends)
    else:

        def ours_fn(i, tile=None):
            return mkernel.grouped_gemm(a[i], b[i], offsets, out=c[i], tile=tile)

        def torch_fn(i):
            return torch._grouped_mm(a[i], b[i], offs=ends)

    ours, theirs = ours_fn(0), torch_fn(0)
    err = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"{name}: grouped_gemm vs torch._grouped_mm relative error {err}")
    fns = {"ours": ours_fn, "torch": torch_fn}
    if tiles:  # every config, each checked like ours first
        for cfg in schedule.TILE_CONFIGS:
            got = ours_fn(0, cfg).float()
            e = ((got - theirs.float()).norm() / theirs.float().norm()).item()
            if not e < 1e-2:
                raise AssertionError(f"{name}: tile {cfg} vs torch._grouped_mm relative error {e}")
            fns[f"tile {cfg}"] = lambda i, cfg=cfg: ours_fn(i, cfg)
    ms = interleaved_ms(fns, sets)
    flop = 2 * rows * k * n
    tile = schedule.pick_grouped_tile(rows, n, k, groups)
    extra = {}
    if tiles:
        tile_ms = {cfg: ms[f"tile {cfg}"] for cfg in schedule.TILE_CONFIGS}
        extra = {"tile_ms": tile_ms, "best_tile": min(tile_ms, key=tile_ms.get)}
    return {
        "shape": name,
        "groups": groups,
        "rows": rows,
        "k": k,
        "n": n,
        "routing": routing,
        "max_group": max(sizes),
        "tile": tile.name,
        "tflops": flop / ms["ours"] / 1e9,
        "torch_tflops": flop / ms["torch"] / 1e9,
        "ms": ms["ours"],
        "torch_ms": ms["torch"],
        "ratio": ms["torch"] / ms["ours"],
    } | extra


def run(shapes=SHAPES, save_json: bool = True, tiles: bool = False) -> list[dict]:
    rows = []
    for shape in shapes:
        rows.append(_measure(*shape, tiles=tiles))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    cols = ["shape", "tile", "max_group", "tflops", "torch_tflops", "ratio"]
    print(table(rows, cols + (["best_tile"] if tiles else [])))
    if save_json:
        print("saved", save("grouped", rows))
    return rows


if __name__ == "__main__":
    from . import cli

    args = cli(__spec__.name, __doc__, {"--tiles": "every tile config of ours too"}, plot=True)
    draw_run("grouped", run(tiles=args.tiles), args.plot)
