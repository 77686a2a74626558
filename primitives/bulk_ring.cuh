// bulk_ring.cuh: global -> global copies (into a peer's memory, or local) by TMA alone, driven by
// ONE thread: a ring of kStages shared-memory buffers, each filled by a bulk load that completes on
// the buffer's mbarrier and drained by a bulk store (or a bf16 / fp32 reduce-store) that the same
// thread issues. Up to kStores stores are in flight while the other buffers load.
//
// Why: a copy that loads a chunk with the CTA's threads, waits, then issues one bulk store keeps
// one chunk in flight and reached 8 GB/s per CTA over NVLink (benchmarks/results/p2p_w2_*.json);
// a link needs ~45 GB/s per CTA for 8 CTAs to fill it. Loads and stores both asynchronous, several
// of each in flight, hide the latency of both directions, and the copy costs one thread: an idle
// warp's lane of a compute CTA, or a comm CTA whose other warps do something else.
//
//   chunk:   0    1    2    3    4    5    6 ...        (kStages = 4, kStores = 2)
//   load     L0   L1   L2   L3        L4   L5           L4 refills chunk 0's buffer once
//   store              S0   S1   S2   S3   S4 ...        S0 has read it (wait_group.read 1)
//
// Protocol (issuer = one thread; the ring's buffers and barriers are its own):
//   ring.init()          before the first copy: mbarriers (count 1); then mbar_fence_init
//   ring.inval()         after the last (every load has completed by then): the barriers' shared
//                        memory may be used otherwise, or init() run again (an op whose copies
//                        are separate tasks brackets each one: no state survives the task)
//   ring.copy(dst, src, bytes, drain)   any number of times; returns with every store issued and
//                        every buffer read (so the ring is free again), not with the data landed
//   ring.stream(n, at, drain)           the same for n chunks that need not be contiguous: at(c)
//                        gives chunk c's {dst, src, bytes} (rows gathered by index: MoE expands)
//   ring.landed()        bulk_wait_all: every byte of every copy is at its destination (before a
//                        release that tells a peer, signal.cuh)
// src must not change until copy() returns; dst may be written by nobody else meanwhile (a peer
// learns of the bytes only through the signal after landed()). bytes and both addresses: multiples
// of 16; chunk_bytes a multiple of 16 (<= 2^20: one bulk op each).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "primitives/comm.cuh"
#include "primitives/gemm/mbarrier.cuh"

namespace mk {

enum class Drain : int { kStore = 0, kReduceAddBf16 = 1, kReduceAddF32 = 2 };

// One chunk of a stream: bytes <= the ring's chunk_bytes, multiples of 16 and 16-byte aligned.
struct BulkChunk {
  char* dst;
  const char* src;
  uint32_t bytes;
};

template <int kStages, int kStores>
struct BulkRing {
  static_assert(kStages >= 2 && kStores >= 1 && kStores < kStages,
                "a ring needs a buffer loading while kStores store");
  char* buffers;   // kStages x chunk_bytes of shared memory, 16-byte aligned
  uint64_t* full;  // kStages mbarriers in shared memory
  int chunk_bytes;
  unsigned long long used = 0;  // chunks through the ring so far: buffer and phase of the next

  __device__ void init() {
    for (int s = 0; s < kStages; ++s) gemm::mbar_init(&full[s], 1);
    gemm::mbar_fence_init();
  }

  __device__ void copy(char* dst, const char* src, long long bytes, Drain drain) {
    const long long chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
    stream(
        chunks,
        [&](long long c) {
          const long long rest = bytes - c * chunk_bytes;
          const uint32_t n = (uint32_t)(rest < chunk_bytes ? rest : chunk_bytes);
          return BulkChunk{dst + c * chunk_bytes, src + c * chunk_bytes, n};
        },
        drain);
  }

