"""Worlds: who the ranks are and where their memory lives.

An emulated world holds W virtual ranks in one process, on the CPU (run by the interpreter) or on
one GPU (all ranks' CTAs in one launch). Every per-rank tensor is one tensor whose leading dimension
is the rank: ``x[r]`` is rank r's tensor. A distributed world is one process per GPU (torchrun); a
per-rank tensor is the local tensor, and symmetric buffers come from PyTorch's symmetric memory
(CUDA IPC peer mappings, never multicast).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .protocol import MAX_LOCAL_RANKS
from .runtime.gpu import raise_timeout
from .runtime.memory import SymBuffer

# NOTE: NVLink multicast / NVLS can take shared GPUs out of service on our machines; every path that
# may touch NCCL or symmetric memory keeps it off.
_NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast() -> None:
    for key, value in _NO_MULTICAST_ENV.items():
        os.environ[key] = value


disable_multicast()


def default_nodes(size: int) -> int:
    """One node per host: W // LOCAL_WORLD_SIZE when the launcher (torchrun) sets it, else 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1 or size % int(local):
        return 1
    return size // int(local)


# The most ranks an emulated CPU world holds: the interpreter's cost grows about as W^3 (each access
# is checked against the log with vector clocks of every agent): an all_gather of 8 x 8 per rank
# took 0.8 s at 16 ranks, 5 s at 32 and 42 s at 64 (one core). A GPU world holds what one launch
# serves (MAX_LOCAL_RANKS, the device's constant).
MAX_CPU_RANKS = 64


def _check_ranks(ranks: Any, device_type: str) -> int:
    if not isinstance(ranks, int) or isinstance(ranks, bool):
        raise TypeError(f"ranks must be an int (the number of virtual ranks), got {ranks!r}")
    most = MAX_LOCAL_RANKS if device_type == "cuda" else MAX_CPU_RANKS
    if not 1 <= ranks <= most:
        where = "one GPU launch serves" if device_type == "cuda" else "the CPU interpreter runs"
        raise ValueError(f"ranks must be in [1, {most}] ({where} at most {most}), got {ranks}")
    return ranks


def _check_timeout(timeout_s: Any) -> float:
    """A deadline in seconds: a finite real number > 0 (an infinite one would overflow the
    device's global-timer bound and is no deadline)."""
    want = "timeout_s must be a finite number of seconds > 0"
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
        raise TypeError(f"{want}, got {type(timeout_s).__name__} {timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{want}, got {timeout_s!r}")
    return timeout_s


def _check_nodes(ranks: int, nodes: Any) -> int:
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or ranks % nodes:
        raise ValueError(f"nodes must be a positive int dividing ranks={ranks}, got {nodes!r}")
    return nodes


