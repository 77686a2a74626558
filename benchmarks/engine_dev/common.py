"""Shared helpers of the GEMM engine dev harness: load the dev module, the config and tile order
(mkernel.schedule's, the package's one heuristic and order), launch, reference, bounds."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo root: mkernel
from mkernel.schedule import TILE_CONFIG_IDS, TileConfig, grouped_order, pick_tile  # noqa: E402

KINDS = {0: "bf16", 1: "f32-reduce-add", 2: "f32", 3: "f32-tma-reduce-add"}


def load_module(build_dir):
    sys.path.insert(0, build_dir)
    import mk_gemm_dev  # noqa: E402

    return mk_gemm_dev


def launch(mk, A, B, C, M, N, K, *, config, kind=0, order=None, ldc=0, num_sms=0):
    """C (+)= A @ B through launch_gemm with config id ``config`` (pick_config's, or any compiled
    id) and ``order`` (a device int32 tensor, or None for row-major); asserts the status is ok."""
    a = mk.GemmArgs()
    a.a, a.b, a.c = A.data_ptr(), B.data_ptr(), C.data_ptr()
    a.M, a.N, a.K = M, N, K
    a.config, a.out_kind, a.ldc = config, kind, ldc
    a.tile_order = order.data_ptr() if order is not None else 0
    a.num_sms = num_sms
    st = mk.launch_gemm(a, torch.cuda.current_stream().cuda_stream)
    assert st == 0, f"launch_gemm -> {st}: {mk.gemm_status_string(st)}"


def status_of(mk, M, N, K, *, config=0, kind=0, ldc=0, ptrs=(256, 256, 256)):
    a = mk.GemmArgs()
    a.a, a.b, a.c = ptrs
    a.M, a.N, a.K, a.config, a.out_kind, a.ldc = M, N, K, config, kind, ldc
    return mk.launch_gemm(a, torch.cuda.current_stream().cuda_stream)


def pick_config(M, N, K, sms):
    """The config id mkernel.schedule.pick_tile picks for an M x N x K GEMM on ``sms`` SMs."""
    return TILE_CONFIG_IDS[pick_tile(M, N, K, sms).name]


def config_tile(mk, config):
    """(TileConfig, cluster) of a compiled config id, experiments (ids >= 100) included."""
    info = mk.gemm_config_info(config)
    return TileConfig(f"id{config}", info["BM"], info["BN"], info["BK"]), info["cluster"]


def num_units(mk, M, N, config):
    """Units of the config's grid (a tile, or CLUSTER vertically adjacent tiles): the length of a
    tile order."""
    cfg, cluster = config_tile(mk, config)
    tiles_m = -(-M // cfg.bm)
    return -(-tiles_m // cluster) * -(-N // cfg.bn)


def tile_order(mk, M, N, config, sms, group=None):
    """mkernel.schedule.grouped_order for config id ``config`` (units of its CLUSTER tiles; an
    explicit group size ``group`` for experiments), as a device int32 tensor."""
    cfg, cluster = config_tile(mk, config)
    order = grouped_order(-(-M // cfg.bm), -(-N // cfg.bn), cfg, sms, cluster=cluster, group=group)
    return torch.tensor(order, dtype=torch.int32, device="cuda")


def error_bound(ref_abs_prod, expected, K, kind):
    """Elementwise bound on |out - expected| from the reference's own rounding.

    fp32 accumulation in another order: <= K * 2^-23 * (|A| @ |B|) with a 2x margin (tensor-core
    accumulation may truncate); bf16 output adds its rounding, <= 2^-8 |expected|."""
    b = K * 2.0**-22 * ref_abs_prod + 1e-6
    if kind == 0:
        b = b + 2.0**-8 * expected.abs()
    else:
        b = b + 2.0**-22 * expected.abs()
    return b


def env_info():
    p = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
        .read()
        .strip(),
    }
