"""all_gather on the CPU interpreter: every rank ends with every rank's rows, in rank order, bit for
bit (a copy rounds nothing). Expected values are indexed out of the inputs here, never taken from
``mkernel.reference``; the reference is checked against the same indexing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mkernel
from tests.helpers import assert_pads_zero, poisoned


def _x(W: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[W, rows, cols] bf16, seeded normal values: a row landing in the wrong place does not match
    by accident."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(W, rows, cols, generator=g).bfloat16()


def _assert_gathered(out: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """out[r] rows q*R .. (q+1)*R are x[q], on every rank r."""
    W, R, C = x.shape
    assert out.shape == (W, W * R, C), f"{what}: shape {tuple(out.shape)}"
    for r in range(W):
        for q in range(W):
            got = out[r, q * R : (q + 1) * R]
            assert torch.equal(got, x[q]), f"{what}: rank {r} rows of rank {q} differ"


@settings(max_examples=25)
@given(
    W=st.integers(1, 6),
    rows=st.integers(1, 90),
    c8=st.integers(1, 6),
    chunk_rows=st.sampled_from([None, 1, 7, 32, 200]),
    overlap=st.sampled_from(["intra_sm", "inter_sm"]),
    sms=st.integers(2, 6),
    seed=st.integers(0, 2**16),
)
@example(W=3, rows=10, c8=2, chunk_rows=4, overlap="intra_sm", sms=2, seed=0)  # a short last chunk
@example(W=1, rows=5, c8=1, chunk_rows=2, overlap="inter_sm", sms=2, seed=1)
def test_every_rank_holds_every_ranks_rows(W, rows, c8, chunk_rows, overlap, sms, seed):
    world = mkernel.World.emulated(W)
    x = _x(W, rows, 8 * c8, seed)
    sched = mkernel.Schedule(overlap=overlap, chunk_rows=chunk_rows, sms=sms, seed=seed)
    out = mkernel.all_gather(x, world, sched, out=poisoned((W, W * rows, 8 * c8), "cpu"))
    _assert_gathered(out, x, f"W={W} rows={rows} chunk_rows={chunk_rows} {overlap}")
    assert_pads_zero(world)
    again = mkernel.all_gather(x, world, mkernel.Schedule(overlap=overlap, seed=seed + 1))
    assert torch.equal(again, out), "a second call (other interleaving) differs"
    assert_pads_zero(world)


@pytest.mark.parametrize("W", [1, 2, 4])
def test_reference_is_the_rank_ordered_rows(W):
    x = _x(W, 6, 16, W)
    _assert_gathered(mkernel.reference.all_gather(x, mkernel.World.emulated(W)), x, "reference")


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_plan_pushes_chunk_major_own_copy_first_then_waits_for_every_chunk(overlap):
    W, rows, cr = 3, 10, 4
    world = mkernel.World.emulated(W)
    plan = mkernel.Schedule(overlap=overlap, chunk_rows=cr).plan(
        "all_gather", world, rows=rows, cols=16
    )
    C = -(-rows // cr)
    assert plan.comm_units >= 1, "the comm role needs a unit even with nothing to compute"
    for r in range(W):
        assert plan.roles["compute"].tasks[r] == []
        comm = plan.roles["comm"].tasks[r]
        pushes = [t for t in comm if t.raises]
        want = [(c, (r + j) % W) for c in range(C) for j in range(W)]
        assert [tuple(t.args[1:3]) for t in pushes] == want
        for t, (c, p) in zip(pushes, want, strict=True):
            assert [(x.pad, x.rank, x.index) for x in t.raises] == [("landed", p, (r, c))]
        waits = sorted(w.index for t in comm for w in t.waits)
        assert waits == [(s, c) for s in range(W) for c in range(C)], f"rank {r}"
