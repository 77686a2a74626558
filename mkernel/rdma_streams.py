"""The one copy stream per GPU that every rdma proxy on it issues its copies on, kept out of the
hardware queues of the streams that launch kernels waiting for those copies.

Why (kernels/rdma_streams.h; measured on the H200, tools/queue_probe.py and
benchmarks/results/queue_probe_2026-12-01.json): CUDA feeds streams to the GPU through
CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default 8), dealt to streams in turn.
- A proxy stream in the launching stream's queue waits behind whatever is queued after the fused
  kernel (the next launch, an event, a matmul), while the kernel waits for its copies: with one
  queue every asynchronous loop stalled.
- Two proxy streams in one queue stalled as well: W = 8 proxies (a stream each) stalled with 8
  queues and not with 16; W = 16 stalled with 16 and not with 32.
So all proxies of a device share one stream (their copies are ordered, nothing else changes), and
that stream is probed against each launching stream (``ensure_independent``) and replaced when
it shares its queue.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

__all__ = ["CopyStream", "copy_stream"]

# The probe's deadline per candidate stream, in microseconds (a write that needs no SM lands in
# microseconds when its queue is free), and the candidates tried before giving up (more than the
# 32 hardware queues CUDA can have).
PROBE_US = 50_000
PROBE_TRIES = 33


class CopyStream:
    """A device's copy stream (``handle``), the launching streams it is known to be free of, and
    the proxy rings that use it (mkernel/rdma.py ProxyRing)."""

    def __init__(self, ext: Any, device: int) -> None:
        self.ext, self.device = ext, device
        self.handle: int = ext.copy_stream_create(device)
        self.independent_of: set[int] = set()
        self.rings: weakref.WeakSet[Any] = weakref.WeakSet()

    def ensure_independent(self, compute: int) -> None:
        """Makes sure the copy stream shares no hardware queue with ``compute`` (the handle of a
        stream about to launch a kernel that waits for the proxies' puts; 0 = the legacy default
        stream; not capturing a graph), moving every proxy on it to a new stream when it does.
        Once per launching stream. Raises RuntimeError when no stream is free of it (one
        hardware queue: CUDA_DEVICE_MAX_CONNECTIONS=1)."""
        if compute in self.independent_of:
            return
        for tries in range(PROBE_TRIES):
            if self.ext.stream_independent(self.handle, compute, self.device, PROBE_US):
                if tries:
                    # NOTE: a launching stream checked before may share the new stream's queue
                    self.independent_of.clear()
                    for ring in list(self.rings):
                        if any(p.running for p in ring.proxies):
                            ring.wait_ready()
                self.independent_of.add(compute)
                return
            self._move()
        conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8 (CUDA's default)")
        raise RuntimeError(
            f"rdma proxies of device {self.device}: none of {PROBE_TRIES} copy streams is free "
            f"of the launching stream's hardware queue (CUDA_DEVICE_MAX_CONNECTIONS={conn}); "
            "their copies would wait behind the kernel that waits for them. Emulated worlds "
            "over nodes need at least 2 connections (set CUDA_DEVICE_MAX_CONNECTIONS before CUDA "
            "starts)"
        )

    def _move(self) -> None:
        """Every proxy on this stream to a new one: stopped, given the stream, restarted as it
        was (each continues from its ring's tail)."""
        proxies = [(ring, p, p.running) for ring in list(self.rings) for p in ring.proxies]
        for _, p, _ in proxies:
            p.stop()
        self.ext.copy_stream_destroy(self.handle)  # freed once its queued work is done
        self.handle = self.ext.copy_stream_create(self.device)
        for ring, p, running in proxies:
            p.set_stream(self.handle)
            if running:
                p.start(ring._stalled)


_STREAMS: dict[int, CopyStream] = {}


def copy_stream(ext: Any, device: int) -> CopyStream:
    """The copy stream of ``device`` (made on first use, kept for the process's life)."""
    cs = _STREAMS.get(device)
    if cs is None:
        cs = _STREAMS[device] = CopyStream(ext, device)
    return cs
