"""grouped_gemm on the CPU: the reference's meaning, bad input named before any work, and the
grouped tile heuristic. The GPU engine's cases: tests/gpu/test_grouped_gemm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mkernel
from mkernel import schedule
from tests.helpers import assert_close_bf16, poisoned, randn_bf16


def _offsets(sizes: list[int], start: int = 0) -> torch.Tensor:
    return torch.tensor(
        [start, *torch.tensor(sizes).cumsum(0).add(start).tolist()], dtype=torch.int32
    )


@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    k=st.integers(1, 12),
    n=st.integers(1, 12),
    lead=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_groups_multiply_their_own_matrix(sizes, k, n, lead, seed):
    g = torch.Generator().manual_seed(seed)
    m = lead + sum(sizes) + 2  # rows before and after the groups stay untouched
    a, b = randn_bf16(m, k, generator=g), randn_bf16(len(sizes), k, n, generator=g)
    offsets = _offsets(sizes, lead)
    out = mkernel.grouped_gemm(a, b, offsets, out=poisoned((m, n), "cpu"))
    row = lead
    for e, rows in enumerate(sizes):
        if rows == 0:
            continue
        ref = (a[row : row + rows].double() @ b[e].double()).bfloat16()
        assert_close_bf16(out[row : row + rows], ref, f"group {e}")
        row += rows
    assert torch.isnan(out[:lead].float()).all() and torch.isnan(out[row:].float()).all()
    fresh = mkernel.grouped_gemm(a, b, offsets)  # rows in no group: the reference leaves zeros
    assert torch.equal(fresh[lead:row], out[lead:row])
    assert not fresh[:lead].any() and not fresh[row:].any()


@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    src_rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_gathered_rows(sizes, src_rows, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = randn_bf16(src_rows, 8, generator=g), randn_bf16(len(sizes), 8, 16, generator=g)
    rows = torch.randint(0, src_rows, (sum(sizes),), generator=g, dtype=torch.int32)
    offsets = _offsets(sizes)
    got = mkernel.grouped_gemm(a, b, offsets, rows=rows)
    assert torch.equal(got, mkernel.grouped_gemm(a[rows.long()], b, offsets))


def test_bad_rows_are_named():
    a, b, offsets = randn_bf16(6, 8), randn_bf16(2, 8, 16), _offsets([2, 4])
    with pytest.raises(ValueError, match="rows must be int32"):
        mkernel.grouped_gemm(a, b, offsets, rows=torch.arange(6))
    with pytest.raises(ValueError, match=r"rows must index a's 6 rows, got \[1, 6\]"):
        mkernel.grouped_gemm(a, b, offsets, rows=torch.arange(7, dtype=torch.int32)[1:] % 7)
    with pytest.raises(ValueError, match=r"M=5"):  # offsets count the gathered rows
        mkernel.grouped_gemm(a, b, offsets, rows=torch.zeros(5, dtype=torch.int32))


def test_reference_is_exported():
    a, b = randn_bf16(5, 8), randn_bf16(2, 8, 8)
    offsets = _offsets([2, 3])
    assert torch.equal(
        mkernel.reference.grouped_gemm(a, b, offsets), mkernel.grouped_gemm(a, b, offsets)
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a, b, o: (a.float(), b, o), TypeError, "a must be torch.bfloat16"),
        (lambda a, b, o: (a, b.half(), o), TypeError, "b must be torch.bfloat16"),
        (lambda a, b, o: (a[None], b, o), ValueError, r"a must be \[M, K\]"),
        (lambda a, b, o: (a, b[0], o), ValueError, r"b \[G, K, N\]"),
        (lambda a, b, o: (a[:, :4], b, o), ValueError, "K must agree"),
        (lambda a, b, o: (a, b, o.long()), ValueError, "offsets must be int32"),
        (lambda a, b, o: (a, b, o[:-1]), ValueError, r"offsets must be int32 \[G \+ 1\]"),
        (
            lambda a, b, o: (a, b, torch.tensor([0, 4, 2], dtype=torch.int32)),
            ValueError,
            "non-decreasing",
        ),
        (lambda a, b, o: (a, b, torch.tensor([0, 4, 7], dtype=torch.int32)), ValueError, "M=6"),
        (lambda a, b, o: (a, b, torch.tensor([-1, 4, 6], dtype=torch.int32)), ValueError, "within"),
        (lambda a, b, o: (a.t().contiguous().t(), b, o), ValueError, "a must be contiguous"),
    ],
)
def test_bad_input_is_named(change, error, match):
    a, b, offsets = randn_bf16(6, 8), randn_bf16(2, 8, 16), _offsets([2, 4])
    with pytest.raises(error, match=match):
        mkernel.grouped_gemm(*change(a, b, offsets))


def test_bad_out_and_tile_are_named():
    a, b, offsets = randn_bf16(6, 8), randn_bf16(2, 8, 16), _offsets([2, 4])
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \[6, 16\]"):
        mkernel.grouped_gemm(a, b, offsets, out=torch.empty(6, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tile 'huge' unknown"):
        mkernel.grouped_gemm(a, b, offsets, tile="huge")
    with pytest.raises(TypeError, match="out_dtype must be"):
        mkernel.grouped_gemm(a, b, offsets, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out must be torch.float32"):
        mkernel.grouped_gemm(
            a, b, offsets, out_dtype=torch.float32, out=torch.empty(6, 16).bfloat16()
        )


def test_fp32_out_is_the_unrounded_product():
    a, b, offsets = randn_bf16(7, 8), randn_bf16(2, 8, 16), _offsets([3, 4])
    out = mkernel.grouped_gemm(a, b, offsets, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = torch.cat([a[:3].double() @ b[0].double(), a[3:].double() @ b[1].double()])
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_grouped_tile_follows_group_size():
    # many small groups (MoE decode): a 128-row tile would be mostly empty rows
    assert schedule.pick_grouped_tile(256 * 16, 2048, 7168, 256).bm == 64
    # large groups: the big tile, as for a dense GEMM of that size
    assert schedule.pick_grouped_tile(8 * 2048, 2048, 7168, 8).name == "128x256x64"
    # one group is the dense heuristic
    for m, n in ((8192, 8192), (2048, 1024), (300, 4096)):
        assert schedule.pick_grouped_tile(m, n, 64, 1) == schedule.pick_tile(m, n, 64)
