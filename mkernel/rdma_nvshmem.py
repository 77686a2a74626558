"""rdma_put through the ``nvshmem`` transport (issue 14): NVSHMEM's device-initiated put-with-signal
in a distributed world, one process per GPU (PE = rank), the path real multi-node runs take. The
ranks are split into virtual nodes (``World.from_process_group(nodes=)``), and the test exchange
sends every rank's row to a rank of the next node, so every transfer takes this path even across
the GPUs of one host. Device side: primitives/rdma/put_nvshmem.cuh; kernel: kernels/nvshmem_test.cu;
extension: mkernel/nvshmem_ext.py (needs the ``nvidia-nvshmem-cu13`` wheel).

    world = mkernel.World.from_process_group(nodes=2)     # under torchrun, one GPU per process
    with NvshmemTransport(world) as nv:                    # bootstraps NVSHMEM (collective)
        dst, out = nv.exchange(src, puts=16)               # src: [n] bytes of this rank's row

A call is synchronous and collective (every rank calls it with the same sizes): it launches the
kernel, a barrier on the stream (the next call's puts must not land before this call's receivers
consumed their signals), and raises CommTimeout if a receiver's wait timed out.

The fused ops over several nodes in a distributed world use it too (``world_buffer``,
``world_transport``): their symmetric buffers come from NVSHMEM's heap, and their kernels are the
``kernels/<op>_nodes.cu`` built into the nvshmem extension (templates/persistent.cuh with
MK_RDMA_NVSHMEM). A buffer's peer table holds a node peer's NVLink address (nvshmem_ptr) and, for a
rank of another node, this rank's own address tagged with ``SYM_TAG``: the symmetric address
NVSHMEM translates for that PE, which faults if device code dereferences it.
"""

from __future__ import annotations

import math
import weakref
from types import ModuleType
from typing import Any

import torch

from .errors import CommTimeout
from .protocol import STATUS_FIELDS
from .rdma import _check_buffer
from .runtime.gpu import StatusBlock
from .runtime.memory import SymBuffer

__all__ = [
    "SYM_TAG",
    "NvshmemTransport",
    "check_exchange",
    "peer_table",
    "shutdown",
    "world_buffer",
    "world_transport",
]

SYM_TAG = 1 << 62  # primitives/rdma/put_nvshmem.cuh kSymTag


