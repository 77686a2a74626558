// rdma_put through the `proxy` transport: one thread posts a put descriptor into its rank's ring;
// a host proxy thread (kernels/rdma_proxy.cpp) copies the bytes and then raises the signal at the
// destination. Layout: primitives/rdma/ring_layout.h. Twin: mkernel/interp/rdma.py (docs/rdma.md).
//
// Protocol (poster = ONE thread; any number of posters of any CTAs share a rank's ring)
// 1. ticket t = atomicAdd(reserve, 1). `reserve` is in device memory and only this GPU's threads
//    touch it, so a device-scope relaxed atomic is enough. NOTE: not in the mapped host ring:
//    atomics on mapped host memory are not atomic with respect to the host and need PCIe AtomicOps
//    (cudaDevAttrHostNativeAtomicSupported is 0 on PCIe hosts); nothing here needs them.
// 2. back-pressure: wait (bounded) until tail >= t - capacity + 1, i.e. the proxy has finished
//    the put that last used slot t % capacity; then an acquire fence, so the proxy's reads of the
//    slot happen before our writes. A stalled proxy makes this wait time out: CommStatus names
//    pad kWaitTail, rank = peer = the ring's owner, task = t.
// 3. write the descriptor into slot t % capacity (weak stores to mapped host memory).
// 4. publish in ticket order: wait (bounded) until head == t, then head = t + 1 with a release at
//    system scope (st.release.sys: a fence.sys then the store), so the host proxy, acquiring
//    head, sees the whole descriptor. A poster whose earlier ticket gave up (abort) leaves head
//    behind: later posters then see `abort` and give up too.
//
// What the caller owns
// - The source: the proxy reads it LATER, from its own stream. Do not rewrite it until the
//   destination's signal says the put landed (the proxy raises it after its copy completed).
// - The destination and signal addresses: `dst` is the destination rank's device memory, `signal`
//   an int in mapped host memory that the proxy raises with a host atomic (release) after the
//   copy, or (kPutSetDevice) an int in device memory that the proxy's stream writes after the
//   copy; the receiver waits on it like any signal (signal.cuh: bounded, acquire).
// - A returned false (timeout or abort): the put may or may not happen; the launch reports it in
//   CommStatus and the host must reset the ring (stop the proxy, zero the counters) before reuse.
#pragma once
#include <cstdint>

#include "primitives/rdma/ring_layout.h"
#include "primitives/signal.cuh"

namespace mk::rdma {

// One rank's ring as device code sees it.
struct RingView {
  RingHeader* header;  // mapped host memory (device address == host address under UVA)
  int* reserve;        // device memory: this ring's ticket counter
  int capacity;
  int rank;
};

__device__ __forceinline__ RingView ring_view(void* rings, int* reserve, int rank, int capacity) {
  return {ring_header(rings, rank, capacity), reserve + rank, capacity, rank};
}

struct Put {
  int dest_rank;
  void* dst;        // the destination rank's device memory
  const void* src;  // this rank's device memory; owned by the caller until the signal rises
  uint64_t bytes;   // per row (0: a signal only)
  int* signal;      // mapped host memory (kPutSet / kPutAdd) or device memory (kPutSetDevice)
  int value;
  PutOp op;
  int rows = 1;  // > 1: a 2D copy of `rows` runs of `bytes`, the pitches apart
  uint64_t dst_pitch = 0, src_pitch = 0;
};

// Posts `put` into `ring` (call from ONE thread). Returns once the descriptor is published, not
// when the bytes land. False on timeout / abort (recorded in w.status; the caller carries on).
__device__ inline bool rdma_put(const RingView& ring, const Put& put, const WaitPolicy& w,
                                int role) {
  const int t = atomicAdd(ring.reserve, 1);
  RingHeader* h = ring.header;
  const int free_from = t - ring.capacity + 1;
  if (free_from > 0) {
    const WaitSite site{ring.rank, ring.rank, t, role, kWaitTail, 0};
    if (!spin_until(w, site, [&] { return ld_relaxed_sys(&h->tail) >= free_from; })) return false;
    fence_acq_rel_sys();
  }
  PutDescriptor* d = ring_slots(h) + t % ring.capacity;
  d->dst = reinterpret_cast<uint64_t>(put.dst);
  d->src = reinterpret_cast<uint64_t>(put.src);
  d->bytes = put.bytes;
  d->signal = reinterpret_cast<uint64_t>(put.signal);
  d->dest_rank = put.dest_rank;
  d->value = put.value;
  d->op = put.op;
  d->rows = put.rows;
  d->dst_pitch = put.dst_pitch;
  d->src_pitch = put.src_pitch;
  d->ticket = t;
  const WaitSite site{ring.rank, ring.rank, t, role, kWaitHead, 0};
  if (!spin_until(w, site, [&] { return ld_relaxed_sys(&h->head) == t; })) return false;
  // NOTE: the release orders the descriptor's stores above before head at system scope.
  st_release_sys(&h->head, t + 1);
  return true;
}

// The quiet (call from ONE thread): every put ticketed on `ring` so far is done (copied,
// signalled, its source read by the proxy): the tail has reached the ticket counter. A fused
// kernel ends with it, so that its caller may rewrite a put's source. False on timeout.
__device__ inline bool rdma_quiet(const RingView& ring, const WaitPolicy& w, int role) {
  const int issued = atomicAdd(ring.reserve, 0);
  const WaitSite site{ring.rank, ring.rank, issued - 1, role, kWaitTail, 0};
  return spin_until(w, site, [&] { return ld_relaxed_sys(&ring.header->tail) >= issued; });
}

}  // namespace mk::rdma
