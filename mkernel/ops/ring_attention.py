"""Ring attention, forward (issue 12): API, plan, data-movement twins and reference, side by side.
The same plan runs in the CPU interpreter and on GPUs (kernels/ring_attention.cu: the attention
engine, primitives/attention/engine.cuh, on the persistent template), emulated or distributed.

Unfused meaning, per rank r of W (q: [B, S, Hq, D], k, v: [B, S, Hkv, D], bf16; S = S_local)::

    Q, K, V = (torch.cat([x_p for p in range(W)], dim=1) in global sequence order)   # the layout
    scores = Q @ K^T * scale  (per head; q head h reads kv head h // (Hq // Hkv)), fp32
    causal: key position > query position masked
    out_r = softmax(scores) @ V at rank r's positions             # [B, S, Hq, D] bf16
    lse_r = logsumexp(scores) at rank r's positions               # [B, Hq, S] fp32

Layouts (global position of local row i on rank r): "contiguous": r * S + i. "zigzag": the sequence
in 2W chunks of S/2, rank r holds chunks r and 2W-1-r (rows [0, S/2) and [S/2, S)), so every rank
does the same causal work.

Protocol (the plan's tables; docs/ring_attention.md): the K/V blocks travel the ring. At step s
rank r holds the block of rank (r - s) mod W: its own inputs at step 0, else slot s of its
symmetric ``k_ring`` / ``v_ring`` (W - 1 slots, each filled once per call: no send ever waits for
a reader). Its comm tasks of step s (the block in ``parts`` row ranges, one per comm unit) copy
it into slot s + 1 of rank r + 1 by bulk copies, each adding 1 to ``landed[step=s+1]`` there;
before, they wait for their own ``landed[s]`` (s > 0). A compute task is one (q tile, K/V chunk
of one step) pair: it waits ``landed[s]`` (s > 0) and folds softmax(q k^T) v into the tile's fp32
state (running max, sum, unnormalised accumulator). A tile's tasks all run on one unit, in the
order ``chain_order`` gives: a tile's tasks back to back (one work item on the GPU, the state in
registers) while their blocks should have landed (the cost model's arrival estimate), else the
unit turns to another tile and the left one's state waits in the ``state`` workspace until it
resumes (program order: no signal); the tile's last task stores out (bf16) and lse (fp32) once.
Causal: a (q tile, K/V chunk) pair wholly in the future has no task, the diagonal pair (masked)
comes first, and a block nobody downstream uses is not sent (contiguous: the ring never wraps,
the last rank sends nothing).

    W = 3, contiguous, causal; Bp = the K/V block of rank p (sends in `parts` pieces)
    step:     0                            1                            2
    rank 0:   q.B0; B0 -> r1 slot 1        -                            -
    rank 1:   q.B1; B1 -> r2 slot 1        wait landed[1]: q.B0;        -
                                           B0 -> r2 slot 2
    rank 2:   q.B2                         wait landed[1]: q.B1         wait landed[2]: q.B0

Why this shape (docs/ring_attention.md): with W - 1 slots filled once per call no send waits for
a compute task, so any order of a unit's tasks is deadlock-free; walking every tile through every
step at once waits for each block right after the first tile (0.48-0.70x of the engine on one
GPU), step-major order (every step-0 task first) sends every tile's state through memory between
steps (0.74-0.83x); the chains in between measured 0.89-0.92x (emulated W = 2).
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cost import OpCost, register
from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, PerUnit, Raise, Task, Wait
from ..runtime import registry
from ..schedule import (
    TILE_CONFIGS,
    Faults,
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
from .ring_cost import overlap_rule, ring_block_lag

Q_TILE = 16  # query rows per compute task in the interpreter (Schedule.chunk_rows)
ENGINE_Q_TILE = 128  # the GPU engine's (primitives/attention/engine.cuh, BM): its only tile
# A step's block travels as at most this many comm tasks (one per comm unit): each piece's TMA
# ring moves ~10 GB/s beside the engine, so the block lands sooner the more units carry it
# (emulated W = 2 on one H200: 66 pieces land in ~105 us, 16 in ~330; docs/ring_attention.md).
MAX_PARTS = 132
LAYOUTS = ("contiguous", "zigzag")
HEAD_DIMS = (64, 128)
# The inputs (the backward declares them too).
QKV = (
    Buffer("q", "input", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
    Buffer("k", "input", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
    Buffer("v", "input", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
)
# The K/V ring (ring_tasks; the backward declares it too).
KV_RING = (
    Buffer(
        "k_ring",
        "symmetric",
        torch.bfloat16,
        ("ring_rows", "kv_cols"),
        "W - 1 K slots: the block of step s >= 1 at rows (s - 1) * B * S",
        when="ranks",
    ),
    Buffer(
        "v_ring", "symmetric", torch.bfloat16, ("ring_rows", "kv_cols"), "V slots", when="ranks"
    ),
)
# A compute task's tile (one per task; args[0] is its id), as the engine reads it
# (kernels/ring_attention.cu task_of):
#   m0    first q row within the q chunk       rows  q rows
#   n0    K/V map row: step 0, b * C + ck of   cols  rows of the K/V chunk
#         k / v; step s >= 1, ((s - 1) * B + b) * C + ck of k_ring / v_ring ([*, S / C, Hkv, D])
#   tag   diag | first << 1 | last << 2 | step << 3 | ((b * Hq + h) * C + cq) << TAG_KEY
# first / last: the task begins / ends its q tile's tasks (all on one unit, in chain_order): a
# work item that begins after the tile's first task loads its online-softmax state from the
# ``state`` workspace, one that ends before its last stores it there, the last stores out and lse.
TAG_KEY = 11  # step: 8 bits (W <= 256); the kernel reads it as spec::ring_attention::kTagKey
STEP_MASK = (1 << (TAG_KEY - 3)) - 1

LANDED = Pad("landed", ("step",), ("W",), counted=True, doc="the K/V block of step is in my slot")
SPEC = OpSpec(
    name="ring_attention",
    doc="ring attention forward: K/V blocks travel the ring, online softmax per q tile",
    buffers=(
        *QKV,
        Buffer("out", "output", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
        Buffer("lse", "output", torch.float32, ("lse_rows", "seq"), "[B * Hq, S]"),
        *KV_RING,
        Buffer(
            "state",
            "symmetric",
            torch.float32,
            ("state_rows", "state_cols"),
            "online softmax per q row between a tile's tasks: acc [D] (unnormalised), max, sum",
            when="ranks",
        ),
    ),
    pads=(LANDED,),
    scalars=("batch", "seq", "heads", "kv_heads", "head_dim", "causal", "zigzag", "scale_bits"),
    constants=(("tag_key", TAG_KEY),),
)
# Its Schedule's overlap by rule, no cost model yet (mkernel/ops/ring_cost.py says why).
register(SPEC.name, OpCost(rule=overlap_rule, note="rule"))


# -- positions and tiles --------------------------------------------------------------------------


def positions(rank: int, world_size: int, seq: int, zigzag: bool) -> torch.Tensor:
    """Global sequence positions of rank ``rank``'s ``seq`` local rows (int64 [seq])."""
    i = torch.arange(seq)
    if not zigzag:
        return rank * seq + i
    half = seq // 2
    late = (2 * world_size - 1 - rank) * half + (i - half)
    return torch.where(i < half, rank * half + i, late)


