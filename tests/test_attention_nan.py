"""NaN and Inf through attention on the CPU interpreter (issue 33): one NaN or +inf element in q, k
or v must reach out, lse and the gradients as it reaches them in mkernel.reference (torch softmax
attention in fp32), never turn into 0 / lse -inf as if the row had seen no key.

The reference is torch math, in which a masked probability (0) still multiplies its value: a NaN
in v, or in a masked score's row, spreads through 0 * NaN to rows and gradients that never use it.
The kernels skip K/V blocks wholly in the future but compute a diagonal block's masked entries (as
every FlashAttention-style kernel does, torch's CPU flash kernel included), so that spread reaches
some of those rows and not others. The contract tested, elementwise:

    NaN in the exact answer   (``_exact``: each query row over the keys it sees, nothing else)
      => NaN in ours          (nothing is hidden)
    NaN in ours => NaN in the reference (forward: out, lse; the gradients, see ``_check``)
    +inf / -inf of lse as in the reference; every finite element close to the reference's.

Without a mask (non-causal) every key is used by every row, the three agree, and the NaN patterns
must be equal. Shared helpers for the GPU tests (tests/gpu/test_attention_nan_gpu.py) too."""

from __future__ import annotations

import math

import pytest
import torch

import mkernel
from mkernel import reference as ref
from mkernel.ops import ring_attention as ra

B, S, HQ, HKV, D = 1, 32, 2, 1, 64
POISONS = [("q", math.nan), ("k", math.nan), ("v", math.nan), ("q", math.inf), ("k", math.inf)]
IDS = [f"{name}-{value}" for name, value in POISONS]


def inputs(W: int, S: int = S, seed: int = 0, device: str = "cpu"):
    """q [W, B, S, HQ, D], k, v [W, B, S, HKV, D]: bf16, seeded normal values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(W, B, S, HQ, D, generator=g).bfloat16()
    k = torch.randn(W, B, S, HKV, D, generator=g).bfloat16()
    v = torch.randn(W, B, S, HKV, D, generator=g).bfloat16()
    return tuple(x.to(device) for x in (q, k, v))


def poison(q, k, v, name: str, value: float, layout: str, at: int | None = None):
    """Copies of q, k, v with ``value`` at one element of ``name``: global position ``at``
    (default: just past the middle of the sequence, so causal rows on both sides of it), head
    1 of q (0 of k, v), column 5. Returns (q, k, v, the rank and local row it lands on)."""
    W, _, S = q.shape[:3]
    at = W * S // 2 + 3 if at is None else at
    pos = torch.stack([ra.positions(r, W, S, layout == "zigzag") for r in range(W)])
    rank, row = (int(i) for i in (pos == at).nonzero()[0])
    x = dict(q=q.clone(), k=k.clone(), v=v.clone())
    x[name][rank, 0, row, 1 if name == "q" else 0, 5] = value
    return x["q"], x["k"], x["v"], (rank, row)


def global_rows(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, B, S, ...] -> ([B, W * S, ...] in sequence order, the argsort that did it)."""
    W, _, S = x.shape[:3]
    pos = torch.cat([ra.positions(r, W, S, layout == "zigzag") for r in range(W)])
    order = torch.argsort(pos)
    return torch.cat(list(x.float()), dim=1)[:, order], order


