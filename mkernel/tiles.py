"""The GEMM engine's tiles: the compiled tile configs (``TILE_CONFIGS``), an output ``Tile``, and
the picks every plan and the cost model share (``pick_tile``, ``pick_grouped_tile``, the grouped
order, a grid of tiles). Below the cost model and the schedules: imports nothing of mkernel."""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple


class TileConfig(NamedTuple):
    """A named compile-time tile shape of the GEMM engine."""

    name: str
    bm: int
    bn: int
    bk: int


TILE_CONFIGS = {
    "128x256x64": TileConfig("128x256x64", 128, 256, 64),
    "128x128x64": TileConfig("128x128x64", 128, 128, 64),
    "64x128x64": TileConfig("64x128x64", 64, 128, 64),
}
# Relative throughput per SM of each config at full occupancy (128x256 reads the least shared
# memory per FLOP). NOTE: estimates, not fitted; see docs/gemm_engine.md. Exact fractions, so that
# equal predicted times tie exactly and pick_tile's tie rule holds.
_TILE_RATE = {"128x256x64": Fraction(1), "128x128x64": Fraction(9, 10), "64x128x64": Fraction(3, 4)}


class Tile(NamedTuple):
    """One output tile: origin (m0, n0), valid extent (rows, cols), and an op-specific tag (the
    owner rank for gemm_rs / gemm_ar, the A row chunk for ag_gemm)."""

    index: int
    m0: int
    n0: int
    rows: int
    cols: int
    tag: int


def pick_tile(m: int, n: int, k: int, sms: int = 132) -> TileConfig:
    """The config with the least predicted time for an m x n x k GEMM on ``sms`` SMs: persistent
    CTAs run ceil(tiles / sms) waves, each as long as one tile, and a BM x BN tile takes
    BM * BN / rate, where the rate (_TILE_RATE) is the config's relative efficiency per SM. Ties go
    to the first config of TILE_CONFIGS (the lowest device id). The one heuristic of the package:
    the fused ops' plans and the plain GEMM op (mkernel/bench/gemm.py) both call it."""
    return pick_grouped_tile(m, n, k, 1, sms)


def pick_grouped_tile(m: int, n: int, k: int, groups: int, sms: int = 132) -> TileConfig:
    """pick_tile's rule for a grouped GEMM of ``groups`` groups over m rows in all (their sizes
    live on the device, so each is taken as the mean m / groups): a group's last m-tile is partial,
    which favours shorter tiles when groups are small (MoE decode). One group: pick_tile."""
    del k
    rows = max(1, -(-m // max(1, groups)))

    def cost(c: TileConfig) -> Fraction:
        tiles = groups * -(-rows // c.bm) * -(-n // c.bn)
        return -(-tiles // sms) * c.bm * c.bn / _TILE_RATE[c.name]

    return min(TILE_CONFIGS.values(), key=cost)  # min keeps the first of equal costs


def grouped_order(
    tiles_m: int,
    tiles_n: int,
    cfg: TileConfig,
    sms: int,
    *,
    cluster: int = 1,
    group: int | None = None,
) -> list[int]:
    """Unit ids of a tiles_m x tiles_n tile grid in L2-friendly order.

    A unit is ``cluster`` vertically adjacent tiles (one tile when cluster = 1): unit id
    ``um * tiles_n + tn`` over ceil(tiles_m / cluster) unit-rows, and unit um covers tile rows
    um * cluster ... um * cluster + cluster - 1 (those below the grid are empty). Units go down a
    group of g unit-rows, then to the next column, so the ~sms tiles in flight cover a near-square
    block of C and share A rows and B columns in L2; columns snake (alternate direction per group)
    so that consecutive groups start on B columns still in L2. g ~ sqrt(slots * BN / (BM *
    cluster)) with slots = sms // cluster, or ``group`` when given (the dev harness's experiments).

    The plain GEMM op takes this order as its ``tile_order`` (kernels/gemm_args.h); the fused ops'
    plans use it with cluster = 1."""
    if not isinstance(cluster, int) or cluster < 1:
        raise ValueError(f"cluster must be a positive int, got {cluster!r}")
    if group is not None and (not isinstance(group, int) or group < 1):
        raise ValueError(f"group must be a positive int or None, got {group!r}")
    units_m = -(-tiles_m // cluster)
    if group is None:
        unit_bm, slots = cfg.bm * cluster, max(1, sms // cluster)
        group = 1
        while (group + 1) * (group + 1) * unit_bm <= slots * cfg.bn:
            group += 1
    order = []
    for grp, m_base in enumerate(range(0, units_m, group)):
        rows = min(group, units_m - m_base)
        cols = range(tiles_n - 1, -1, -1) if grp % 2 else range(tiles_n)
        order += [(m_base + i) * tiles_n + j for j in cols for i in range(rows)]
    return order


def grid_tiles(m0: int, rows: int, n: int, cfg: TileConfig, tag: int, start: int) -> list[Tile]:
    """Tiles covering rows [m0, m0 + rows) x all n columns, row-major, clipped at the edges."""
    out = []
    for i in range(0, rows, cfg.bm):
        for j in range(0, n, cfg.bn):
            r, c = min(cfg.bm, rows - i), min(cfg.bn, n - j)
            out.append(Tile(start + len(out), m0 + i, j, r, c, tag))
    return out