  // Chunks at(0) .. at(chunks - 1) through the ring (at(c) is asked twice: load and drain).
  template <class At>
  __device__ void stream(long long chunks, At at, Drain drain) {
    const long long first = chunks < kStages ? chunks : kStages;
    for (long long c = 0; c < first; ++c) load(at(c), c);
    for (long long c = 0; c < chunks; ++c) {
      const unsigned long long g = used + c;
      const int s = (int)(g % kStages);
      gemm::mbar_wait(&full[s], (uint32_t)((g / kStages) & 1));
      const BulkChunk k = at(c);
      drain_one(k.dst, buffers + s * chunk_bytes, k.bytes, drain);
      bulk_commit();
      const long long r = c - (kStores - 1);  // oldest store that may still read its buffer
      if (r >= 0 && r + kStages < chunks) {
        bulk_wait_read_n<kStores - 1>();  // chunk r's buffer is read: refill it
        load(at(r + kStages), r + kStages);
      }
    }
    bulk_wait_read();  // every buffer free for the next copy
    used += chunks;
  }

  __device__ void landed() const { bulk_wait_all(); }

  __device__ void inval() {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(&full[s])) : "memory");
    used = 0;
  }

 private:
  __device__ void load(const BulkChunk& k, long long c) {
    const int s = (int)((used + c) % kStages);
    gemm::mbar_arrive_expect_tx(&full[s], k.bytes);
    bulk_load(buffers + s * chunk_bytes, k.src, k.bytes, &full[s]);
  }

  __device__ static void drain_one(char* dst, const char* buf, uint32_t n, Drain drain) {
    switch (drain) {
      case Drain::kStore: tile_send_bulk(dst, buf, n); break;
      case Drain::kReduceAddBf16:
        reduce_add_bulk_bf16(reinterpret_cast<__nv_bfloat16*>(dst),
                             reinterpret_cast<const __nv_bfloat16*>(buf), n);
        break;
      case Drain::kReduceAddF32:
        reduce_add_bulk_f32(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(buf), n);
        break;
    }
  }
};

// A BulkRing that lives as long as a comm unit, laid out in its shared memory as [kStages buffers
// of kChunkBytes][kStages mbarriers][chunks through it so far]: begin() once before the unit's
// first task, copy() in any task, end() after its last (the persistent template's comm_begin /
// comm_end hooks). Why: a ring initialised and invalidated per task made compute-sanitizer
// racecheck report write-write hazards between successive tasks' bulk loads into a buffer (the
// tool does not follow the completions across mbarrier re-initialisation); kept initialised, the
// buffers' reuse is ordered by the barriers' phases, which it does follow.
template <int kStages, int kStores, int kChunkBytes>
struct UnitRing {
  static constexpr int kChunk = kChunkBytes;
  static constexpr int kSmemBytes = kStages * kChunkBytes + 8 * kStages + 8;
  char* smem;
  __device__ BulkRing<kStages, kStores> ring() const {
    return BulkRing<kStages, kStores>{smem, barriers(), kChunkBytes, used()};
  }
  __device__ uint64_t* barriers() const {
    return reinterpret_cast<uint64_t*>(smem + kStages * kChunkBytes);
  }
  __device__ unsigned long long& used() const {
    return *reinterpret_cast<unsigned long long*>(smem + kStages * kChunkBytes + 8 * kStages);
  }
  __device__ void begin() const {
    auto r = ring();
    r.init();
    used() = 0;
  }
  // Copies as BulkRing::copy does (every store issued and every buffer read on return).
  __device__ void copy(char* dst, const char* src, long long bytes, Drain drain) const {
    auto r = ring();
    r.copy(dst, src, bytes, drain);
    used() = r.used;
  }
  template <class At>
  __device__ void stream(long long chunks, At at, Drain drain) const {
    auto r = ring();
    r.stream(chunks, at, drain);
    used() = r.used;
  }
  __device__ void end() const { ring().inval(); }
};

}  // namespace mk