def exact(q, k, v, dout, causal: bool, layout: str, scale: float | None = None):
    """Attention row by row, each query row over exactly the keys it sees (no masked entry is
    computed, so no 0 * NaN), fp32, with autograd: per rank (out, lse, dq, dk, dv) [W, ...]."""
    W, _, S = q.shape[:3]
    scale = 1 / math.sqrt(D) if scale is None else scale
    (Q, order), (K, _), (V, _), (dO, _) = (global_rows(x.cpu(), layout) for x in (q, k, v, dout))
    Q, K, V = (x.requires_grad_() for x in (Q, K, V))
    Kh, Vh = (x.repeat_interleave(HQ // HKV, dim=2) for x in (K, V))
    outs, lses = [], []
    for i in range(W * S):
        n = i + 1 if causal else W * S
        s = torch.einsum("bhd,bkhd->bhk", Q[:, i], Kh[:, :n]) * scale
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("bhk,bkhd->bhd", torch.softmax(s, dim=-1), Vh[:, :n]))
    out, lse = torch.stack(outs, dim=1), torch.stack(lses, dim=2)  # [B, N, H, D], [B, H, N]
    grads = torch.autograd.grad(out, (Q, K, V), dO)
    inv = torch.argsort(order)  # sequence order -> rank-major rows

    def per_rank(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return torch.stack(x.detach().index_select(dim, inv).chunk(W, dim=dim))

    return per_rank(out), per_rank(lse, 2), *(per_rank(g) for g in grads)


def check(name: str, got, want, exact_, *, equal: bool, subset: bool = True, tol: float = 0.0):
    """The contract of the module docstring for one result: NaN(exact) <= NaN(got) <= NaN(want)
    (``subset``; == with ``equal``), the infinities of ``want`` where got is not NaN, and the finite
    elements within ``tol`` (relative to the largest |want|) of want."""
    got, want, exact_ = (x.detach().float().cpu() for x in (got, want, exact_))
    g, w, e = got.isnan(), want.isnan(), exact_.isnan()
    if equal:
        extra, missing = _where(g & ~w), _where(w & ~g)
        assert torch.equal(g, w), (
            f"{name}: NaN not in the reference at {extra}, missing at {missing}"
        )
    assert not (e & ~g).any(), f"{name}: NaN hidden at {_where(e & ~g)} (exact: NaN there)"
    if subset:
        assert not (g & ~w).any(), f"{name}: NaN at {_where(g & ~w)}, not in the reference"
    both = ~g & ~w
    assert torch.equal(got[both].isinf(), want[both].isinf()), f"{name}: infinities differ"
    assert torch.equal(got[both & got.isinf()], want[both & got.isinf()]), f"{name}: inf signs"
    fin = both & want.isfinite()
    if fin.any():
        err = (got[fin] - want[fin]).abs().max().item()
        scale = max(want[fin].abs().max().item(), 1.0)
        assert err <= tol * scale, f"{name}: finite elements off by {err:.3g} (tol {tol * scale})"


def _where(mask: torch.Tensor) -> str:
    idx = mask.nonzero()
    return f"{len(idx)} elements, first {idx[0].tolist()}" if len(idx) else "none"


OUT_TOL, LSE_TOL, GRAD_TOL = 2**-6, 1e-4, 2**-5  # bf16 results; lse fp32 in both


def check_forward(out, lse, q, k, v, world, causal: bool, layout: str, what: str) -> None:
    """out, lse of ring attention on the poisoned inputs against the reference and ``exact``."""
    w_out, w_lse = ref.ring_attention(q.cpu(), k.cpu(), v.cpu(), _cpu(world), causal, None, layout)
    dout = torch.zeros_like(q)
    e_out, e_lse, *_ = exact(q, k, v, dout, causal, layout)
    check(f"{what} out", out, w_out, e_out, equal=not causal, tol=OUT_TOL)
    check(f"{what} lse", lse, w_lse, e_lse, equal=True, tol=LSE_TOL)


def check_backward(grads, q, k, v, dout, world, causal: bool, layout: str, what: str) -> None:
    """dq, dk, dv on the poisoned inputs: NaN wherever the exact gradient is; without a mask the
    reference's pattern exactly. Causal, the reference's own 0 * NaN spread and the kernels' (a
    NaN row's masked entries in a diagonal tile) differ, so only the exact answer's NaN is
    required and the finite elements compared."""
    cpu = [x.cpu() for x in (q, k, v)]
    out, lse = ref.ring_attention(*cpu, _cpu(world), causal, None, layout)
    want = ref.ring_attention_backward(
        dout.cpu(), *cpu, out, lse, _cpu(world), causal, None, layout
    )
    ex = exact(q, k, v, dout, causal, layout)[2:]
    for name, g, w, e in zip(("dq", "dk", "dv"), grads, want, ex, strict=True):
        check(f"{what} {name}", g, w, e, equal=not causal, subset=not causal, tol=GRAD_TOL)


def _cpu(world: mkernel.World) -> mkernel.World:
    return mkernel.World.emulated(world.size)


# -- the forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("poison_", POISONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_propagates_nan_and_inf(poison_, causal):
    q, k, v, _ = poison(*inputs(1), *poison_, "contiguous")
    out, lse = mkernel.attention(q[0], k[0], v[0], causal)
    world = mkernel.World.emulated(1)
    check_forward(out[None], lse[None], q, k, v, world, causal, "contiguous", "attention")


@pytest.mark.parametrize("poison_", POISONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("W", "layout"), [(2, "contiguous"), (2, "zigzag"), (3, "zigzag"), (3, "contiguous")]
)
def test_ring_attention_propagates_nan_and_inf(poison_, causal, W, layout):
    world = mkernel.World.emulated(W)
    q, k, v, _ = poison(*inputs(W), *poison_, layout)
    out, lse = mkernel.ring_attention(q, k, v, world, causal, layout=layout)
    check_forward(out, lse, q, k, v, world, causal, layout, f"W={W} {layout}")


def test_a_nan_in_q_is_nan_in_its_row_only():
    """The issue's case, spelled out: NaN in one q element is NaN in that row's out (every column)
    and lse, and nowhere else; the row is not mistaken for one that saw no key (0, -inf)."""
    q, k, v, (_, row) = poison(*inputs(1), "q", math.nan, "contiguous")
    for causal in (False, True):
        out, lse = mkernel.attention(q[0], k[0], v[0], causal)
        assert out[0, row, 1].isnan().all() and lse[0, 1, row].isnan()
        assert out.isnan().sum() == D and lse.isnan().sum() == 1


def test_rows_that_see_no_key_of_a_block_still_merge_finite():
    """Causal zigzag at W = 3: many (q tile, block) pairs have rows that see none of the block's
    keys (their state stays m = -inf, den = 0 until a later block); with finite inputs every row
    ends finite and matches the reference (the empty-row guard kept)."""
    world = mkernel.World.emulated(3)
    q, k, v = inputs(3)
    out, lse = mkernel.ring_attention(q, k, v, world, True, layout="zigzag")
    assert out.isfinite().all() and lse.isfinite().all()
    check_forward(out, lse, q, k, v, world, True, "zigzag", "finite")


# -- the backward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("poison_", POISONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("W", "layout"), [(1, "contiguous"), (2, "zigzag"), (3, "contiguous")])
def test_ring_attention_backward_propagates_nan_and_inf(poison_, causal, W, layout):
    world = mkernel.World.emulated(W)
    q, k, v, _ = poison(*inputs(W), *poison_, layout)
    dout = inputs(W, seed=1)[0]
    out, lse = mkernel.ring_attention(q, k, v, world, causal, layout=layout)
    grads = mkernel.ring_attention_backward(dout, q, k, v, out, lse, world, causal, layout=layout)
    check_backward(grads, q, k, v, dout, world, causal, layout, f"W={W} {layout}")


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_through_attention_propagates_nan(causal):
    q, k, v, _ = poison(*inputs(1), "q", math.nan, "contiguous")
    leaves = [x[0].clone().requires_grad_() for x in (q, k, v)]
    out, _ = mkernel.attention(*leaves, causal)
    dout = inputs(1, seed=1)[0]
    out.backward(dout[0])
    grads = [x.grad[None] for x in leaves]
    world = mkernel.World.emulated(1)
    check_backward(grads, q, k, v, dout, world, causal, "contiguous", "autograd")


# -- a wrong-rank operand is reported as passed ----------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dims", [3, 5])
def test_attention_names_the_operand_and_the_shape_it_was_given(name, dims):
    q, k, v = (x[0] for x in inputs(1))
    x = dict(q=q, k=k, v=v)
    bad = x[name][None] if dims == 5 else x[name][0]
    x[name] = bad
    form = "[B, S, Hq, D]" if name == "q" else "[B, S, Hkv, D]"
    with pytest.raises(ValueError) as e:
        mkernel.attention(x["q"], x["k"], x["v"])
    msg = str(e.value)
    assert msg.startswith(f"{name} must have shape {form}"), msg
    assert str(tuple(bad.shape)) in msg and "W=" not in msg, msg
    with pytest.raises(ValueError, match=rf"^{name} must have shape"):  # differentiable path too
        mkernel.attention(*(t.clone().requires_grad_() for t in x.values()))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_ring_attention_names_the_operand_and_the_shape_it_was_given(name):
    world = mkernel.World.emulated(2)
    x = dict(zip("qkv", inputs(2), strict=True))
    for bad in (x[name][None], x[name][0]):
        y = x | {name: bad}
        with pytest.raises(ValueError) as e:
            mkernel.ring_attention(y["q"], y["k"], y["v"], world)
        msg = str(e.value)
        assert msg.startswith(f"{name} must have shape [W=2, B, S_local, H"), msg
        assert str(tuple(bad.shape)) in msg, msg


@pytest.mark.parametrize("name", ["dout", "q", "k", "v", "out", "lse"])
def test_ring_attention_backward_names_the_operand_and_the_shape_it_was_given(name):
    world = mkernel.World.emulated(2)
    q, k, v = inputs(2)
    out, lse = mkernel.ring_attention(q, k, v, world)
    x = dict(dout=out.clone(), q=q, k=k, v=v, out=out, lse=lse)
    bad = x[name][None]
    x[name] = bad
    with pytest.raises(ValueError) as e:
        mkernel.ring_attention_backward(*x.values(), world)
    msg = str(e.value)
    assert msg.startswith(f"{name} must have shape"), msg
    assert str(tuple(bad.shape)) in msg or str(list(bad.shape)) in msg, msg
