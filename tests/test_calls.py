"""Back-to-back calls on one world: each call's result is its own inputs' formula (fp64, computed in
tests/test_laws.py), whatever the previous call left in the symmetric workspaces (accumulators, the
gathered A, pads), for every op, both overlaps and both ag_gemm transfers; a plan is cached per
schedule setting, so a call never runs the plan of another schedule."""

from __future__ import annotations

import pytest

import mkernel
from tests.helpers import assert_close_exact, assert_pads_zero, gemm_inputs, poisoned
from tests.test_laws import ag_gemm_formula, assert_gemm_rs, gemm_ar_formula

CASES = [
    ("gemm_rs", "intra_sm", "auto"),
    ("gemm_rs", "inter_sm", "auto"),
    ("gemm_ar", "intra_sm", "auto"),
    ("gemm_ar", "inter_sm", "auto"),
    ("ag_gemm", "intra_sm", "stores"),
    ("ag_gemm", "inter_sm", "stores"),
    ("ag_gemm", "inter_sm", "tma"),
]
FORMULA = {"ag_gemm": ag_gemm_formula, "gemm_ar": gemm_ar_formula}


@pytest.mark.parametrize("op, overlap, transfer", CASES)
def test_each_call_is_its_own_inputs_formula(op, overlap, transfer):
    W, rows, n, k = 3, 40, 24, 16
    world = mkernel.World.emulated(W)
    sched = mkernel.Schedule(overlap=overlap, transfer=transfer, tile="64x128x64", chunk_rows=16)
    m = W * rows if op == "gemm_rs" else rows  # gemm_rs splits M over the ranks
    for call in range(3):
        a, b = gemm_inputs(W, m, n, k, seed=call)
        out_rows = rows if op == "gemm_rs" else (W * rows if op == "ag_gemm" else m)
        out = getattr(mkernel, op)(a, b, world, sched, out=poisoned((W, out_rows, n), "cpu"))
        what = f"{op} {overlap} {transfer} call {call}"
        if op == "gemm_rs":
            assert_gemm_rs(out, a, b, what)
        else:
            assert_close_exact(out, *FORMULA[op](a, b), what)
        assert_pads_zero(world)


SETTINGS = {  # a Schedule field, two values, and what of the plan shows which one it ran
    "overlap": (("intra_sm", "inter_sm"), lambda p: p.overlap),
    "sms": ((2, 5), lambda p: p.compute_units),
    "tile": (("64x128x64", "128x128x64"), lambda p: p.tile.name),
    "chunk_rows": ((4, 16), lambda p: p.sizes["chunk_rows"]),
    "transfer": (("stores", "tma"), lambda p: p.sizes["transfer_tma"]),
    "faults": ((mkernel.Faults(), mkernel.Faults(delay_rank=1, delay_us=3)), lambda p: p.faults),
    "comm_sms": ((1, 2), lambda p: p.comm_units),
    "tile_order": ((None, lambda r, t: range(len(t))[::-1]), lambda p: int(p.compute_order[0][0])),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_plan_is_cached_per_schedule_setting(name):
    (v0, v1), shown = SETTINGS[name]
    world = mkernel.World.emulated(2)
    base = {"overlap": "inter_sm", "sms": 6, "tile": "64x128x64", "chunk_rows": 8}
    seen = []
    for v in (v0, v1, v0):  # one world: the second schedule must not get the first's plan
        sched = mkernel.Schedule(**{**base, name: v})
        plan = sched.plan("ag_gemm", world, m=2 * 64, n=256, k=16)
        seen.append(shown(plan))
    assert seen[0] != seen[1] and seen[0] == seen[2], f"{name}: plans show {seen}"


def test_a_call_on_a_world_of_another_gpu_launches_with_that_gpu_current(monkeypatch):
    """gpu.run_gpu: a kernel launches into the current device's context, so a world on another
    GPU than the current one makes that GPU current for the call (and only then: on the current
    device nothing is switched)."""
    import contextlib

    import torch

    from mkernel.runtime import gpu

    current = [0]
    seen: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        seen.append(("switch", current[0]))
        try:
            yield
        finally:
            current[0] = before

    class Reached(Exception):
        pass

    def status_block(world):  # the first thing a launch does once on the right device
        seen.append(("launch", current[0]))
        raise Reached

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(gpu, "status_block", status_block)
    for index in (1, 0):
        world = mkernel.World(size=2, device=torch.device("cuda", index), kind="emulated")
        with pytest.raises(Reached):
            gpu.run_gpu(world, None, {})
    assert seen == [("switch", 1), ("launch", 1), ("launch", 0)]
    assert current[0] == 0  # switched back after the call