class _CudaArray:
    """A device allocation that torch.as_tensor can view (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


_USERS = 0  # open transports of this process: NVSHMEM is initialized once, finalized by the last


class NvshmemTransport:
    """NVSHMEM on the ranks of ``world`` (a distributed world: World.from_process_group), with a
    symmetric buffer pool per size and a status block. Bootstraps by a unique id that rank 0 makes
    and the world's process group broadcasts; NVSHMEM is initialized once per process, so a second
    transport (the fused ops' world's, ``world_transport``) shares it if its ranks are the same PEs,
    and the last one closed finalizes it."""

    def __init__(self, world: Any, ext: ModuleType | None = None) -> None:
        import torch.distributed as dist

        if getattr(world, "kind", None) != "distributed":
            raise ValueError(
                "the nvshmem transport runs in a distributed world, one process per GPU "
                "(World.from_process_group(nodes=N)); emulated worlds use the proxy transport"
            )
        if world.nodes < 2:
            raise ValueError(
                f"the nvshmem transport carries puts across nodes: the world has {world.nodes}; "
                "split it with World.from_process_group(nodes=N), N >= 2"
            )
        if ext is None:
            from . import nvshmem_ext

            ext = nvshmem_ext.load()
        self.ext, self.world = ext, world
        self.rank, self.world_size, self.nodes = world.rank, world.size, world.nodes
        self.device = world.device
        global _USERS
        if ext.initialized():  # another transport of this process (e.g. the fused ops' world's)
            _check_same_pes(ext.my_pe(), ext.n_pes(), world)
        else:
            uid = [ext.get_unique_id() if self.rank == 0 else None]
            src = dist.get_global_rank(world.group, 0)
            dist.broadcast_object_list(uid, src=src, group=world.group)
            with torch.cuda.device(self.device):
                torch.zeros(1, device=self.device)  # NOTE: NVSHMEM needs the context current
                ext.init(self.rank, self.world_size, uid[0])
        _USERS += 1
        self._closed = False
        self._sym: dict[str, tuple[int, int]] = {}  # name -> (ptr, bytes)
        self._allocs: list[int] = []  # allocate()'s, kept until close()
        self.status = StatusBlock()  # CommStatus in pinned memory, as the fused ops' launches
        self.launches = 0

    # -- symmetric memory ----------------------------------------------------------------------
    def symmetric(self, name: str, nbytes: int) -> tuple[int, torch.Tensor]:
        """A zeroed symmetric buffer of at least ``nbytes`` (collective: every rank asks for the
        same), kept by name and grown when asked for more; its address and a uint8 view."""
        ptr, have = self._sym.get(name, (0, 0))
        if have >= nbytes:
            return ptr, self._view(ptr, have)
        if ptr:
            torch.cuda.synchronize(self.device)
            self.ext.free(ptr)
        ptr, view = self._zeroed(nbytes)
        self._sym[name] = (ptr, nbytes)
        return ptr, view

    def allocate(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A zeroed symmetric allocation of ``nbytes`` kept until ``close()`` (collective: every
        rank allocates the same sizes in the same order); its address and a uint8 view."""
        ptr, view = self._zeroed(nbytes)
        self._allocs.append(ptr)
        return ptr, view

    def _zeroed(self, nbytes: int) -> tuple[int, torch.Tensor]:
        ptr = self.ext.malloc(max(1, nbytes))
        view = self._view(ptr, nbytes)
        # NOTE: nvshmem_malloc does not zero; no peer may put into it before it is zeroed
        with torch.cuda.device(self.device):
            view.zero_()
            self.barrier()
        return ptr, view

    def _view(self, ptr: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(ptr, (nbytes,), "|u1"), device=self.device)

    def barrier(self) -> None:
        """Every rank's work queued so far on its current stream is done (collective)."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            self.ext.barrier_all_on_stream(stream.cuda_stream)
            stream.synchronize()

    # -- the test exchange ---------------------------------------------------------------------
    def exchange(
        self,
        src: torch.Tensor,
        puts: int,
        *,
        posters: int = 1,
        op: str = "set",
        receive: str = "copy",
        timeout_s: float = 5.0,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank puts ``src`` (a contiguous CUDA tensor, its bytes cut in ``puts`` equal tiles
        of a multiple of 16 bytes) into the symmetric buffer of rank ``(rank + W // nodes) % W``,
        by ``posters`` CTAs, each tile with its signal; this rank's receivers wait (bounded) for
        the tiles of rank ``(rank - W // nodes) % W`` and, with ``receive="copy"``, copy each into
        ``out`` after its signal. Unfused meaning: ``dst = src of the previous node's rank``.
        Returns (dst, out): dst a copy of what landed in the symmetric buffer."""
        ext = self.ext
        ops, receives = dict(ext.OPS), dict(ext.RECEIVE)
        nbytes = check_exchange(src, self.device, puts, posters, op, receive, timeout_s)
        dst_ptr, dst_view = self.symmetric("dst", nbytes)
        sig_ptr, _ = self.symmetric("signals", 8 * max(puts, posters))
        if receive == "copy":
            out = _check_buffer("out", out, src)
        a = ext.NvTestArgs()
        a.src, a.dst, a.signals = src.data_ptr(), dst_ptr, sig_ptr
        a.out = out.data_ptr() if out is not None else 0
        a.status = self.status.ptr()
        a.bytes, a.timeout_ns = nbytes // puts, int(timeout_s * 1e9)
        a.rank, a.world_size, a.nodes = self.rank, self.world_size, self.nodes
        a.puts, a.posters, a.op, a.receive = puts, posters, ops[op], receives[receive]
        self.launches += 1
        a.launch = self.launches
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            rc = ext.launch_nvshmem_test(a, stream.cuda_stream)
            if rc != 0:
                raise RuntimeError(f"launch_nvshmem_test: {ext.nvshmem_test_status_string(rc)}")
            # NOTE: copied before the barrier: once past it a peer's next call may put into the
            # symmetric buffer while this rank still reads it (measured: 3 of 24 cases compared
            # the next case's bytes on a rank that lagged)
            dst = dst_view[:nbytes].view(src.dtype).view(src.shape).clone()
            # NOTE: the next call's puts must not land before this call's receivers zeroed
            ext.barrier_all_on_stream(stream.cuda_stream)
            stream.synchronize()
        self._raise_timeout()
        return dst, out

    def _raise_timeout(self) -> None:
        if not self.status.error:
            return
        v = dict(zip(STATUS_FIELDS, self.status.t.tolist(), strict=True))
        self.status.t.zero_()
        raise CommTimeout(
            v["rank"],
            v["peer"],
            f"landed[{v['rank']}][{v['index']}]",
            v["task"],
            "receiver",
            "nvshmem transport: the put or its signal did not arrive (signals are now unknown: "
            "close the transport)",
        )

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Frees this transport's symmetric buffers (collective) and, when it is the process's
        last transport, finalizes NVSHMEM."""
        global _USERS
        if self._closed:
            return
        torch.cuda.synchronize(self.device)
        for ptr in [p for p, _ in self._sym.values()] + self._allocs:
            self.ext.free(ptr)
        self._sym.clear()
        self._allocs.clear()
        self._closed = True
        _USERS -= 1
        if _USERS == 0:
            self.ext.finalize()

    def __enter__(self) -> NvshmemTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the fused ops' worlds ------------------------------------------------------------------------

_TRANSPORT: NvshmemTransport | None = None  # NVSHMEM is initialized once per process
_WORLDS: weakref.WeakSet = weakref.WeakSet()  # the worlds whose buffers are on its heap


def world_transport(world: Any) -> NvshmemTransport:
    """The process's transport, bootstrapped by the first distributed world of several nodes that
    asks (collective: every rank of the world asks at the same call). A later world must be the
    same ranks (PE = rank), since NVSHMEM cannot be initialized twice in a process."""
    global _TRANSPORT
    if _TRANSPORT is None:
        import torch.distributed as dist

        if world.size != dist.get_world_size() or world.rank != dist.get_rank():
            raise ValueError(
                "a distributed world over nodes spans every process (NVSHMEM's PEs are the "
                f"default group's ranks): this world has {world.size} ranks, the job "
                f"{dist.get_world_size()}"
            )
        _TRANSPORT = NvshmemTransport(world)
    else:
        _check_same_pes(_TRANSPORT.rank, _TRANSPORT.world_size, world)
    return _TRANSPORT


def _check_same_pes(pe: int, n_pes: int, world: Any) -> None:
    """NVSHMEM, initialized once per process as PE ``pe`` of ``n_pes``, serves ``world`` only if
    the world's ranks are those PEs."""
    if (pe, n_pes) != (world.rank, world.size):
        raise ValueError(
            f"NVSHMEM runs as PE {pe} of {n_pes} in this process; a world of {world.size} ranks "
            f"(rank {world.rank}) cannot use it"
        )


