"""Python twins of the device primitives: same names, same meaning, for the CPU interpreter.

Every twin is a generator (``yield from twin(ctx, ...)``) that does its one action and then yields a
scheduling point, so the interpreter can interleave agents between any two primitives. The device
versions live in ``primitives/signal.cuh`` and ``primitives/comm.cuh``.

Protocol (same as the device):
- a producer writes data (``tile_send``, ``peer_store``, ``reduce_add``), then raises a signal with
  ``signal_set_release`` / ``signal_add_release``: the release orders every earlier write of that
  agent before the signal. ``signal_set_relaxed`` / ``signal_add_relaxed`` / ``fetch_add_relaxed``
  change the value but order nothing;
- bulk (TMA) copies ``tile_send_bulk`` / ``reduce_add_bulk`` are only issued: the producer owns
  their completion and must ``bulk_wait_all`` before the release (a kernel exit also drains them);
- a consumer ``wait_acquire``s the signal before reading; ``wait_acquire_reset`` also sets it back
  to 0, which is how signal pads reset themselves for the next call;
- a TMA load (``tile_load_async``) of data written by plain stores reads through the async proxy:
  the consumer runs ``fence_proxy_async`` between the wait and the load;
- every wait is bounded by the deadline and names its peer;
- device code holds peer pointers only within its node: a data access or signal raise on a rank of
  another node (``Machine(nodes=N)``) is a PlanError "cross-node access"; across nodes data moves
  only through ``rdma.rdma_put`` and the node's proxy.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ..errors import PlanError
from .machine import STEP, Ctx, Rect, SigRef, Sleep, Wait

Gen = Generator[Any, Any, Any]


def _same_node(ctx: Ctx, rank: int, what: str) -> None:
    """A peer pointer exists only within a node (one node: always)."""
    m, a = ctx.m, ctx.agent
    if m.node_of(rank) != m.node_of(a.rank):
        raise PlanError(
            "cross-node access",
            a.rank,
            a.task,
            f"{what} on rank {rank} (node {m.node_of(rank)}) from node {m.node_of(a.rank)}",
            "no peer pointer into another node: use rdma_put",
            role=a.role,
            unit=a.unit,
        )


def _view(ctx: Ctx, buf: str, rank: int, rect: Rect) -> torch.Tensor:
    r0, nr, c0, nc = rect
    return ctx.m.buffers[buf][rank, r0 : r0 + nr, c0 : c0 + nc]


def _load(ctx: Ctx, buf: str, rank: int, rect: Rect, proxy: str) -> torch.Tensor:
    _same_node(ctx, rank, f"{buf}[{rank}]")
    ctx.m.access(ctx.agent, buf, rank, rect, "r", proxy=proxy)
    return _view(ctx, buf, rank, rect).clone()


def tile_load(ctx: Ctx, buf: str, rank: int, rect: Rect) -> Gen:
    """Read a tile of ``buf`` on ``rank`` (local or peer) into registers/shared memory."""
    value = _load(ctx, buf, rank, rect, "generic")
    yield STEP
    return value


def tile_load_async(ctx: Ctx, buf: str, rank: int, rect: Rect) -> Gen:
    """TMA load of a tile of ``buf`` on ``rank``: reads through the async proxy, so plain (generic)
    writes are seen only if this agent ran ``fence_proxy_async`` after the wait that orders them."""
    value = _load(ctx, buf, rank, rect, "async")
    yield STEP
    return value


def bulk_load(ctx: Ctx, buf: str, rank: int, rect: Rect) -> Gen:
    """cp.async.bulk global -> shared (comm.cuh ``bulk_load``, the loads of bulk_ring.cuh): an
    async-proxy read, as ``tile_load_async``."""
    return (yield from tile_load_async(ctx, buf, rank, rect))


def fence_proxy_async(ctx: Ctx) -> Gen:
    """fence.proxy.async: generic-proxy writes this agent is ordered after become visible to its
    async-proxy (TMA) reads."""
    ctx.m.fence_proxy(ctx.agent)
    yield STEP


def tile_send(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Copy a tile into ``buf`` on ``peer``, complete when it returns (device: plain stores)."""
    _same_node(ctx, peer, f"{buf}[{peer}]")
    ctx.m.access(ctx.agent, buf, peer, rect, "w")
    dst = _view(ctx, buf, peer, rect)
    dst.copy_(value.to(dst.dtype))
    yield STEP


