"""Ring attention, backward (issue 13): API, plan, data-movement twins, reference and the autograd
Function that makes ``ring_attention`` differentiable. The same plan runs in the CPU interpreter
and, in emulated GPU worlds, as one launch of the fused kernel (kernels/ring_attention_backward.cu:
the backward engine, primitives/attention/bwd_engine.cuh, on the persistent template), in
distributed GPU worlds too (one process per GPU, the ring through symmetric memory). The unfused
ring (mkernel/bench/baselines/ring_dist.py) is the two-GPU benchmark's baseline.

Unfused meaning, per rank r of W (shapes as the forward; dout, out bf16 like q, lse fp32)::

    P = softmax(Q K^T * scale) at the layout's global positions (causal: future keys masked)
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = scale dS K;  dK = scale dS^T Q
    dq_r, dk_r, dv_r = those rows of rank r (GQA: dK, dV summed over the q heads of a K/V head)

FlashAttention-style: P is recomputed from lse (P = exp(scale q k^T - lse)), delta = rowsum(dO *
O) - dlse once per q row (the prep), all in fp32.

Protocol (make_plan; docs/ring_attention.md, "Ring attention, backward"): the forward's K/V ring
(W - 1 slots per rank, ``landed`` counted, ``parts`` sends per step); a compute task is one K/V
tile of the block held at step s against every q row of one q chunk (the backward engine's shape:
dK, dV of the tile in registers over the walk), reduce-adding dQ into ``dq_acc`` and dK, dV into
``dkv_acc`` slot s (or, a block nobody else adds to, storing dk, dv in bf16: ``DIRECT``); a
unit's last task of step s and tail group g (a range of the (b, K/V head) pairs) adds its count
of them to ``computed[s, g]``. Row tasks of the compute role (``AUX`` tiles, run by the engine's
consumer warpgroups): each unit's prep part first (delta rows, ``landed[0]``), the tails (home,
dq and finish parts of one group's rows and heads) after its K/V tiles; comm tasks: the K/V sends
and the grad sends (slot s on to slot s + 1 of rank r + 1, ``dlanded[s + 1, 0]``). Home: the
block's last holder stores the slot's sum in bf16 into the owner's ``dkv_home`` (``dlanded[0,
g]``); the finish copies it into dk, dv; dq is bf16(dq_acc) once. A group's tails wait for its
own counts only, so the units that end their K/V tiles first run them while other units still
compute later groups. Each reader of an fp32 accumulator zeroes what it read.

    W = 3, contiguous, causal (Bp = the K/V block of rank p; g = its fp32 dK|dV partial; +in: the
    previous holders' partial, added into the same slot)
    step:     0                          1                             2
    rank 0:   B0 tiles; g -> r1 slot 1   -                             finish: dlanded[0, *]
    rank 1:   B1 tiles; g -> r2 slot 1   B0 tiles (+in); g -> r2 s 2   finish: dlanded[0, *]
    rank 2:   B2 tiles (dk, dv stored    B1 tiles (+in); home -> r1    B0 tiles (+in); home -> r0
              by the engine: DIRECT)
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any

import torch

from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, PerUnit, Raise, Task, Wait
from ..runtime import registry
from ..schedule import (
    TILE_CONFIGS,
    Plan,
    Schedule,
    Tile,
    build_plan,
    is_resolved,
    least_loaded,
    resolve,
    split_units,
)
from ..world import World
from . import common
from . import ring_attention as fwd
from .ring_cost import item_rows, row_task_rows, spare_copy_rows

# comm args[1] beyond a K/V send's part: a grad send on (to the next holder); the kinds of the
# compute role's row tasks (their tile's key, AUX set): the finish, the prep, the dq store, home
# (the last holder's sum of a block, bf16, to its owner)
GRAD, FINISH, PREP, DQ, HOME = (16 + i for i in range(5))
# A block's K/V send in at most this many pieces (a piece's index is its comm args[1], below
# GRAD). The forward sends in up to MAX_PARTS so that its chains find their blocks sooner; here
# the K/V tiles run step-major and a unit's step-0 tiles (~3 ms at the bench's shapes) outlast
# the sends (~330 us for 16 pieces, emulated W = 2), so more pieces would buy nothing.
KV_PARTS = GRAD
# A step's grad sends in at most this many parts (one a comm unit): each part is one unit's TMA
# ring, so fewer parts move the same bytes at a lower rate (the partial is needed only by the
# end of the next step), leaving more memory bandwidth to the compute units beside them. With one
# part per unit (66 in an emulated W = 2 world on an H200) the K/V tile tasks that ran during the
# grad sends took up to ~40-80 us longer each (p90); measured (benchmarks/ring_bwd_parts_probe.py,
# intra_sm, vs the engine, full / causal): 66 parts 0.813 / 0.660, 32 0.861 / 0.680, 24 0.863 /
# 0.680, 16 0.854 / 0.674, 12 0.845 / 0.662, 8 0.822 / 0.631 (too slow: the homes wait for them).
GRAD_PARTS = 24
# compute tile tag bits beyond the forward's diag: AUX, a row task (prep, dq, home or finish: kind
# in the key, the step in the step bits, first tile / row in m0, count in rows), run by the
# engine's consumer warpgroups between its tiles; DIRECT, a K/V tile whose dK, dV nobody else adds
# to (W = 1, a block that is never sent), stored in bf16 into dk, dv by the engine, no finish
AUX, DIRECT = 2, 4
# The (b, K/V head) pairs in this many groups for the tails (home, dq and finish, row tasks): a
# step's K/V tiles run group by group and a group's tails wait for its own count (computed[s,
# g]), so the units that end their K/V tiles first run the tails of the groups already done while
# the others finish (the tails go after a unit's K/V tiles: placed among them, they stalled units
# whose group was not done). A unit raises computed[s, g] once, at its last K/V tile of the step
# and group, a fence each: more groups, more fences. Measured (emulated W = 2, the bench's shapes,
# intra_sm, vs the engine, benchmarks/ring_bwd_parts_probe.py; full / causal): 1 group 0.879 /
# 0.691, 2 0.885 / 0.725, 8 0.863 / 0.770, 16 0.870 / 0.761, 32 0.867 / 0.760. Causal's K/V
# tiles differ in length and its units end them further apart: more groups pay there.
TAIL_GROUPS = 8  # causal
TAIL_GROUPS_FULL = 2
# The tails' parts per compute unit (each kind, over all groups). Smaller parts did not even out
# the units' ends (emulated W = 2, intra_sm, full / causal: 1 part 0.885 / 0.763, 2 0.882 /
# 0.758, 4 0.876 / 0.752; benchmarks/results/ring_bwd_tail_groups_probe_2026-12-02.txt).
TAIL_PARTS = 1
KV_TILE = 16  # K/V rows per compute task in the interpreter (Schedule.chunk_rows)
ENGINE_KV_TILE = 128  # the GPU backward engine's (primitives/attention/bwd_engine.cuh, BKV)
ROW_TILE = 64  # q rows per packed tile of ``delta`` (the engine's BQ, its TMA_ROWS fetch)
LANDED = Pad(
    "landed",
    ("step",),
    ("W",),
    counted=True,
    doc="step s > 0: the K/V block of step s is in my slot; step 0: my delta rows are prepared",
)
SPEC = OpSpec(
    name="ring_attention_backward",
    doc="ring attention backward: K/V travel the ring, fp32 dK/dV partials travel with them",
    buffers=(
        Buffer("dout", "input", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
        *fwd.QKV,
        Buffer("out", "input", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
        Buffer("lse", "input", torch.float32, ("lse_rows", "seq"), "[B * Hq, S]"),
        Buffer("dlse", "input", torch.float32, ("lse_rows", "seq"), "grad of lse (zeros: none)"),
        Buffer("dq", "output", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
        Buffer("dk", "output", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
        Buffer("dv", "output", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
        *fwd.KV_RING,
        Buffer(
            "delta",
            "symmetric",
            torch.float32,
            ("delta_rows", "delta_cols"),
            "per (q chunk, head, q tile of 64 rows): lse * log2 e [64] | delta [64]; rows past "
            "the chunk +inf | 0",
        ),
        Buffer(
            "dq_acc",
            "symmetric",
            torch.float32,
            ("rows", "q_cols"),
            "dQ of every compute task, reduce-added, fp32 (zero between calls)",
        ),
        Buffer(
            "dkv_acc",
            "symmetric",
            torch.float32,
            ("acc_rows", "acc_cols"),
            "per step: the held block's dK | dV partial, fp32 (zero between calls)",
        ),
        Buffer(
            "dkv_home",
            "symmetric",
            torch.bfloat16,
            ("rows", "acc_cols"),
            "my block's dK | dV, summed, bf16: stored by its last holder (HOME), read by my finish",
        ),
    ),
    pads=(
        LANDED,
        Pad(
            "computed",
            ("step", "group"),
            ("W", "tail_groups"),
            counted=True,
            doc="my compute tasks of step and tail group added their dK, dV, dQ",
        ),
        Pad(
            "dlanded",
            ("step", "group"),
            ("W", "tail_groups"),
            counted=True,
            doc="[s > 0, 0]: the previous holders' partial is in my slot s; [0, g]: my block's "
            "sum of tail group g is in dkv_home",
        ),
    ),
    scalars=("batch", "seq", "heads", "kv_heads", "head_dim", "causal", "zigzag", "scale_bits"),
    constants=(
        ("tag_key", fwd.TAG_KEY),
        ("grad", GRAD),
        ("finish", FINISH),
        ("prep", PREP),
        ("dq", DQ),
        ("home", HOME),
        ("row_tile", ROW_TILE),
        ("aux", AUX),
        ("direct", DIRECT),
    ),
)


# -- the plan -------------------------------------------------------------------------------------


def pack_key(b: int, hk: int, cq: int, ck: int, chunks: int, kv_heads: int) -> int:
    """A compute task's key (its tag above TAG_KEY): batch, K/V head, q chunk, K/V chunk."""
    return ((b * kv_heads + hk) * chunks + cq) * chunks + ck


