"""Planted mistakes in the ops' real plans, run end to end through the interpreter's generic task
program (mkernel/interp/program.py run_plan), each next to the unchanged plan that passes. A
mistake goes into a COPY of the plan's tasks, into a wrapper around the op's data-movement twin, or
into the template's twin (entry barrier, the comm warp's start) for the length of one test:

- gemm_ar: tile_ready raised before the owner's broadcast stores; stores to peers dropped;
- the entry barrier a no-op over two calls in stream order (gemm_rs, ag_gemm; gemm_ar needs none
  in this model: every rank's kernel waits for every tile it does not own, which the owner
  announces after its finalize, so a next call's epilogue is already ordered after it);
- ag_gemm intra_sm: the comm warp starting before its CTA passed the entry barrier;
- reads after reduce-adds nobody waited for (gemm_rs, gemm_ar finalize without its waits);
- signals raised before the data they publish (gemm_rs epilogue, ag_gemm pushes by stores or TMA,
  and TMA pushes signalled before their bulk copies landed);
- an ag_gemm tile that does not wait for the last chunk its rows need;
- gemm_rs flags nobody resets, so the next call's finalize reads early.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

import mkernel
from mkernel.interp import program, twins
from mkernel.ops import common
from mkernel.protocol import RoleTables
from mkernel.runtime import registry
from tests.helpers import assert_close_exact, assert_pads_zero, gemm_inputs, poisoned
from tests.test_laws import ag_gemm_formula, assert_gemm_rs, gemm_ar_formula

FORMULA = {"ag_gemm": ag_gemm_formula, "gemm_ar": gemm_ar_formula}


def check(op: str, out, a, b, what: str) -> None:
    """The op's result against its fp64 formula and roundings (gemm_rs: bf16 partials too)."""
    if op == "gemm_rs":
        assert_gemm_rs(out, a, b, what)
    else:
        assert_close_exact(out, *FORMULA[op](a, b), what)


SEEDS = range(4)


def _inputs(op: str, W: int, seed: int = 0):
    """Operands with remainder tiles (64x128 tiles): M/W = 70 (gemm_rs, ag_gemm), M = 150."""
    if op == "ag_gemm":
        return gemm_inputs(W, 70, 136, 16, seed)
    return gemm_inputs(W, W * 70 if op == "gemm_rs" else 150, 136, 16, seed)


def run(op, W, sched, *, edit=None, wrap=None, calls=1, seed=0, inputs_seed=0):
    """One fresh plan of ``op`` run through run_plan as common.run_cpu runs it: ``edit(plan,
    tasks)`` changes a deep copy of the tasks ({role: [W][...]}); ``wrap(plan, moves)`` returns
    the data-movement twins to use. Returns (out, plan, world, a, b)."""
    module = registry.get(op)
    world = mkernel.World.emulated(W)
    a, b = _inputs(op, W, inputs_seed)
    s = module.shapes(a, b, world)
    plan = module.make_plan(sched, world, **s)
    if edit is not None:
        tasks = {role: copy.deepcopy(t.tasks) for role, t in plan.roles.items()}
        edit(plan, tasks)
        plan = dataclasses.replace(plan, roles={k: RoleTables(tasks=v) for k, v in tasks.items()})
    rows = s["m"] // W if op == "gemm_rs" else s["m"]
    out = poisoned((W, rows, s["n"]), "cpu")
    ws = common.workspace(world, plan)
    buffers = {"a": a, "b": b, "out": out, **{k: v.local for k, v in ws.items() if v is not None}}
    moves = module.twins_of(plan)
    if wrap is not None:
        moves = wrap(plan, moves)
    outputs = lambda rank: module.outputs(plan, rank)  # noqa: E731
    program.run_plan(world, plan, buffers, moves, seed, outputs, calls=calls)
    return out, plan, world, a, b


def _sched(**kw):
    return mkernel.Schedule(tile="64x128x64", sms=3, **kw)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm", "gemm_ar"])
def test_the_unchanged_plans_pass_over_two_calls(op, overlap):
    for seed in SEEDS[:2]:
        out, plan, world, a, b = run(op, 3, _sched(overlap=overlap), calls=2, seed=seed)
        check(op, out, a, b, f"{op} {overlap} seed {seed}")
        assert_pads_zero(world)


def _raise_now(plan, pad: str, rank: int, index: int):
    """A release of pad[index] on rank, from inside a data-movement twin."""
    sig = program.PlanSignals(plan)

    def gen(ctx):
        yield from twins.signal_set_release(ctx, sig(pad, rank, index), 1)

    return gen


