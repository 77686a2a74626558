"""Ring attention, forward (issue 12): API, plan, data-movement twins and reference, side by side.
Fused in the CPU interpreter only for now (``SPEC.device`` is False: no fused kernel, no
kernels/ring_attention.cu); the plan below is what the GPU kernel will execute when the attention
engine (primitives/attention/engine.cuh) plugs into the template. In an emulated world on a GPU
it runs unfused (ring_attention_gpu.py: the engine per block, log-sum-exp merge in fp32).

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
rank r holds the block of rank (r - s) mod W: its own inputs at step 0, else slot s % 2 of its
symmetric ``k_ring`` / ``v_ring``. Its comm task of step s forwards that block to slot (s+1) % 2 of
rank r+1 by bulk copies and raises ``landed[step=s+1]`` there; before it, it waits for its own
``landed[s]`` (s > 0) and for ``free[prev]`` on itself: every reader on r+1 of the block that slot
held last (step prev = s-1: r+1's compute tasks and its own forward) has finished. Compute task
(q tile t, step s, K/V tile j) waits ``landed[s]`` (s > 0) and ``merged[t, s, j]`` (the tile's
previous task stored its online-softmax state), folds softmax(q_t k_j^T) v_j into the fp32 state
(running max, denominator, accumulator) and, at the tile's last task, stores out (bf16) and lse
(fp32) once. K/V tiles are the layout's chunks (a block, or zigzag's two halves). Causal: a (q
tile, K/V tile) pair wholly in the future has no task, and a block nobody downstream uses is not
sent (contiguous: the ring never wraps, the last rank sends nothing).

    W = 3, contiguous, causal; Bp = the K/V block of rank p; q_r = rank r's q tiles
    step:     0                           1                              2
    rank 0:   q0.B0; send B0 -> r1 slot1  -                              -
    rank 1:   q1.B1; send B1 -> r2 slot1  wait landed[1]: q1.B0;         -
                                          send B0 -> r2 slot0
    rank 2:   q2.B2                       wait landed[1]: q2.B1          wait landed[2]: q2.B0
    (no send waits for free here: with W >= 4, rank r's send of step 2 refills r+1's slot 1 after
     r+1's readers of step 1 have raised free[1] on r)

GPU mapping (the fused kernel, not built): a CTA owns a q tile for all its steps (state in
registers, the ``merged`` chain is then program order), its producer warp TMA-loads each block from
the slot the plan's wait names while the wgmma consumer warpgroups work on the previous one; the
comm role's bulk copies are cp.async.bulk global -> shared -> peer global, as ``tile_send_bulk``
models here.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch

from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..schedule import TILE_CONFIGS, Plan, Schedule, Tile, build_plan
from ..world import World
from . import common, ring_attention_gpu

Q_TILE = 16  # default query rows per compute task (Schedule.chunk_rows; a GPU engine's: 64, 128)
LAYOUTS = ("contiguous", "zigzag")
HEAD_DIMS = (64, 128)
# Declarations the backward (ring_attention_backward.py) shares: the inputs, the K/V ring's two
# slots per rank and its landed / free signals.
QKV = (
    Buffer("q", "input", torch.bfloat16, ("rows", "q_cols"), "[B * S, Hq * D]"),
    Buffer("k", "input", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
    Buffer("v", "input", torch.bfloat16, ("rows", "kv_cols"), "[B * S, Hkv * D]"),
)
KV_RING = (
    Buffer("k_ring", "symmetric", torch.bfloat16, ("ring_rows", "kv_cols"), "2 K slots"),
    Buffer("v_ring", "symmetric", torch.bfloat16, ("ring_rows", "kv_cols"), "2 V slots"),
)
RING_PADS = (
    Pad("landed", ("step",), ("W",), counted=True, doc="the K/V block of step is in my slot"),
    Pad("free", ("step",), ("W",), doc="my successor's readers of its step's slot are done"),
)
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
            "online softmax per q row: acc [D], max, denominator (the engine: registers)",
        ),
    ),
    pads=(
        *RING_PADS,
        Pad(
            "merged",
            ("qtile", "step", "kv"),
            ("qtiles", "W", "kv_tiles"),
            doc="the q tile's state is ready for K/V tile kv of step's block",
        ),
    ),
    scalars=("batch", "seq", "heads", "kv_heads", "head_dim", "causal", "zigzag"),
    device=False,
)


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
    """(row0, rows) of the layout's chunks on a rank: the whole block, or zigzag's two halves.
    They are also the K/V tiles of a block: a zigzag block's half that lies wholly in a q tile's
    future is skipped on its own, which is what keeps zigzag's causal work equal across ranks."""
    return [(0, seq // 2), (seq // 2, seq // 2)] if zigzag else [(0, seq)]


def row_tiles(seq: int, zigzag: bool, tile: int = Q_TILE) -> list[tuple[int, int]]:
    """(row0, rows) of each q tile of one (batch, head): ``tile`` rows, never across a zigzag
    chunk boundary (so causal skipping sees each chunk's own positions)."""
    chunks = segments(seq, zigzag)
    return [(a + i, min(tile, n - i)) for a, n in chunks for i in range(0, n, tile)]


def _qtiles(s: dict[str, int], tile: int) -> list[tuple[int, int, int, int]]:
    """(b, h, row0, rows) per q tile id."""
    rows = row_tiles(s["seq"], bool(s["zigzag"]), tile)
    return [(b, h, r0, n) for b in range(s["batch"]) for h in range(s["heads"]) for r0, n in rows]


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
) -> Plan:
    W, S, D = world.size, seq, head_dim
    shapes = dict(
        batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=D, causal=causal
    ) | {"zigzag": zigzag}
    qtiles = _qtiles(shapes, schedule.chunk_rows or Q_TILE)
    pos = [positions(r, W, S, bool(zigzag)) for r in range(W)]

    kv_tiles = segments(S, bool(zigzag))

    def used(r: int, s: int, j: int, row0: int, n: int) -> bool:
        """Do q rows [row0, row0 + n) of rank r see a key of K/V tile j of its step-s block?"""
        k0, kn = kv_tiles[j]
        keys = pos[(r - s) % W][k0 : k0 + kn]
        return not causal or int(keys.min()) <= int(pos[r][row0 : row0 + n].max())

    # steps[r][t]: the (step, kv tile) pairs q tile t of rank r computes, in order
    pairs = [(s, j) for s in range(W) for j in range(len(kv_tiles))]
    steps = [
        [[(s, j) for s, j in pairs if used(r, s, j, r0, n)] for (_, _, r0, n) in qtiles]
        for r in range(W)
    ]
    readers = [[sum(p[0] == s for st in steps[r] for p in st) for s in range(W)] for r in range(W)]
    # needed[r][s]: rank r holds the block of step s for itself or a rank downstream of it
    needed = [[False] * W for _ in range(W)]
    for s in reversed(range(W)):
        for r in range(W):
            later = s + 1 < W and needed[(r + 1) % W][s + 1]
            needed[r][s] = readers[r][s] > 0 or later
    sends = [[s for s in range(W - 1) if needed[(r + 1) % W][s + 1]] for r in range(W)]

    def consumers(r: int, s: int) -> int:  # readers of rank r's slot of step s
        return readers[r][s] + (s in sends[r])

    # free waits: the send of step s refills slot (s+1) % 2 of rank r+1, last filled at step s-1
    free_waits: dict[tuple[int, int], Wait] = {}
    for r in range(W):
        nxt = (r + 1) % W
        for s in sends[r]:
            prev = s - 1
            if prev >= 1 and needed[nxt][prev]:
                free_waits[(r, s)] = Wait("free", r, (prev,), value=consumers(nxt, prev))
    frees = {(r, w.index[0]) for (r, _), w in free_waits.items()}  # (sender rank, step)

    def free_raise(r: int, s: int) -> tuple[Raise, ...]:
        """A reader on r of its step-s slot frees it for its predecessor, if a send waits."""
        before = (r - 1) % W
        return (Raise("free", before, (s,), op="add"),) if (before, s) in frees else ()

    def landed_wait(r: int, s: int) -> tuple[Wait, ...]:
        return (Wait("landed", r, (s,), consumers=consumers(r, s)),) if s > 0 else ()

    comm, compute = [], []
    for r in range(W):
        nxt = (r + 1) % W
        comm.append(
            [
                Task(
                    s,
                    (s,),
                    waits=landed_wait(r, s)
                    + ((free_waits[(r, s)],) if (r, s) in free_waits else ()),
                    raises=(Raise("landed", nxt, (s + 1,)),) + (free_raise(r, s) if s else ()),
                )
                for s in sends[r]
            ]
        )
        tasks = []
        for s, j in pairs:  # step-major: a unit's earlier rows never wait for its later ones
            for t, st in enumerate(steps[r]):
                if (s, j) not in st:
                    continue
                i = st.index((s, j))
                chain = (Wait("merged", r, (t, s, j)),) if i > 0 else ()
                follow = (Raise("merged", r, (t, *st[i + 1])),) if i + 1 < len(st) else ()
                raises = follow + (free_raise(r, s) if s else ())
                tid = (s * len(kv_tiles) + j) * len(qtiles) + t
                tasks.append(Task(tid, (t, s, j), landed_wait(r, s) + chain, raises))
        compute.append(tasks)

    sizes = {
        "rows": batch * S,
        "q_cols": heads * D,
        "kv_cols": kv_heads * D,
        "lse_rows": batch * heads,
        "seq": S,
        "ring_rows": 2 * batch * S,
        "state_rows": batch * heads * S,
        "state_cols": D + 2,
        "qtiles": len(qtiles),
        "kv_tiles": len(kv_tiles),
    }
    tiles = [Tile(t, b * S + r0, h * D, n, D, h) for t, (b, h, r0, n) in enumerate(qtiles)]
    tile = TILE_CONFIGS["64x128x64"]  # unused: there is no attention engine yet
    extra = {"qtiles": qtiles, "kv_tiles": kv_tiles, "steps": steps, "sends": sends}
    return build_plan(SPEC, schedule, world, tile, shapes, sizes, tiles, compute, comm, extra)


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
        "zigzag": int(layout == "zigzag")
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
        world's deadline. On GPUs it runs unfused: in an emulated world the attention engine per
        block with lse merges (ring_attention_gpu.py); in a distributed world the same with the
        K/V blocks travelling the ring by torch.distributed sends (ring_attention_dist.py).
        Differentiable: when q, k or v require grad, ``out.backward(g)`` runs
        ``ring_attention_backward`` (mkernel/ops/ring_attention_backward.py; lse's gradient too).
    """
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)
    ):  # differentiable: the backward op's autograd Function calls back here without grad
        from .ring_attention_backward import RingAttention

        return RingAttention.apply(q, k, v, world, causal, scale, layout, schedule)
    module = sys.modules[__name__]
    world = common.check_world(world)
    if world.on_gpu and world.emulated_world:  # the engine per block, unfused (ring_attention_gpu)
        common.check_schedule(schedule)
        s = shapes(q, k, v, world, causal, layout)
        scale = check_scale(scale, s["head_dim"])
        return ring_attention_gpu.forward(q, k, v, causal, scale, layout == "zigzag")
    if world.on_gpu:  # distributed: K/V by NCCL sends, the engine per block (ring_attention_dist)
        from . import ring_attention_dist as rd

        common.check_schedule(schedule)
        s = shapes(q, k, v, world, causal, layout)
        scale = check_scale(scale, s["head_dim"])
        fwd_block, _ = rd.gpu_engines()
        return rd.forward(q, k, v, world, causal, scale, layout == "zigzag", fwd_block)
    world = common.check_world_for(SPEC, world)
    schedule = common.check_schedule(schedule)
    s = shapes(q, k, v, world, causal, layout)
    scale = check_scale(scale, s["head_dim"])
    common.check_faults(schedule, world)
    plan = common.cached_plan(module, schedule, world, **s)
    lead = (world.size,) if world.emulated_world else ()
    B, S, H, D = s["batch"], s["seq"], s["heads"], s["head_dim"]
    # NaN poison: a tile the plan forgets shows (and the kernel end reports it unwritten)
    out = torch.full((*lead, B, S, H, D), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((*lead, B, H, S), float("nan"), dtype=torch.float32)
    reads = lambda rank: outputs(plan, rank)  # noqa: E731
    views = operands(plan, q, k, v, out, lse)
    common.run_cpu(world, plan, views, twins_of(plan, scale), reads, schedule.seed)
    return out, lse


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
        return ring_attention_gpu.attention(q, k, v, causal, scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise NotImplementedError(
                f"attention: {name} is on {t.device}; CUDA tensors run on the attention engine, "
                "CPU tensors in the interpreter"
            )
    out, lse = ring_attention(lift(q), lift(k), lift(v), _solo_world(), causal, scale)
    return out[0], lse[0]


# -- CPU interpreter: the data-movement twins (the engine's and the comm role's) -------------------


def twins_of(plan: Plan, scale: float | None = None):
    z, W = plan.shapes, plan.world_size
    S, D, H, Hkv = z["seq"], z["head_dim"], z["heads"], z["kv_heads"]
    BS = z["batch"] * S
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qtiles, kv_tiles, steps = plan.extra["qtiles"], plan.extra["kv_tiles"], plan.extra["steps"]
    pos = [positions(r, W, S, bool(z["zigzag"])) for r in range(W)]

    def block(s: int, rank: int) -> tuple[str, str, int]:
        """(k buffer, v buffer, first row) of the block rank holds at step s."""
        return ("k", "v", 0) if s == 0 else ("k_ring", "v_ring", (s % 2) * BS)

    def compute(ctx, task):  # the attention engine: merge one K/V tile into a q tile's state
        t, s, j = task.args[:3]
        b, h, r0, n = qtiles[t]
        k0, kn = kv_tiles[j]
        hk = h // (H // Hkv)
        kb, vb, base = block(s, ctx.rank)
        qv = yield from twins.tile_load_async(ctx, "q", ctx.rank, (b * S + r0, n, h * D, D))
        kv_rect = (base + b * S + k0, kn, hk * D, D)
        kt = yield from twins.tile_load_async(ctx, kb, ctx.rank, kv_rect)
        vt = yield from twins.tile_load_async(ctx, vb, ctx.rank, kv_rect)
        st_rect = ((b * H + h) * S + r0, n, 0, D + 2)
        mine = steps[ctx.rank][t]
        if (s, j) == mine[0]:
            state = torch.zeros(n, D + 2)
            state[:, D] = -math.inf
        else:
            state = yield from twins.tile_load(ctx, "state", ctx.rank, st_rect)
        scores = (qv.float() @ kt.float().T) * scale  # [n, kn]
        if z["causal"]:
            keys = pos[(ctx.rank - s) % W][k0 : k0 + kn]
            future = keys[None, :] > pos[ctx.rank][r0 : r0 + n, None]
            scores = scores.masked_fill(future, -math.inf)
        state = merge(state, scores, vt.float())
        if (s, j) != mine[-1]:
            yield from twins.tile_send(ctx, "state", ctx.rank, st_rect, state)
            return
        out, lse = finish(state)
        yield from twins.output_store(ctx, "out", ctx.rank, (b * S + r0, n, h * D, D), out, t)
        lse_rect = (b * H + h, 1, r0, n)
        yield from twins.output_store(ctx, "lse", ctx.rank, lse_rect, lse[None], len(qtiles) + t)

    def comm(ctx, task):  # forward the block of step s to slot (s+1) % 2 of rank r+1
        s = task.args[0]
        kb, vb, base = block(s, ctx.rank)
        nxt, dst = (ctx.rank + 1) % W, ((s + 1) % 2) * BS
        cols = Hkv * D
        for src, ring in ((kb, "k_ring"), (vb, "v_ring")):
            x = yield from twins.tile_load_async(ctx, src, ctx.rank, (base, BS, 0, cols))
            yield from twins.tile_send_bulk(ctx, ring, nxt, (dst, BS, 0, cols), x)

    return {"compute": compute, "comm": comm}


def merge(state: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Online softmax, fp32: fold one K/V tile's ``scores`` [n, kn] (-inf: masked) and values
    [kn, D] into ``state`` [n, D + 2] = (acc, m, den): running max m, denominator den (both of
    scaled scores) and the unnormalised output. A row that sees no key of the tile keeps its
    state."""
    D = v.shape[1]
    acc, m, den = state[:, :D], state[:, D], state[:, D + 1]
    m_new = torch.maximum(m, scores.amax(dim=1))
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all -inf so far
    p = torch.exp(scores - shift[:, None])
    alpha = torch.exp(m - shift)
    out = torch.empty_like(state)
    out[:, :D] = alpha[:, None] * acc + p @ v
    out[:, D] = m_new
    out[:, D + 1] = alpha * den + p.sum(dim=1)
    return out


def finish(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16 [n, D], lse fp32 [n]) of a final state; a row with no key: 0 and -inf."""
    D = state.shape[1] - 2
    acc, m, den = state[:, :D], state[:, D], state[:, D + 1]
    seen = den > 0
    den = torch.where(seen, den, 1.0)
    out = torch.where(seen[:, None], acc / den[:, None], 0.0)
    lse = torch.where(seen, m + torch.log(den), -math.inf)
    return out.bfloat16(), lse


def outputs(plan: Plan, rank: int) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    """Per output buffer, the tiles the kernel end reads on every rank: out tile t (q rows x one
    head) and lse tile qtiles + t (that head's row of lse)."""
    S, D, H = plan.shapes["seq"], plan.shapes["head_dim"], plan.shapes["heads"]
    qtiles = plan.extra["qtiles"]
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