@dataclass(eq=False)
class World:
    """The set of ranks an op runs over. Build one with ``World.emulated`` or
    ``from_process_group``."""

    size: int
    device: torch.device
    kind: str  # "emulated" | "distributed"
    nodes: int = 1
    rank: int = 0  # this process's rank (distributed); 0 in an emulated world
    group: Any = None
    timeout_s: float = 5.0
    # Calls are asynchronous: a GPU call enqueues its kernel and returns; a timed-out wait is raised
    # by the next call on this world, by ``check()``, and reported by the watchdog within a second
    # (``on_timeout(exc)`` if set, else a RuntimeWarning). True: each call waits for its kernel and
    # raises at once (debugging; costs a host synchronize per call).
    sync_checks: bool = False
    on_timeout: Any = field(default=None, repr=False)
    last_timeline: Any = field(default=None, repr=False)
    _buffers: dict[tuple, SymBuffer] = field(default_factory=dict, repr=False)
    _plans: dict[tuple, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def emulated(
        ranks: int, device: str | torch.device = "cpu", nodes: int = 1, timeout_s: float = 5.0
    ) -> World:
        """W virtual ranks in this process. device "cpu" runs ops in the CPU interpreter; "cuda"
        runs all ranks' CTAs in one launch on the current GPU. ``nodes`` splits the ranks into that
        many equal virtual nodes. ``timeout_s`` (a finite number of seconds > 0) bounds every
        wait. ``ranks`` is at most MAX_CPU_RANKS (64) on the CPU and MAX_LOCAL_RANKS (16, what
        one launch serves) on a GPU."""
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from e
        _check_ranks(ranks, dev.type)
        _check_nodes(ranks, nodes)
        timeout_s = _check_timeout(timeout_s)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' asked for, but torch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        return World(size=ranks, device=dev, kind="emulated", nodes=nodes, timeout_s=timeout_s)

    @staticmethod
    def from_process_group(
        group: Any = None, timeout_s: float = 5.0, nodes: int | None = None
    ) -> World:
        """One process per GPU: the world of ``group`` (default: the default process group).
        Symmetric buffers come from ``torch.distributed._symmetric_memory`` with multicast
        disabled. ``nodes`` (default: one node per host, W // LOCAL_WORLD_SIZE from the launcher,
        else 1) splits the ranks into equal contiguous nodes; with nodes > 1 the symmetric buffers
        come from NVSHMEM's heap instead (the nvshmem transport, mkernel/rdma_nvshmem.py), and
        the world spans every process of the job."""
        import torch.distributed as dist

        timeout_s = _check_timeout(timeout_s)
        if not dist.is_initialized():
            raise ValueError("from_process_group needs torch.distributed initialised (torchrun)")
        group = group if group is not None else dist.group.WORLD
        if not torch.cuda.is_available():
            raise ValueError("a distributed world needs a CUDA device per process")
        dev = torch.device("cuda", torch.cuda.current_device())
        size = dist.get_world_size(group)
        nodes = _check_nodes(size, default_nodes(size) if nodes is None else nodes)
        return World(
            size=size,
            device=dev,
            kind="distributed",
            nodes=nodes,
            rank=dist.get_rank(group),
            group=group,
            timeout_s=timeout_s,
        )

    def check(self) -> None:
        """Waits for this world's launches and raises CommTimeout if a wait timed out."""
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()
            raise_timeout(self)

    def reset(self) -> None:
        """Zeroes every workspace and signal pad of this world. Needed only after a CommTimeout in
        a distributed world (call it on every rank); an emulated world resets itself then."""
        handle = next((b.handle for b in self._buffers.values() if b.handle), None)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            if handle is not None:
                # every rank's kernels have ended before any rank zeroes: a late store or put of
                # a timed-out call would otherwise land in what was zeroed
                handle.barrier()
        rings = getattr(self, "_rdma", None)
        if rings is not None:
            # The fused ops' proxy rings (nodes > 1): stopped first (stop() drains the copies and
            # signal writes the proxies issued), so no put of the timed-out call lands in what is
            # zeroed below; emptied and restarted after.
            rings.stop()
        for buf in self._buffers.values():
            buf.local.zero_()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            if handle is not None:
                handle.barrier()
        if rings is not None:
            rings.reset()
            rings.start()
            rings.wait_ready()

    # -- properties -------------------------------------------------------------------------------
    @property
    def emulated_world(self) -> bool:
        return self.kind == "emulated"

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nodes

    def node_of(self, rank: int) -> int:
        """The node of ``rank``: ranks split into ``nodes`` equal contiguous groups. Within a node
        device code stores into peers directly; across nodes data moves only by rdma_put."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise ValueError(f"rank must be an int in [0, {self.size}), got {rank!r}")
        return rank // self.ranks_per_node

    def __repr__(self) -> str:
        return f"World({self.kind}, size={self.size}, device={self.device}, nodes={self.nodes})"

    # -- symmetric memory -------------------------------------------------------------------------
    def symmetric(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> SymBuffer:
        """A zero-initialised symmetric buffer, cached under ``key`` (ops keep their workspace and
        signal pads here between calls; signals reset themselves, so the cache stays valid)."""
        full_key = (key, tuple(shape), dtype)
        buf = self._buffers.get(full_key)
        if buf is None:
            buf = self._alloc(tuple(shape), dtype)
            self._buffers[full_key] = buf
        return buf

    def signal_pads(self) -> dict[tuple, torch.Tensor]:
        """Every signal pad this world holds, by key (its int32 symmetric buffers but those keyed
        as data, (op, buffer, "data"): MoE's row maps); tests check that each is back to all
        zeros after an op."""
        return {
            k: b.local
            for k, b in self._buffers.items()
            if b.local.dtype == torch.int32 and k[0][-1] != "data"
        }

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> SymBuffer:
        if self.emulated_world:
            t = torch.zeros((self.size, *shape), dtype=dtype, device=self.device)
            ptrs = None
            if self.on_gpu:
                stride = t[0].numel() * t.element_size()
                base = t.data_ptr()
                ptrs = torch.tensor(
                    [base + r * stride for r in range(self.size)], dtype=torch.int64
                )
                ptrs = ptrs.to(self.device)
            return SymBuffer(local=t, peer_ptrs=ptrs)
        if self.nodes > 1:  # across nodes the fused ops put through NVSHMEM: its heap
            from .rdma_nvshmem import world_buffer

            return world_buffer(self, shape, dtype)
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(shape, dtype=dtype, device=self.device)
        t.zero_()
        handle = symm_mem.rendezvous(t, self.group)
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        torch.cuda.synchronize()
        handle.barrier()
        return SymBuffer(local=t, peer_ptrs=ptrs, handle=handle)


def check_world(world: Any) -> World:
    if not isinstance(world, World):
        raise TypeError(f"world must be an mkernel.World, got {type(world).__name__}")
    return world