def peer_store(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Vectorised stores into ``buf`` on ``peer`` (device: st.global.v4 through the peer
    mapping)."""
    yield from tile_send(ctx, buf, peer, rect, value)


def reduce_add(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Add a tile into ``buf`` on ``peer`` at the destination (device: red.global.add);
    concurrent reduce-adds into the same tile commute."""
    _same_node(ctx, peer, f"{buf}[{peer}]")
    ctx.m.access(ctx.agent, buf, peer, rect, "add")
    dst = _view(ctx, buf, peer, rect)
    dst.add_(value.to(dst.dtype))
    yield STEP


def output_store(ctx: Ctx, buf: str, rank: int, rect: Rect, value: torch.Tensor, tile: int) -> Gen:
    """Write a final output tile (tracked: each must be written exactly once per rank)."""
    ctx.m.record_output(ctx.agent, rank, tile)
    yield from tile_send(ctx, buf, rank, rect, value)


def tile_send_bulk(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Issue a TMA bulk copy of a tile into ``buf`` on ``peer``: nothing lands until this agent's
    ``bulk_wait_all`` (or its end), ordered by what the agent's clock orders then."""
    _same_node(ctx, peer, f"{buf}[{peer}]")
    ctx.m.issue_bulk(ctx.agent, buf, peer, rect, value, "w")
    yield STEP


def reduce_add_bulk(ctx: Ctx, buf: str, peer: int, rect: Rect, value: torch.Tensor) -> Gen:
    """Issue a TMA reduce-add (cp.reduce.async.bulk .add) of a tile into ``buf`` on ``peer``;
    lands like ``tile_send_bulk``."""
    _same_node(ctx, peer, f"{buf}[{peer}]")
    ctx.m.issue_bulk(ctx.agent, buf, peer, rect, value, "add")
    yield STEP


def bulk_wait_all(ctx: Ctx) -> Gen:
    """cp.async.bulk.wait_group 0: every bulk copy this agent issued has landed."""
    ctx.m.land_bulk(ctx.agent)
    yield STEP


def bulk_wait_read(ctx: Ctx) -> Gen:
    """cp.async.bulk.wait_group.read 0: the sources may be reused; nothing has landed yet."""
    yield STEP


def _signal(ctx: Ctx, sig: SigRef, op: str, value: int, release: bool) -> int:
    _same_node(ctx, sig.rank, f"signal {sig}")
    return ctx.m.signal(ctx.agent, sig, op, value, release=release)


def signal_set_release(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """st.release.sys: every earlier write of this agent is visible to whoever acquires the
    value."""
    _signal(ctx, sig, "set", value, release=True)
    yield STEP


def signal_add_release(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """red.release.sys.add: like signal_set_release, for counters raised by several producers."""
    _signal(ctx, sig, "add", value, release=True)
    yield STEP


def signal_set_release_at(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """signal_set_release at gpu or system scope (the device's ``kGpu``): one step here, where
    every rank shares one memory and scopes do not differ."""
    yield from signal_set_release(ctx, sig, value)


def signal_add_release_at(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """signal_add_release at gpu or system scope, as signal_set_release_at."""
    yield from signal_add_release(ctx, sig, value)


def signal_set_relaxed(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """st.relaxed.sys: sets the value, orders nothing (an acquirer of it gains no ordering)."""
    _signal(ctx, sig, "set", value, release=False)
    yield STEP


def signal_add_relaxed(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """red.relaxed.sys.add: adds, orders none of this agent's writes."""
    _signal(ctx, sig, "add", value, release=False)
    yield STEP


def fetch_add_relaxed(ctx: Ctx, sig: SigRef, value: int = 1) -> Gen:
    """atomicAdd (relaxed): adds in one step and returns the old value (e.g. a work ticket)."""
    old = _signal(ctx, sig, "add", value, release=False)
    yield STEP
    return old


def wait_acquire(ctx: Ctx, sig: SigRef, value: int, peer: int) -> Gen:
    """Spin (bounded by the deadline) until the signal equals ``value``; acquire."""
    yield Wait(sig, value, reset=False, peer=peer)


def wait_acquire_at(ctx: Ctx, sig: SigRef, value: int, peer: int) -> Gen:
    """wait_acquire at gpu or system scope (the device's ``kGpu``): the same step here, where
    every rank shares one memory and scopes do not differ."""
    yield from wait_acquire(ctx, sig, value, peer)


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
        flag = SigRef(pad, peer, (slot, ctx.rank))
        # NOTE: the device arrives with a CAS 0 -> 1: my previous call's arrival may not be
        # consumed yet by the peer's previous call. Only I set this flag, so wait-then-set is a CAS.
        yield Wait(flag, 0, reset=False, peer=peer)
        yield from signal_set_release(ctx, flag, 1)
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
# the interpreter models who writes what, when, through which proxy, not the transfer mechanism.
peer_store_v4 = peer_store
copy_v4_team = peer_store
fence_proxy_async_global = fence_proxy_async
reduce_add_bulk_f32 = reduce_add_bulk
reduce_add_bulk_bf16 = reduce_add_bulk
red_add_v2_f32_sys = reduce_add
red_add_f32_sys = reduce_add
red_add_v4_f32 = reduce_add
red_add_bf16x2 = reduce_add