def _moved_raises(role: str, when: str):
    """Takes ``role``'s raises off its tasks (edit) and raises them from the twin instead (wrap):
    "before" the data movement, "between" it and the wait for its bulk copies, or "after" both
    (what the template does, so it passes)."""

    def edit(plan, tasks):
        plan.extra["moved"] = {}
        for r, ts in enumerate(tasks[role]):
            for t in ts:
                plan.extra["moved"][(r, t.id)] = t.raises
                t.raises = ()

    def wrap(plan, moves):
        inner = moves[role]

        def moved(ctx, task):
            raises = plan.extra["moved"][(ctx.rank, task.id)]
            flats = [program._flat_index(plan, x.pad, x.index) for x in raises]
            signals = [
                _raise_now(plan, x.pad, x.rank, f) for x, f in zip(raises, flats, strict=True)
            ]
            for step in ("before", "move", "between", "land", "after"):
                if step == "move":
                    yield from inner(ctx, task)
                elif step == "land":
                    yield from twins.bulk_wait_all(ctx)
                elif step == when:
                    for s in signals:
                        yield from s(ctx)

        return {**moves, role: moved}

    return edit, wrap


@pytest.mark.parametrize("early", [True, False])
def test_gemm_ar_tile_ready_before_the_broadcast_is_a_race(early):
    # The owner tells its peers their tile landed before storing it: a peer's kernel end (the
    # host's read of out) is not ordered after the owner's store.
    edit, wrap = _moved_raises("comm", "before" if early else "after")
    for seed in SEEDS:
        if not early:
            out, _, world, a, b = run("gemm_ar", 3, _sched(), edit=edit, wrap=wrap, seed=seed)
            assert_close_exact(out, *gemm_ar_formula(a, b), "raised after the stores")
            continue
        with pytest.raises(mkernel.RaceError, match=r"out\[") as e:
            run("gemm_ar", 3, _sched(), edit=edit, wrap=wrap, seed=seed)
        assert "kernel end" in str(e.value)


def test_gemm_ar_broadcast_without_the_peers_stores_leaves_tiles_unwritten(monkeypatch):
    real = twins.output_store

    def own_rank_only(ctx, buf, rank, rect, value, tile):
        if rank == ctx.rank:
            yield from real(ctx, buf, rank, rect, value, tile)

    monkeypatch.setattr(twins, "output_store", own_rank_only)
    with pytest.raises(mkernel.TileWriteError, match="never written"):
        run("gemm_ar", 3, _sched())


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm"])
def test_without_the_entry_barrier_the_next_call_races_the_peers_last_one(op, monkeypatch):
    # gemm_rs: a rank's next peer tile stores its partial into an owner's stage slot that the
    # owner's previous own tile may still read; ag_gemm: a rank's next push overwrites a peer's
    # gathered A that the peer's previous GEMM may still load.
    def no_barrier(ctx, sig, slot):
        return
        yield

    monkeypatch.setattr(program, "entry_barrier", no_barrier)
    for overlap in ("intra_sm", "inter_sm"):
        for seed in SEEDS:
            with pytest.raises(mkernel.RaceError, match="call 1") as e:
                run(op, 3, _sched(overlap=overlap), calls=2, seed=seed)
            buf = "stage" if op == "gemm_rs" else "gather"
            assert f"{buf}[" in str(e.value)


@pytest.mark.parametrize("overlap", ["intra_sm", "inter_sm"])
def test_a_comm_warp_that_does_not_wait_for_its_ctas_barrier_races(overlap, monkeypatch):
    # intra_sm: the comm warp starts when its CTA passed the entry barrier (cta_ready). Skipping
    # that wait lets ag_gemm's next pushes overwrite a peer's gathered A still being loaded.
    # inter_sm comm CTAs run their own barrier: the same patch changes nothing there.
    real = twins.wait_acquire_reset

    def skip_cta_ready(ctx, sig, value, peer):
        if sig.pad != "cta_ready":
            yield from real(ctx, sig, value, peer)

    monkeypatch.setattr(twins, "wait_acquire_reset", skip_cta_ready)
    for seed in SEEDS:
        if overlap == "inter_sm":
            out, _, world, a, b = run("ag_gemm", 3, _sched(overlap=overlap), calls=2, seed=seed)
            assert_close_exact(out, *ag_gemm_formula(a, b), "inter_sm")
            continue
        with pytest.raises(mkernel.RaceError, match=r"gather\[.*call 1|call 1.*gather\["):
            run("ag_gemm", 3, _sched(overlap=overlap), calls=2, seed=seed)


