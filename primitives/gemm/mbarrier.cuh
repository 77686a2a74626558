// mbarrier.cuh: shared-memory mbarriers for the GEMM engine's TMA pipeline (sm_90a).
//
// Protocol (one pipeline stage = one "full" and one "empty" barrier):
//   * init:     ONE thread calls mbar_init(bar, count) for every barrier, then the participating
//               threads pass a barrier (named barrier / __syncthreads) before anyone touches them.
//   * producer: waits "empty" with parity (phase ^ 1) (a fresh barrier counts its previous phase as
//               complete, so the first round passes at once), then mbar_arrive_expect_tx on "full"
//               with the byte count of the TMA loads that will complete_tx on it.
//   * consumer: waits "full" with parity `phase`, reads the stage, then arrives on "empty" (one arrive
//               per consumer warpgroup).
//   * phases flip each time a stage index wraps; they are never reset, so the pipeline carries over
//               from one tile to the next.
// Waits here are unbounded by design: they wait on this CTA's own producer/consumers, which always
// make progress (cross-GPU waits, which need deadlines, live in the communication primitives).
#pragma once
#include <cstdint>

#include "../comm.cuh"  // smem_u32

namespace mk::gemm {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrive_count)
               : "memory");
}

// Makes the initialisation visible to the async proxy (TMA complete_tx) before first use.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive (count 1) and announce `bytes` of transactions that TMA will complete on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
      "r"(bytes)
      : "memory");
}

// Plain arrive (count 1) with release semantics at CTA scope.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

// Non-blocking probe: true once the phase with the given parity has completed (acquire, CTA scope).
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

// Blocking wait for the phase with the given parity (try_wait already suspends for a while in HW).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// A stage index with its phase bit; advance() wraps at STAGES and flips the phase.
template <int STAGES>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Named barriers (bar.sync id, count). Only the threads named in `count` may take part.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// The unaligned form, for a barrier whose participants reach it from different static code paths
// (role branches of a warp-specialised kernel each inline their own copy). bar.sync promises that
// every participant executes the same instruction; synccheck reports "divergent threads" otherwise.
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int count) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

}  // namespace mk::gemm
