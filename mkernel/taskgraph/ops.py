"""Each op of a TaskGraph as tiles: which output rectangles its tasks write (``tiles``), what each
task reads (value or build-time tensor, rank, rectangle), and the tile's math (``compute``, fp32
in, fp32 out; the task rounds to bf16 when it stores). The interpreter's twins and the GPU fallback
both run ``compute`` on what the reads loaded, so they compute the same bits.

Every value and build-time tensor is a buffer of 2-D per-rank tensors [rows, cols]: a value
[M, N] as it is, an rmsnorm weight [H] as [1, H], a cache [B, Hkv, S, D] as [B * Hkv * S, D].
Tiles (``Blocks``: rows, cols):

    rmsnorm           a block of rows, every column (the row's norm needs all of it)
    linear            block of rows x block of columns; reads x's rows [all K], weight's rows
    silu_mul          block x block; reads the gate and the up columns of the same rows
    add               block x block; reads the same rectangle of a and b
    attention_decode  one sequence b x one kv head h: q's columns of the G query heads of h
    all_reduce        block x block; reads that rectangle on every rank (pull-reduce, rank order)
    all_gather        rank q's rows x block of columns; reads q's rows of x on rank q
    reduce_scatter    block x block of my rows; reads rows r * M/W + .. of x on every rank
"""

from __future__ import annotations

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
    elif node.op == "linear":
        x, K = node.args[0], node.args[0].shape[1]
        for rect in _grid(M, N, blocks):
            r0, nr, c0, nc = rect
            reads = [me(x, (r0, nr, 0, K)), Read(const_buf(idx, "weight"), rank, (c0, nc, 0, K))]
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
    elif node.op == "attention_decode":
        (q,) = node.args
        at = node.attrs
        Hkv, S, D, L = at["kv_heads"], at["seq"], at["head_dim"], at["length"]
        cols = at["heads"] // Hkv * D  # the G query heads of one kv head
        for b in range(M):
            for h in range(Hkv):
                rect = (b, 1, h * cols, cols)
                kv = ((b * Hkv + h) * S, L, 0, D)
                k = Read(const_buf(idx, "k"), rank, kv)
                v = Read(const_buf(idx, "v"), rank, kv)
                out.append(TileTask(idx, rect, (me(q, rect), k, v)))
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


def _attention(node: Node, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    D = node.attrs["head_dim"]
    qh = q.reshape(-1, D)  # [G, D]
    p = torch.softmax(qh @ k.T * D**-0.5, dim=-1)  # [G, L]
    return (p @ v).reshape(1, -1)


def _sum(node: Node, *parts: torch.Tensor) -> torch.Tensor:
    acc = parts[0]
    for p in parts[1:]:  # NOTE: in rank order on every rank: all ranks get the same bits
        acc = acc + p
    return acc


COMPUTE: dict[str, Callable[..., torch.Tensor]] = {
    "rmsnorm": _rmsnorm,
    "linear": _linear,
    "silu_mul": lambda node, g, u: torch.nn.functional.silu(g) * u,
    "add": lambda node, a, b: a + b,
    "attention_decode": _attention,
    "all_reduce": _sum,
    "all_gather": lambda node, x: x,
    "reduce_scatter": _sum,
}


def compute(node: Node, loaded: list[torch.Tensor]) -> torch.Tensor:
    """The tile's result in fp32 from what its reads loaded (bf16), in the reads' order."""
    return COMPUTE[node.op](node, *(t.float() for t in loaded))