def test_gemm_ar_reading_the_accumulator_without_waiting_for_the_reduce_adds_is_a_race():
    def edit(plan, tasks):  # every finalize (not the pure tile_ready waits) waits nothing
        for ts in tasks["comm"]:
            for t in ts:
                if t.id < len(plan.tiles):
                    t.waits = ()

    for overlap in ("intra_sm", "inter_sm"):
        for seed in SEEDS:
            with pytest.raises(mkernel.RaceError, match=r"acc\[") as e:
                run("gemm_ar", 3, _sched(overlap=overlap), edit=edit, seed=seed)
            assert "reduce-add" in str(e.value)


def _own_tiles_wait_nothing(plan, tasks):
    for ts in tasks["compute"]:
        for t in ts:
            t.waits = ()


def test_gemm_rs_own_tile_reading_the_stage_without_its_partials_is_a_race():
    for overlap in ("intra_sm", "inter_sm"):
        for seed in SEEDS:
            with pytest.raises(mkernel.RaceError, match=r"stage\["):
                run("gemm_rs", 3, _sched(overlap=overlap), edit=_own_tiles_wait_nothing, seed=seed)


def test_gemm_rs_flag_before_the_partials_store_is_a_race():
    for early in (True, False):
        edit, wrap = _moved_raises("compute", "before" if early else "after")
        for seed in SEEDS:
            if not early:
                out, _, _, a, b = run("gemm_rs", 3, _sched(), edit=edit, wrap=wrap, seed=seed)
                assert_gemm_rs(out, a, b, "flag after the partial's store")
                continue
            with pytest.raises(mkernel.RaceError, match=r"stage\["):
                run("gemm_rs", 3, _sched(), edit=edit, wrap=wrap, seed=seed)


@pytest.mark.parametrize("transfer", ["stores", "tma"])
def test_ag_gemm_chunk_ready_before_the_push_is_a_race(transfer):
    # Raised before the push: a race either way. Raised after the push but before its bulk copies
    # landed: a race for TMA pushes (they land at bulk_wait_all), fine for stores.
    sched = _sched(overlap="inter_sm", transfer=transfer, chunk_rows=16)
    for when in ("before", "between", "after"):
        edit, wrap = _moved_raises("comm", when)
        for seed in SEEDS:
            if when == "after" or (when == "between" and transfer == "stores"):
                out, _, _, a, b = run("ag_gemm", 3, sched, edit=edit, wrap=wrap, seed=seed)
                assert_close_exact(out, *ag_gemm_formula(a, b), f"{transfer}, raised {when}")
                continue
            with pytest.raises(mkernel.RaceError, match=r"gather\["):
                run("ag_gemm", 3, sched, edit=edit, wrap=wrap, seed=seed)


def test_ag_gemm_tile_missing_its_last_chunk_is_a_race():
    def edit(plan, tasks):
        for ts in tasks["compute"]:
            for t in ts:
                if len(t.waits) > 1:
                    t.waits = t.waits[:-1]

    for seed in SEEDS:
        with pytest.raises(mkernel.RaceError, match=r"gather\["):
            run("ag_gemm", 3, _sched(chunk_rows=8), edit=edit, seed=seed)


def test_gemm_rs_flags_nobody_resets_let_the_next_call_read_early():
    def edit(plan, tasks):
        for ts in tasks["compute"]:
            for t in ts:
                t.waits = tuple(dataclasses.replace(w, consumers=0) for w in t.waits)

    late = mkernel.Faults(delay_rank=1, delay_us=5000)  # its next-call flags come late
    for seed in SEEDS:
        with pytest.raises(mkernel.RaceError, match="call 1"):
            run("gemm_rs", 3, _sched(faults=late), edit=edit, calls=2, seed=seed)


def test_raise_edits_reach_the_interpreter():
    # The harness's edits are what runs: a plan whose compute tasks raise nothing deadlocks with
    # the own tiles waiting for their peers' partials, named as the GPU names it.
    def edit(plan, tasks):
        for ts in tasks["compute"]:
            for t in ts:
                t.raises = ()

    with pytest.raises(mkernel.DeadlockError, match=r"partial\[tile=\d+, src=\d\]"):
        run("gemm_rs", 2, _sched(), edit=edit)
