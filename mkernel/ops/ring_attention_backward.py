"""Ring attention, backward (issue 13): API, plan, data-movement twins, reference and the autograd
Function that makes ``ring_attention`` differentiable. Fused in the CPU interpreter only
(``SPEC.device`` is False), on the forward's plan shape (mkernel/ops/ring_attention.py,
``ring_tasks``); in an emulated world on a GPU it runs unfused on the backward engine
(ring_attention_gpu.backward).

Unfused meaning, per rank r of W (shapes as the forward; dout, out bf16 like q, lse fp32)::

    P = softmax(Q K^T * scale) at the layout's global positions (causal: future keys masked)
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = scale dS K;  dK = scale dS^T Q
    dq_r, dk_r, dv_r = those rows of rank r (GQA: dK, dV summed over the q heads of a K/V head)

Per (q tile, K/V chunk), FlashAttention-style: P is recomputed from lse (P = exp(scale q k^T -
lse)), delta = rowsum(dO * O) - dlse once per q tile, all in fp32.

Protocol (docs/ring_attention.md, "Backward"): the forward's plan, unchanged: the K/V blocks travel
the ring into W - 1 slots per rank (``landed`` counted, ``parts`` comm tasks per step, no
``free``); a compute task is one (q tile, K/V chunk of one step) pair that waits ``landed[s]`` (s
> 0); a unit runs its q tiles' tasks step-major, all of one q tile's tasks on that unit, which
keeps the tile's fp32 dQ accumulator and delta in the ``state`` workspace between them (program
order: no signal); the tile's first task computes delta, its last stores dq once in bf16. What is
new is the way back of dK / dV:

- compute (q tile, step s, K/V chunk) reduce-adds its fp32 dK, dV contributions into ``dkv_acc``
  slot s on its own rank (adds commute: no order among them) and adds 1 to ``computed[s]``;
- grad (step s) on rank r waits ``computed[s]`` (all of r's contributions to the block it holds)
  and, s > 0, ``dlanded[s]`` (the partial of the previous holders, reduce-added into the same
  slot by rank r-1); it reads the slot, zeroes it (workspace back to zero for the next call) and
  reduce-adds it by a bulk copy into slot s+1 of rank r+1 (``dlanded[s+1]``) when the block goes
  on, else into slot 0 of the block's owner (``dlanded[0]``: the gradient is home);
- finish on each rank waits ``dlanded[0]`` (or, when no other rank uses its block, its own
  ``computed[0]``), reads slot 0, zeroes it and stores dk, dv once in bf16.

A comm task's args: a K/V send's are the forward's (s, part, row0, rows), part < ``GRAD``; a grad
send's (s, GRAD), the finish's (0, FINISH). A rank's comm tasks: its K/V sends (the forward's, in
the same rows), then its grad sends by step, then its finish. One ``dkv_acc`` slot per step (W
slots): a slot is used once per call, so the partials need no ``free`` signal; the next call's
adds are ordered after this call's zeroing by the entry barrier.

    W = 3, contiguous, causal (rank r holds B0..Br); g = the grad send of a partial; +in: the
    previous holders' partial, added into the same slot
    step:     0                         1                            2
    rank 0:   q0.B0; g B0 -> r1 slot 1  -                            finish: dlanded[0]
    rank 1:   q1.B1; g B1 -> r2 slot 1  q1.B0 (+in); g -> r2 slot 2  finish: dlanded[0]
    rank 2:   q2.B2 (own; finish:       q2.B1 (+in); g -> r1 slot 0  q2.B0 (+in); g -> r0 slot 0
              computed[0])

GPU mapping (not built): as the forward's kernel runs its plan, a unit's q tile keeps dQ and
delta in registers within a step's run and in ``state`` between steps; its dK / dV contributions
go out with red.global.add (or a per-CTA reduction first); the comm role's grad send is
cp.reduce.async.bulk .add into the peer's slot.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ..interp import twins
from ..protocol import Buffer, OpSpec, Pad, Raise, Task, Wait
from ..schedule import TILE_CONFIGS, Plan, Schedule, build_plan
from ..world import World
from . import common
from . import ring_attention as fwd

# comm args[1] beyond a K/V send's part: a grad send, the finish
GRAD, FINISH = fwd.MAX_PARTS, fwd.MAX_PARTS + 1
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
            "state",
            "symmetric",
            torch.float32,
            ("state_rows", "state_cols"),
            "per q row between a tile's tasks: dQ acc [D] (fp32), delta",
        ),
        Buffer(
            "dkv_acc",
            "symmetric",
            torch.float32,
            ("acc_rows", "acc_cols"),
            "per step: the held block's dK | dV partial, fp32 (zero between calls)",
        ),
    ),
    pads=(
        fwd.LANDED,
        Pad("computed", ("step",), ("W",), doc="my compute tasks of step added their dK, dV"),
        Pad(
            "dlanded",
            ("step",),
            ("W",),
            doc="the previous holders' partial is in my slot (0: home)",
        ),
    ),
    scalars=("batch", "seq", "heads", "kv_heads", "head_dim", "causal", "zigzag"),
    device=False,
)


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
    """The forward's plan (``ring_tasks``: its K/V ring, its compute tasks, a q tile's on one unit),
    each compute task also raising ``computed``, plus the grad sends and a finish per rank.

    NOTE: no deadlock, whatever the interleaving. Rank every task by a key: a K/V send of step s
    (0, s), a compute task of step s (1, s), a grad send of step s (2, s), the finish (3, 0). Each
    wait is for tasks of a smaller key: a K/V send of step s waits ``landed[s]`` (K/V sends of
    s - 1 on r - 1), a compute task of step s the same, a grad send of step s ``computed[s]``
    (compute tasks of step s) and ``dlanded[s]`` (the grad send of s - 1 on r - 1), the finish
    grad sends or compute tasks of step 0. Each unit runs its tasks in non-decreasing key order:
    a compute unit only compute tasks, step-major (empty ones wait for nothing); a comm unit
    takes rows u, u + units, ... of K/V sends by step, then grad sends by step, then the finish.
    Were the run stalled (each unfinished unit's head task waiting), take the waiting head t of
    least key: t waits for an unfinished t' of smaller key; the head h of t''s unit has key(h) <=
    key(t') < key(t) and waits too: a contradiction. (The K/V sends first also keep the ring from
    waiting behind compute.)"""
    W = world.size
    scalars = dict(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    p = fwd.ring_tasks(SPEC, schedule, world, **scalars, causal=causal, zigzag=zigzag)
    sends, readers = p.extra["sends"], p.readers
    # holds[r][s]: rank r holds a block at step s (its own at 0, else one its predecessor sent)
    holds = [[s == 0 or (s - 1) in sends[(r - 1) % W] for s in range(W)] for r in range(W)]

    for r, tasks in enumerate(p.compute):
        for t in tasks:
            tile = p.tiles[t.args[0]]
            if tile.rows:  # not an empty task that pads a unit
                step = fwd.unpack_tag(tile.tag)[1]
                t.raises = t.raises + (Raise("computed", r, (step,), op="add"),)

    def computed(r: int, s: int) -> tuple[Wait, ...]:
        n = readers[r][s]
        return (Wait("computed", r, (s,), value=n),) if n else ()

    first_id = W * p.extra["parts"]  # after the K/V sends' ids
    for r, tasks in enumerate(p.comm):
        nxt = (r + 1) % W
        for s in range(W):
            if not holds[r][s] or (s == 0 and 0 not in sends[r]):
                continue  # nothing held, or my own block that nobody else uses: finish has it
            waits = computed(r, s) + ((Wait("dlanded", r, (s,)),) if s else ())
            on = s in sends[r]
            dest = Raise("dlanded", nxt, (s + 1,)) if on else Raise("dlanded", (r - s) % W, (0,))
            tasks.append(Task(first_id + s, (s, GRAD), waits, (dest,)))
        home = (Wait("dlanded", r, (0,)),) if 0 in sends[r] else computed(r, 0)
        tasks.append(Task(first_id + W, (0, FINISH), home, ()))

    sizes = p.sizes | {
        "state_cols": head_dim + 1,
        "acc_rows": W * batch * seq,
        "acc_cols": 2 * kv_heads * head_dim,
    }
    extra = p.extra | {"holds": holds}
    tile = TILE_CONFIGS["64x128x64"]  # unused: this op has no device kernel
    args = (p.shapes, sizes, p.tiles, p.compute, p.comm, extra)
    return build_plan(SPEC, p.schedule, world, tile, *args)


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
    s = fwd.shapes(q, k, v, world, causal, layout)
    del s["scale_bits"]  # the forward's launch field (this op has no kernel)
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
        before anything runs. On GPUs it runs unfused: the backward engine per block with fp32
        sums, in an emulated world (ring_attention_gpu.py) or a distributed one, where K/V and
        the dK / dV accumulators travel by torch.distributed sends (ring_attention_dist.py).
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
    module = sys.modules[__name__]
    world = common.check_world(world)
    if world.on_gpu and world.emulated_world:  # the backward engine per block, unfused
        common.check_schedule(schedule)
        s = shapes(dout, q, k, v, out, lse, world, causal, layout)
        scale = fwd.check_scale(scale, s["head_dim"])
        if dlse is not None:
            check_lse("dlse", dlse, world, tuple(lse.shape[1:]))
        return fwd.ring_attention_gpu.backward(
            dout, q, k, v, out, lse, dlse, causal, scale, layout == "zigzag"
        )
    if world.on_gpu:  # distributed: blocks and dK / dV by NCCL sends (ring_attention_dist)
        from . import ring_attention_dist as rd

        common.check_schedule(schedule)
        s = shapes(dout, q, k, v, out, lse, world, causal, layout)
        scale = fwd.check_scale(scale, s["head_dim"])
        if dlse is not None:
            check_lse("dlse", dlse, world, tuple(lse.shape))
        _, bwd_block = rd.gpu_engines()
        zigzag = layout == "zigzag"
        return rd.backward(dout, q, k, v, out, lse, dlse, world, causal, scale, zigzag, bwd_block)
    world = common.check_world_for(SPEC, world)
    schedule = common.check_schedule(schedule)
    s = shapes(dout, q, k, v, out, lse, world, causal, layout)
    scale = fwd.check_scale(scale, s["head_dim"])
    if dlse is None:
        dlse = torch.zeros_like(lse)
    else:
        check_lse("dlse", dlse, world, tuple(lse.shape[1:]))
    common.check_faults(schedule, world)
    plan = common.cached_plan(module, schedule, world, **s)
    # NaN poison: a tile the plan forgets shows (and the kernel end reports it unwritten)
    dq = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    dk = torch.full(k.shape, float("nan"), dtype=torch.bfloat16)
    dv = torch.full(v.shape, float("nan"), dtype=torch.bfloat16)
    views = operands(plan, dout, q, k, v, out, lse, dlse, dq, dk, dv)
    reads = lambda rank: outputs(plan, rank)  # noqa: E731
    common.run_cpu(world, plan, views, twins_of(plan, scale), reads, schedule.seed)
    return dq, dk, dv


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
    S, D, H, Hkv = z["seq"], z["head_dim"], z["heads"], z["kv_heads"]
    BS, KC = z["batch"] * S, Hkv * D  # rows of a block, columns of dK (dV follows)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sends, out_tiles = plan.extra["sends"], plan.extra["out_tiles"]
    pos = [fwd.positions(r, W, S, bool(z["zigzag"])) for r in range(W)]
    kv_send = fwd.twins_of(plan)["comm"]  # the forward's K/V ring
    owner: dict[tuple[int, int, int, int], int] = {}  # (call, rank, key, m0) -> its unit

    def compute(ctx, task):  # one (q tile, K/V chunk): dQ into the state, dK / dV into slot s
        tile = plan.tiles[task.args[0]]
        if tile.rows == 0:  # an empty task that pads the unit's rows
            return
        v = fwd.task_view(plan, tile)
        b, h, hk, q0, n, s = v.b, v.h, v.hk, v.q0, v.rows, v.step
        q_rect = (b * S + q0, n, h * D, D)
        qv = (yield from twins.tile_load_async(ctx, "q", ctx.rank, q_rect)).float()
        do = (yield from twins.tile_load_async(ctx, "dout", ctx.rank, q_rect)).float()
        kt = (yield from twins.tile_load_async(ctx, v.k_buf, ctx.rank, v.kv_rect)).float()
        vt = (yield from twins.tile_load_async(ctx, v.v_buf, ctx.rank, v.kv_rect)).float()
        lse_rect = (b * H + h, 1, q0, n)
        lse = (yield from twins.tile_load_async(ctx, "lse", ctx.rank, lse_rect))[0]
        st_rect = ((b * H + h) * S + q0, n, 0, D + 1)
        fwd.keep_on_unit(owner, ctx, task, v)
        if v.first:  # the tile's first task: delta = rowsum(dO * O) - dlse, once
            o = yield from twins.tile_load_async(ctx, "out", ctx.rank, q_rect)
            dlse = yield from twins.tile_load_async(ctx, "dlse", ctx.rank, lse_rect)
            state = torch.zeros(n, D + 1)
            state[:, D] = (do * o.float()).sum(dim=1) - dlse[0]
        else:
            state = yield from twins.tile_load(ctx, "state", ctx.rank, st_rect)
        scores = (qv @ kt.T) * scale  # [n, Sc]
        if z["causal"]:
            scores = fwd.mask_future(scores, pos, ctx.rank, v)
        dq, dk, dv = grads(scores, lse, do, qv, kt, vt, state[:, D], scale)
        state[:, :D] += dq
        acc = (s * BS + b * S + v.k0, scores.shape[1])
        yield from twins.reduce_add(ctx, "dkv_acc", ctx.rank, (*acc, hk * D, D), dk)
        yield from twins.reduce_add(ctx, "dkv_acc", ctx.rank, (*acc, KC + hk * D, D), dv)
        if not v.last:
            yield from twins.tile_send(ctx, "state", ctx.rank, st_rect, state)
            return
        dq_out = state[:, :D].bfloat16()
        yield from twins.output_store(ctx, "dq", ctx.rank, q_rect, dq_out, v.out_tile)

    def comm(ctx, task):
        s, kind = task.args[:2]
        if kind < GRAD:  # a part of the K/V block of step s (the forward's comm task)
            yield from kv_send(ctx, task)
            return
        slot = (s * BS, BS, 0, 2 * KC)
        part = yield from twins.tile_load_async(ctx, "dkv_acc", ctx.rank, slot)
        yield from twins.tile_send(ctx, "dkv_acc", ctx.rank, slot, torch.zeros_like(part))
        if kind == GRAD:  # on to the next holder, or home to the block's owner (slot 0)
            on = s in sends[ctx.rank]
            dst, row = ((ctx.rank + 1) % W, (s + 1) * BS) if on else ((ctx.rank - s) % W, 0)
            yield from twins.reduce_add_bulk(ctx, "dkv_acc", dst, (row, BS, 0, 2 * KC), part)
            return
        T, n = len(out_tiles), z["batch"] * Hkv  # FINISH: my block's gradient, once in bf16
        for i in range(n):
            b, hk = divmod(i, Hkv)
            rows, cols = slice(b * S, (b + 1) * S), hk * D
            rect = (b * S, S, cols, D)
            dk, dv = part[rows, cols : cols + D], part[rows, KC + cols : KC + cols + D]
            yield from twins.output_store(ctx, "dk", ctx.rank, rect, dk.bfloat16(), T + i)
            yield from twins.output_store(ctx, "dv", ctx.rank, rect, dv.bfloat16(), T + n + i)

    return {"compute": compute, "comm": comm}


def grads(scores, lse, do, q, k, v, delta, scale):
    """FlashAttention's backward of one (q tile, K/V tile), fp32: (dQ [n, D], dK [kn, D], dV [kn,
    D]) from the scaled, masked ``scores`` [n, kn], the forward's ``lse`` [n] and delta [n]."""
    live = torch.isfinite(lse)  # a row that saw no key at all has no gradient
    p = torch.where(live[:, None], torch.exp(scores - torch.where(live, lse, 0.0)[:, None]), 0.0)
    dp = do @ v.T  # [n, kn]
    ds = p * (dp - delta[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def outputs(plan: Plan, rank: int) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    """Per output buffer, the tiles the kernel end reads: dq tile t (q rows x one head), dk / dv
    tiles (a sequence x one K/V head), numbered after the q tiles."""
    S, D = plan.shapes["seq"], plan.shapes["head_dim"]
    Hkv, B = plan.shapes["kv_heads"], plan.shapes["batch"]
    qtiles = plan.extra["out_tiles"]
    T, n = len(qtiles), B * Hkv
    kv = {i: (i // Hkv * S, S, i % Hkv * D, D) for i in range(n)}
    return {
        "dq": {t: (b * S + r0, rows, h * D, D) for t, (b, h, r0, rows) in enumerate(qtiles)},
        "dk": {T + i: r for i, r in kv.items()},
        "dv": {T + n + i: r for i, r in kv.items()},
    }


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
