"""Shared test helpers: tolerance from the reference's own rounding, poisoned outputs, GEMM
operands, random tile orders, clean signal pads, and the bad-input checks every fused op shares."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """``ref`` is the bf16 rounding of an fp32 reference; our result differs from it only by fp32
    summation order, which can flip the final bf16 rounding: allow one bf16 ulp of the magnitude
    (2^-8 relative) plus the fp32 accumulation error, and never a NaN (poison)."""
    assert not torch.isnan(out.float()).any(), f"{what}: NaN in the result (an unwritten tile)"
    o, r = out.float(), ref.float()
    scale = r.abs().max().item() + 1e-6
    err = (o - r).abs()
    tol = r.abs() * 2.0**-7 + scale * 2.0**-12
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off; "
        f"max err {err.max().item():.3g} at scale {scale:.3g}"
    )


def randn_bf16(*shape: int, device="cpu", generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)


def poisoned(shape, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def gemm_inputs(W: int, rows: int, n: int, k: int, seed: int):
    """An emulated world's GEMM operands: a [W, rows, k] and b [W, k, n], bf16, seeded."""
    g = torch.Generator().manual_seed(seed)
    return randn_bf16(W, rows, k, generator=g), randn_bf16(W, k, n, generator=g)


def random_order(seed: int):
    """A Schedule.tile_order hook: a seeded random permutation of the tiles, different per rank."""

    def hook(rank, tiles):
        order = list(range(len(tiles)))
        random.Random(seed * 31 + rank).shuffle(order)
        return order

    return hook


def assert_pads_zero(world) -> None:
    """Every signal pad of the world is back to zero (after an op, a failed one included)."""
    for key, pad in world.signal_pads().items():
        assert int(pad.abs().sum()) == 0, f"signal pad {key} not back to zero"


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same shape and values as ``x`` [W, r, c], as a non-contiguous (transposed) view."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def assert_rejects_bad_dtype(op, a: torch.Tensor, b: torch.Tensor, world) -> None:
    """``op(a, b, world=world)`` names the operand that is not bf16."""
    with pytest.raises(TypeError, match="a must be torch.bfloat16"):
        op(a.float(), b, world=world)
    with pytest.raises(TypeError, match="b must be torch.bfloat16"):
        op(a, b.half(), world=world)


def assert_rejects_layout_and_world(op, a, b, a4, b4, world) -> None:
    """Good operands ``a``, ``b`` of ``world``: ``op`` rejects a non-contiguous operand, an operand
    of a 4-rank world (``a4``, ``b4``) and a world that is not an mkernel.World."""
    with pytest.raises(ValueError, match="a must be contiguous"):
        op(non_contiguous(a), b, world=world)
    with pytest.raises(ValueError, match="b must be contiguous"):
        op(a, non_contiguous(b), world=world)
    with pytest.raises(ValueError, match="another world"):
        op(a4, b, world=world)
    with pytest.raises(ValueError, match="another world"):
        op(a, b4, world=world)
    for not_a_world in ("2 ranks", 2, None):
        with pytest.raises(TypeError, match="world must be an mkernel.World"):
            op(a, b, world=not_a_world)


U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits): round to nearest is within this
U_FP32 = 2.0**-24


def assert_close_exact(
    out: torch.Tensor,
    exact: torch.Tensor,
    mag: torch.Tensor,
    terms: int,
    what: str = "",
) -> None:
    """``out`` (bf16) is the bf16 rounding of an fp32 computation of ``exact`` (fp64, computed by
    the test): fp32 sums of at most ``terms`` products and partial sums, in any order, are within
    ``terms * 2^-24 * mag`` of the exact value (``mag``: the same sums over absolute values), and
    the final rounding to bf16 adds at most 2^-8 of the magnitude. Elementwise, no NaN
    (poison)."""
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)}, want {tuple(exact.shape)}"
    assert out.dtype == torch.bfloat16, f"{what}: dtype {out.dtype}, want bfloat16"
    o = out.double()
    assert not torch.isnan(o).any(), f"{what}: NaN in the result (an unwritten tile)"
    acc = (terms + 2) * U_FP32 * 1.01 * mag
    assert_within(o, exact, U_BF16 * exact.abs() + (1 + U_BF16) * acc, what)


def assert_within(got: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """Elementwise |got - exact| <= tol (exact: fp64 from the test); the failure names how many
    elements are off and the first one, with its value, the exact value and its tolerance."""
    bad = (got.double() - exact).abs() > tol
    if bad.any():
        i = tuple(int(x) for x in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off the fp64 value; first at "
            f"{list(i)}: got {got[i].item():.6g}, exact {exact[i].item():.6g}, "
            f"tol {tol[i].item():.3g}"
        )


@contextlib.contextmanager
def gloo_world(rank: int, W: int, port: int):
    """A distributed CPU World of W processes (this one ``rank``) joined by gloo on localhost:
    the process-group tests' worker setup; the group is destroyed on exit."""
    import torch.distributed as dist

    from mkernel.world import World

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    try:
        yield World(size=W, device=torch.device("cpu"), kind="distributed", rank=rank,
                    group=dist.group.WORLD)  # fmt: skip
    finally:
        dist.destroy_process_group()


ROOT = Path(__file__).resolve().parents[1]


def run_script(cmd: list[str], timeout: float, **env: str) -> tuple[int, str]:
    """Runs ``cmd`` from the repository root with the repository on PYTHONPATH (and ``env`` on
    top of this process's environment); returns its exit status and its stdout + stderr."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    res = subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=ROOT, timeout=timeout)
    return res.returncode, res.stdout + res.stderr
