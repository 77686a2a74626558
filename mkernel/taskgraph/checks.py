"""The builder's checks: every bad argument raises TypeError / ValueError naming the op and the
argument and the expected form, before anything is lowered or launched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

BF16 = torch.bfloat16


def fail(op: str, arg: str, want: str, got: str, kind: type = ValueError) -> None:
    raise kind(f"TaskGraph.{op}: {arg} must be {want}, got {got}")


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_shape(op: str, shape: Any) -> tuple[int, ...]:
    """A graph value's shape: two positive ints [rows, cols] (every op works on 2-D values)."""
    if not isinstance(shape, (tuple, list, torch.Size)):
        fail(op, "shape", "a tuple of 2 positive ints [rows, cols]", repr(shape), TypeError)
    ok = all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
    if not ok:
        fail(op, "shape", "a tuple of 2 positive ints [rows, cols]", repr(shape), TypeError)
    if len(shape) != 2 or any(s < 1 for s in shape):
        fail(op, "shape", "a tuple of 2 positive ints [rows, cols]", repr(tuple(shape)))
    return tuple(shape)


def check_dtype(op: str, arg: str, dtype: Any) -> None:
    if dtype != BF16:
        fail(op, arg, "torch.bfloat16 (the only dtype TaskGraph runs yet)", repr(dtype), TypeError)


def per_rank(
    op: str,
    arg: str,
    t: Any,
    world_size: int,
    device: torch.device | None,
    want: str,
    ok: Any,
) -> list[torch.Tensor]:
    """A build-time tensor (weight, cache): one tensor (the same on every rank), a list / tuple
    of one per rank, or, in a world of several ranks, one tensor stacking them on a leading rank
    dimension ([W, *shape], rank r's at [r], as the other ops' emulated inputs); each bf16, on
    ``device`` (None: any, the first one fixes it), of a shape that ``ok(shape)`` accepts
    (``want`` says which). Returns one tensor per rank.

    A stacked tensor is never mistaken for a shared one: it has one dimension more than ``ok``
    accepts."""
    if isinstance(t, torch.Tensor):
        stacked = (
            world_size > 1
            and t.dim() >= 1
            and t.shape[0] == world_size
            and not ok(tuple(t.shape))
            and ok(tuple(t.shape[1:]))
        )
        ts = list(t.unbind(0)) if stacked else [t] * world_size
    elif isinstance(t, (list, tuple)):
        if len(t) != world_size:
            fail(op, arg, f"a tensor or a list of {world_size} (one per rank)", f"{len(t)} items")
        ts = list(t)
    else:
        fail(op, arg, "a torch.Tensor or a list of one per rank", type(t).__name__, TypeError)
    dev = device
    for r, x in enumerate(ts):
        where = f"{arg}[{r}]" if isinstance(t, (list, tuple)) else arg
        if not isinstance(x, torch.Tensor):
            fail(op, where, "a torch.Tensor", type(x).__name__, TypeError)
        check_dtype(op, where, x.dtype)
        if dev is None:
            dev = x.device
        if x.device != dev:
            fail(op, where, f"on {dev} (the graph's device)", str(x.device))
        if not ok(tuple(x.shape)):
            fail(op, where, want, shape_str(x.shape))
    return ts
