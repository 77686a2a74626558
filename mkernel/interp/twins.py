"""Python twins of the device primitives: same names, same meaning, for the CPU interpreter.

Every twin is a generator (``yield from twin(ctx, ...)``) that does its one action and then yields a
scheduling point, so the interpreter can interleave agents between any two primitives. The device
versions live in ``primitives/signal.cuh`` and ``primitives/comm.cuh``.

Protocol (same as the device):
- a producer writes data (``tile_send``, ``peer_store``, ``reduce_add``), then raises a signal with
  ``signal_set_release`` / ``signal_add_release``: the release orders every earlier write of that
  agent before the signal;
- a consumer ``wait_acquire``s the signal before reading; ``wait_acquire_reset`` also sets it back
  to 0, which is how signal pads reset themselves for the next call;
- every wait is bounded by the deadline and names its peer.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from .machine import STEP, Ctx, Rect, SigRef, Sleep, Wait

Gen = Generator[Any, Any, Any]


def _view(ctx: Ctx, buf: str, rank: int, rect: Rect) -> torch.Tensor:
    r0, nr, c0, nc = rect
    return ctx.m.buffers[buf][rank, r0 : r0 + nr, c0 : c0 + nc]


def tile_load(ctx: Ctx, buf: str, rank: int, rect: Rect) -> Gen:
    """Read a tile of ``buf`` on ``rank`` (local or peer) into registers/shared memory."""
    ctx.m.access(ctx.agent, buf, rank, rect, "r")
    value = _view(ctx, buf, rank, rect).clone()
    yield STEP
    return value


def tile_send(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Copy a tile into ``buf`` on ``peer`` (device: TMA bulk copy, completed before any signal)."""
    ctx.m.access(ctx.agent, buf, peer, rect, "w")
    dst = _view(ctx, buf, peer, rect)
    dst.copy_(value.to(dst.dtype))
    yield STEP


def peer_store(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Vectorised stores into ``buf`` on ``peer`` (device: st.global.v4 through the peer
    mapping)."""
    yield from tile_send(ctx, buf, peer, rect, value)


def reduce_add(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Add a tile into ``buf`` on ``peer`` at the destination (device: TMA reduce-store add or
    red.global.add); concurrent reduce-adds into the same tile commute."""
    ctx.m.access(ctx.agent, buf, peer, rect, "add")
    dst = _view(ctx, buf, peer, rect)
    dst.add_(value.to(dst.dtype))
    yield STEP


def output_store(ctx: Ctx, buf: str, rank: int, rect: Rect, value: torch.Tensor, tile: int) -> Gen:
    """Write a final output tile (tracked: each must be written exactly once per rank)."""
    ctx.m.record_output(ctx.agent, rank, tile)
    yield from tile_send(ctx, buf, rank, rect, value)


def signal_set_release(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """st.release.sys: every earlier write of this agent is visible to whoever acquires the
    value."""
    ctx.m.release(ctx.agent, sig, accumulate=False)
    ctx.m.pads[sig.pad][sig.rank][sig.index] = value
    yield STEP


def signal_add_release(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """red.release.sys.add: like signal_set_release, for counters raised by several producers."""
    ctx.m.release(ctx.agent, sig, accumulate=True)
    ctx.m.pads[sig.pad][sig.rank][sig.index] += value
    yield STEP


def wait_acquire(ctx: Ctx, sig: SigRef, value: int, peer: int) -> Gen:
    """Spin (bounded by the deadline) until the signal equals ``value``; acquire."""
    yield Wait(sig, value, reset=False, peer=peer)


def wait_acquire_reset(ctx: Ctx, sig: SigRef, value: int, peer: int) -> Gen:
    """wait_acquire, then set the signal back to 0 (the consumer resets what it consumed)."""
    yield Wait(sig, value, reset=True, peer=peer)


def entry_barrier(ctx: Ctx, pad: str, slot: int) -> Gen:
    """Barrier of CTA ``slot`` with CTA ``slot`` of every peer, on flags that reset themselves:
    arrive by setting flag[peer][slot][me] 0 -> 1, wait for flag[me][slot][peer] == 1 and consume
    it. In a distributed world it keeps a rank from writing into a peer's workspace while that
    peer's previous call may still read it."""
    for i in range(1, ctx.W):
        peer = (ctx.rank + i) % ctx.W
        # NOTE: the device arrives with a CAS 0 -> 1 (it waits for a previous call's flag to be
        # consumed); the interpreter runs one call, so the flag is always 0 here.
        yield from signal_set_release(ctx, SigRef(pad, peer, (slot, ctx.rank)), 1)
    for i in range(1, ctx.W):
        peer = (ctx.rank + i) % ctx.W
        yield from wait_acquire_reset(ctx, SigRef(pad, ctx.rank, (slot, peer)), 1, peer)


def local_event_set(ctx: Ctx, sig: SigRef) -> Gen:
    """Inside one CTA: publish to the other warps (device: a named barrier / smem flag)."""
    yield from signal_set_release(ctx, sig, 1)


def delay(ctx: Ctx, steps: int) -> Gen:
    """Injected lateness (device: __nanosleep until the global timer passes)."""
    if steps > 0:
        yield Sleep(steps)


# The device primitives' own names (primitives/comm.cuh), each the twin above of the same meaning:
# the interpreter does not model the transfer mechanism, only who writes what, when, and how.
tile_send_bulk = tile_send
peer_store_v4 = peer_store
copy_v4_team = peer_store
reduce_add_bulk_f32 = reduce_add
reduce_add_bulk_bf16 = reduce_add
red_add_v2_f32_sys = reduce_add
red_add_f32_sys = reduce_add
red_add_v4_f32 = reduce_add
red_add_bf16x2 = reduce_add
