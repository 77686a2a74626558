// rdma_put through the `nvshmem` transport: NVSHMEM's device-initiated put-with-signal, the path
// a real multi-node run takes (InfiniBand / RoCE / EFA through NVSHMEM's transports; NVLink P2P
// between the GPUs of one host). Same contract as the proxy's rdma_put (put.cuh): the destination
// observes the signal only after every byte of the put is visible there; the wait side is bounded
// and records a timeout in CommStatus like every wait (signal.cuh).
//
// Differences from the proxy transport, and why
// - Addresses are symmetric (nvshmem_malloc): `dst` and `signal` are this PE's addresses of the
//   symmetric objects, and NVSHMEM translates them for PE `pe`. Sources may be any device memory.
// - Signals are uint64 (NVSHMEM's signal type), raised by NVSHMEM_SIGNAL_SET or _ADD.
// - No ring, no host thread: nothing of the put depends on host progress, so there is nothing to
//   stall behind a host (the proxy's hardware-queue and driver hazards, docs/rdma.md, do not apply).
// - Non-blocking: the source may be rewritten only after `nvshmem_quiet()` by the poster (or the
//   destination's signal); the test kernel quiets before it ends.
// Only translation units built with -rdc and linked with libnvshmem_device include this header
// (mkernel/nvshmem_ext.py).
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "primitives/signal.cuh"

namespace mk::rdma::nv {

// A put of `bytes` from `src` (this GPU) to symmetric `dst` on PE `pe`, then `signal` on `pe` set
// to (or increased by) `value`, by the whole CTA (every thread must call it; NVSHMEM copies with
// all of them over NVLink, or hands the put to the NIC).
__device__ __forceinline__ void put_signal_block(void* dst, const void* src, size_t bytes,
                                                 uint64_t* signal, uint64_t value, bool add,
                                                 int pe) {
  nvshmemx_putmem_signal_nbi_block(dst, src, bytes, signal, value,
                                   add ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET, pe);
}

// Bounded wait until this PE's symmetric `signal` >= value (acquire): false on timeout / abort.
// NOTE: NVSHMEM's own nvshmem_signal_wait_until never gives up; this one records the site in
// CommStatus as every mkernel wait does, so the host raises CommTimeout naming rank and peer.
__device__ inline bool wait_signal_geq(const uint64_t* signal, uint64_t value, const WaitPolicy& w,
                                       const WaitSite& site) {
  const bool ok = spin_until(w, site, [&] {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(signal) : "memory");
    return v >= value;
  });
  fence_acq_rel_sys();
  return ok;
}

}  // namespace mk::rdma::nv
