"""Host-side facts of the GEMM engine's compiled configs (primitives/gemm/config.cuh config_info),
compiled with the host compiler: within the sm_90 shared-memory limit, the cluster experiment's
CLUSTER, unknown ids, and the same tile shapes as Python's TILE_CONFIGS under TILE_CONFIG_IDS (the
heuristic and the tile order that pick among them are Python's: tests/test_tile_heuristics.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mkernel.schedule import TILE_CONFIG_IDS, TILE_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")

DRIVER = r"""
#include <cstdio>
#include "primitives/gemm/config.cuh"
using namespace mk::gemm;
// stdin: config ids; stdout per id: "id bm bn bk stages smem_bytes cluster"
int main() {
  int c;
  while (std::scanf("%d", &c) == 1) {
    ConfigInfo i = config_info(c);
    std::printf("%d %d %d %d %d %d %d\n", i.id, i.bm, i.bn, i.bk, i.stages, i.smem_bytes,
                i.cluster);
  }
  std::printf("num_configs %d\n", kNumConfigs);
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

    def run(ids: list[int]) -> tuple[dict[int, list[int]], int]:
        p = subprocess.run(
            [str(exe)],
            input="\n".join(map(str, ids)) + "\n",
            capture_output=True,
            text=True,
            check=True,
        )
        *rows, last = p.stdout.splitlines()
        info = {i: list(map(int, row.split())) for i, row in zip(ids, rows, strict=True)}
        return info, int(last.split()[1])

    return run


def test_config_facts(driver) -> None:
    info, num_configs = driver([*CONFIGS, 5, -1])
    for c in CONFIGS:
        assert info[c][0] == c
        assert info[c][5] <= 232448, f"config {c} over the sm_90 shared-memory limit"
    assert info[0][1:5] == [128, 256, 64, 4] and info[0][6] == 1
    assert info[103][6] == 2  # two CTAs per cluster along M
    assert info[5][0] == -1 and info[-1][0] == -1  # unknown ids
    assert num_configs == len(TILE_CONFIGS)


def test_python_tile_configs_are_the_compiled_ones(driver) -> None:
    """pick_tile picks among TILE_CONFIGS and the launcher runs TILE_CONFIG_IDS[name]: the two
    must describe the same tiles, all single-CTA (grouped_order's cluster = 1)."""
    info, _ = driver(list(TILE_CONFIG_IDS.values()))
    for name, i in TILE_CONFIG_IDS.items():
        c = TILE_CONFIGS[name]
        assert info[i][1:4] == [c.bm, c.bn, c.bk], name
        assert info[i][6] == 1, name
