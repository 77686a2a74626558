"""The tile heuristics, once, in Python (mkernel/schedule.py): pick_tile, the config every GEMM
picks (the fused ops' plans and the plain GEMM op), and grouped_order, the L2-friendly tile order
(of cluster units too: the plain GEMM op's cluster experiments). The device code has neither: it
runs the config id and the order it is given."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from mkernel.bench.gemm import SHAPES  # the six target shapes of the benchmark
from mkernel.schedule import _TILE_RATE, TILE_CONFIGS, TileConfig, grouped_order, pick_tile

C0, C1, C2 = TILE_CONFIGS.values()  # device ids 0, 1, 2 (TILE_CONFIG_IDS)
# The cluster experiment's grid (kernels/gemm.cu config 103: 128 x 256 tiles in pairs along M).
CLUSTER_CASES = [(c, 1) for c in TILE_CONFIGS.values()] + [(C0, 2), (C2, 2)]


def covered_tiles(order: list[int], tiles_m: int, tiles_n: int, cluster: int) -> list[int]:
    """The row-major tile ids the units of ``order`` cover: unit um * tiles_n + tn is the tiles
    (um * cluster + r, tn), r < cluster, of those inside the grid."""
    return [
        (um * cluster + r) * tiles_n + u % tiles_n
        for u in order
        for um in [u // tiles_n]
        for r in range(cluster)
        if um * cluster + r < tiles_m
    ]


def test_grouped_order_covers_every_tile_once() -> None:
    rng = random.Random(7)
    cases = [
        (
            rng.randint(1, 5000),
            8 * rng.randint(1, 1200),
            *rng.choice(CLUSTER_CASES),
            rng.choice([1, 2, 3, 7, 66, 132]),
            rng.choice([None, None, None, 1, 3, 8]),
        )
        for _ in range(300)
    ]
    cases += [(8192, 8192, C0, 1, 132, None), (4096, 28672, C0, 1, 132, None)]
    cases += [(300, 520, C0, 2, 132, None), (1, 8, C0, 2, 1, None), (1, 8, C2, 1, 1, 4)]
    for m, n, cfg, cluster, sms, group in cases:
        tiles_m, tiles_n = -(-m // cfg.bm), -(-n // cfg.bn)
        order = grouped_order(tiles_m, tiles_n, cfg, sms, cluster=cluster, group=group)
        case = (m, n, cfg.name, cluster, sms, group)
        units = -(-tiles_m // cluster) * tiles_n
        assert sorted(order) == list(range(units)), f"not a permutation of the units: {case}"
        got = sorted(covered_tiles(order, tiles_m, tiles_n, cluster))
        assert got == list(range(tiles_m * tiles_n)), f"tiles missed or doubled: {case}"


@pytest.mark.parametrize("cluster", [1, 2])
def test_grouped_order_goes_down_groups_and_snakes(cluster: int) -> None:
    """Units go down a group of g unit-rows, then to the next column; groups alternate direction."""
    rng = random.Random(cluster)
    for _ in range(100):
        cfg = rng.choice(list(TILE_CONFIGS.values()))
        tiles_m, tiles_n = rng.randint(1, 60), rng.randint(1, 40)
        g = rng.randint(1, 12)
        order = grouped_order(tiles_m, tiles_n, cfg, rng.randint(1, 200), cluster=cluster, group=g)
        units_m = -(-tiles_m // cluster)
        k = 0
        for grp, m_base in enumerate(range(0, units_m, g)):
            rows = min(g, units_m - m_base)
            cols = range(tiles_n - 1, -1, -1) if grp % 2 else range(tiles_n)
            for tn in cols:
                assert order[k : k + rows] == [(m_base + i) * tiles_n + tn for i in range(rows)]
                k += rows
        assert k == len(order)


def test_grouped_order_group_size() -> None:
    """Without ``group``: g = floor(sqrt(slots * BN / (BM * cluster))), slots = sms // cluster (at
    least 1 of each): the ~sms tiles in flight cover a near-square block of C."""
    order = grouped_order(64, 32, C0, 132)  # 8192 x 8192 on an H200: g = 16 (16^2 * 128 <= 33792)
    assert order[:17] == [i * 32 for i in range(16)] + [1]
    order = grouped_order(64, 64, C1, 132)  # g = 11 (11^2 * 128 <= 16896 < 12^2 * 128)
    assert order[:12] == [i * 64 for i in range(11)] + [1]
    order = grouped_order(64, 32, C0, 132, cluster=2)  # 66 slots of 256 x 256 units: g = 8
    assert order[:9] == [i * 32 for i in range(8)] + [1]
    assert grouped_order(4, 2, C0, 1, cluster=2) == [0, 1, 3, 2]  # 1 slot: g = 1, snaking
    assert grouped_order(3, 1, C2, 132, group=2) == [0, 1, 2]


def test_grouped_order_frozen() -> None:
    """Small orders written out (they equal the C++ make_tile_order this function replaced): a
    change to the order must be deliberate."""
    assert grouped_order(5, 3, C2, 4) == [0, 3, 1, 4, 2, 5, 8, 11, 7, 10, 6, 9, 12, 13, 14]
    assert grouped_order(3, 2, C0, 132) == [0, 2, 4, 1, 3, 5]
    assert grouped_order(7, 2, C1, 2) == [0, 1, 3, 2, 4, 5, 7, 6, 8, 9, 11, 10, 12, 13]
    assert grouped_order(4, 3, C2, 1) == [0, 1, 2, 5, 4, 3, 6, 7, 8, 11, 10, 9]
    assert grouped_order(5, 3, C0, 16, cluster=2) == [0, 3, 1, 4, 2, 5, 8, 7, 6]
    assert grouped_order(6, 2, C0, 132, group=2) == [0, 2, 1, 3, 5, 7, 4, 6, 8, 10, 9, 11]
    assert grouped_order(0, 5, C0, 132) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cluster": 0}, "cluster"), ({"cluster": 1.5}, "cluster"), ({"group": 0}, "group")],
)
def test_grouped_order_rejects_bad_units(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        grouped_order(4, 4, C0, 132, **kwargs)


def exact_pick(m: int, n: int, sms: int) -> TileConfig:
    """The documented rule in exact arithmetic: ceil(tiles / sms) waves x BM * BN / rate, the least
    cost, ties to the first config of TILE_CONFIGS."""
    best, best_cost = None, None
    for c in TILE_CONFIGS.values():
        tiles = -(-m // c.bm) * -(-n // c.bn)
        cost = Fraction(-(-tiles // sms) * c.bm * c.bn) / Fraction(_TILE_RATE[c.name])
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


def test_pick_tile_follows_the_rule() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        m = rng.randint(1, rng.choice([300, 3000, 30000, 200000]))
        n = rng.randint(1, rng.choice([300, 3000, 30000]))
        sms = rng.randint(1, 300)
        assert pick_tile(m, n, 64, sms) == exact_pick(m, n, sms), (m, n, sms)
    for mi in range(1, 41):
        for ni in range(1, 41):
            assert pick_tile(64 * mi, 64 * ni, 64, 132) == exact_pick(64 * mi, 64 * ni, 132)


def test_pick_tile_picks() -> None:
    assert all(pick_tile(m, n, k, 132) == C0 for m, n, k in SHAPES)  # the measured workhorse
    assert pick_tile(128, 1024, 1024, 132) == C2  # few tiles: the small config uses more SMs
    # Equal predicted times go to the first config (the float C++ heuristic this replaced broke
    # the 1-vs-2 tie towards 2).
    assert pick_tile(128, 1152, 64, 1) == C0  # 5 x 128x256 = 9 x 128x128 / 0.9
    assert pick_tile(281, 48, 64, 1) == C1  # 3 x 128x128 / 0.9 = 5 x 64x128 / 0.75
    assert pick_tile(192, 256, 64, 2) == C0  # 1 wave of 128x256 = 3 waves of 64x128 / 0.75
    assert pick_tile(298, 14840, 64, 132) == C1  # a tie on an H200's 132 SMs
