"""Laws of the fused ops on the CPU interpreter, every expected value computed here from the inputs
in fp64 (never through ``mkernel.reference``, which lives beside each op and could be broken the
same way as the op):

- gemm_rs: out[r] = rows r*M/W .. (r+1)*M/W of sum_q a[q] @ b[q];
- ag_gemm: out[r] = cat_q(a[q]) @ b[r];
- gemm_ar: out[r] = sum_q a[q] @ b[q], the same bits on every rank;

each within the bf16 rounding of an fp32 accumulation (tests/helpers.py assert_close_exact). The
references obey the same formulas. Cross-op laws: gemm_ar is the concatenation of gemm_rs's shards
(bit for bit at W <= 2, where the fp32 sum of two partial products cannot depend on their order);
ag_gemm with one b everywhere gives one result everywhere, the GEMM of the gathered a; at W = 1
every op is a plain fp32 GEMM rounded to bf16 (the fast paths, remainder tiles included).

Bit-for-bit claims need the CPU BLAS to compute a sub-block of a product as the same block of the
whole product (true for MKL at these K); ``_blocks_agree`` checks that first for the plan's tiles
and the law falls back to the fp64 tolerance where it does not hold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mkernel
from tests.helpers import assert_close_exact, gemm_inputs, poisoned

OVERLAP = st.sampled_from(["intra_sm", "inter_sm"])
TILE = st.sampled_from([None, "128x128x64", "128x256x64", "64x128x64"])


def _order_hook(rank, tiles):
    """A tile order that differs per rank: rotated by 3 * rank + 1, reversed on odd ranks."""
    n = len(tiles)
    rot = (3 * rank + 1) % n
    order = list(range(rot, n)) + list(range(rot))
    return order[::-1] if rank % 2 else order


def _schedule(overlap, tile, sms, seed, shuffle, **kw):
    hook = _order_hook if shuffle else None
    return mkernel.Schedule(overlap=overlap, tile=tile, sms=sms, seed=seed, tile_order=hook, **kw)


# -- the formulas, in fp64 -------------------------------------------------------------------------


def sum_of_products(a: torch.Tensor, b: torch.Tensor):
    """sum_q a[q] @ b[q] ([M, N], fp64) and the same sum over |a[q]| @ |b[q]| (the magnitude the
    fp32 rounding error scales with)."""
    W = a.shape[0]
    exact = sum(a[q].double() @ b[q].double() for q in range(W))
    mag = sum(a[q].double().abs() @ b[q].double().abs() for q in range(W))
    return exact, mag


def gemm_rs_formula(a, b):
    """[W, M/W, N]: rank r holds rows r*M/W .. (r+1)*M/W of the sum; fp32 terms: K/W + W."""
    W, M, kl = a.shape
    ms = M // W
    exact, mag = sum_of_products(a, b)
    rows = [slice(r * ms, (r + 1) * ms) for r in range(W)]
    return torch.stack([exact[s] for s in rows]), torch.stack([mag[s] for s in rows]), kl + W


def assert_gemm_rs(out, a, b, what: str) -> None:
    """gemm_rs's result: each rank's rows of the fp64 sum, within fp32 accumulation (the peers'
    fp32 partials added to the owner's) and the final bf16 rounding."""
    assert_close_exact(out, *gemm_rs_formula(a, b), what)


def ag_gemm_formula(a, b):
    """[W, M, N]: the gathered a (rank q's shard at rows q*M/W ..) times rank r's own b."""
    W, ms, k = a.shape
    full = torch.cat([a[q] for q in range(W)]).double()  # [M, K]
    exact = torch.stack([full @ b[r].double() for r in range(W)])
    mag = torch.stack([full.abs() @ b[r].double().abs() for r in range(W)])
    return exact, mag, k


def gemm_ar_formula(a, b):
    """[W, M, N]: the whole sum on every rank."""
    W, M, kl = a.shape
    exact, mag = sum_of_products(a, b)
    return exact.expand(W, *exact.shape), mag.expand(W, *mag.shape), kl + W


def _blocks_agree(x: torch.Tensor, y: torch.Tensor, tiles) -> bool:
    """Whether this CPU's fp32 GEMM of each tile's rows and columns gives the same bits as that
    block of the whole product (then tile-wise fp32 results equal the whole GEMM's bit for bit)."""
    x, y = x.float(), y.float()
    whole = x @ y
    return all(
        torch.equal(
            x[t.m0 : t.m0 + t.rows] @ y[:, t.n0 : t.n0 + t.cols],
            whole[t.m0 : t.m0 + t.rows, t.n0 : t.n0 + t.cols],
        )
        for t in tiles
    )


# -- each op against its formula -------------------------------------------------------------------


@settings(max_examples=30)
@given(
    W=st.integers(1, 8),
    rows=st.integers(1, 150),
    n8=st.integers(1, 34),
    k8=st.integers(1, 8),
    overlap=OVERLAP,
    tile=TILE,
    sms=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
# W = 1 (the fast path) with remainder tiles in both dimensions
@example(W=1, rows=200, n8=33, k8=2, overlap="intra_sm", tile="128x128x64", sms=3, seed=1,
         shuffle=True)  # fmt: skip
# M/W = 130 rows: not a multiple of the tile height; N = 136: not a multiple of the tile width
@example(W=2, rows=130, n8=17, k8=3, overlap="inter_sm", tile="128x128x64", sms=4, seed=2,
         shuffle=False)  # fmt: skip
@example(W=3, rows=70, n8=9, k8=1, overlap="intra_sm", tile="64x128x64", sms=2, seed=3,
         shuffle=True)  # fmt: skip
@example(W=8, rows=3, n8=2, k8=1, overlap="inter_sm", tile=None, sms=3, seed=4, shuffle=True)
def test_gemm_rs_is_each_ranks_rows_of_the_sum(W, rows, n8, k8, overlap, tile, sms, seed, shuffle):
    m, n, kl = W * rows, 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = _schedule(overlap, tile, sms, seed, shuffle)
    out = mkernel.gemm_rs(a, b, world, sched, out=poisoned((W, rows, n), "cpu"))
    assert_gemm_rs(out, a, b, f"gemm_rs W={W} {m}x{n}x{kl}")


@settings(max_examples=30)
@given(
    W=st.integers(1, 8),
    ms=st.integers(1, 140),
    n8=st.integers(1, 34),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    tile=TILE,
    chunk_rows=st.sampled_from([None, 1, 3, 16, 50]),
    sms=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
@example(W=1, ms=200, n8=33, k8=2, overlap="intra_sm", tile="128x128x64", chunk_rows=None, sms=3,
         seed=1, shuffle=True)  # fmt: skip
@example(W=2, ms=130, n8=17, k8=3, overlap="inter_sm", tile="128x128x64", chunk_rows=None, sms=4,
         seed=2, shuffle=False)  # fmt: skip
# single-row shards: every tile spans every rank's shard
@example(W=4, ms=1, n8=3, k8=1, overlap="intra_sm", tile=None, chunk_rows=None, sms=2, seed=3,
         shuffle=True)  # fmt: skip
@example(W=3, ms=1, n8=1, k8=2, overlap="inter_sm", tile="64x128x64", chunk_rows=3, sms=3, seed=5,
         shuffle=False)  # fmt: skip
@example(W=8, ms=5, n8=2, k8=1, overlap="inter_sm", tile=None, chunk_rows=3, sms=3, seed=4,
         shuffle=True)  # fmt: skip
def test_ag_gemm_is_the_gathered_a_times_each_ranks_b(
    W, ms, n8, k8, overlap, tile, chunk_rows, sms, seed, shuffle
):
    n, k = 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, ms, n, k, seed)
    sched = _schedule(overlap, tile, sms, seed, shuffle, chunk_rows=chunk_rows)
    out = mkernel.ag_gemm(a, b, world, sched, out=poisoned((W, W * ms, n), "cpu"))
    assert_close_exact(out, *ag_gemm_formula(a, b), f"ag_gemm W={W} ms={ms} n={n} k={k}")


@settings(max_examples=30)
@given(
    W=st.integers(1, 8),
    m=st.integers(1, 300),
    n8=st.integers(1, 34),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    tile=TILE,
    sms=st.integers(2, 8),
    seed=st.integers(0, 2**16),
    shuffle=st.booleans(),
)
@example(W=1, m=200, n8=33, k8=2, overlap="intra_sm", tile="128x128x64", sms=3, seed=1,
         shuffle=True)  # fmt: skip
@example(W=2, m=130, n8=17, k8=3, overlap="inter_sm", tile="128x128x64", sms=4, seed=2,
         shuffle=False)  # fmt: skip
@example(W=3, m=1, n8=1, k8=1, overlap="intra_sm", tile=None, sms=2, seed=3, shuffle=False)
@example(W=8, m=20, n8=40, k8=1, overlap="inter_sm", tile="64x128x64", sms=3, seed=4, shuffle=True)
def test_gemm_ar_is_the_sum_on_every_rank(W, m, n8, k8, overlap, tile, sms, seed, shuffle):
    n, kl = 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = _schedule(overlap, tile, sms, seed, shuffle)
    out = mkernel.gemm_ar(a, b, world, sched, out=poisoned((W, m, n), "cpu"))
    assert_close_exact(out, *gemm_ar_formula(a, b), f"gemm_ar W={W} {m}x{n}x{kl}")
    for r in range(1, W):
        assert torch.equal(out[r], out[0]), f"rank {r} holds other bits than rank 0"


@settings(max_examples=15)
@given(
    W=st.integers(1, 5),
    rows=st.integers(1, 40),
    n8=st.integers(1, 6),
    k8=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@example(W=1, rows=3, n8=1, k8=1, seed=0)
@example(W=4, rows=1, n8=2, k8=1, seed=1)
def test_references_obey_the_formulas(W, rows, n8, k8, seed):
    world = mkernel.World.emulated(W)
    n, k = 8 * n8, 8 * k8
    a, b = gemm_inputs(W, W * rows, n, k, seed)
    assert_close_exact(mkernel.reference.gemm_rs(a, b, world), *gemm_rs_formula(a, b), "rs ref")
    assert_close_exact(mkernel.reference.gemm_ar(a, b, world), *gemm_ar_formula(a, b), "ar ref")
    a, b = gemm_inputs(W, rows, n, k, seed + 1)
    assert_close_exact(mkernel.reference.ag_gemm(a, b, world), *ag_gemm_formula(a, b), "ag ref")


# -- laws between ops ------------------------------------------------------------------------------


@settings(max_examples=15)
@given(
    W=st.integers(1, 4),
    rows=st.integers(1, 100),
    n8=st.integers(1, 24),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    tile=TILE,
    seed=st.integers(0, 2**16),
)
@example(W=2, rows=130, n8=17, k8=2, overlap="intra_sm", tile="128x128x64", seed=0)
@example(W=1, rows=70, n8=33, k8=1, overlap="inter_sm", tile="64x128x64", seed=1)
@example(W=4, rows=33, n8=5, k8=3, overlap="inter_sm", tile=None, seed=2)
def test_gemm_ar_is_the_concatenation_of_the_gemm_rs_shards(W, rows, n8, k8, overlap, tile, seed):
    m, n, kl = W * rows, 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, m, n, kl, seed)
    sched = mkernel.Schedule(overlap=overlap, tile=tile, seed=seed)
    rs = mkernel.gemm_rs(a, b, world, sched)
    ar = mkernel.gemm_ar(a, b, world, sched)
    shards = torch.cat([rs[r] for r in range(W)])  # [M, N]: rank r's rows at r*M/W
    exact, mag = sum_of_products(a, b)
    assert_close_exact(shards, exact, mag, kl + W, "gemm_rs shards")
    tiles = sched.plan("gemm_rs", world, a, b).tiles + sched.plan("gemm_ar", world, a, b).tiles
    if W <= 2 and all(_blocks_agree(a[q], b[q], tiles) for q in range(W)):
        # 0 + x + y == 0 + y + x: gemm_ar rounds the fp32 sum once; gemm_rs's owner adds its
        # peer's fp32 partial to its own fp32 tile, then rounds once: the same bits
        whole = sum(a[q].float() @ b[q].float() for q in range(W)).bfloat16()
        assert torch.equal(shards, whole), "gemm_rs shards differ from the fp32 sum in bf16"
        for r in range(W):
            assert torch.equal(ar[r], shards), f"gemm_ar on rank {r} != cat(gemm_rs shards)"
    else:
        for r in range(W):
            assert_close_exact(ar[r], exact, mag, kl + W, f"gemm_ar rank {r}")


@settings(max_examples=15)
@given(
    W=st.integers(1, 5),
    ms=st.integers(1, 90),
    n8=st.integers(1, 24),
    k8=st.integers(1, 6),
    overlap=OVERLAP,
    tile=TILE,
    chunk_rows=st.sampled_from([None, 1, 7, 32]),
    seed=st.integers(0, 2**16),
)
@example(W=3, ms=1, n8=2, k8=1, overlap="intra_sm", tile=None, chunk_rows=None, seed=0)
@example(W=2, ms=70, n8=17, k8=2, overlap="inter_sm", tile="64x128x64", chunk_rows=7, seed=1)
def test_ag_gemm_with_one_b_everywhere_is_one_gemm_of_the_gathered_a(
    W, ms, n8, k8, overlap, tile, chunk_rows, seed
):
    n, k = 8 * n8, 8 * k8
    world = mkernel.World.emulated(W)
    a, b = gemm_inputs(W, ms, n, k, seed)
    same_b = b[:1].expand(W, k, n).contiguous()
    sched = mkernel.Schedule(overlap=overlap, tile=tile, chunk_rows=chunk_rows, seed=seed)
    out = mkernel.ag_gemm(a, same_b, world, sched)
    full_a = torch.cat([a[q] for q in range(W)])  # [M, K]
    for r in range(1, W):
        assert torch.equal(out[r], out[0]), f"rank {r} differs from rank 0 with the same b"
    exact = full_a.double() @ b[0].double()
    assert_close_exact(out[0], exact, full_a.double().abs() @ b[0].double().abs(), k, "ag_gemm")
    if _blocks_agree(full_a, b[0], sched.plan("ag_gemm", world, a, same_b).tiles):
        assert torch.equal(out[0], (full_a.float() @ b[0].float()).bfloat16())


# -- W = 1: every op is a plain GEMM, each tile stored at its own rows ----------------------------

W1_SHAPES = [  # (M, N, K): remainder tiles in M and N for every config
    (200, 264, 16),
    (130, 136, 8),
    (1, 8, 8),
    (257, 392, 24),
]


@pytest.mark.parametrize("tile", ["128x128x64", "128x256x64", "64x128x64"])
@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm", "gemm_ar"])
def test_w1_is_a_plain_gemm_rounded_to_bf16(op, tile):
    world = mkernel.World.emulated(1)
    for i, (m, n, k) in enumerate(W1_SHAPES):
        a, b = gemm_inputs(1, m, n, k, seed=i)
        overlap = ("intra_sm", "inter_sm")[i % 2]
        sched = mkernel.Schedule(overlap=overlap, tile=tile, sms=3, tile_order=_order_hook)
        out = getattr(mkernel, op)(a, b, world, sched, out=poisoned((1, m, n), "cpu"))
        what = f"{op} W=1 {m}x{n}x{k} {tile} {overlap}"
        exact = a[0].double() @ b[0].double()
        assert_close_exact(out[0], exact, a[0].double().abs() @ b[0].double().abs(), k, what)
        plan = sched.plan(op, world, a, b)
        if _blocks_agree(a[0], b[0], plan.tiles):
            assert torch.equal(out[0], (a[0].float() @ b[0].float()).bfloat16()), what
