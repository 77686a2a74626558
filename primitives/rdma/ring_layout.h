// The `proxy` RDMA transport's descriptor ring: ONE layout, read by the device poster
// (primitives/rdma/put.cuh) and by the host proxy (kernels/rdma_proxy.cpp). Plain C++: no CUDA
// headers, so host-only translation units include it too.
//
// Memory (per GPU rank):
//   pinned, mapped host memory (cudaHostAllocMapped; under UVA the device address is the host one)
//     RingHeader                        head (posters -> proxy), tail (proxy -> posters), capacity
//     PutDescriptor slots[capacity]     the slot of count n is slots[n % capacity]
//   device memory
//     int reserve                       tickets; only device threads touch it (see put.cuh)
// The W rings of an emulated world sit back to back: ring r at base + r * ring_bytes(capacity).
//
// Counters are monotonic int32: a ring serves fewer than 2^31 puts between resets (the Python side
// checks). Wrap-around of the slots is only the modulo.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MK_RDMA_HD __host__ __device__
#else
#define MK_RDMA_HD
#endif

namespace mk::rdma {

// How the proxy raises the destination's signal after the bytes landed. Set / add: an int in
// mapped host memory, by a host atomic (release) after the copy's stream synchronize. SetDevice:
// an int in device memory (a fused op's signal pad), by a stream write ordered after the copy on
// the proxy's stream (cuStreamWriteValue32, whose default fences the copy's writes before it).
enum PutOp : int32_t { kPutSet = 0, kPutAdd = 1, kPutSetDevice = 2 };

// Counters that one side writes and the other polls each get their own 64-byte line: the GPU's
// writes of `head` over PCIe never invalidate the line the proxy writes `tail` into.
struct RingHeader {
  alignas(64) int32_t head;  // puts published: written by posters (release), polled by the proxy
  alignas(64) int32_t tail;  // puts done (copied and signalled): written by the proxy (release)
  alignas(64) int32_t capacity;  // slots; written once by the host before the proxy starts
  int32_t rank;                  // the ring's owner (names in errors)
};
static_assert(offsetof(RingHeader, head) == 0, "ring layout: head");
static_assert(offsetof(RingHeader, tail) == 64, "ring layout: tail");
static_assert(offsetof(RingHeader, capacity) == 128, "ring layout: capacity");
static_assert(sizeof(RingHeader) == 192, "ring layout: header size");

// One put: copy `rows` runs of `bytes` from `src` (the poster's device memory, rows
// `src_pitch` bytes apart) to `dst` (the destination rank's device memory, `dst_pitch` apart),
// then raise the int at `signal` by `op` with `value`. A put of no bytes only signals.
struct PutDescriptor {
  uint64_t dst;
  uint64_t src;
  uint64_t bytes;  // per row
  uint64_t signal;
  uint64_t dst_pitch;  // rows > 1: bytes from one row's start to the next
  uint64_t src_pitch;
  int32_t dest_rank;
  int32_t value;
  int32_t op;      // PutOp
  int32_t ticket;  // the count this slot was written for (lets the proxy check the slot is fresh)
  int32_t rows;    // >= 1 (a tile of an fp32 matrix: its rows)
  int32_t unused;
};
static_assert(sizeof(PutDescriptor) == 72, "ring layout: descriptor size");
static_assert(offsetof(PutDescriptor, dest_rank) == 48, "ring layout: descriptor fields");

// Which wait of the poster timed out: CommStatus.pad (the launch names it by these ids).
enum RingWait : int32_t { kWaitTail = 0, kWaitHead = 1, kRingWaits = 2 };

// Bytes of one ring, rounded up to 64 so that the next ring's header keeps its alignment.
MK_RDMA_HD constexpr size_t ring_bytes(int capacity) {
  const size_t bytes = sizeof(RingHeader) + static_cast<size_t>(capacity) * sizeof(PutDescriptor);
  return (bytes + 63) / 64 * 64;
}
static_assert(ring_bytes(1) == 320 && ring_bytes(4) == 512, "ring layout: ring size");

MK_RDMA_HD inline RingHeader* ring_header(void* base, int rank, int capacity) {
  return reinterpret_cast<RingHeader*>(static_cast<char*>(base) + rank * ring_bytes(capacity));
}

MK_RDMA_HD inline PutDescriptor* ring_slots(RingHeader* header) {
  return reinterpret_cast<PutDescriptor*>(header + 1);
}

}  // namespace mk::rdma
