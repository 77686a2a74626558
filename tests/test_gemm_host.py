"""Host-side logic of the GEMM engine (primitives/gemm/config.cuh), compiled with the host compiler:
the tile order covers every tile exactly once for every config (cluster configs: every cluster unit,
whose CLUSTER tiles are the rows um * CLUSTER + r), the heuristic's picks, config facts."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from mkernel.bench.gemm import SHAPES  # the six target shapes of the benchmark

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")

DRIVER = r"""
#include <cstdio>
#include <vector>
#include "primitives/gemm/config.cuh"
using namespace mk::gemm;
// stdin: lines "order M N config sms" or "pick M N K sms" or "info config"
int main() {
  char cmd[16];
  while (std::scanf("%15s", cmd) == 1) {
    if (cmd[0] == 'o') {
      int M, N, c, s;
      std::scanf("%d %d %d %d", &M, &N, &c, &s);
      int n = make_tile_order(M, N, c, s, nullptr, 0);
      std::vector<int32_t> v(n > 0 ? n : 0);
      if (n > 0) make_tile_order(M, N, c, s, v.data(), n);
      std::printf("%d", n);
      for (int x : v) std::printf(" %d", x);
      std::printf("\n");
    } else if (cmd[0] == 'p') {
      int M, N, K, s;
      std::scanf("%d %d %d %d", &M, &N, &K, &s);
      std::printf("%d\n", pick_config(M, N, K, s));
    } else {
      int c;
      std::scanf("%d", &c);
      ConfigInfo i = config_info(c);
      std::printf("%d %d %d %d %d %d\n", i.id, i.bm, i.bn, i.stages, i.smem_bytes, i.cluster);
    }
  }
}
"""

CONFIGS = (0, 1, 2, 103)  # 103: the 2-CTA cluster experiment (built with MK_GEMM_EXPERIMENTS)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory):
    if CXX is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("gemm_host")
    (d / "driver.cpp").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O1",
            "-DMK_GEMM_EXPERIMENTS",
            f"-I{ROOT}",
            str(d / "driver.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )

    def run(lines: list[str]) -> list[str]:
        p = subprocess.run(
            [str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
        )
        return p.stdout.splitlines()

    return run


def test_order_covers_every_tile_once(driver) -> None:
    rng = random.Random(7)
    cases = [
        (
            rng.randint(1, 5000),
            8 * rng.randint(1, 1200),
            rng.choice(CONFIGS),
            rng.choice([1, 2, 3, 7, 66, 132]),
        )
        for _ in range(150)
    ]
    cases += [(8192, 8192, 0, 132), (4096, 28672, 0, 132), (300, 520, 103, 132), (1, 8, 103, 1)]
    infos = {c: list(map(int, driver([f"info {c}"])[0].split())) for c in CONFIGS}
    outs = driver([f"order {m} {n} {c} {s}" for m, n, c, s in cases])
    for (m, n, c, s), line in zip(cases, outs, strict=True):
        _, bm, bn, _, _, cl = infos[c]
        vals = list(map(int, line.split()))
        count, order = vals[0], vals[1:]
        tiles_m, tiles_n = -(-m // bm), -(-n // bn)
        units_m = -(-tiles_m // cl)
        assert count == units_m * tiles_n == len(order), (m, n, c, s)
        assert sorted(order) == list(range(count)), f"not a permutation: {(m, n, c, s)}"
        covered = sorted(
            (um * cl + r) * tiles_n + u % tiles_n
            for u in order
            for um in [u // tiles_n]
            for r in range(cl)
            if um * cl + r < tiles_m
        )
        assert covered == list(range(tiles_m * tiles_n)), f"tiles missed or doubled: {(m, n, c, s)}"


def test_heuristic_and_config_facts(driver) -> None:
    picks = driver([f"pick {m} {n} {k} 132" for m, n, k in SHAPES])
    assert picks == ["0"] * len(SHAPES)  # the measured workhorse on every target shape
    assert driver(["pick 128 1024 1024 132"]) == ["2"]  # few tiles: the small config uses more SMs
    info = [list(map(int, line.split())) for line in driver([f"info {c}" for c in (*CONFIGS, 5)])]
    for row in info[:-1]:
        assert row[4] <= 232448, f"config {row[0]} over the sm_90 shared-memory limit"
    assert info[0][1:4] == [128, 256, 4] and info[3][5] == 2
    assert info[-1][0] == -1  # unknown id
