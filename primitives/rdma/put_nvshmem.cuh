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

#include "primitives/rdma/put.cuh"
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

// -- the fused ops over nodes (templates/persistent.cuh, built with MK_RDMA_NVSHMEM) --------------
//
// A distributed world of several nodes allocates its symmetric buffers from NVSHMEM's heap
// (mkernel/rdma_nvshmem.py). Their peer tables hold, for a rank of this node, its NVLink address
// (nvshmem_ptr), and for a rank of another node THIS rank's address of the same object tagged with
// kSymTag: what NVSHMEM needs (the symmetric address, translated for the destination PE), and an
// address that faults if device code dereferences it (no peer pointer into another node).
constexpr uint64_t kSymTag = 1ull << 62;  // mkernel/rdma_nvshmem.py SYM_TAG

template <class T>
__device__ __forceinline__ T* sym_address(T* tagged) {
  return reinterpret_cast<T*>(reinterpret_cast<uint64_t>(tagged) & ~kSymTag);
}

// f(dst, src, bytes) for each contiguous run of `put`'s rectangle (rows of `bytes`, the pitches
// apart; dst untagged): one run when its rows lie back to back in both places.
template <class F>
__device__ __forceinline__ void for_each_run(const Put& put, F&& f) {
  char* dst = static_cast<char*>(sym_address(put.dst));
  const char* src = static_cast<const char*>(put.src);
  if (put.rows == 1 || (put.dst_pitch == put.bytes && put.src_pitch == put.bytes)) {
    f(dst, src, put.bytes * put.rows);
    return;
  }
  for (int r = 0; r < put.rows; ++r) f(dst + r * put.dst_pitch, src + r * put.src_pitch, put.bytes);
}

// After the put's bytes were posted: nvshmem_fence orders the flag after every one of them at the
// destination PE, so the receiver's acquire of the flag (signal.cuh) sees the data.
__device__ __forceinline__ void fence_then_set(const Put& put) {
  if (put.bytes > 0) nvshmem_fence();
  nvshmem_int_atomic_set(sym_address(put.signal), put.value, put.dest_rank);
}

// A fused op's cross-node raise, by ONE thread: `put`'s rectangle (dst and signal tagged
// symmetric addresses, src this GPU's memory) into PE put.dest_rank, then its int flag set to
// put.value.
// NOTE: a thread's put over NVLink copies with that one thread (slow for big tiles); over a
// network NVSHMEM hands it to the NIC. The source is read later: nvshmem_quiet (end of CTA).
__device__ inline void put_then_set(const Put& put) {
  if (put.bytes > 0)
    for_each_run(put, [&](char* dst, const char* src, size_t bytes) {
      nvshmem_putmem_nbi(dst, src, bytes, put.dest_rank);
    });
  fence_then_set(put);
}

// The same by a team of the CTA that every member calls: a warp (size 32) or the whole CTA (size
// blockDim.x); NVSHMEM splits the copy among them (over NVLink a warp or a CTA copies far faster
// than one thread). After the team's sync, lane 0 fences and sets the flag: the members' copies
// happen before it through the sync, as every team write before a raise in the template.
// NOTE: over a network this relies on NVSHMEM ordering a group put before a fence of one of the
// group's threads (its group calls post from one thread); checked over NVLink only.
template <class Team>
__device__ inline void put_then_set_team(const Put& put, const Team& team) {
  if (put.bytes > 0)
    for_each_run(put, [&](char* dst, const char* src, size_t bytes) {
      if (team.size == 32) {
        nvshmemx_putmem_nbi_warp(dst, src, bytes, put.dest_rank);
      } else {
        nvshmemx_putmem_nbi_block(dst, src, bytes, put.dest_rank);
      }
    });
  team.sync();
  if (team.lane == 0) fence_then_set(put);
}

}  // namespace mk::rdma::nv
