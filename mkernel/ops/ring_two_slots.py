"""The two-slot K/V ring that the ring attention backward's plan builds on (interpreter only).

Each rank has two symmetric K/V slots: at step s it holds the block of rank (r - s) mod W (its own
inputs at step 0, else slot s % 2); the comm task of step s forwards that block to slot (s+1) % 2
of rank r+1 and raises ``landed[s+1]`` there, after ``free[s-1]`` on itself says that every reader
on r+1 of the block that slot held last has finished. Compute task (q tile t, step s, K/V tile j)
waits ``landed[s]`` and ``merged[t, s, j]`` (its q tile's previous task stored the tile's state in
global memory), so a unit may run any q tile's task of any step: step-major rows never deadlock.

The forward op (ring_attention.py) no longer runs this shape: its GPU engine keeps a q tile's
state in registers, so a q tile's tasks stay on one unit, and with two slots that deadlocks from
W = 4 (docs/ring_attention.md); it has W - 1 slots and no ``free`` / ``merged``. The backward
keeps its dQ chain in the ``state`` workspace and runs here.

    W = 3, contiguous, causal; Bp = the K/V block of rank p; q_r = rank r's q tiles
    step:     0                           1                              2
    rank 0:   q0.B0; send B0 -> r1 slot1  -                              -
    rank 1:   q1.B1; send B1 -> r2 slot1  wait landed[1]: q1.B0;         -
                                          send B0 -> r2 slot0
    rank 2:   q2.B2                       wait landed[1]: q2.B1          wait landed[2]: q2.B0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..interp import twins
from ..protocol import Buffer, Pad, Raise, Task, Wait
from ..schedule import Plan, Tile
from .ring_attention import positions, segments

Q_TILE = 16  # default query rows per compute task (Schedule.chunk_rows)
KV_RING = (
    Buffer("k_ring", "symmetric", torch.bfloat16, ("ring_rows", "kv_cols"), "2 K slots"),
    Buffer("v_ring", "symmetric", torch.bfloat16, ("ring_rows", "kv_cols"), "2 V slots"),
)
RING_PADS = (
    Pad("landed", ("step",), ("W",), counted=True, doc="the K/V block of step is in my slot"),
    Pad("free", ("step",), ("W",), doc="my successor's readers of its step's slot are done"),
)


def row_tiles(seq: int, zigzag: bool, tile: int = Q_TILE) -> list[tuple[int, int]]:
    """(row0, rows) of each q tile of one (batch, head): ``tile`` rows, never across a zigzag
    chunk boundary (so causal skipping sees each chunk's own positions)."""
    chunks = segments(seq, zigzag)
    return [(a + i, min(tile, n - i)) for a, n in chunks for i in range(0, n, tile)]


@dataclass
class RingParts:
    """The two-slot ring's tasks per rank (execution order) and its plan sizes, for an op's
    ``build_plan``."""

    compute: list[list[Task]]
    comm: list[list[Task]]
    shapes: dict[str, int]
    sizes: dict[str, int]
    tiles: list[Tile]
    extra: dict[str, Any]


def ring_parts(
    world_size: int,
    tile_rows: int,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: int,
    zigzag: int,
) -> RingParts:
    W, S, D = world_size, seq, head_dim
    shapes = dict(
        batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=D, causal=causal
    ) | {"zigzag": zigzag}
    rows = row_tiles(S, bool(zigzag), tile_rows)
    qtiles = [(b, h, r0, n) for b in range(batch) for h in range(heads) for r0, n in rows]
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
        "qtiles": len(qtiles),
        "kv_tiles": len(kv_tiles),
    }
    tiles = [Tile(t, b * S + r0, h * D, n, D, h) for t, (b, h, r0, n) in enumerate(qtiles)]
    extra = {"qtiles": qtiles, "kv_tiles": kv_tiles, "steps": steps, "sends": sends}
    return RingParts(compute, comm, shapes, sizes, tiles, extra)


def kv_send_twin(plan: Plan):
    """The comm task's data movement: the block of step s to slot (s+1) % 2 of rank r+1."""
    z, W = plan.shapes, plan.world_size
    BS, cols = z["batch"] * z["seq"], z["kv_heads"] * z["head_dim"]

    def comm(ctx, task):
        s = task.args[0]
        kb, vb, base = ("k", "v", 0) if s == 0 else ("k_ring", "v_ring", (s % 2) * BS)
        nxt, dst = (ctx.rank + 1) % W, ((s + 1) % 2) * BS
        for src, ring in ((kb, "k_ring"), (vb, "v_ring")):
            x = yield from twins.tile_load_async(ctx, src, ctx.rank, (base, BS, 0, cols))
            yield from twins.tile_send_bulk(ctx, ring, nxt, (dst, BS, 0, cols), x)

    return comm