def shutdown() -> None:
    """Frees the fused ops' NVSHMEM buffers and finalizes NVSHMEM (collective). The worlds that
    used them forget their buffers and plans, so a later call on one of them starts NVSHMEM
    again (collectively) rather than touching freed memory."""
    global _TRANSPORT
    if _TRANSPORT is not None:
        _TRANSPORT.close()
        _TRANSPORT = None
    for world in list(_WORLDS):
        world._buffers.clear()
        world._plans.clear()
    _WORLDS.clear()


def peer_table(ptr: int, rank: int, world_size: int, per_node: int, peer_ptr: Any) -> list[int]:
    """The peer table of a symmetric allocation at ``ptr`` on ``rank``: its own address; a node
    peer's NVLink address (``peer_ptr(ptr, r)``: nvshmem_ptr, 0 when unreachable, an error); a
    rank of another node, ``ptr | SYM_TAG`` (what the device hands NVSHMEM, never dereferences)."""
    table = []
    for r in range(world_size):
        if r == rank:
            table.append(ptr)
        elif r // per_node == rank // per_node:
            p = peer_ptr(ptr, r)
            if not p:
                raise RuntimeError(
                    f"rank {r} is in rank {rank}'s node but NVSHMEM gives no NVLink address of "
                    "its memory (nvshmem_ptr): a node's ranks must share NVLink"
                )
            table.append(p)
        else:
            table.append(ptr | SYM_TAG)
    return table


class _Barrier:
    """The SymBuffer handle of an NVSHMEM-backed buffer (World.reset calls barrier())."""

    def __init__(self, transport: NvshmemTransport) -> None:
        self.transport = transport

    def barrier(self) -> None:
        self.transport.barrier()


def world_buffer(world: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A zeroed symmetric buffer of a distributed world of several nodes, from NVSHMEM's heap
    (collective), as a SymBuffer (mkernel/runtime/memory.py)."""
    nv = world_transport(world)
    _WORLDS.add(world)
    nbytes = math.prod(shape) * dtype.itemsize
    ptr, view = nv.allocate(nbytes)
    t = view[:nbytes].view(dtype).view(shape)
    table = peer_table(ptr, world.rank, world.size, world.ranks_per_node, nv.ext.peer_ptr)
    ptrs = torch.tensor(table, dtype=torch.int64, device=world.device)
    return SymBuffer(local=t, peer_ptrs=ptrs, handle=_Barrier(nv))


def check_exchange(
    src: Any,
    device: torch.device,
    puts: Any,
    posters: Any,
    op: Any,
    receive: Any,
    timeout_s: Any,
) -> int:
    """Every check of ``NvshmemTransport.exchange`` before anything is launched (no GPU needed);
    returns the bytes of ``src``."""
    if not isinstance(src, torch.Tensor) or src.device != device:
        raise ValueError(f"src must be a tensor on {device}")
    if not src.is_contiguous() or src.data_ptr() % 16:
        raise ValueError("src must be contiguous and 16-byte aligned")
    if not isinstance(puts, int) or isinstance(puts, bool) or puts < 1:
        raise ValueError(f"puts must be an int >= 1, got {puts!r}")
    if not isinstance(posters, int) or isinstance(posters, bool) or not 1 <= posters <= puts:
        raise ValueError(f"posters must be an int in [1, puts={puts}], got {posters!r}")
    if op not in ("set", "add"):
        raise ValueError(f"op must be 'set' or 'add', got {op!r}")
    if receive not in ("copy", "wait"):
        raise ValueError(f"receive must be 'copy' or 'wait', got {receive!r}")
    if not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    nbytes = src.numel() * src.element_size()
    if nbytes == 0 or nbytes % puts or (nbytes // puts) % 16:
        raise ValueError(f"bytes per put ({nbytes} / {puts}) must be a positive multiple of 16")
    return nbytes
