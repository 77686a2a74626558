"""Symmetric memory: ``SymBuffer`` (a buffer every rank can address in every peer) and an op's
workspace (every symmetric buffer and signal pad its spec declares, kept on the world)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..protocol import BARRIER_PAD, MAX_BARRIER_SLOTS, buffer_shape, pad_shape

if TYPE_CHECKING:
    from ..schedule import Plan
    from ..world import World


@dataclass
class SymBuffer:
    """A symmetric buffer: the same shape on every rank, each rank able to address every peer's.

    ``local`` is this process's view: in an emulated world the [W, ...] tensor of all ranks; in a
    distributed world the local rank's tensor. ``peer_ptrs`` (int64, on the world's device) holds
    the address of every rank's buffer, for device code (``SymPtr::map(rank)``).
    """

    local: torch.Tensor
    peer_ptrs: torch.Tensor | None
    handle: Any = None


# -- workspace: every symmetric buffer and signal pad the spec declares ----------------------------


def barrier_pad(world: World) -> SymBuffer:
    """The template's entry-barrier flags, [MAX_BARRIER_SLOTS, W] int32, shared by every op."""
    return world.symmetric(("fused", BARRIER_PAD), (MAX_BARRIER_SLOTS, world.size), torch.int32)


def workspace(world: World, plan: Plan) -> dict[str, SymBuffer | None]:
    """The op's symmetric buffers and pads by name (allocated once per shape, kept on the world;
    pads reset themselves). A buffer declared ``when="distributed"`` is None in emulated worlds,
    ``when="ranks"`` at W = 1."""
    spec, sizes = plan.spec, plan.sizes
    out: dict[str, SymBuffer | None] = {BARRIER_PAD: barrier_pad(world)}
    for b in spec.buffers:
        if b.kind == "symmetric":
            wanted = b.when == "always" or (
                world.size > 1 and (b.when == "ranks" or not world.emulated_world)
            )
            shape = buffer_shape(b, sizes)
            # int32 data (MoE's row maps) is keyed apart from signal pads (World.signal_pads)
            key = (spec.name, b.name, "data") if b.dtype == torch.int32 else (spec.name, b.name)
            out[b.name] = world.symmetric(key, shape, b.dtype) if wanted else None
    for p in spec.all_pads()[1:]:
        out[p.name] = world.symmetric((spec.name, p.name), pad_shape(spec, p, sizes), torch.int32)
    return out