def segments(seq: int, zigzag: bool) -> list[tuple[int, int]]:
    """(row0, rows) of the layout's chunks on a rank: the whole block, or zigzag's two halves."""
    return [(0, seq // 2), (seq // 2, seq // 2)] if zigzag else [(0, seq)]


def num_chunks(zigzag: int, causal: int, world_size: int) -> int:
    """Chunks a rank's rows are cut into for the plan: zigzag's two halves when causal (each has
    its own positions), else one (without a mask positions do not matter; at W = 1 zigzag's two
    halves are the sequence in order)."""
    return 2 if zigzag and causal and world_size > 1 else 1


def chunk_id(rank: int, c: int, world_size: int, zigzag: int) -> int:
    """Global index of chunk c of rank ``rank`` in sequence order (chunks of equal size)."""
    return (rank if c == 0 else 2 * world_size - 1 - rank) if zigzag else rank


def pack_tag(key: int, step: int, diag: bool, first: bool, last: bool) -> int:
    return (key << TAG_KEY) | (step << 3) | (int(last) << 2) | (int(first) << 1) | int(diag)


def unpack_tag(tag: int) -> tuple[int, int, bool, bool, bool]:
    """(key, step, diag, first, last) of a compute tile's tag."""
    return tag >> TAG_KEY, (tag >> 3) & STEP_MASK, bool(tag & 1), bool(tag & 2), bool(tag & 4)


# -- the plan -------------------------------------------------------------------------------------


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
    """The op's plan: ``ring_tasks`` (the module docstring's protocol) on this op's SPEC."""
    scalars = dict(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    scalars |= dict(causal=causal, zigzag=zigzag, scale_bits=scale_bits)
    p = ring_tasks(SPEC, schedule, world, **scalars)
    tile = TILE_CONFIGS["64x128x64"]  # unused: the attention engine has one tile shape
    args = (p.shapes, p.sizes, p.tiles, p.compute, p.comm, p.extra)
    return build_plan(SPEC, p.schedule, world, tile, *args)


@dataclass
class RingTasks:
    """The ring's plan before ``build_plan`` (``ring_tasks``): per rank its compute tasks unit by
    unit and its comm tasks in execution order, the tiles, the op's shapes and sizes, the resolved
    schedule, and for an op that adds to it (the backward) ``readers[r][s]``, rank r's compute
    tasks of step s."""

    schedule: Schedule
    compute: PerUnit
    comm: list[list[Task]]
    tiles: list[Tile]
    shapes: dict[str, int]
    sizes: dict[str, int]
    extra: dict[str, Any]
    readers: list[list[int]]


def row_parts(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` rows cut into ``k`` consecutive parts of near-equal size: (first row, rows) each (the
    K/V sends' parts here; the backward's row tasks and grad sends)."""
    bounds = [p * n // k for p in range(k + 1)]
    return [(bounds[p], bounds[p + 1] - bounds[p]) for p in range(k)]


def chain_order(chains: list[list[tuple[int, int, int]]], lag: float) -> list[int]:
    """One compute unit's task order. ``chains``: its q tiles in the order they were given to it,
    each tile's tasks as (id, step, cost) in the tile's order (the diagonal first, then by step);
    block s is taken to land at s * ``lag`` (costs and lag in key rows, ``block_lag``).

    The unit runs a tile's tasks back to back (one work item on the GPU: the tile's state stays
    in registers) while their blocks have landed by its clock; a tile whose next block has not
    yet landed is left (its state goes to the workspace) and resumed later. Next comes the first
    tile, in order, whose next block has landed and whose remaining tasks would then all run
    without another turn (a tile that needs only the own block, while the others' travel), else
    the first whose next block has landed, else the one whose block lands first (a stall).
    Step-major order is lag = infinity's first pass; chains back to back is lag = 0.

        lag = 1.5 steps; tiles A, B, C of two steps:  A0 | B0 B1 | A1 | C0 C1  (| a new item)"""
    pos = [0] * len(chains)
    live = [i for i, c in enumerate(chains) if c]
    landed = lambda step: 0.0 if step == 0 else step * lag  # noqa: E731

    def runs_out(i: int, clock: float) -> bool:  # tile i's remaining tasks, with no turn
        for _, step, cost in chains[i][pos[i] :]:
            if landed(step) > clock:
                return False
            clock += cost
        return True

    def pick(clock: float) -> int:  # the rule above, scanning the live tiles in order once
        first_ready = None
        for i in live:
            if landed(chains[i][pos[i]][1]) <= clock:
                if runs_out(i, clock):
                    return i
                first_ready = i if first_ready is None else first_ready
        if first_ready is not None:
            return first_ready
        return min(live, key=lambda i: landed(chains[i][pos[i]][1]))

    clock, order = 0.0, []
    while live:
        i = pick(clock)
        clock = max(clock, landed(chains[i][pos[i]][1]))
        while pos[i] < len(chains[i]) and landed(chains[i][pos[i]][1]) <= clock:
            task, _, cost = chains[i][pos[i]]
            order.append(task)
            clock += cost
            pos[i] += 1
        if pos[i] == len(chains[i]):
            live.remove(i)
    return order


def block_lag(
    world: World, block_bytes: int, parts: int, q_rows: int, head_dim: int, seq: int
) -> float:
    """``chain_order``'s lag for this world: on a GPU the cost model's estimate
    (ring_cost.ring_block_lag); in the CPU interpreter one and a half steps of a q tile (``seq`` key
    rows a step), so its runs see tiles both chained and left for later."""
    if not world.on_gpu:
        return 1.5 * seq
    emulated = world.emulated_world
    return ring_block_lag(block_bytes, parts, q_rows, head_dim, emulated)


def ring_sends(readers: list[list[int]]) -> list[list[int]]:
    """The steps s < W - 1 at which rank r sends on the K/V block it holds, from ``readers[r][s]``
    (rank r's compute tasks on the block of step s): a block goes on only while a rank downstream
    still reads it (causal rings leave blocks wholly in the future unsent)."""
    W = len(readers)
    # needed[r][s]: rank r holds the block of step s for itself or a rank downstream of it
    needed = [[False] * W for _ in range(W)]
    for s in reversed(range(W)):
        for r in range(W):
            later = s + 1 < W and needed[(r + 1) % W][s + 1]
            needed[r][s] = readers[r][s] > 0 or later
    return [[s for s in range(W - 1) if needed[(r + 1) % W][s + 1]] for r in range(W)]


def ring_tasks(
    spec: OpSpec,
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
) -> RingTasks:
    """The forward's plan shape for ``spec`` (this op's, or one built on it): the K/V ring (W - 1
    slots, ``landed`` counted, ``parts`` comm tasks per step) and one compute task per (q tile,
    K/V chunk of one step), a q tile's tasks on one unit, each unit's rows in chain_order.
    ``shapes`` and the scalar sizes hold ``spec.scalars``."""
    W, S, D, B, H = world.size, seq, head_dim, batch, heads
    if W > 256 or B * H * 2 >= 1 << (31 - TAG_KEY):
        raise ValueError(
            f"ring attention plans up to W = 256 and B * Hq < {1 << (30 - TAG_KEY)} (a task's "
            f"tag), got W = {W}, B * Hq = {B * H}"
        )
    if not is_resolved(schedule):  # a direct call (the API resolves first): as build_plan would
        schedule, _ = resolve(schedule, spec.name, world, {})
    C = num_chunks(zigzag, causal, W)
    Sc = S // C
    tq = schedule.chunk_rows or (ENGINE_Q_TILE if world.on_gpu else Q_TILE)
    units, comm_units = split_units(schedule, world, 1 << 30)  # every unit (some may idle)
    parts = max(1, min(MAX_PARTS, comm_units, B * S))
    lag = block_lag(world, B * S * kv_heads * D * 4, parts, tq, D, Sc)

    tiles: list[Tile] = []
    # per rank, per q tile: (cost, its chain: (tile id, step, cost) per task, in order)
    qtiles: list[list[tuple[int, list[tuple[int, int, int]]]]] = []
    readers = [[0] * W for _ in range(W)]
    out_tiles: list[tuple[int, int, int, int]] = []  # per q tile of rank 0: (b, h, row0, rows)
    for r in range(W):
        mine = []
        for b in range(B):
            for h in range(H):
                for cq in range(C):
                    gq = chunk_id(r, cq, W, zigzag)
                    for m0 in range(0, Sc, tq):
                        n = min(tq, Sc - m0)
                        pairs = []  # (step, kv chunk, diag), the diagonal first
                        for s in range(W):
                            for ck in range(C):
                                gk = chunk_id((r - s) % W, ck, W, zigzag)
                                if not causal or gk < gq:
                                    pairs.append((s, ck, False))
                                elif gk == gq:
                                    pairs.insert(0, (s, ck, True))
                        chain = []  # (tile id, step, cost in key rows)
                        for i, (s, ck, diag) in enumerate(pairs):
                            outer = b * C + ck if s == 0 else ((s - 1) * B + b) * C + ck
                            key = (b * H + h) * C + cq
                            tag = pack_tag(key, s, diag, i == 0, i == len(pairs) - 1)
                            chain.append((len(tiles), s, min(Sc, m0 + n) if diag else Sc))
                            tiles.append(Tile(len(tiles), m0, outer, n, Sc, tag))
                            readers[r][s] += 1
                        mine.append((sum(c for *_, c in chain), chain))
                        if r == 0:
                            out_tiles.append((b, h, cq * Sc + m0, n))
        qtiles.append(mine)
    sends = ring_sends(readers)

    def landed(r: int, s: int) -> tuple[Wait, ...]:
        if s == 0:
            return ()
        n = readers[r][s] + (parts if s in sends[r] else 0)
        return (Wait("landed", r, (s,), value=parts, consumers=n),)

    compute, comm = [], []
    for r in range(W):
        nxt = (r + 1) % W
        # Comm task (s, part, row0, rows): those rows of the block held at step s (of B * S).
        arrive = lambda s, nxt=nxt: (Raise("landed", nxt, (s + 1,), op="add"),)  # noqa: E731
        comm.append(
            [
                Task(s * parts + p, (s, p, r0, n), landed(r, s), arrive(s))
                for s in sends[r]
                for p, (r0, n) in enumerate(row_parts(B * S, parts))
            ]
        )
        # q tiles to units, longest first onto the least loaded unit, so a q tile's tasks are
        # all on the unit that keeps its state between them; each unit's order is chain_order's
        # (a tile's steps back to back once their blocks should have landed), its own list.
        chains = least_loaded(((chain, cost) for cost, chain in qtiles[r]), units)
        step_of = lambda t: unpack_tag(tiles[t].tag)[1]  # noqa: E731
        compute.append(
            [[Task(t, (t,), landed(r, step_of(t))) for t in chain_order(c, lag)] for c in chains]
        )

    scalars = dict(batch=B, seq=S, heads=H, kv_heads=kv_heads, head_dim=D, causal=causal) | {
        "zigzag": zigzag,
        "scale_bits": scale_bits,
    }
    shapes = {k: scalars[k] for k in spec.scalars}
    sizes = {
        "rows": B * S,
        "q_cols": H * D,
        "kv_cols": kv_heads * D,
        "lse_rows": B * H,
        "seq": S,
        "ring_rows": max(1, W - 1) * B * S,
        "state_rows": B * H * S,
        "state_cols": D + 2,
    } | shapes
    extra = {"chunks": C, "q_tile": tq, "parts": parts, "sends": sends, "out_tiles": out_tiles}
    extra["lag"] = lag
    return RingTasks(schedule, PerUnit(compute), comm, tiles, shapes, sizes, extra, readers)


# -- input checks and the API ---------------------------------------------------------------------


def shapes(
    q: Any, k: Any, v: Any, world: World, causal: Any = False, layout: Any = "contiguous"
) -> dict[str, int]:
    """The operand checks (TypeError / ValueError naming the argument); the plan's sizes."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    B, S, Hq, D = common.check_operand("q", q, world, 4, "[B, S_local, Hq, D]")
    kv = common.check_operand("k", k, world, 4, "[B, S_local, Hkv, D]")
    if common.check_operand("v", v, world, 4, "[B, S_local, Hkv, D]") != kv:
        raise ValueError(f"v has shape {list(v.shape)}, k {list(k.shape)}: they must agree")
    if kv[:2] != (B, S) or kv[3] != D:
        raise ValueError(
            f"k is [B, S_local, Hkv, D] = {list(kv)} but q is {[B, S, Hq, D]}: B, S_local, D differ"
        )
    if D not in HEAD_DIMS:
        raise ValueError(f"D (last dim of q, k, v) = {D} must be one of {HEAD_DIMS}")
    common.check_divides("B (batch of q)", B, 1, "at least one sequence")
    common.check_divides("S_local (dim 1 of q)", S, 2 if layout == "zigzag" else 1, layout)
    Hkv = kv[2]
    common.check_divides("Hkv (heads of k, v)", Hkv, 1, "at least one head")
    if Hq % Hkv:
        raise ValueError(f"Hq (heads of q) = {Hq} must be a multiple of Hkv (heads of k) = {Hkv}")
    return dict(batch=B, seq=S, heads=Hq, kv_heads=Hkv, head_dim=D, causal=int(causal)) | {
        "zigzag": int(layout == "zigzag"),
        "scale_bits": scale_bits(1.0 / math.sqrt(D)),  # the default scale's (a call sets its own)
    }


def check_scale(scale: Any, head_dim: int) -> float:
    """The softmax scale: 1 / sqrt(D) by default, else a positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive number or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: World,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    schedule: Schedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention (forward) over the sequence shards of ``world``'s ranks.

    Unfused equivalent (``reference``): gather the sequence, place each rank's rows at its global
    positions (``layout``), fp32 softmax attention (causal: key position <= query position),
    slice this rank's rows::

        out[r], lse[r] = attention(Q_global, K_global, V_global)[rows of rank r]

    Args:
        q: bf16, per rank [B, S_local, Hq, D] (emulated world: [W, B, S_local, Hq, D]).
        k, v: bf16, per rank [B, S_local, Hkv, D]; Hq a multiple of Hkv (GQA / MQA); D 64 or 128.
        world: the World whose ranks hold the sequence shards.
        causal: mask keys later in the sequence than the query.
        scale: softmax scale (default 1 / sqrt(D)), a positive number.
        layout: "contiguous" (rank r holds positions [r * S_local, (r + 1) * S_local)) or
            "zigzag" (2W chunks; rank r holds chunks r and 2W-1-r; S_local even).
        schedule: a Schedule (units, interleaving seed, faults).

    Returns:
        (out, lse): out bf16 per rank [B, S_local, Hq, D]; lse fp32 per rank [B, Hq, S_local],
        the natural log of each row's softmax denominator (scaled scores). Raises TypeError /
        ValueError naming the argument before anything runs; CommTimeout if a wait passes the
        world's deadline (asynchronous on GPUs: raised by the next call or ``world.check()``).
        On GPUs, emulated or distributed, one launch of the fused kernel (kernels/ring_attention.cu:
        the attention engine on the persistent template, K/V blocks pushed along the ring); with
        one rank and a schedule that sets nothing but the seed, the engine's own launch
        (``solo_engine``: no block travels).
        Differentiable: when q, k or v require grad, ``out.backward(g)`` runs
        ``ring_attention_backward`` (mkernel/ops/ring_attention_backward.py; lse's gradient too).
    """
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)
    ):  # differentiable: the backward op's autograd Function calls back here without grad
        return _differentiable(q, k, v, world, causal, scale, layout, schedule)
    inputs = {"q": q, "k": k, "v": v}
    options = dict(causal=causal, scale=scale, layout=layout)
    return common.run_op(OP, inputs, world, schedule, **options)


# -- the run path's hooks (mkernel/runtime/run.py OpDef) ---------------------------------------


def _check(call: common.Call) -> None:
    """The scale (default 1/sqrt(D); its fp32 bits key the plan) and the GPU engine's q tile."""
    call.options["scale"] = scale = check_scale(call.options["scale"], call.sizes["head_dim"])
    if call.world.on_gpu and call.schedule.chunk_rows not in (None, ENGINE_Q_TILE):
        raise ValueError(
            f"Schedule.chunk_rows={call.schedule.chunk_rows}: the GPU attention engine's q tile "
            f"is {ENGINE_Q_TILE} rows (leave it None)"
        )
    call.sizes["scale_bits"] = scale_bits(scale)


def _solo(call: common.Call) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One rank on a GPU with nothing to observe or inject: the engine's own launch."""
    world = call.world
    if not solo_engine(world, call.schedule):
        return None
    views = (solo(t, world) for t in call.inputs.values())
    res = engine_attention(*views, call.options["causal"], call.options["scale"])
    return tuple(t[None] for t in res) if world.emulated_world else res


def _results(call: common.Call) -> dict[str, torch.Tensor]:
    """out and lse, poisoned where result_buffer poisons: a tile the plan forgets shows (and the
    kernel end reports it unwritten)."""
    z, q = call.sizes, call.inputs["q"]
    lead = (call.world.size,) if call.world.emulated_world else ()
    B, S, H, D = z["batch"], z["seq"], z["heads"], z["head_dim"]
    return {
        "out": common.result_buffer((*lead, B, S, H, D), torch.bfloat16, q.device),
        "lse": common.result_buffer((*lead, B, H, S), torch.float32, q.device),
    }


OP = common.OpDef(
    spec=SPEC,
    make_plan=make_plan,
    shapes=shapes,
    shape_args=("causal", "layout"),
    check=_check,
    solo=_solo,
    results=_results,
    views=lambda c: operands(c.plan, *c.inputs.values(), c.results["out"], c.results["lse"]),
    twins=lambda c: twins_of(c.plan, c.options["scale"]),
    outputs=lambda plan, rank: outputs(plan, rank),
    finish=lambda c: (c.results["out"], c.results["lse"]),
)


def scale_bits(scale: float) -> int:
    """The fp32 bits of ``scale`` as an int32 (the launch record's scalars are ints)."""
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def operands(plan: Plan, q, k, v, out, lse) -> dict[str, torch.Tensor]:
    """The caller's tensors as the interpreter's 2-D per-rank views [W, rows, cols] (rows = batch x
    sequence, columns = heads x head dim; lse: batch x heads rows), as the engine addresses them."""
    W, z = plan.world_size, plan.sizes
    return {
        "q": q.view(W, z["rows"], z["q_cols"]),
        "k": k.view(W, z["rows"], z["kv_cols"]),
        "v": v.view(W, z["rows"], z["kv_cols"]),
        "out": out.view(W, z["rows"], z["q_cols"]),
        "lse": lse.view(W, z["lse_rows"], z["seq"]),
    }


@functools.cache
def _solo_world() -> World:
    return World.emulated(1)


@functools.cache
def _solo_gpu_world(device: torch.device) -> World:
    return World.emulated(1, device=device)


def _no_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError(
        "ring_attention's backward is not registered (mkernel.ops.ring_attention_backward)"
    )


# The differentiable call: ring_attention_backward.py, which imports this module, sets it at its
# import to its autograd Function's apply (importing mkernel imports both): the backward op
# declares itself the forward's gradient, so this module need not import it.
_differentiable: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _no_backward


def set_backward(apply: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Called once by mkernel/ops/ring_attention_backward.py: ``apply(q, k, v, world, causal,
    scale, layout, schedule)`` is what a call whose q, k or v requires grad runs."""
    global _differentiable
    _differentiable = apply


def engine_attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of one rank on the GPU (checked operands [B, S, H, D]): one engine call,
    what a world of one runs (solo_engine)."""
    # NOTE: imported on first use (no cycle): `import mkernel` then imports no build machinery,
    # so `python -m mkernel.jit` / `mkernel.codegen` run as scripts without runpy's warning
    from .. import attention_ext

    return attention_ext.attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), causal, scale
    )


def solo_engine(world: World, schedule: Schedule) -> bool:
    """Whether a call runs on the attention engines alone: one rank on a GPU, so no K/V block
    travels, and a schedule with nothing to observe or inject. The fused kernel read 0.86-0.90x
    of the engine's own launch there (forward; backward 0.81-0.84x, docs/ring_attention.md). A
    schedule that traces, injects faults or sets the SMs or the overlap keeps the fused kernel.
    A timeout an earlier call left on the world is raised first, as every launch does."""
    if not (world.on_gpu and world.size == 1):
        return False
    if schedule.trace or schedule.faults != Faults() or schedule.sms is not None:
        return False
    if schedule.overlap is not None or schedule.comm_sms is not None:
        return False
    common.raise_pending(world)
    return True


def solo(t: torch.Tensor, world: World) -> torch.Tensor:
    """The one rank's [B, S, H, D] of a checked operand (an emulated world's without its rank
    dimension)."""
    return t[0] if world.emulated_world else t


PLAIN_FORMS = {"q": "[B, S, Hq, D]", "k": "[B, S, Hkv, D]", "v": "[B, S, Hkv, D]"}


def check_plain(q: Any, k: Any, v: Any) -> None:
    """``attention``'s operands as passed: tensors of 4 dims, contiguous, v shaped as k
    (TypeError / ValueError naming the argument, its shape as given and the form expected). The
    checks after run on them lifted into a 1-rank world, [1, B, S, H, D], and would report that
    shape (issue 33)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        form = PLAIN_FORMS[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}"
            )
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape {form} (4 dims), got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), shape {form}")
    if v.shape != k.shape:  # shapes() would report them lifted too
        raise ValueError(f"v has shape {list(v.shape)}, k {list(k.shape)}: they must agree")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention: ``ring_attention`` on one rank, without a world. q [B, S, Hq, D], k, v
    [B, S, Hkv, D], bf16; returns (out [B, S, Hq, D] bf16, lse [B, Hq, S] fp32). CUDA tensors
    run on the attention engine (one launch; docs/ring_attention.md has its speed), CPU tensors
    in the interpreter (a 1-rank emulated world). Differentiable when q, k or v require grad
    (on CUDA the backward engine runs: one launch)."""
    check_plain(q, k, v)
    lift = lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t  # noqa: E731
    if isinstance(q, torch.Tensor) and q.is_cuda:
        world = _solo_gpu_world(q.device)
        if torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)
        ):  # differentiable: through ring_attention's autograd Function, one rank
            out, lse = ring_attention(lift(q), lift(k), lift(v), world, causal, scale)
            return out[0], lse[0]
        s = shapes(lift(q), lift(k), lift(v), world, causal)
        scale = check_scale(scale, s["head_dim"])
        return engine_attention(q, k, v, causal, scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise ValueError(
                f"attention: {name} is on {t.device}; CUDA tensors run on the attention engine, "
                "CPU tensors in the interpreter"
            )
    out, lse = ring_attention(lift(q), lift(k), lift(v), _solo_world(), causal, scale)
    return out[0], lse[0]


# -- CPU interpreter: the data-movement twins (the engine's and the comm role's) -------------------


@dataclass(frozen=True)
class TaskView:
    """A compute task's tile decoded for a twin (the forward's and the backward's): its q tile
    (batch, head, kv head, first local row, rows, index of its out / dq tile), its step, where
    its K/V chunk is (buffers, rect of the rank's rows), and its place in the tile's tasks."""

    key: int
    m0: int
    step: int
    first: bool
    last: bool
    b: int
    h: int
    hk: int
    q0: int
    rows: int
    out_tile: int
    k_buf: str
    v_buf: str
    kv_rect: tuple[int, int, int, int]
    k0: int  # first row of the K/V chunk within its block


def task_view(plan: Plan, tile: Tile) -> TaskView:
    z = plan.shapes
    S, D, H, B = z["seq"], z["head_dim"], z["heads"], z["batch"]
    C, tq = plan.extra["chunks"], plan.extra["q_tile"]
    Sc = S // C
    key, s, _, first, last = unpack_tag(tile.tag)
    bh, cq = divmod(key, C)
    b, h = divmod(bh, H)
    hk, k0 = h // (H // z["kv_heads"]), (tile.n0 % C) * Sc
    k_buf, v_buf, base = ("k", "v", 0) if s == 0 else ("k_ring", "v_ring", (s - 1) * B * S)
    out_tile = key * -(-Sc // tq) + tile.m0 // tq  # outputs()'s order: (b, h, chunk, q tile)
    kv_rect = (base + b * S + k0, Sc, hk * D, D)
    q0 = cq * Sc + tile.m0
    return TaskView(key, tile.m0, s, first, last, b, h, hk, q0, tile.rows, out_tile, k_buf, v_buf,
                    kv_rect, k0)  # fmt: skip


def keep_on_unit(owner: dict, ctx, task, v: TaskView) -> None:
    """The q tile's first task claims it for its unit; a later one must run on that unit, which
    holds the tile's state (the engine's threads reload what they stored)."""
    mine = (ctx.call, ctx.rank, v.key, v.m0)
    if v.first:
        owner[mine] = ctx.agent.unit
    elif owner.get(mine) != ctx.agent.unit:
        raise AssertionError(
            f"rank {ctx.rank} unit {ctx.agent.unit}: task {task.id} continues a q tile that unit "
            f"{owner.get(mine)} began (a plan keeps a q tile on one unit)"
        )


def mask_future(scores: torch.Tensor, pos: list[torch.Tensor], rank: int, v: TaskView):
    """Causal: -inf where the key's global position lies after the query's."""
    W = len(pos)
    keys = pos[(rank - v.step) % W][v.k0 : v.k0 + scores.shape[1]]
    future = keys[None, :] > pos[rank][v.q0 : v.q0 + v.rows, None]
    return scores.masked_fill(future, -math.inf)


def twins_of(plan: Plan, scale: float | None = None):
    z, W = plan.shapes, plan.world_size
    S, D, H, Hkv, B = z["seq"], z["head_dim"], z["heads"], z["kv_heads"], z["batch"]
    BS, T = B * S, len(plan.extra["out_tiles"])
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = [positions(r, W, S, bool(z["zigzag"])) for r in range(W)]
    owner: dict[tuple[int, int, int, int], int] = {}  # (call, rank, key, m0) -> its unit

    def compute(ctx, task):  # the engine: fold one K/V chunk into the q tile's state
        tile = plan.tiles[task.args[0]]
        v = task_view(plan, tile)
        n, q_rect = v.rows, (v.b * S + v.q0, v.rows, v.h * D, D)
        qv = yield from twins.tile_load_async(ctx, "q", ctx.rank, q_rect)
        kt = yield from twins.tile_load_async(ctx, v.k_buf, ctx.rank, v.kv_rect)
        vt = yield from twins.tile_load_async(ctx, v.v_buf, ctx.rank, v.kv_rect)
        st_rect = ((v.b * H + v.h) * S + v.q0, n, 0, D + 2)
        keep_on_unit(owner, ctx, task, v)
        if v.first:
            state = torch.zeros(n, D + 2)
            state[:, D] = -math.inf
        else:
            state = yield from twins.tile_load(ctx, "state", ctx.rank, st_rect)
        scores = (qv.float() @ kt.float().T) * scale  # [n, Sc]
        if z["causal"]:
            scores = mask_future(scores, pos, ctx.rank, v)
        state = merge(state, scores, vt.float())
        if not v.last:
            yield from twins.tile_send(ctx, "state", ctx.rank, st_rect, state)
            return
        out, lse = finish(state)
        t = v.out_tile
        yield from twins.output_store(ctx, "out", ctx.rank, q_rect, out, t)
        lse_rect = (v.b * H + v.h, 1, v.q0, n)
        yield from twins.output_store(ctx, "lse", ctx.rank, lse_rect, lse[None], T + t)

    def comm(ctx, task):  # rows [r0, r0 + n) of the block of step s into slot s + 1 of rank r + 1
        s, _, r0, n = task.args
        base = 0 if s == 0 else (s - 1) * BS
        nxt, cols = (ctx.rank + 1) % W, Hkv * D
        for src, ring in (("k", "k_ring"), ("v", "v_ring")):
            src = src if s == 0 else ring
            x = yield from twins.tile_load_async(ctx, src, ctx.rank, (base + r0, n, 0, cols))
            yield from twins.tile_send_bulk(ctx, ring, nxt, (s * BS + r0, n, 0, cols), x)

    return {"compute": compute, "comm": comm}


def merge(state: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Online softmax, fp32: fold one K/V tile's ``scores`` [n, kn] (-inf: masked) and values
    [kn, D] into ``state`` [n, D + 2] = (acc, m, den): running max m, denominator den (both of
    scaled scores) and the unnormalised output. A row that sees no key of the tile keeps its
    state. NaN and +inf propagate as in softmax: a NaN score makes m NaN (torch.maximum keeps
    NaN), a +inf one makes m +inf, and either makes den NaN (exp(inf - inf))."""
    D = v.shape[1]
    acc, m, den = state[:, :D], state[:, D], state[:, D + 1]
    m_new = torch.maximum(m, scores.amax(dim=1))
    # NOTE: only a row with no key so far (m_new = -inf) shifts by 0, so that exp(-inf - 0) = 0
    # rather than NaN; a NaN or +inf max must not be taken for one (issue 33: isinf(m_new) here
    # also caught +inf, and finish() read the NaN den as "no key", out 0 and lse -inf)
    shift = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - shift[:, None])
    alpha = torch.exp(m - shift)
    out = torch.empty_like(state)
    out[:, :D] = alpha[:, None] * acc + p @ v
    out[:, D] = m_new
    out[:, D + 1] = alpha * den + p.sum(dim=1)
    return out


def finish(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16 [n, D], lse fp32 [n]) of a final state; a row with no key: 0 and -inf. A row
    with a NaN score: NaN and NaN; with a +inf one (and no NaN): NaN and +inf, as
    torch.softmax and torch.logsumexp give (the GPU engine's OnlineSoftmax::finish likewise)."""
    D = state.shape[1] - 2
    acc, m, den = state[:, :D], state[:, D], state[:, D + 1]
    # NOTE: den == 0, not "not den > 0": a NaN den (a NaN or +inf score) is not an empty row
    empty = den == 0
    den = torch.where(empty, 1.0, den)
    out = torch.where(empty[:, None], 0.0, acc / den[:, None])
    lse = torch.where(m == math.inf, math.inf, m + torch.log(den))  # log(NaN den) would hide +inf
    lse = torch.where(empty, -math.inf, lse)
    return out.bfloat16(), lse


def outputs(plan: Plan, rank: int) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    """Per output buffer, the tiles the kernel end reads on every rank: out tile t (q rows x one
    head) and lse tile T + t (that head's row of lse), for each q tile t."""
    S, D, H = plan.shapes["seq"], plan.shapes["head_dim"], plan.shapes["heads"]
    qtiles = plan.extra["out_tiles"]
    T = len(qtiles)
    return {
        "out": {t: (b * S + r0, n, h * D, D) for t, (b, h, r0, n) in enumerate(qtiles)},
        "lse": {T + t: (b * H + h, 1, r0, n) for t, (b, h, r0, n) in enumerate(qtiles)},
    }


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: World,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused reference: gather the sequence at the layout's global positions, fp32 softmax
    attention, this rank's rows (emulated: every rank's, [W, ...]). (out bf16, lse fp32)."""
    s = shapes(q, k, v, world, causal, layout)
    scale = check_scale(scale, s["head_dim"])
    W, S, H, Hkv = world.size, s["seq"], s["heads"], s["kv_heads"]
    pos = torch.cat([positions(r, W, S, layout == "zigzag") for r in range(W)])
    order = torch.argsort(pos)  # global position -> row of the rank-major concatenation
    gather = lambda x: torch.cat(common.per_rank(x, world), dim=1)[:, order].float()  # noqa: E731
    Q, K, V = gather(q), gather(k), gather(v)  # [B, W * S, heads, D] in sequence order
    K = K.repeat_interleave(H // Hkv, dim=2)
    V = V.repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", Q, K) * scale
    if causal:
        n = W * S
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, W * S]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), V)
    rows = [pos[r * S : (r + 1) * S] for r in range(W)]  # each rank's global positions
    outs = [out[:, p].bfloat16() for p in rows]
    lses = [lse[:, :, p].contiguous() for p in rows]
    if world.emulated_world:
        return torch.stack(outs), torch.stack(lses)
    return outs[world.rank], lses[world.rank]


registry.register(sys.modules[__name__])  # the op joins the registry (mkernel/runtime/registry.py)