def unpack_key(key: int, chunks: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(b, hk, cq, ck) of a compute task's key."""
    rest, ck = divmod(key, chunks)
    bh, cq = divmod(rest, chunks)
    b, hk = divmod(bh, kv_heads)
    return b, hk, cq, ck


def make_plan(
    schedule: Schedule,
    world: World,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: int,
    zigzag: int,
    scale_bits: int = 0,
) -> Plan:
    """The backward's plan: the forward's K/V ring (its sends, ``landed`` counted), compute tasks
    that each own one K/V tile of a held block (the backward engine's shape: dK, dV of the tile
    in registers over a walk of every q row of one q chunk, all q heads of the tile's K/V head),
    row tasks of the compute role (one part per compute unit, run by the engine's consumer
    warpgroups between its tiles) and grad sends of the comm role (one part per comm unit):

    - prep (row task, row 0 of unit p: part p): delta = rowsum(dO * O) - dlse and lse * log2 e
      into the ``delta`` workspace, a range of its 64-row tiles; adds 1 to its own ``landed[0]``,
      which the first K/V tile task of every unit waits for;
    - compute (step s, K/V tile, q chunk): waits ``landed[s]`` (s > 0); reduce-adds its dQ into
      ``dq_acc`` and its dK, dV into ``dkv_acc`` slot s, or, when nobody else adds to the block's
      dK, dV (never sent, one q chunk: W = 1, the last rank of a contiguous causal ring), stores
      them in bf16 into dk, dv (the tile's ``DIRECT`` bit; that rank has no finish); a unit's
      last task of step s and tail group g (TAIL_GROUPS: ranges of the (b, K/V head) pairs)
      adds the unit's number of those tasks to ``computed[s, g]`` (one fence for all of them);
    - grad (comm, step s, rows): the block goes on: waits ``computed[s, g]`` of every group and,
      s > 0, ``dlanded[s, 0]``; reduce-adds the slot's rows into slot s + 1 of rank r + 1
      (``dlanded[s + 1, 0]``), zeroes them;
    - the tails, row tasks in parts of a group's rows and K/V heads (``tail_parts``), each
      waiting for its group's counts only:
      - home (step s > 0): I am the block's last holder: waits ``computed[s, g]`` and
        ``dlanded[s, 0]``; stores the slot's part (the block's whole sum) in bf16 into the
        owner's ``dkv_home`` (``dlanded[0, g]`` there), zeroes it;
      - dq: waits ``computed[s, g]`` of every step; dq = bf16(dq_acc part), zeroed;
      - finish: waits ``dlanded[0, g]``; dk, dv = the part of ``dkv_home``.

    A unit's rows: its prep, then its K/V tiles step-major and by group within a step (the
    longest first within a group), then the tails, each onto the least loaded unit: home parts,
    dq parts, finish parts (after everything where the holder that sends my block home has a
    later last step than mine), each by group.

    NOTE: no deadlock, whatever the interleaving. Rank every task by a key: a prep (-2,), a K/V
    send of step s (-1, s), a compute task of step s and group g (s, g, 0), a grad send (s, G, 0),
    a home part (L, G, 1), a dq part (L, G, 2) and a finish part (L, G, 3), L my last step with
    K/V tiles, or (W, 0, 3) where my block's last holder has a later last step. Each wait is for
    tasks of a smaller key (K/V sends and compute tasks wait for K/V sends of s - 1 and preps;
    grad sends for compute tasks of s and grad sends of s - 1; homes for compute tasks of (s, g),
    s <= L, and grad sends of s - 1; dq for compute tasks of g; a finish for the homes of its
    group at the holder), and each unit runs its tasks in non-decreasing key order (a compute
    unit: as placed above; a comm unit: K/V sends, then grad sends by step). Were the run
    stalled, take the waiting head t of least key: it waits for an unfinished t' of smaller key;
    the head h of t''s unit has key(h) <= key(t') < key(t) and waits too: a contradiction. (The
    tests check both conditions on plans: test_no_wait_is_for_a_later_key_and_units_run_keys_in_
    order.)"""
    W, S, D, B, H, Hkv = world.size, seq, head_dim, batch, heads, kv_heads
    if W > 256 or B * Hkv * 4 >= 1 << (31 - fwd.TAG_KEY):
        raise ValueError(
            f"ring attention backward plans up to W = 256 and B * Hkv < {1 << (29 - fwd.TAG_KEY)} "
            f"(a task's tag), got W = {W}, B * Hkv = {B * Hkv}"
        )
    if not is_resolved(schedule):  # a direct call (the API resolves first): as build_plan would
        schedule, _ = resolve(schedule, SPEC.name, world, {})
    C = fwd.num_chunks(zigzag, causal, W)
    Sc, group = S // C, H // Hkv
    tk = schedule.chunk_rows or (ENGINE_KV_TILE if world.on_gpu else KV_TILE)
    units, comm_units = split_units(schedule, world, 1 << 30)  # every unit (some may idle)
    parts = max(1, min(KV_PARTS, comm_units, B * S))
    if parts > GRAD:  # the kernel reads args[1] >= GRAD as a grad send
        raise AssertionError(f"{parts} K/V pieces: their indices reach the grad sends' kind")
    # grad sends: one part per comm unit (their kind is args[1], not a part); prep, home, dq and
    # finish: one part per compute unit (row tasks); a prep part is a range of 64-row tiles of the
    # (q chunk, head) pairs' rows
    qt = -(-Sc // ROW_TILE)
    gparts = max(1, min(comm_units, B * S, GRAD_PARTS))
    preps, tails = min(units, B * C * H * qt), max(1, min(units, B * S))

    # Compute tasks per rank and step: (group, cost, tile id); the tag holds the step and the key.
    # Cost: the q rows the task walks (times the q heads of its K/V head) plus an item's fixed
    # cost. Group: the tail group of its (b, K/V head) pair (TAIL_GROUPS).
    item = item_rows(tk, D)
    G = max(1, min(TAIL_GROUPS if causal else TAIL_GROUPS_FULL, B * Hkv))
    group_of = [0] * (B * Hkv)
    for g, (first, n) in enumerate(fwd.row_parts(B * Hkv, G)):
        group_of[first : first + n] = [g] * n
    tiles: list[Tile] = []
    per_rank: list[list[list[tuple[int, float, int]]]] = []
    sg_of: dict[int, tuple[int, int]] = {}  # a K/V tile task's (step, group)
    readers = [[0] * W for _ in range(W)]
    for r in range(W):
        steps: list[list[tuple[int, float, int]]] = [[] for _ in range(W)]
        for s in range(W):
            for b in range(B):
                for hk in range(Hkv):
                    g = group_of[b * Hkv + hk]
                    for cq in range(C):
                        gq = fwd.chunk_id(r, cq, W, zigzag)
                        for ck in range(C):
                            gk = fwd.chunk_id((r - s) % W, ck, W, zigzag)
                            diag = bool(causal) and gk == gq
                            if causal and gk > gq:
                                continue
                            outer = b * C + ck if s == 0 else ((s - 1) * B + b) * C + ck
                            key = pack_key(b, hk, cq, ck, C, Hkv)
                            tag = fwd.pack_tag(key, s, diag, False, False)
                            for m0 in range(0, Sc, tk):
                                n = min(tk, Sc - m0)
                                cost = group * ((Sc - m0) if diag else Sc) + item
                                steps[s].append((g, cost, len(tiles)))
                                sg_of[len(tiles)] = (s, g)
                                tiles.append(Tile(len(tiles), m0, outer, n, Sc, tag))
                                readers[r][s] += 1
        per_rank.append(steps)
    sends = fwd.ring_sends(readers)
    holds = [[s == 0 or (s - 1) in sends[(r - 1) % W] for s in range(W)] for r in range(W)]
    home = [0 in sends[r] for r in range(W)]  # my block comes back as a partial (dlanded[0, g])
    # nobody else adds to my block's dK, dV (never sent; one q chunk): the engine stores them
    direct = [not home[r] and C == 1 for r in range(W)]
    # NOTE: a block never sent has one q chunk: causal zigzag (C = 2, W > 1) sends every block
    # (rank r + 1, or rank 0 for the last, sees chunk r, 2W - 1 - r); so every block is stored by
    # the engine or comes home (the finish reads dkv_home, never an unsent fp32 slot)
    if not all(home[r] or direct[r] for r in range(W)):
        raise AssertionError(f"a block neither sent nor stored by the engine: {home}, {direct}")
    for r in range(W):
        for _, _, t in per_rank[r][0] if direct[r] else ():
            x = tiles[t]
            tiles[t] = x._replace(tag=x.tag | DIRECT)
    # the blocks each rank passes on (GRAD, comm parts) and returns (HOME, row parts), and the
    # step at which each block comes home (its last holder's)
    grads = [[s for s in range(W) if holds[r][s] and s in sends[r]] for r in range(W)]
    homes = [[s for s in range(1, W) if holds[r][s] and s not in sends[r]] for r in range(W)]
    home_step = {(r - s) % W: s for r in range(W) for s in homes[r]}
    last_step = [max(s for s in range(W) if readers[r][s]) for r in range(W)]

    def aux_tiles(kind: int, parts, s: int = 0) -> list[int]:  # row tasks, a tile a part
        first = len(tiles)
        for m0, m, n0, cols in parts:
            tiles.append(
                Tile(len(tiles), m0, n0, m, cols, fwd.pack_tag(kind, s, False, True, False))
            )
        return list(range(first, len(tiles)))

    prep_tiles = aux_tiles(PREP, [(p0, m, 0, 0) for p0, m in fwd.row_parts(B * C * H * qt, preps)])
    # the tails' parts of each group: rows of one b, a range of K/V heads (m0 = b * S + row, n0 =
    # the first K/V head, cols = heads); the same cut for home, dq and finish
    cuts = tail_parts(B, S, Hkv, group, D, G, TAIL_PARTS * tails)
    dq_tiles = [aux_tiles(DQ, cuts[g]) for g in range(G)]
    finish_tiles = [aux_tiles(FINISH, cuts[g]) for g in range(G)]
    home_tiles: dict[int, list[list[int]]] = {}  # step -> per group, the home parts of its block
    for s in sorted({s for r in range(W) for s in homes[r]}):
        home_tiles[s] = [aux_tiles(HOME, cuts[g], s) for g in range(G)]
    hparts = [len(cuts[g]) for g in range(G)]  # parts per group, each of home, dq and finish
    part_cost = tail_costs(tiles, group, D, tk)

    def landed(r: int, s: int) -> tuple[Wait, ...]:
        n = readers[r][s] + (parts if s in sends[r] else 0)
        return (Wait("landed", r, (s,), value=parts, consumers=n),)

    compute, comm = [], []
    for r in range(W):
        nxt = (r + 1) % W
        count = [[0] * G for _ in range(W)]  # my compute tasks per (step, group)
        for s in range(W):
            for g, _, _ in per_rank[r][s]:
                count[s][g] += 1
        # the consumers of computed[s, g]: the grad parts of s, the home parts of (s, g), the dq
        # parts of g
        n_comp = [
            [(gparts if s in grads[r] else 0) + hparts[g] * ((s in homes[r]) + 1) for g in range(G)]
            for s in range(W)
        ]

        def computed(s: int, g: int, r: int = r, count=count, n_comp=n_comp) -> tuple[Wait, ...]:
            n = count[s][g]
            # NOTE: patience 2 (3 for dlanded): these follow other waits (the compute tasks'
            # landed, the previous holder's computed), which report a silent peer first
            wait = Wait("computed", r, (s, g), value=n, consumers=n_comp[s][g], patience=2)
            return (wait,) if n else ()

        # comm tasks: the K/V sends, then the grad sends by step
        tasks: list[Task] = []
        tid = W * parts  # after the K/V sends' ids
        arrive = lambda s, nxt=nxt: (Raise("landed", nxt, (s + 1,), op="add"),)  # noqa: E731
        for s in sends[r]:
            for p, (r0, n) in enumerate(fwd.row_parts(B * S, parts)):
                args = (s, p, r0, n)
                tasks.append(Task(s * parts + p, args, landed(r, s) if s else (), arrive(s)))
        for s in grads[r]:
            waits = tuple(w for g in range(G) for w in computed(s, g))
            if s:
                waits += (Wait("dlanded", r, (s, 0), value=gparts, consumers=gparts, patience=3),)
            dest = Raise("dlanded", nxt, (s + 1, 0), op="add")
            for r0, n in fwd.row_parts(B * S, gparts):
                tasks.append(Task(tid, (s, GRAD, r0, n), waits, (dest,)))
                tid += 1

        # The tails (row tasks) by the step after whose K/V tiles they go, my last (W: after
        # everything): homes, dq, finish, each by group
        tails_at: dict[int, list[Task]] = {}
        for s in homes[r]:  # the sum of the block held at step s (mine + the previous holders')
            arrived = Wait("dlanded", r, (s, 0), value=gparts, consumers=sum(hparts), patience=3)
            for g in range(G):
                owner = Raise("dlanded", (r - s) % W, (0, g), op="add")
                waits = computed(s, g) + (arrived,)
                tails_at.setdefault(max(s, last_step[r]), []).extend(
                    Task(t, (t,), waits, (owner,)) for t in home_tiles[s][g]
                )
        for g in range(G):
            every = tuple(w for s in range(W) for w in computed(s, g))
            tails_at.setdefault(last_step[r], []).extend(Task(t, (t,), every) for t in dq_tiles[g])
        if not direct[r]:
            # NOTE: after the homes of my block at its last holder (no deadlock, below)
            holder = (r + home_step[r]) % W
            point = last_step[r] if last_step[holder] <= last_step[r] else W
            for g in range(G):
                back = Wait("dlanded", r, (0, g), value=hparts[g], consumers=hparts[g], patience=3)
                tails_at.setdefault(point, []).extend(
                    Task(t, (t,), (back,)) for t in finish_tiles[g]
                )

        # K/V tiles and tails to units: in that order, each onto the least loaded unit; a
        # step's K/V tiles group by group, the longest first within a group. Each unit's list
        # begins with its prep (unit p: part p), if any.
        load = [0.0] * units
        if schedule.overlap == "intra_sm":  # comm unit u runs on compute unit u's SM
            # NOTE: its copies slow that unit's tiles (a unit hosting a grad part ended its tiles
            # ~340 us late, emulated W = 2; RingRates.spare_copy_gbps): start it with their cost.
            # Traffic in bytes read + written a row: a K/V piece's (K and V, bf16), a grad part's
            # (dK | dV fp32: read, reduce-added into the peer, zeroed); comm task k runs on unit
            # k % comm_units (the template's rule).
            for k, t in enumerate(tasks):
                per_row = (24 if t.args[1] == GRAD else 8) * Hkv * D
                load[k % comm_units] += spare_copy_rows(per_row * t.args[3], tk, D)
        order: list[tuple[Task | int, float]] = []
        for s in range(W + 1):
            kv = sorted(per_rank[r][s], key=lambda c: (c[0], -c[1])) if s < W else ()
            order += [(t, cost) for _, cost, t in kv]
            order += [(x, part_cost[x.id]) for x in tails_at.get(s, [])]
        lists = least_loaded(order, units, load, longest_first=False)
        # the units that run K/V tiles: each one's first waits for every prep
        busy = sum(1 for x in lists if any(not isinstance(y, Task) for y in x))
        prepped = Wait("landed", r, (0,), value=preps, consumers=busy)
        rows: list[list[Task]] = [[] for _ in range(units)]
        for p, t in enumerate(prep_tiles):
            rows[p].append(Task(t, (t,), (), (Raise("landed", r, (0,), op="add"),)))
        for u, entries in enumerate(lists):
            mine = [x for x in entries if not isinstance(x, Task)]
            n_of = Counter(sg_of[x] for x in mine)
            last_of = {sg_of[x]: x for x in mine}
            for x in entries:
                if isinstance(x, Task):  # a tail
                    rows[u].append(x)
                    continue
                s, g = sg_of[x]
                waits = ((prepped,) if x == mine[0] else ()) + (landed(r, s) if s else ())
                # NOTE: the unit's last task of a (step, group) raises for all of them
                # (computed[s, g] += their count): the others end without a fence (it waits for
                # the item's dK, dV red.adds) and come earlier in the unit's rows
                raises = ()
                if last_of[s, g] == x:
                    raises = (Raise("computed", r, (s, g), value=n_of[s, g], op="add"),)
                rows[u].append(Task(x, (x,), waits, raises))
        compute.append(rows)

        comm.append(tasks)

    shapes = dict(batch=B, seq=S, heads=H, kv_heads=Hkv, head_dim=D, causal=causal, zigzag=zigzag)
    shapes["scale_bits"] = scale_bits
    sizes = {
        "rows": B * S,
        "q_cols": H * D,
        "kv_cols": Hkv * D,
        "lse_rows": B * H,
        "seq": S,
        "ring_rows": max(1, W - 1) * B * S,
        "delta_rows": B * C * H * qt,
        "delta_cols": 2 * ROW_TILE,
        "acc_rows": W * B * S,
        "acc_cols": 2 * Hkv * D,
    } | shapes
    sizes["tail_groups"] = G
    extra = {"chunks": C, "kv_tile": tk, "parts": parts, "preps": preps, "tails": tails}
    extra |= {"gparts": gparts, "sends": sends, "direct": direct, "groups": G}
    extra |= {"group_of": group_of, "tail_cuts": cuts}
    extra |= {"holds": holds, "readers": readers, "row_tiles": qt}
    tile = TILE_CONFIGS["64x128x64"]  # unused: the backward engine has one tile shape
    per_unit = PerUnit(compute)  # each unit its own list: none padded to the longest
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, tiles, per_unit, comm, extra)


def tail_parts(
    B: int, S: int, Hkv: int, group: int, D: int, G: int, tails: int
) -> list[list[tuple[int, int, int, int]]]:
    """Per tail group (``G`` near-equal ranges of the B * Hkv (b, K/V head) pairs), the parts of
    its home, dq and finish: (m0 = b * S + first row, rows, first K/V head, heads), about
    ``tails`` parts in all, each within one b (a part's rows are consecutive there)."""
    out = []
    per_group = max(1, tails // G)
    for first, n in fwd.row_parts(B * Hkv, G):
        parts, bh = [], first
        while bh < first + n:  # the group's pairs by b: (b, first head, heads)
            b, hk = divmod(bh, Hkv)
            nh = min(first + n - bh, Hkv - hk)
            # NOTE: the device counts a part's 16-byte elements in int32 (home: dK | dV fp32, dq:
            # the q heads' fp32 per row)
            row_quads = nh * D * max(2, group) // 4
            k = max(round(per_group * nh / n), 1, -(-S * row_quads // (2**31 - 1)))
            parts += [(b * S + r0, m, hk, nh) for r0, m in fwd.row_parts(S, min(k, S))]
            bh += nh
        out.append(parts)
    return out


def tail_costs(tiles: list[Tile], group: int, D: int, tk: int) -> dict[int, float]:
    """A tail part's cost in the plan's task cost unit, per tile id (AUX tiles of HOME, DQ,
    FINISH), from its bytes read + written: home, dK | dV fp32 read, zeroed, bf16 to the owner;
    dq, its q heads' fp32 read, zeroed, bf16 stored; finish, dK | dV bf16 copied."""
    per_elem = {HOME: 2 * (4 + 4 + 2), DQ: group * (4 + 4 + 2), FINISH: 2 * (2 + 2)}
    costs = {}
    for t in tiles:
        kind = fwd.unpack_tag(t.tag)[0]
        if t.tag & AUX and kind in per_elem:
            costs[t.index] = row_task_rows(per_elem[kind] * t.rows * t.cols * D, tk, D)
    return costs


# -- input checks and the API ---------------------------------------------------------------------


def shapes(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    world: World,
    causal: Any = False,
    layout: Any = "contiguous",
) -> dict[str, int]:
    """The forward's checks of q, k, v, then dout and out (bf16, like q) and lse (fp32 [B, Hq,
    S_local] per rank); TypeError / ValueError naming the argument. The plan's sizes."""
    s = fwd.shapes(q, k, v, world, causal, layout)  # scale_bits: the default scale's
    q_shape = (s["batch"], s["seq"], s["heads"], s["head_dim"])
    for name, t in (("dout", dout), ("out", out)):
        if common.check_operand(name, t, world, 4, "[B, S_local, Hq, D]") != q_shape:
            raise ValueError(
                f"{name} has shape {list(t.shape)}, q {list(q.shape)}: they must agree"
            )
    check_lse("lse", lse, world, (s["batch"], s["heads"], s["seq"]))
    return s


def check_lse(name: str, t: Any, world: World, shape: tuple[int, ...]) -> None:
    """An fp32 per-rank [B, Hq, S_local] tensor on the world's device, contiguous."""
    full = (world.size, *shape) if world.emulated_world else shape
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be torch.float32 (the forward's lse), got {t.dtype}")
    if t.device.type != world.device.type:
        raise ValueError(f"{name} is on {t.device}, but the world's device is {world.device}")
    if tuple(t.shape) != full:
        raise ValueError(
            f"{name} must have shape {list(full)} ([B, Hq, S_local]), got {list(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    world: World,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    schedule: Schedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention, backward: the gradients of ``out = ring_attention(q, k, v, ...)`` for the
    incoming gradient ``dout``, from the forward's ``out`` and ``lse``.

    Unfused equivalent (``reference``): autograd through the fp32 attention of the gathered
    sequence at the layout's global positions, each rank's rows::

        dq[r], dk[r], dv[r] = torch.autograd.grad(attention(Q, K, V), (q, k, v), dout)[rank r]

    Args:
        dout: bf16, per rank [B, S_local, Hq, D] (emulated world: [W, B, S_local, Hq, D]).
        q: bf16 [B, S_local, Hq, D]; k, v: bf16 [B, S_local, Hkv, D] (as the forward).
        out: bf16 [B, S_local, Hq, D], lse: fp32 [B, Hq, S_local]: the forward's results.
        world, causal, scale, layout, schedule: as ``ring_attention`` (the same values as the
            forward that made out and lse).

    Returns:
        (dq, dk, dv): bf16, dq like q, dk and dv like k and v (GQA: summed over the q heads that
        share a K/V head), accumulated in fp32. Raises TypeError / ValueError naming the argument
        before anything runs; CommTimeout if a wait passes the world's deadline (asynchronous on
        GPUs: raised by the next call or ``world.check()``). In an emulated GPU world: one launch
        of the fused kernel (kernels/ring_attention_backward.cu), in a distributed one too (this
        rank's tensors, no rank dimension; every rank calls with the same shapes). One rank with
        a schedule that sets nothing but the seed: the backward engine's own launches
        (``ring_attention.solo_engine``).
    """
    return run(dout, q, k, v, out, lse, world, causal, scale, layout, schedule, None)


def run(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    world: World,
    causal: bool,
    scale: float | None,
    layout: str,
    schedule: Schedule | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ring_attention_backward`` with the gradient of lse too (``dlse``, fp32 like lse, or None):
    d lse / d scores is the softmax, so it enters as delta - dlse (the autograd Function's path)."""
    inputs = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    options = dict(causal=causal, scale=scale, layout=layout, dlse=dlse)
    return common.run_op(OP, inputs, world, schedule, **options)


# -- the run path's hooks (mkernel/runtime/run.py OpDef) ---------------------------------------


def _check(call: common.Call) -> None:
    """The scale (its fp32 bits key the plan), dlse like lse, the GPU engine's K/V tile."""
    world, lse, dlse = call.world, call.inputs["lse"], call.options["dlse"]
    call.options["scale"] = scale = fwd.check_scale(call.options["scale"], call.sizes["head_dim"])
    if dlse is not None:  # lse is checked: per rank [B, Hq, S_local] after a rank dimension
        check_lse("dlse", dlse, world, tuple(lse.shape[1 if world.emulated_world else 0 :]))
    if world.on_gpu and call.schedule.chunk_rows not in (None, ENGINE_KV_TILE):
        raise ValueError(
            f"Schedule.chunk_rows={call.schedule.chunk_rows}: the GPU backward engine's K/V tile "
            f"is {ENGINE_KV_TILE} rows (leave it None)"
        )
    call.sizes["scale_bits"] = fwd.scale_bits(scale)


def _solo(call: common.Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One rank on a GPU with nothing to observe or inject: the backward engine (three launches)."""
    world, dlse = call.world, call.options["dlse"]
    if not fwd.solo_engine(world, call.schedule):
        return None
    from .. import attention_ext  # NOTE: on first use, as ring_attention.engine_attention

    ops = (fwd.solo(t, world) for t in call.inputs.values())
    dl = None if dlse is None else fwd.solo(dlse, world)
    opts = call.options
    grads = attention_ext.attention_backward(*ops, opts["causal"], opts["scale"], dlse=dl)
    return tuple(g[None] for g in grads) if world.emulated_world else grads


def _results(call: common.Call) -> dict[str, torch.Tensor]:
    """dq, dk, dv like q, k, v, poisoned where result_buffer poisons (a tile the plan forgets
    shows). dlse's default (zeros: no gradient through lse) joins the operands here, after the
    solo path, whose engine takes None."""
    ins = call.inputs
    dlse = call.options["dlse"]
    ins["dlse"] = torch.zeros_like(ins["lse"]) if dlse is None else dlse
    dev = ins["q"].device
    return {
        f"d{n}": common.result_buffer(ins[n].shape, torch.bfloat16, dev) for n in ("q", "k", "v")
    }


def _views(call: common.Call) -> dict[str, torch.Tensor]:
    i, r = call.inputs, call.results
    return operands(
        call.plan,
        *(i[n] for n in ("dout", "q", "k", "v", "out", "lse", "dlse")),
        *(r[n] for n in ("dq", "dk", "dv")),
    )


OP = common.OpDef(
    spec=SPEC,
    make_plan=make_plan,
    shapes=shapes,
    shape_args=("causal", "layout"),
    check=_check,
    solo=_solo,
    results=_results,
    views=_views,
    twins=lambda c: twins_of(c.plan, c.options["scale"]),
    outputs=lambda plan, rank: outputs(plan, rank),
    finish=lambda c: (c.results["dq"], c.results["dk"], c.results["dv"]),
)


def operands(plan: Plan, dout, q, k, v, out, lse, dlse, dq, dk, dv) -> dict[str, torch.Tensor]:
    """The caller's tensors as the interpreter's 2-D per-rank views (the forward's ``operands``)."""
    W, z = plan.world_size, plan.sizes
    views = fwd.operands(plan, q, k, v, out, lse)
    rows = lambda x, cols: x.view(W, z["rows"], z[cols])  # noqa: E731
    return views | {
        "dout": rows(dout, "q_cols"),
        "dlse": dlse.view(W, z["lse_rows"], z["seq"]),
        "dq": rows(dq, "q_cols"),
        "dk": rows(dk, "kv_cols"),
        "dv": rows(dv, "kv_cols"),
    }


# -- CPU interpreter: the data-movement twins ------------------------------------------------------


def twins_of(plan: Plan, scale: float | None = None):
    z, W = plan.shapes, plan.world_size
    S, D, H, Hkv, B = z["seq"], z["head_dim"], z["heads"], z["kv_heads"], z["batch"]
    BS, KC = B * S, Hkv * D  # rows of a block, columns of dK (dV follows)
    C, qt = plan.extra["chunks"], plan.extra["row_tiles"]
    Sc, group, T = S // C, H // Hkv, ROW_TILE
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = [fwd.positions(r, W, S, bool(z["zigzag"])) for r in range(W)]

    def compute(ctx, task):  # one K/V tile: every q row of one q chunk, all its q heads
        tile = plan.tiles[task.args[0]]
        key, s, _, _, _ = fwd.unpack_tag(tile.tag)
        if tile.tag & AUX:  # a row task: the prep, dq, home or the finish (the consumers' rows)
            yield from rows_task(ctx, key, s, tile)
            return
        b, hk, cq, ck = unpack_key(key, C, Hkv)
        k0, n = ck * Sc + tile.m0, tile.rows  # the tile's first row within the block
        k_buf, v_buf, base = ("k", "v", 0) if s == 0 else ("k_ring", "v_ring", (s - 1) * BS)
        kv_rect = (base + b * S + k0, n, hk * D, D)
        kt = (yield from twins.tile_load_async(ctx, k_buf, ctx.rank, kv_rect)).float()
        vt = (yield from twins.tile_load_async(ctx, v_buf, ctx.rank, kv_rect)).float()
        q0 = cq * Sc
        keys = pos[(ctx.rank - s) % W][k0 : k0 + n]
        future = keys[None, :] > pos[ctx.rank][q0 : q0 + Sc, None]
        dk, dv = torch.zeros(n, D), torch.zeros(n, D)
        for h in range(hk * group, (hk + 1) * group):
            q_rect = (b * S + q0, Sc, h * D, D)
            qv = (yield from twins.tile_load_async(ctx, "q", ctx.rank, q_rect)).float()
            do = (yield from twins.tile_load_async(ctx, "dout", ctx.rank, q_rect)).float()
            lse_rect = (b * H + h, 1, q0, Sc)
            lse = (yield from twins.tile_load_async(ctx, "lse", ctx.rank, lse_rect))[0]
            rows = ((b * C + cq) * H + h) * qt
            delta = yield from twins.tile_load_async(ctx, "delta", ctx.rank, (rows, qt, T, T))
            scores = (qv @ kt.T) * scale  # [Sc, n]
            if z["causal"]:
                scores = scores.masked_fill(future, -math.inf)
            dq, dk_h, dv_h = grads(scores, lse, do, qv, kt, vt, delta.reshape(-1)[:Sc], scale)
            yield from twins.reduce_add(ctx, "dq_acc", ctx.rank, q_rect, dq)
            dk, dv = dk + dk_h, dv + dv_h
        if tile.tag & DIRECT:  # nobody else adds to these rows: bf16, once
            rect, ids = (b * S + k0, n, hk * D, D), direct_ids(tile.index)
            yield from twins.output_store(ctx, "dk", ctx.rank, rect, dk.bfloat16(), ids[0])
            yield from twins.output_store(ctx, "dv", ctx.rank, rect, dv.bfloat16(), ids[1])
            return
        acc = s * BS + b * S + k0
        yield from twins.reduce_add(ctx, "dkv_acc", ctx.rank, (acc, n, hk * D, D), dk)
        yield from twins.reduce_add(ctx, "dkv_acc", ctx.rank, (acc, n, KC + hk * D, D), dv)

    def prep(ctx, first: int, n: int):  # tiles [first, first + n) of ``delta``
        for t in range(first, first + n):
            pair, i0 = divmod(t, qt)
            outer, h = divmod(pair, H)
            b, cq = divmod(outer, C)
            i0 *= T
            m = min(T, Sc - i0)  # the tile's rows within the chunk
            q_rect = (b * S + cq * Sc + i0, m, h * D, D)
            do = (yield from twins.tile_load(ctx, "dout", ctx.rank, q_rect)).float()
            o = (yield from twins.tile_load(ctx, "out", ctx.rank, q_rect)).float()
            lse_rect = (b * H + h, 1, cq * Sc + i0, m)
            lse = (yield from twins.tile_load(ctx, "lse", ctx.rank, lse_rect))[0]
            dlse = (yield from twins.tile_load(ctx, "dlse", ctx.rank, lse_rect))[0]
            value = torch.zeros(1, 2 * T)
            value[0, :T] = math.inf  # rows past the chunk see nothing
            value[0, :m] = packed_lse2(lse)
            value[0, T : T + m] = (do * o).sum(dim=1) - dlse
            yield from twins.tile_send(ctx, "delta", ctx.rank, (t, 1, 0, 2 * T), value)

    def rows_task(ctx, kind: int, s: int, tile: Tile):
        r0, n = tile.m0, tile.rows
        if kind == PREP:  # delta tiles [r0, r0 + n)
            yield from prep(ctx, r0, n)
            return
        # a tail part: rows [r0, r0 + n) of one b, K/V heads [n0, n0 + cols) and their q heads
        hk0, nh = tile.n0, tile.cols
        if kind == DQ:  # my dq rows of the group's q heads, once in bf16; the accumulator zeroed
            rect = (r0, n, hk0 * group * D, nh * group * D)
            dq = yield from twins.tile_load(ctx, "dq_acc", ctx.rank, rect)
            yield from twins.tile_send(ctx, "dq_acc", ctx.rank, rect, torch.zeros_like(dq))
            yield from twins.output_store(ctx, "dq", ctx.rank, rect, dq.bfloat16(), tile.index)
            return
        halves = (hk0 * D, KC + hk0 * D)  # the dK, dV columns in dK | dV rows
        if kind == HOME:  # slot s's rows (the block's sum), bf16, into its owner's dkv_home
            owner = (ctx.rank - s) % W
            for col in halves:
                rect = (s * BS + r0, n, col, nh * D)
                part = yield from twins.tile_load(ctx, "dkv_acc", ctx.rank, rect)
                yield from twins.tile_send(ctx, "dkv_acc", ctx.rank, rect, torch.zeros_like(part))
                home = (r0, n, col, nh * D)
                yield from twins.peer_store(ctx, "dkv_home", owner, home, part.bfloat16())
            return
        # FINISH: my block's gradient rows, home in dkv_home: dk, dv
        for name, col, out_id in zip(("dk", "dv"), halves, finish_ids(tile.index), strict=True):
            part = yield from twins.tile_load(ctx, "dkv_home", ctx.rank, (r0, n, col, nh * D))
            rect = (r0, n, hk0 * D, nh * D)
            yield from twins.output_store(ctx, name, ctx.rank, rect, part, out_id)

    def comm(ctx, task):
        s, kind, r0, n = task.args
        if kind < GRAD:  # rows of the K/V block of step s into slot s + 1 of rank r + 1
            src_row, nxt = (0 if s == 0 else (s - 1) * BS) + r0, (ctx.rank + 1) % W
            for name, ring in (("k", "k_ring"), ("v", "v_ring")):
                name = name if s == 0 else ring
                x = yield from twins.tile_load_async(ctx, name, ctx.rank, (src_row, n, 0, KC))
                yield from twins.tile_send_bulk(ctx, ring, nxt, (s * BS + r0, n, 0, KC), x)
            return
        # GRAD: slot s's rows added into slot s + 1 of the next holder
        rows = (s * BS + r0, n, 0, 2 * KC)
        part = yield from twins.tile_load_async(ctx, "dkv_acc", ctx.rank, rows)
        yield from twins.tile_send(ctx, "dkv_acc", ctx.rank, rows, torch.zeros_like(part))
        dst, row = (ctx.rank + 1) % W, (s + 1) * BS
        yield from twins.reduce_add_bulk(ctx, "dkv_acc", dst, (row + r0, n, 0, 2 * KC), part)

    return {"compute": compute, "comm": comm}


def packed_lse2(lse: torch.Tensor) -> torch.Tensor:
    """lse * log2 e as the backward engines read it (the prep's packed rows): +inf where lse is
    -inf (a row that saw no key: P = exp2(s - inf) = 0), NaN where it is +inf (a row with a +inf
    score: its softmax is NaN in every column, not 0 where s is finite), else lse * log2 e."""
    lse2 = torch.where(lse == math.inf, math.nan, lse * (1.0 / math.log(2.0)))
    return torch.where(lse == -math.inf, math.inf, lse2)


def grads(scores, lse, do, q, k, v, delta, scale):
    """FlashAttention's backward of one (q tile, K/V tile), fp32: (dQ [n, D], dK [kn, D], dV [kn,
    D]) from the scaled, masked ``scores`` [n, kn], the forward's ``lse`` [n] and delta [n]."""
    # NOTE: a row that saw no key at all (lse -inf) has no gradient; a NaN or +inf lse (a NaN or
    # +inf score in the forward) is not such a row: its P, and so the gradients, are NaN
    live = lse != -math.inf
    # NOTE: a +inf lse row's softmax is NaN in every column (its sum has an exp(inf - inf), and
    # torch's softmax divides by it), but exp(s - inf) would give 0 for its finite scores and a
    # finite dV: taken as NaN, as packed_lse2 and the engines' packed rows take it
    lse = torch.where(lse == math.inf, math.nan, lse)
    p = torch.where(live[:, None], torch.exp(scores - torch.where(live, lse, 0.0)[:, None]), 0.0)
    dp = do @ v.T  # [n, kn]
    ds = p * (dp - delta[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def _dk_dv_ids(space: int, tile: int) -> tuple[int, int]:
    """Output tile ids of one tile's dk and dv, in an id space apart from the dq parts' (their
    tile ids) and from the other writer of dk, dv."""
    return space | 2 * tile, space | (2 * tile + 1)


def direct_ids(tile: int) -> tuple[int, int]:
    """The output tile ids of a DIRECT compute tile's dk and dv (after those of the row tasks)."""
    return _dk_dv_ids(1 << 30, tile)


def finish_ids(tile: int) -> tuple[int, int]:
    """The output tile ids of a finish part's dk and dv (a dq part's is its tile id)."""
    return _dk_dv_ids(1 << 29, tile)


def outputs(plan: Plan, rank: int) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    """Per output buffer, the tiles the kernel end reads: the rows and columns of the dq and
    finish parts (numbered by tile id: dq, ``finish_ids``), or, where the engine stores dk and dv
    (``DIRECT`` tiles), their K/V tiles (``direct_ids``)."""
    z, C = plan.shapes, plan.extra["chunks"]
    S, D, group = z["seq"], z["head_dim"], z["heads"] // z["kv_heads"]
    got: dict[str, dict[int, tuple[int, int, int, int]]] = {"dq": {}, "dk": {}, "dv": {}}
    direct = plan.extra["direct"][rank]
    for task in plan.roles["compute"].tasks[rank]:
        tile = plan.tiles[task.args[0]]
        if not tile.rows:
            continue
        kind = fwd.unpack_tag(tile.tag)[0]
        if tile.tag & AUX and kind == DQ:
            got["dq"][tile.index] = (tile.m0, tile.rows, tile.n0 * group * D, tile.cols * group * D)
        elif tile.tag & AUX and kind == FINISH:
            rect = (tile.m0, tile.rows, tile.n0 * D, tile.cols * D)
            ids = finish_ids(tile.index)
            got["dk"][ids[0]], got["dv"][ids[1]] = rect, rect
        elif direct and tile.tag & DIRECT:
            b, hk, _, ck = unpack_key(fwd.unpack_tag(tile.tag)[0], C, z["kv_heads"])
            rect = (b * S + ck * (S // C) + tile.m0, tile.rows, hk * D, D)
            ids = direct_ids(tile.index)
            got["dk"][ids[0]], got["dv"][ids[1]] = rect, rect
    return got


# -- autograd -------------------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    """``ring_attention`` as a differentiable function: the forward saves q, k, v, out, lse; the
    backward is ``ring_attention_backward`` (with lse's gradient, if any, folded into delta)."""

    @staticmethod
    def forward(ctx, q, k, v, world, causal, scale, layout, schedule):  # type: ignore[override]
        out, lse = fwd.ring_attention(q, k, v, world, causal, scale, layout, schedule)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (world, causal, scale, layout, schedule)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.bfloat16().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq, dk, dv = run(dout, q, k, v, out, lse, *ctx.args, dlse)
        return dq, dk, dv, None, None, None, None, None


# -- the unfused reference ------------------------------------------------------------------------


def reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    world: World,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused reference: torch autograd through the forward's fp32 reference (gather the
    sequence, fp32 attention) for ``dout``; (dq, dk, dv) bf16, this rank's (emulated: every
    rank's, [W, ...]). ``out`` and ``lse`` are checked, not used (autograd recomputes them)."""
    shapes(dout, q, k, v, out, lse, world, causal, layout)
    if world.emulated_world:
        parts = q, k, v, dout
    else:
        parts = tuple(torch.stack(common.per_rank(x, world)) for x in (q, k, v, dout))
    whole = World.emulated(world.size, device=str(q.device))
    with torch.enable_grad():
        leaves = [x.detach().float().requires_grad_() for x in parts[:3]]
        # NOTE: the forward's reference takes bf16; a float leaf keeps its gradient in fp32
        got, _ = fwd.reference(*(x.bfloat16() for x in leaves), whole, causal, scale, layout)
        grads = torch.autograd.grad(got.float(), leaves, parts[3].float())
    grads = tuple(g.bfloat16() for g in grads)
    return grads if world.emulated_world else tuple(g[world.rank] for g in grads)


fwd.set_backward(RingAttention.apply)  # ring_attention's differentiable calls run it
registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
