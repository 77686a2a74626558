"""grouped_gemm on the GPU (the GEMM engine with a batched B, tasks found on the device): every
config against an fp64 reference on groups that are empty, partial, larger than a tile and not
tile-aligned in K and N; rows outside the groups and guard rows never written; garbage offsets on
the device clamped (no write outside out); CUDA-graph replay with the groups changing between
replays; a loop of 1000 calls; the launcher's status codes."""

from __future__ import annotations

import random

import pytest
import torch

import mkernel
from mkernel import schedule
from mkernel.ops.common import extension
from tests.helpers import assert_close_bf16

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(sizes: list[int], k: int, n: int, lead: int = 0, tail: int = 0, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    m = lead + sum(sizes) + tail
    a = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    b = torch.randn(len(sizes), k, n, device=DEV, generator=g).bfloat16()
    offs = [lead]
    for s in sizes:
        offs.append(offs[-1] + s)
    return a, b, torch.tensor(offs, dtype=torch.int32, device=DEV)


def _check(out: torch.Tensor, a, b, offsets: torch.Tensor, what: str) -> None:
    offs = offsets.tolist()
    for e in range(b.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            ref = (a[lo:hi].double() @ b[e].double()).bfloat16()
            assert_close_bf16(out[lo:hi], ref, f"{what} group {e}")


CASES = [  # group sizes, K, N
    ([130, 0, 1, 255, 64], 200, 264),  # empty / one-row / partial groups; K, N off the tile
    ([1000], 64, 128),  # one group: the dense GEMM
    ([0, 0, 300], 128, 72),
    ([128] * 8, 512, 512),  # tile-aligned groups: full TMA-stored tiles
    ([random.Random(7).randrange(0, 300) for _ in range(33)], 256, 256),
]


@pytest.mark.parametrize("tile", list(schedule.TILE_CONFIGS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_groups_against_reference(tile, case):
    sizes, k, n = CASES[case]
    a, b, offsets = _inputs(sizes, k, n, lead=5, tail=3, seed=case)
    m = a.shape[0]
    big = torch.full((m + 6, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = big[3 : 3 + m]  # guard rows around out
    got = mkernel.grouped_gemm(a, b, offsets, out=out, tile=tile)
    assert got.data_ptr() == out.data_ptr()
    _check(out, a, b, offsets, f"{tile} case {case}")
    assert torch.isnan(big[: 3 + 5].float()).all(), "rows before the groups were written"
    assert torch.isnan(big[3 + m - 3 :].float()).all(), "rows after the groups were written"


@pytest.mark.parametrize("tile", list(schedule.TILE_CONFIGS))
def test_fp32_out_is_the_unrounded_product(tile):
    sizes, k, n = CASES[0]
    a, b, offsets = _inputs(sizes, k, n, lead=2, tail=1, seed=3)
    out = torch.full((a.shape[0], n), float("nan"), device=DEV)
    mkernel.grouped_gemm(a, b, offsets, out=out, out_dtype=torch.float32, tile=tile)
    offs = offsets.tolist()
    for e in range(len(sizes)):
        lo, hi = offs[e], offs[e + 1]
        exact = a[lo:hi].double() @ b[e].double()
        bound = (a[lo:hi].double().abs() @ b[e].double().abs()) * (k * 2.0**-23) + 1e-30
        assert ((out[lo:hi].double() - exact).abs() <= bound).all(), f"group {e}"
    assert torch.isnan(out[:2]).all() and torch.isnan(out[-1:]).all()


def test_against_torch_grouped_mm():
    sizes = [random.Random(3).randrange(64, 512) for _ in range(8)]
    a, b, offsets = _inputs(sizes, 1024, 512, seed=11)
    ours = mkernel.grouped_gemm(a, b, offsets)
    theirs = torch._grouped_mm(a, b, offs=offsets[1:].contiguous())
    _check(ours, a, b, offsets, "ours")
    assert_close_bf16(ours, theirs.float().bfloat16(), "ours vs torch._grouped_mm")


def test_garbage_offsets_are_clamped_on_the_device():
    a, b, _ = _inputs([64, 64, 64], 64, 64)
    m = a.shape[0]
    # decreasing, negative, past M, all at M: each group clamps to [lo, hi) inside [0, M)
    for offs in ([0, 100, 50, 50], [-50, 10, 20, 1 << 30], [192, 0, 0, 0], [10, 5, 300, 2]):
        big = torch.full((m + 4, 64), float("nan"), dtype=torch.bfloat16, device=DEV)
        offsets = torch.tensor(offs, dtype=torch.int32, device=DEV)
        mkernel.grouped_gemm(a, b, offsets, out=big[2 : 2 + m])
        torch.cuda.synchronize()
        assert torch.isnan(big[:2].float()).all() and torch.isnan(big[2 + m :].float()).all()
        written = torch.zeros(m, dtype=torch.bool)
        for e in range(3):  # the clamped groups are computed as such
            lo = min(max(offs[e], 0), m)
            hi = min(max(offs[e + 1], lo), m)
            if hi > lo:
                ref = (a[lo:hi].double() @ b[e].double()).bfloat16()
                assert_close_bf16(big[2 + lo : 2 + hi], ref, f"offsets {offs} group {e}")
                written[lo:hi] = True
        assert torch.isnan(big[2 : 2 + m][~written.to(DEV)].float()).all(), offs


def test_graph_replay_with_changing_groups():
    k, n, groups, m = 256, 256, 6, 900
    a, b, _ = _inputs([150] * groups, k, n, seed=5)
    offsets = torch.zeros(groups + 1, dtype=torch.int32, device=DEV)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    mkernel.grouped_gemm(a, b, offsets, out=out)  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mkernel.grouped_gemm(a, b, offsets, out=out)
    rng = random.Random(1)
    for replay in range(5):
        cuts = sorted(rng.randrange(0, m + 1) for _ in range(groups - 1))
        offsets.copy_(torch.tensor([0, *cuts, m], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, a, b, offsets, f"replay {replay}")
        assert not torch.isnan(out.float()).any()


def test_loop_of_1000_calls():
    k, n, groups = 128, 128, 4
    a, b, _ = _inputs([100] * groups, k, n, seed=9)
    m = a.shape[0]
    rng = random.Random(2)
    outs = []
    for i in range(1000):
        cuts = sorted(rng.randrange(0, m + 1) for _ in range(groups - 1))
        offsets = torch.tensor([0, *cuts, m], dtype=torch.int32, device=DEV)
        out = mkernel.grouped_gemm(a, b, offsets)
        if i % 250 == 249:
            outs.append((out, offsets))
    torch.cuda.synchronize()
    for out, offsets in outs:
        _check(out, a, b, offsets, "loop")


def test_status_codes():
    ext = extension()
    a, b, offsets = _inputs([64], 64, 64)
    out = torch.empty(64, 64, dtype=torch.bfloat16, device=DEV)
    ws = torch.empty(2, dtype=torch.int32, device=DEV)

    def args(**kw):
        x = ext.GroupedGemmArgs()
        x.a, x.b, x.c = a.data_ptr(), b.data_ptr(), out.data_ptr()
        x.offsets, x.workspace = offsets.data_ptr(), ws.data_ptr()
        x.M, x.N, x.K, x.G, x.config = 64, 64, 64, 1, 0
        for key, v in kw.items():
            setattr(x, key, v)
        return x

    stream = torch.cuda.current_stream().cuda_stream
    assert ext.launch_grouped_gemm(args(), stream) == 0
    for kw, status in (
        ({"G": 0}, 1),
        ({"N": 60}, 2),
        ({"workspace": 0}, 3),
        ({"a": a.data_ptr() + 2}, 3),
        ({"config": 103}, 4),
        ({"config": -1}, 4),
    ):
        assert ext.launch_grouped_gemm(args(**kw), stream) == status, kw
        assert ext.grouped_gemm_status_string(status) != "unknown status"
    torch.cuda.synchronize()


@pytest.mark.parametrize("tile", list(schedule.TILE_CONFIGS))
@pytest.mark.parametrize("case", [0, 2, 4])
def test_gathered_rows_against_reference(tile, case):
    """rows=: A's rows gathered by index (repeats, any order) are the rows of a[rows]."""
    sizes, k, n = CASES[case]
    m = sum(sizes)
    g = torch.Generator(device=DEV).manual_seed(case)
    src = torch.randn(97, k, device=DEV, generator=g).bfloat16()
    b = torch.randn(len(sizes), k, n, device=DEV, generator=g).bfloat16()
    rows = torch.randint(0, 97, (m,), device=DEV, generator=g, dtype=torch.int32)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    mkernel.grouped_gemm(src, b, offsets.to(DEV), rows=rows, out=out, tile=tile)
    _check(out, src[rows.long()], b, offsets, f"gather {tile} case {case}")


def test_gathered_rows_out_of_range_are_clamped():
    src = torch.randn(10, 64, device=DEV).bfloat16()
    b = torch.randn(1, 64, 64, device=DEV).bfloat16()
    rows = torch.tensor([-5, 0, 9, 10, 1 << 30, 3], dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 6], dtype=torch.int32, device=DEV)
    out = mkernel.grouped_gemm(src, b, offsets, rows=rows)
    clamped = rows.clamp(0, 9).long()
    _check(out, src[clamped], b, offsets, "clamped rows")
