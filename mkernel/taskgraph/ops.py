"""Each op of a TaskGraph as tiles: which output rectangles its tasks write (``tiles``), what each
task reads (value or build-time tensor, rank, rectangle), and the tile's math (``compute``, fp32
in, fp32 out; the task rounds to bf16 when it stores). The interpreter's twins and the GPU fallback
both run ``compute`` on what the reads loaded, so they compute the same bits.

Every value and build-time tensor is a buffer of 2-D per-rank tensors [rows, cols]: a value
[M, N] as it is, an rmsnorm weight [H] as [1, H], a cache [B, Hkv, S, D] as [B * Hkv * S, D].
Tiles (``Blocks``: rows, cols):

    rmsnorm           a block of rows, every column (the row's norm needs all of it)
    linear            block of rows x block of columns; reads x's rows [all K], weight's rows
      norm_linear     a linear of rmsnorm(x) (``fuse_linears``): reads x's rows; the norm's
                      weight folded into the linear's columns, the row's 1 / rms applied last
      silu_linear     a linear of silu_mul(x): reads x's rows [all 2K] (gate | up)
    silu_mul          block x block; reads the gate and the up columns of the same rows
    add               block x block; reads the same rectangle of a and b
    attention_decode  lowered as two ops (``split_attention``; the graph keeps one node):
      attention_partial  sequence b x kv head h x a chunk of ``Blocks.cols`` cached positions:
                         a row (b, h) of the partials value, the chunk's columns (its softmax
                         average of V for the G query heads of h, then each head's log-sum-exp)
      attention_combine  sequence b x kv head h: q's columns of the G heads; reads the (b, h)
                         row of every chunk (one group) and weighs each by exp(its lse - max)
    all_reduce        block x block; reads that rectangle on every rank (pull-reduce, rank order)
    all_gather        rank q's rows x block of columns; reads q's rows of x on rank q
    reduce_scatter    block x block of my rows; reads rows r * M/W + .. of x on every rank
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .graph import Node

Rect = tuple[int, int, int, int]  # row0, rows, col0, cols


class Blocks(NamedTuple):
    """The tile shape: rows x cols of a value per task (small: CPU-interpreter sized)."""

    rows: int = 4
    cols: int = 32


DEFAULT_BLOCKS = Blocks()
# The tile shape per node: one Blocks for every op (the interpreter's default), or a function of
# the node (the GPU kernel's, mkernel/taskgraph/device.py gpu_blocks: sized per op and shape).
BlocksOf = Blocks | Callable[["Node"], Blocks]


class Read(NamedTuple):
    buf: str  # a buffer name: "v<id>" (a value) or "n<node>_<name>" (a build-time tensor)
    rank: int
    rect: Rect
    value: int = -1  # the value's id, or -1: a build-time tensor (nothing to wait for)


class TileTask(NamedTuple):
    node: int  # the node's index in the graph
    rect: Rect  # what it writes of the node's value
    reads: tuple[Read, ...]


def value_buf(value_id: int) -> str:
    return f"v{value_id}"


def const_buf(node: int, name: str) -> str:
    return f"n{node}_{name}"


def const_2d(t: torch.Tensor) -> torch.Tensor:
    """A build-time tensor as the 2-D [rows, cols] its buffer holds."""
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


# A partial's columns after its G * D averages: each head's lse as a bf16 pair (hi, lo), zeros
# after (MAX_GROUP = 8 heads; a multiple of the kernel's 16-byte accesses).
STAT_COLS = 16


def split_attention(node: Node, chunk: int, value_id: int) -> tuple[Node, Node]:
    """``node`` (an attention_decode) as its two lowered nodes: the partials over chunks of
    ``chunk`` cached positions, a new value ``value_id`` [B * Hkv, chunks * (G * D + STAT_COLS)],
    and their combine into the node's own value."""
    at = node.attrs
    G, Hkv = at["heads"] // at["kv_heads"], at["kv_heads"]
    chunk = max(1, min(chunk, at["length"]))
    chunks = -(-at["length"] // chunk)
    (q,) = node.args
    shape = (q.shape[0] * Hkv, chunks * (G * at["head_dim"] + STAT_COLS))
    part = dataclasses.replace(node.out, id=value_id, shape=shape, op="attention_partial")
    attrs = {**at, "chunk": chunk, "chunks": chunks}
    first = dataclasses.replace(node, op="attention_partial", out=part, attrs=attrs)
    second = dataclasses.replace(node, op="attention_combine", args=(part,), consts={}, attrs=attrs)
    return first, second


def fuse_linears(nodes: list[Node], outputs: set[int]) -> list[Node]:
    """``nodes`` with each linear of an rmsnorm or a silu_mul read by nothing else (and not an
    output) as one node that computes its input as it loads it: ``norm_linear`` (the norm's
    weight folded into the linear's, ``x @ (W * w).T * rsqrt(mean(x**2) + eps)``) and
    ``silu_linear`` (``(silu(gate) * up) @ W.T``, rounded to bf16 as the unfused value is). The
    norm or SiLU then has no reader and is not lowered; a stage and its waits are gone."""
    uses = collections.Counter(a.id for n in nodes for a in n.args)
    made = {n.out.id: n for n in nodes}
    out = []
    for node in nodes:
        src = made.get(node.args[0].id) if node.op == "linear" else None
        alone = src is not None and uses[src.out.id] == 1 and src.out.id not in outputs
        if alone and src.op == "rmsnorm":
            w = [
                (t.float() * n.float().reshape(1, -1)).to(t.dtype)
                for t, n in zip(node.consts["weight"], src.consts["weight"], strict=True)
            ]
            node = dataclasses.replace(
                node, op="norm_linear", args=(src.args[0], *node.args[1:]), consts={"weight": w},
                attrs={**node.attrs, "eps": src.attrs["eps"]},
            )  # fmt: skip
        elif alone and src.op == "silu_mul":
            node = dataclasses.replace(node, op="silu_linear", args=(src.args[0], *node.args[1:]))
        out.append(node)
    return out


def _spans(n: int, b: int) -> list[tuple[int, int]]:
    return [(i, min(b, n - i)) for i in range(0, n, b)]


def _grid(M: int, N: int, blocks: Blocks) -> list[Rect]:
    return [
        (r0, nr, c0, nc) for r0, nr in _spans(M, blocks.rows) for c0, nc in _spans(N, blocks.cols)
    ]


def _read(v, rank: int, rect: Rect) -> Read:
    return Read(value_buf(v.id), rank, rect, v.id)


def tiles(node: Node, idx: int, rank: int, W: int, blocks: BlocksOf) -> list[TileTask]:
    """The tasks of ``node`` (the graph's node ``idx``) on ``rank``, in order; the same number and
    output rectangles on every rank."""
    if not isinstance(blocks, Blocks):
        blocks = blocks(node)
    M, N = node.out.shape
    me = lambda v, rect: _read(v, rank, rect)  # noqa: E731
    out: list[TileTask] = []
    if node.op == "rmsnorm":
        (x,) = node.args
        w = Read(const_buf(idx, "weight"), rank, (0, 1, 0, N))
        for r0, nr in _spans(M, blocks.rows):
            out.append(TileTask(idx, (r0, nr, 0, N), (me(x, (r0, nr, 0, N)), w)))
    elif node.op in ("linear", "norm_linear", "silu_linear"):
        x, K = node.args[0], node.args[0].shape[1]
        for rect in _grid(M, N, blocks):
            r0, nr, c0, nc = rect
            wk = K // 2 if node.op == "silu_linear" else K  # the weight's K: gate | up halves
            reads = [me(x, (r0, nr, 0, K)), Read(const_buf(idx, "weight"), rank, (c0, nc, 0, wk))]
            if len(node.args) > 1:
                reads.append(me(node.args[1], rect))
            out.append(TileTask(idx, rect, tuple(reads)))
    elif node.op == "silu_mul":
        (x,) = node.args
        for rect in _grid(M, N, blocks):
            r0, nr, c0, nc = rect
            out.append(TileTask(idx, rect, (me(x, rect), me(x, (r0, nr, N + c0, nc)))))
    elif node.op == "add":
        a, b = node.args
        out += [TileTask(idx, rect, (me(a, rect), me(b, rect))) for rect in _grid(M, N, blocks)]
    elif node.op == "attention_partial":
        (q,) = node.args
        at = node.attrs
        Hkv, S, D, L, chunk = at["kv_heads"], at["seq"], at["head_dim"], at["length"], at["chunk"]
        cols = at["heads"] // Hkv * D  # the G query heads of one kv head
        P = cols + STAT_COLS
        for b in range(q.shape[0]):
            for h in range(Hkv):
                for c, (l0, nl) in enumerate(_spans(L, chunk)):
                    kv = ((b * Hkv + h) * S + l0, nl, 0, D)
                    k = Read(const_buf(idx, "k"), rank, kv)
                    v = Read(const_buf(idx, "v"), rank, kv)
                    rect = (b * Hkv + h, 1, c * P, P)
                    out.append(TileTask(idx, rect, (me(q, (b, 1, h * cols, cols)), k, v)))
    elif node.op == "attention_combine":
        (part,) = node.args
        Hkv = node.attrs["kv_heads"]
        cols = N // Hkv
        for b in range(M):
            for h in range(Hkv):
                rect = (b, 1, h * cols, cols)
                out.append(TileTask(idx, rect, (me(part, (b * Hkv + h, 1, 0, part.shape[1])),)))
    elif node.op == "all_reduce":
        (x,) = node.args
        for rect in _grid(M, N, blocks):
            out.append(TileTask(idx, rect, tuple(_read(x, q, rect) for q in range(W))))
    elif node.op == "all_gather":
        (x,) = node.args
        m = x.shape[0]
        for q in range(W):
            for r0, nr in _spans(m, blocks.rows):
                for c0, nc in _spans(N, blocks.cols):
                    src = (r0, nr, c0, nc)
                    out.append(TileTask(idx, (q * m + r0, nr, c0, nc), (_read(x, q, src),)))
    elif node.op == "reduce_scatter":
        (x,) = node.args
        for rect in _grid(M, N, blocks):
            r0, nr, c0, nc = rect
            src = (rank * M + r0, nr, c0, nc)
            out.append(TileTask(idx, rect, tuple(_read(x, q, src) for q in range(W))))
    else:
        raise ValueError(f"TaskGraph: no tiles for op {node.op!r}")
    return out


def _rmsnorm(node: Node, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + node.attrs["eps"]) * w


def _linear(node: Node, x: torch.Tensor, w: torch.Tensor, *res: torch.Tensor) -> torch.Tensor:
    y = x @ w.T
    return y + res[0] if res else y


def _partial(node: Node, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    D = node.attrs["head_dim"]
    qh = q.reshape(-1, D)  # [G, D]
    s = qh @ k.T * D**-0.5  # [G, chunk]
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    lse = (m + torch.log(total)).reshape(-1)
    hi = lse.bfloat16().float()  # the pair (hi, lo) keeps ~16 bits of lse through bf16 stores
    stats = torch.zeros(STAT_COLS, device=q.device)
    stats[0 : 2 * len(lse) : 2], stats[1 : 2 * len(lse) : 2] = hi, lse - hi
    return torch.cat([((p @ v) / total).reshape(-1), stats]).reshape(1, -1)


def _combine(node: Node, part: torch.Tensor) -> torch.Tensor:
    G, D = node.attrs["heads"] // node.attrs["kv_heads"], node.attrs["head_dim"]
    rows = part.reshape(-1, G * D + STAT_COLS)  # [chunks, P]
    o = rows[:, : G * D].reshape(-1, G, D)
    lse = rows[:, G * D : G * D + 2 * G].reshape(-1, G, 2).sum(-1)  # [chunks, G]
    w = torch.exp(lse - lse.amax(0))
    return ((w[..., None] * o).sum(0) / w.sum(0)[:, None]).reshape(1, -1)


def _norm_linear(node: Node, x: torch.Tensor, w: torch.Tensor, *res: torch.Tensor) -> torch.Tensor:
    y = x @ w.T * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + node.attrs["eps"])
    return y + res[0] if res else y


def _silu_linear(node: Node, x: torch.Tensor, w: torch.Tensor, *res: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return _linear(node, (torch.nn.functional.silu(gate) * up).bfloat16().float(), w, *res)


def _sum(node: Node, *parts: torch.Tensor) -> torch.Tensor:
    acc = parts[0]
    for p in parts[1:]:  # NOTE: in rank order on every rank: all ranks get the same bits
        acc = acc + p
    return acc


COMPUTE: dict[str, Callable[..., torch.Tensor]] = {
    "rmsnorm": _rmsnorm,
    "linear": _linear,
    "norm_linear": _norm_linear,
    "silu_linear": _silu_linear,
    "silu_mul": lambda node, g, u: torch.nn.functional.silu(g) * u,
    "add": lambda node, a, b: a + b,
    "attention_partial": _partial,
    "attention_combine": _combine,
    "all_reduce": _sum,
    "all_gather": lambda node, x: x,
    "reduce_scatter": _sum,
}


def compute(node: Node, loaded: list[torch.Tensor]) -> torch.Tensor:
    """The tile's result in fp32 from what its reads loaded (bf16), in the reads' order."""
    return COMPUTE[node.op](node, *(t.float() for t in loaded))
