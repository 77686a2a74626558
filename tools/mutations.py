"""The mutations tools/mutate.py plants, one real bug each, as data: the file, the exact old snippet
(it must occur once), the new one, and the bug in one line. ``also`` holds further edits of the
same bug (another file or place); ``equivalent`` argues why a mutation cannot change observable
behaviour (it is still run: a kill would refute the argument); ``tests`` overrides the test files.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fast, discriminating modules first: pytest -x stops at the first failure.
DEFAULT_TESTS = (
    "tests/test_protocol.py",
    "tests/test_per_unit.py",
    "tests/test_plans.py",
    "tests/test_interpreter_models.py",
    "tests/test_interpreter.py",
    "tests/test_op_mistakes.py",
    "tests/test_program.py",
    "tests/test_layout_phase.py",
    "tests/test_twins.py",
    "tests/test_trace.py",
    "tests/test_all_gather.py",
    "tests/test_calls.py",
    "tests/test_schedule.py",
    "tests/test_tile_heuristics.py",
    "tests/test_laws.py",
)
# The op modules' own (slower) property tests, for mutations in what they exercise.
AREA_TESTS = {
    "mkernel/ops/gemm_rs.py": ("tests/test_gemm_rs.py",),
    "mkernel/ops/ag_gemm.py": ("tests/test_ag_gemm.py",),
    "mkernel/ops/gemm_ar.py": ("tests/test_gemm_ar.py",),
    "mkernel/ops/common.py": ("tests/test_gemm_ar.py", "tests/test_ag_gemm.py"),
    "mkernel/interp/trace.py": ("tests/test_gemm_rs.py",),
    "mkernel/ops/ring_attention.py": ("tests/test_ring_attention.py",),
    "mkernel/ops/moe_dispatch_gemm.py": ("tests/test_moe.py",),
    "mkernel/ops/moe_gemm_combine.py": ("tests/test_moe.py",),
    "mkernel/ops/ring_attention_backward.py": ("tests/test_ring_attention_backward.py",),
}

NODES_TESTS = ("tests/test_hierarchical.py",)  # the plans over several nodes (docs/rdma.md)
ORDER = DEFAULT_TESTS + tuple(
    sorted({t for ts in AREA_TESTS.values() for t in ts} | {*NODES_TESTS})
)


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    old: str
    new: str
    bug: str
    also: tuple[tuple[str, str, str], ...] = ()
    equivalent: str | None = None
    tests: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.tests:
            object.__setattr__(self, "tests", DEFAULT_TESTS + AREA_TESTS.get(self.file, ()))


RS, AG, AR, AX = (f"mkernel/ops/{op}.py" for op in ("gemm_rs", "ag_gemm", "gemm_ar", "all_gather"))
RA = "mkernel/ops/ring_attention.py"
MD, MC = "mkernel/ops/moe_dispatch_gemm.py", "mkernel/ops/moe_gemm_combine.py"
RB = "mkernel/ops/ring_attention_backward.py"
COMMON, PROTO, SCHED = "mkernel/ops/common.py", "mkernel/protocol.py", "mkernel/schedule.py"
RUN, TILES = "mkernel/runtime/run.py", "mkernel/tiles.py"
PROG, MACH, TWINS, TRACE = (
    f"mkernel/interp/{f}.py" for f in ("program", "machine", "twins", "trace")
)

MUTATIONS = [
    # -- gemm_rs -----------------------------------------------------------------------------------
    Mutation(
        "rs_w1_rows",
        RS,
        'twins.output_store(ctx, "out", ctx.rank, rect, part.bfloat16(), t.index)',
        'twins.output_store(ctx, "out", ctx.rank, (0, *rect[1:]), part.bfloat16(), t.index)',
        "an own tile stores at row 0 of out",
    ),
    Mutation(
        "rs_handshake_gone",
        RS,
        'tasks.append(Task(i, (i,), raises=(Raise("partial", owner, (u, r)),)))',
        "tasks.append(Task(i, (i,)))",
        "partial handshake removed on both sides: an own tile reads unwaited partials",
        also=(
            (
                RS,
                "tasks.append(Task(i, (i,), waits=tuple("
                'Wait("partial", r, (u, s)) for s in peers)))',
                "tasks.append(Task(i, (i,)))",
            ),
        ),
    ),
    Mutation(
        "rs_own_skips_a_partial",
        RS,
        "                peers = [(r + 1 + j) % W for j in range(W - 1)]",
        "                peers = [(r + 1 + j) % W for j in range(W - 2)]",
        "an own tile waits for all but one peer's partial (W > 2), then reads it",
    ),
    Mutation(
        "rs_flag_wrong_owner",
        RS,
        'Raise("partial", owner, (u, r))',
        'Raise("partial", (owner + 1) % W, (u, r))',
        "a peer tile raises its partial flag on the wrong rank's pad (the next owner's)",
    ),
    Mutation(
        "rs_hook_rank",
        RS,
        "for j in block]\n        order = apply_order(schedule.tile_order, r, tiles, default)\n"
        "        # NOTE: the peers' tiles first",
        "for j in block]\n        order = apply_order(schedule.tile_order, (r + 1) % W, tiles, "
        "default)\n        # NOTE: the peers' tiles first",
        "tile-order hook applied to the wrong rank (rank r runs rank r+1's order)",
    ),
    Mutation(
        "rs_own_tiles_first",
        RS,
        "order = [i for i in order if tiles[i].tag != r] + [i for i in order if tiles[i].tag == r]",
        "order = [i for i in order if tiles[i].tag == r] + [i for i in order if tiles[i].tag != r]",
        "own tiles (which wait) before the peers' tiles they wait for: deadlock",
    ),
    Mutation(
        "rs_reference_rows",
        RS,
        "full[r * ms : (r + 1) * ms] for r in range(world.size)",
        "full[(world.size - 1 - r) * ms : (world.size - r) * ms] for r in range(world.size)",
        "reference scatters rank W-1-r's rows to rank r",
    ),
    Mutation(
        "rs_partial_wrong_slot",
        RS,
        "            slot = (ctx.rank * ms + rect[0], t.rows, t.n0, t.cols)",
        "            slot = (t.tag * ms + rect[0], t.rows, t.n0, t.cols)",
        "a peer writes its partial into the owner's own slot, not its slot",
    ),
    Mutation(
        "prog_defer_every_completion",
        PROG,
        "return not (task.raises and nxt is not None and nxt.waits)",
        "return True",
        "the twin defers a raising task's completion past a waiting next task (hides the deadlock "
        "the GPU rule avoids)",
        tests=DEFAULT_TESTS + ("tests/test_gemm_rs.py",),
    ),
    # -- ag_gemm -----------------------------------------------------------------------------------
    Mutation(
        "ag_w1_reads_gather",
        AG,
        'src = "a" if W == 1 else "gather"',
        'src = "gather"',
        "W=1 fast path loads the gather buffer, which nobody fills at W=1",
    ),
    Mutation(
        "ag_last_chunk",
        AG,
        "_chunk_of(t.m0 + t.rows - 1, ms, cr, C) + 1)",
        "_chunk_of(t.m0 + t.rows - 1, ms, cr, C))",
        "a tile does not wait for the last chunk its rows need",
    ),
    Mutation(
        "ag_consumers_plus_one",
        AG,
        'Wait("chunk_ready", r, (g,), consumers=consumers[g])',
        'Wait("chunk_ready", r, (g,), consumers=consumers[g] + 1)',
        "wrong counted-consumer count: chunk_ready never reset by its last consumer",
    ),
    Mutation(
        "ag_push_rows",
        AG,
        "dst = (src * ms + r0, rows, 0, k)",
        "dst = (r0, rows, 0, k)",
        "push writes the chunk at its shard-local rows of the gathered A",
    ),
    Mutation(
        "ag_same_b_op_and_ref",
        AG,
        'b = yield from twins.tile_load_async(ctx, "b", ctx.rank, (0, k, t.n0, t.cols))',
        'b = yield from twins.tile_load_async(ctx, "b", 0, (0, k, t.n0, t.cols))',
        "op and reference broken the same way: every rank multiplies by rank 0's b",
        also=((AG, "full_a @ b[r].float() for r in", "full_a @ b[0].float() for r in"),),
    ),
    Mutation(
        "ag_chunk_of",
        AG,
        "return src * chunks + (row - src * ms) // cr",
        "return src * chunks + (row - src * ms + 1) // cr",
        "row-to-chunk map off by one row: a tile waits for the wrong chunks",
    ),
    Mutation(
        "ag_tma_as_stores",
        AG,
        'bulk = plan.sizes["transfer_tma"] and plan.overlap == "inter_sm"',
        "bulk = False",
        "twin models transfer='tma' pushes as plain stores (bulk landing never checked)",
    ),
    Mutation(
        "ag_push_order",
        AG,
        "for p in ((r + j) % W for j in range(W))",
        "for p in range(W)",
        "pushes go to rank 0 first instead of own copy first, then r+1, ...",
    ),
    # -- gemm_ar -----------------------------------------------------------------------------------
    Mutation(
        "ar_ready_before_broadcast",
        AR,
        'flags = [(Raise("tile_flag", t.tag, (t.index, r)),) if W > 1 else () for t in tiles]',
        'flags = [((Raise("tile_flag", t.tag, (t.index, r)),) + tuple(Raise("tile_ready", '
        "(r + j) % W, (t.index,)) for j in range(1, W) if t.tag == r)) if W > 1 else () "
        "for t in tiles]",
        "tile_ready raised by the owner's epilogue, before it writes the peers' results",
        also=(
            (
                AR,
                'raises=tuple(Raise("tile_ready", (r + j) % W, (t,)) for j in range(1, W)),',
                "raises=(),",
            ),
        ),
    ),
    Mutation(
        "ar_no_handshake",
        AR,
        'raises=tuple(Raise("tile_ready", (r + j) % W, (t,)) for j in range(1, W)),',
        "raises=(),",
        "tile_ready handshake removed on both sides: a rank may end before its result landed",
        also=((AR, "comm.append(finalize + landed)", "comm.append(finalize)"),),
    ),
    Mutation(
        "ar_broadcast_skips_self",
        AR,
        "for j in range(W):  # own result first",
        "for j in range(1, W):  # own result first",
        "owner writes the peers' results but not its own",
    ),
    Mutation(
        "ar_finalize_no_zero",
        AR,
        '        yield from twins.tile_send(ctx, "acc", ctx.rank, rect, torch.zeros_like(v))',
        "        pass",
        "finalize leaves the accumulator tile for the next call",
    ),
    Mutation(
        "ar_landed_value_off",
        AR,
        'Wait("tile_ready", r, (t,), patience=2)',
        'Wait("tile_ready", r, (t,), 2, patience=2)',
        "off-by-one in a wait's expected value (tile_ready == 2)",
    ),
    Mutation(
        "ar_landed_patience",
        AR,
        'Wait("tile_ready", r, (t,), patience=2)',
        'Wait("tile_ready", r, (t,), patience=1)',
        "pure tile_ready waits lose their double deadline: a peer reports before the stuck owner",
    ),
    Mutation(
        "ar_reference_bf16_partials",
        AR,
        "full = sum(x.float() @ y.float() for x, y in zip(*parts, strict=True)).bfloat16()",
        "full = sum((x.float() @ y.float()).bfloat16().float() for x, y in zip(*parts, "
        "strict=True)).bfloat16()",
        "reference rounds each rank's partial product to bf16 before the sum",
    ),
    # -- all_gather --------------------------------------------------------------------------------
    Mutation(
        "ax_push_rows",
        AX,
        "rect = (ctx.rank * rows + c * cr, n, 0, cols)",
        "rect = (c * cr, n, 0, cols)",
        "push writes the chunk at the source-local rows of the result",
    ),
    Mutation(
        "ax_chunk_rows",
        AX,
        "n = min(cr, rows - c * cr)",
        "n = cr",
        "the last, short chunk is pushed at full chunk height",
    ),
    Mutation(
        "ax_reference_order",
        AX,
        "full = torch.cat(common.per_rank(x, world))",
        "full = torch.cat(common.per_rank(x, world)[::-1])",
        "reference gathers the ranks in reverse order",
    ),
    # -- common ------------------------------------------------------------------------------------
    Mutation(
        "common_cache_key",
        SCHED,
        "        schedule.chunk_rows,\n",
        "",
        "plan cache key ignores chunk_rows: a call runs a plan of another chunking",
    ),
    Mutation(
        "common_no_reset_after_timeout",
        RUN,
        "        world.reset()  # as on the GPU",
        "        pass  # as on the GPU",
        "a timed-out call leaves its flags set for the next call",
    ),
    Mutation(
        "common_faults_range",
        RUN,
        "if v is not None and not 0 <= v < world.size:",
        "if v is not None and not 0 <= v <= world.size:",
        "a fault naming rank W (not a rank) is accepted",
    ),
    # -- protocol ----------------------------------------------------------------------------------
    Mutation(
        "proto_value_check",
        PROTO,
        "            if w.value != total:",
        "            if w.value > total:",
        "static check misses a wait for less than its raises give",
    ),
    Mutation(
        "proto_reset_count",
        PROTO,
        "if want == 0 or len(resetting) != want:",
        "if want == 0:",
        "static check misses counted consumers that do not match their count",
    ),
    Mutation(
        "proto_unwaited_raise",
        PROTO,
        "    for key in raised:\n        if key not in waited:",
        "    for key in raised:\n        if key not in raised:",
        "static check misses a signal raised that nobody waits for",
    ),
    Mutation(
        "proto_encode_fields",
        PROTO,
        "waits.append([pid, w.rank, flat, w.value, w.consumers, counter, w.patience, w.peer])",
        "waits.append([pid, w.rank, flat, w.consumers, w.value, counter, w.patience, w.peer])",
        "wait table row has value and consumers swapped (what the GPU reads)",
    ),
    Mutation(
        "proto_signal_name",
        PROTO,
        "        index //= n\n    return out[::-1]",
        "        index //= n\n    return out",
        "signal names print the coordinates in reverse (tile_flag[tile=src, src=tile])",
    ),
    Mutation(
        "proto_counter_first",
        PROTO,
        "            out.append(p)\n            if p.counted:\n"
        '                out.append(Pad(p.name + "_count", p.dims, p.shape, '
        'doc=f"consumers of {p.name}"))',
        "            if p.counted:\n"
        '                out.append(Pad(p.name + "_count", p.dims, p.shape, '
        'doc=f"consumers of {p.name}"))\n            out.append(p)',
        "a counted pad's counter takes the pad id before its pad (ids the device disagrees with)",
    ),
    # -- the template's twin (interp/program.py) ---------------------------------------------------
    Mutation(
        "prog_no_entry_barrier",
        PROG,
        "            yield from entry_barrier(ctx, sig, slot)\n",
        "            pass\n",
        "the entry barrier made a no-op",
    ),
    Mutation(
        "prog_comm_warp_skips_barrier",
        PROG,
        "            yield from twins.wait_acquire_reset(ctx, ready, 1, ctx.rank)",
        "            yield from ()",
        "intra_sm comm warp starts without waiting for its CTA's entry barrier",
    ),
    Mutation(
        "prog_barrier_no_cas",
        PROG,
        "        yield from twins.wait_acquire(ctx, flag, 0, peer)\n",
        "",
        "entry-barrier arrival overwrites a previous call's arrival not yet consumed (no CAS)",
    ),
    Mutation(
        "prog_single_no_reset",
        PROG,
        "        if w.consumers == 1:\n"
        "            yield from twins.signal_set_relaxed(ctx, sig(w.pad, w.rank, flat), 0)",
        "        if w.consumers == 1:\n            pass",
        "missing reset of a flag: the single consumer leaves it set",
    ),
    Mutation(
        "prog_no_counter_reset",
        PROG,
        "                yield from twins.signal_set_relaxed(ctx, counter, 0)\n",
        "",
        "missing reset of a counted pad's counter",
    ),
    Mutation(
        "prog_counted_first_resets",
        PROG,
        "if old + 1 == w.consumers:",
        "if old == 0:",
        "reset policy: the first counted consumer resets the flag, not the last",
    ),
    Mutation(
        "prog_no_proxy_fence",
        PROG,
        "    if task.waits:\n        yield from twins.fence_proxy_async(ctx)",
        "    if False:\n        yield from twins.fence_proxy_async(ctx)",
        "no fence.proxy.async between the waits and the TMA loads",
    ),
    Mutation(
        "prog_no_bulk_wait",
        PROG,
        "            yield from twins.bulk_wait_all(ctx)\n",
        "",
        "raises before the task's bulk copies landed",
    ),
    Mutation(
        "prog_raise_before_move",
        PROG,
        "            yield from run_waits(ctx, plan, sig, task)\n"
        "            yield from moves[role](ctx, task)",
        "            yield from run_waits(ctx, plan, sig, task)\n"
        "            yield from run_raises(ctx, plan, sig, task)\n"
        "            yield from moves[role](ctx, task)",
        "raises before the data movement they publish",
    ),
    Mutation(
        "prog_no_kernel_end_read",
        PROG,
        "m.expect_outputs(call, r, output, rects)",
        "(lambda *_: None)(call, r, output, rects)",  # the call stays, it does nothing
        "the kernel end reads no outputs (nothing checks what lands after a rank's last wait)",
    ),
    Mutation(
        "prog_add_as_set",
        PROG,
        '        if r.op == "add":\n'
        "            yield from twins.signal_add_release(ctx, flag, r.value)\n"
        "        else:\n"
        "            yield from twins.signal_set_release(ctx, flag, r.value)",
        "        yield from twins.signal_set_release(ctx, flag, r.value)",
        "raises of op 'add' (counters of several producers) executed as sets",
    ),
    Mutation(
        "prog_layout_no_wait",
        PROG,
        "            yield from twins.wait_acquire(ctx, flag, 1, ctx.rank)\n",
        "",
        "layout phase: a CTA reads its device-filled tasks without waiting for slot 0's layout",
    ),
    Mutation(
        "prog_layout_never_reset",
        PROG,
        "if old + 1 == readers:",
        "if old == readers:",
        "layout phase: the last reader miscounts and nobody resets the layout flag",
    ),
    Mutation(
        "prog_layout_no_capacity",
        PROG,
        "if len(tasks) > cap.rows or waits > cap.waits or raises > cap.raises:",
        "if False:",
        "layout phase: a layout over the plan's capacity is accepted",
    ),
    # -- the machine (interp/machine.py) -----------------------------------------------------------
    Mutation(
        "mach_add_read_ok",
        MACH,
        'if (kind == "add" and e.kind == "add") or (kind == "r" and e.kind == "r"):',
        'if (kind == "add" or e.kind == "add") or (kind == "r" and e.kind == "r"):',
        "race detection ignores reads of reduce-adds nobody waited for",
    ),
    Mutation(
        "mach_relaxed_set_releases",
        MACH,
        "        if release:\n            self.release(a, sig,",
        '        if release or op == "set":\n            self.release(a, sig,',
        "a relaxed store publishes the agent's clock like a release",
    ),
    Mutation(
        "mach_add_no_accumulate",
        MACH,
        'self.release(a, sig, accumulate=op == "add")',
        "self.release(a, sig, accumulate=False)",
        "a release add drops the earlier releasers' clocks (false races on counters)",
    ),
    Mutation(
        "mach_no_proxy_check",
        MACH,
        'cross = kind == "r" and proxy == "async" and e.proxy == "generic"',
        "cross = False",
        "TMA loads of plain stores need no proxy fence",
    ),
    Mutation(
        "mach_fence_no_tick",
        MACH,
        "        a.proxy_clock = list(a.clock)\n"
        "        # NOTE: the agent's own later generic writes are not covered: they need another "
        "fence.\n"
        "        a.clock[a.id] += 1",
        "        a.proxy_clock = list(a.clock)",
        "a proxy fence also covers the agent's own later plain stores",
    ),
    Mutation(
        "mach_bulk_immediate",
        MACH,
        "        a.pending.append(_Bulk(buf, rank, rect, value.clone(), kind))",
        "        a.pending.append(_Bulk(buf, rank, rect, value.clone(), kind))\n"
        "        self.land_bulk(a)",
        "bulk copies land at issue instead of at bulk_wait_all",
    ),
    Mutation(
        "mach_bulk_lost_at_end",
        MACH,
        "            self.land_bulk(a)  # NOTE: the kernel exit waits for the CTA's bulk copies",
        "            pass",
        "bulk copies never waited for are lost at the agent's end",
    ),
    Mutation(
        "mach_kernel_end_no_read",
        MACH,
        '            self.access(end, buf, end.rank, rect, "r")',
        "            pass",
        "the kernel end is not a reader of the expected outputs",
    ),
    Mutation(
        "mach_double_write",
        MACH,
        "        if len(writers) > 1:",
        "        if len(writers) > 2:",
        "an output tile written twice in one call goes unreported",
    ),
    Mutation(
        "mach_proxy_base",
        MACH,
        "a.clock, a.proxy_clock, a.started = _join(a.clock, base), list(base), True",
        "a.clock, a.proxy_clock, a.started = _join(a.clock, base), [0] * len(base), True",
        "a kernel boundary does not order the previous call's writes for the async proxy",
    ),
    Mutation(
        "mach_wait_ge",
        MACH,
        "return v >= w.value if w.at_least else v == w.value",
        "return v >= w.value",
        "a wait passes on any value at least the expected one (a stale flag passes a wait for 0)",
    ),
    # -- twins -------------------------------------------------------------------------------------
    Mutation(
        "twin_bulk_send_adds",
        TWINS,
        'ctx.m.issue_bulk(ctx.agent, buf, peer, rect, value, "w")',
        'ctx.m.issue_bulk(ctx.agent, buf, peer, rect, value, "add")',
        "TMA bulk copy twin adds into the destination instead of overwriting it",
    ),
    Mutation(
        "twin_barrier_no_cas",
        TWINS,
        "        yield Wait(flag, 0, reset=False, peer=peer)\n",
        "",
        "twin entry barrier arrives without waiting for the previous arrival's consumption",
    ),
    Mutation(
        "twin_load_async_generic",
        TWINS,
        'value = _load(ctx, buf, rank, rect, "async")',
        'value = _load(ctx, buf, rank, rect, "generic")',
        "TMA load twin reads through the generic proxy",
    ),
    # -- trace -------------------------------------------------------------------------------------
    Mutation(
        "trace_chrome_dur",
        TRACE,
        '"dur": max(1, s.end - s.start),',
        '"dur": max(1, s.end),',
        "chrome trace durations count from time 0, not from the span's start",
    ),
    Mutation(
        "trace_ascii_max_rows",
        TRACE,
        "sum(r in kept or r == rank for r, _ in rows) > max_rows",
        "sum(r in kept or r == rank for r, _ in rows) >= max_rows",
        "ascii(max_rows=) leaves out a rank whose rows fit exactly",
    ),
    # -- schedule ----------------------------------------------------------------------------------
    Mutation(
        "sched_pick_tile_waves",
        TILES,
        "return -(-tiles // sms) * c.bm * c.bn / _TILE_RATE[c.name]",
        "return tiles // sms * c.bm * c.bn / _TILE_RATE[c.name]",
        "pick_tile counts waves rounded down (a partial wave costs nothing)",
    ),
    Mutation(
        "sched_grouped_no_snake",
        TILES,
        "cols = range(tiles_n - 1, -1, -1) if grp % 2 else range(tiles_n)",
        "cols = range(tiles_n)",
        "grouped_order does not snake: every group starts on column 0",
    ),
    Mutation(
        "sched_hook_rank",
        SCHED,
        "        got = hook(rank, list(tiles))",
        "        got = hook(0, list(tiles))",
        "tile-order hook called with rank 0 for every rank",
    ),
    Mutation(
        "sched_unit_reversed",
        SCHED,
        "return [t.id for t in self.roles[role].unit_tasks(rank, unit, n)]",
        "return [t.id for t in self.roles[role].unit_tasks(rank, unit, n)][::-1]",
        "a unit runs its share of the tasks in reverse plan order",
    ),
    Mutation(
        "sched_zero_units",
        SCHED,
        "        units = max(1, min(sms, n_compute_tasks))",
        "        units = min(sms, n_compute_tasks)",
        "intra_sm with no compute tasks (all_gather) gets no CTA, so no comm warp either",
    ),
    Mutation(
        "sched_peer_fill",
        SCHED,
        "raisers.get((w.pad, w.rank, w.index), -1)",
        "w.rank",
        "a wait names its own rank as the peer that raises it",
    ),
    Mutation(
        "ra_landed_consumers",
        RA,
        "n = readers[r][s] + (parts if s in sends[r] else 0)",
        "n = readers[r][s]",
        "ring attention: a step's landed flag does not count the forward among its consumers",
    ),
    Mutation(
        "ra_chain_ignores_landing",
        RA,
        "        while pos[i] < len(chains[i]) and landed(chains[i][pos[i]][1]) <= clock:",
        "        while pos[i] < len(chains[i]):",
        "ring attention: a unit walks each q tile through every step whether or not the next "
        "block can have landed (its unit stalls where another tile could run)",
    ),
    Mutation(
        "ra_chain_turns_early",
        RA,
        "                if runs_out(i, clock):\n                    return i\n",
        "                pass\n",
        "ring attention: a unit starts a tile that must turn before one that would run out",
    ),
    Mutation(
        "proto_unit_span_shift",
        PROTO,
        "first = rows.start + sum(counts[:unit])",
        "first = rows.start + sum(counts[: max(0, unit - 1)])",
        "a unit given its own list (PerUnit) runs the previous unit's rows: a q tile's tasks run "
        "twice and another's never",
    ),
    Mutation(
        "ra_state_not_resumed",
        RA,
        'state = yield from twins.tile_load(ctx, "state", ctx.rank, st_rect)',
        "state = torch.zeros(n, D + 2)",
        "ring attention: a q tile's later task starts from a fresh state (the engine's "
        "load_state skipped)",
    ),
    # -- MoE ---------------------------------------------------------------------------------------
    Mutation(
        "moe_wait_total_not_per_source",
        MD,
        '            Wait("expert_rows", me, (e, s), from_src[e, s], consumers=n, patience=2, '
        "peer=s)\n"
        "            for s in range(W)\n"
        "            if from_src[e, s]",
        '            Wait("expert_rows", me, (e, 0), sum(from_src[e, q] for q in range(W)), '
        "consumers=n, patience=2, peer=0)\n"
        "            for s in range(1)\n"
        "            if consumers[e]",
        "MoE dispatch: a tile waits for all of its expert's rows on source 0's flag (the other "
        "sources raise flags nobody waits for)",
    ),
    Mutation(
        "moe_wait_too_few_consumers",
        MD,
        "    consumers = Counter(t[1] for t in tasks)",
        "    consumers = Counter(t[1] for t in tasks if t[4] == 0)",
        "MoE dispatch: an expert's flags count its row tiles, not their column tiles, as "
        "consumers (a flag is reset while column tiles still wait for it)",
    ),
    Mutation(
        "moe_expand_before_its_source_landed",
        MD,
        "        tokens = len(routing.sent[s][me])",
        "        tokens = len(routing.sent[s][me]) - 1",
        "MoE dispatch: an expand waits for all but one of its source's tokens (it may copy a "
        "receive row before the push has written it)",
    ),
    Mutation(
        "moe_ids_read_before_landed",
        MD,
        '            yield from twins.wait_acquire_reset(ctx, sig("ids_landed", me, s), 1, s)\n',
        "",
        "MoE dispatch: a layout reads the peers' routing ids without waiting for them to land",
    ),
    Mutation(
        "moe_landed_one_consumer",
        MD,
        "    expands_of = Counter(s for _, s, _, _ in pieces)",
        "    expands_of = Counter(s for _, s, _, _ in pieces[:1])",
        "MoE dispatch: landed[s] counts one consumer for most sources (the first expand resets "
        "it while the source's other pieces still wait)",
    ),
    Mutation(
        "moe_slot_tile_numbered_per_expert",
        MC,
        "    for i, (_, r0, n) in enumerate(gemm_tiles(offsets, tr)):",
        "    for _, r0, n in gemm_tiles(offsets, tr):\n        i = r0 // tr",
        "MoE combine: a slot names its row tile by the row's position, not the tile's index in "
        "the rank's list (wrong once an expert's rows do not start on a tile boundary)",
    ),
    Mutation(
        "moe_slot_entries_not_zeroed",
        MC,
        "        zeros = torch.zeros(k, SLOT_FIELDS, dtype=torch.int32)\n",
        "        zeros = torch.tensor(made[ctx.rank][t * k : (t + 1) * k], dtype=torch.int32)"
        " + 1\n",
        "MoE combine: a reduce leaves its token's slot entries as they were (the next call reads "
        "the last call's places for slots it does not use)",
    ),
    Mutation(
        "moe_slots_read_before_landed",
        MC,
        '            yield from twins.wait_acquire_reset(ctx, sig("slots_landed", me, d), 1, d)\n',
        "            pass\n",
        "MoE combine: a layout reads its slot table without waiting for the peers' entries",
    ),
    Mutation(
        "moe_reduce_waits_one_slot",
        MC,
        "            for d, _, i, n in slots[t * k : (t + 1) * k]",
        "            for d, _, i, n in slots[t * k : t * k + 1]",
        "MoE combine: a token's reduce waits for its first slot's tile only",
    ),
    Mutation(
        "ring_bwd_compute_without_prep",
        RB,
        "                waits = ((prepped,) if x == mine[0] else ()) + (landed(r, s) if s else "
        "())",
        "                waits = landed(r, s) if s else ()",
        "ring backward: compute tasks do not wait for the prep (delta and lse rows read unwritten)",
    ),
    Mutation(
        "ring_bwd_compute_before_landed",
        RB,
        "                waits = ((prepped,) if x == mine[0] else ()) + (landed(r, s) if s else "
        "())",
        "                waits = (prepped,) if x == mine[0] else ()",
        "ring backward: a compute task reads a ring slot's K/V before it landed",
    ),
    Mutation(
        "ring_bwd_grad_before_computed",
        RB,
        "            waits = tuple(w for g in range(G) for w in computed(s, g))\n            if s:",
        "            waits = ()\n            if s:",
        "ring backward: a grad send moves a block's dK/dV partial before its compute tasks "
        "added theirs",
    ),
    Mutation(
        "ring_bwd_home_before_the_previous_holders",
        RB,
        "                waits = computed(s, g) + (arrived,)",
        "                waits = computed(s, g)",
        "ring backward: the last holder sends a block's sum home before the previous holders' "
        "partials landed",
    ),
    Mutation(
        "ring_bwd_dq_waits_step_zero_only",
        RB,
        "            every = tuple(w for s in range(W) for w in computed(s, g))",
        "            every = computed(0, g)",
        "ring backward: dq is converted once step 0's tasks added theirs (later steps' missing)",
    ),
    Mutation(
        "ring_bwd_finish_without_wait",
        RB,
        "                    Task(t, (t,), (back,)) for t in finish_tiles[g]",
        "                    Task(t, (t,)) for t in finish_tiles[g]",
        "ring backward: the owner's finish reads its block's sum before it came home",
    ),
    Mutation(
        "ring_bwd_home_waits_for_another_group",
        RB,
        "                waits = computed(s, g) + (arrived,)",
        "                waits = computed(s, 0) + (arrived,)",
        "ring backward: a tail group's home parts wait for the first group's count, not their own",
    ),
    Mutation(
        "ring_bwd_dq_waits_for_another_group",
        RB,
        "            every = tuple(w for s in range(W) for w in computed(s, g))",
        "            every = tuple(w for s in range(W) for w in computed(s, 0))",
        "ring backward: a tail group's dq parts wait for the first group's counts, not their own",
    ),
    # -- over several nodes (the hierarchical plans, docs/rdma.md) --------------------------------
    Mutation(
        "rs_nodes_owner_drops_a_node_sum",
        RS,
        "part = yield from add_slots(ctx, t, part, 0, R + N - 2)",
        "part = yield from add_slots(ctx, t, part, 0, R + N - 3)",
        "gemm_rs over nodes: the owner adds one stage slot too few (the last node's sum)",
        tests=NODES_TESTS,
    ),
    Mutation(
        "rs_nodes_slot_ignores_the_owner_node",
        RS,
        "lo, mo = (src - me) % R, (owner // R - node) % N",
        "lo, mo = (src - me) % R, 0",
        "gemm_rs over nodes: partials for other nodes' owners land in the reducer's own slots",
        tests=NODES_TESTS,
    ),
    Mutation(
        "ag_nodes_forward_before_the_put_landed",
        AG,
        "tasks.append(Task(g * W + p, (g, p, FORWARD), waits=landed, raises=flag(g, p)))",
        "tasks.append(Task(g * W + p, (g, p, FORWARD), raises=flag(g, p)))",
        "ag_gemm over nodes: a chunk is forwarded within the node before its rdma put landed",
        tests=NODES_TESTS,
    ),
    Mutation(
        "ar_nodes_finalize_without_the_node_sums",
        AR,
        "            waits = (*node_flags(t), *arrived)",
        "            waits = node_flags(t)",
        "gemm_ar over nodes: the owner finalizes before the other nodes' sums landed",
        tests=NODES_TESTS,
    ),
    Mutation(
        "any_order_agents_unshared",
        PROG,
        "                    tasks = _Claims(tasks)",
        "                    tasks = tasks",
        "interpreter: the agents of an any-order comm unit each run every task (no claims)",
        tests=("tests/test_moe.py",),
    ),
]
