// Moving tiles between ranks: TMA bulk copies, vectorised peer stores, reductions at the destination.
//
// Protocol
// - tile_send_bulk / reduce_add_bulk_* are issued by ONE thread from shared memory that the issuing
//   CTA wrote with generic stores: every writing thread runs fence_proxy_async_smem() before the
//   barrier that publishes the staging tile to the issuing thread.
// - They complete asynchronously (bulk_group). Before reusing the shared source: bulk_wait_read();
//   before signalling a peer that the data landed: bulk_wait_all() (full completion), then a release
//   at system scope (signal.cuh).
// - peer_store_* and red_add_* are ordinary (generic-proxy) accesses through the peer mapping; a CTA
//   barrier and then a release by one thread publish them.
// - In-network reduce never uses a multicast object (no multimem, no NVLS): the reduction happens at
//   the destination's memory (TMA reduce-store add, red.global.add) or in the reader's registers
//   (pull-reduce).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

namespace mk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Generic-proxy writes to shared memory that the async proxy (TMA) reads next.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Data acquired through a signal that the async proxy (TMA loads) reads next.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// TMA bulk copy shared -> global (local or peer). bytes % 16 == 0, both addresses 16-byte aligned.
__device__ __forceinline__ void tile_send_bulk(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_u32(src_smem)), "r"(bytes)
               : "memory");
}

// TMA bulk copy global -> shared, completing on the mbarrier `bar` (whose expected transaction
// bytes the issuer raised by `bytes`). bytes % 16 == 0, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst_smem)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// TMA reduce-store: dst[i] += src[i] at the destination, fp32.
__device__ __forceinline__ void reduce_add_bulk_f32(float* dst, const float* src_smem,
                                                    uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(smem_u32(src_smem)), "r"(bytes)
      : "memory");
}

// TMA reduce-store: dst[i] += src[i] at the destination, bf16.
__device__ __forceinline__ void reduce_add_bulk_bf16(__nv_bfloat16* dst,
                                                     const __nv_bfloat16* src_smem,
                                                     uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(
          dst),
      "r"(smem_u32(src_smem)), "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// The shared-memory sources of every committed bulk op may be reused.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// All but the newest N committed bulk ops have finished reading their shared-memory sources
// (N + 1 staging buffers in flight: the oldest may be refilled).
template <int N>
__device__ __forceinline__ void bulk_wait_read_n() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Every committed bulk op has completed at its destination (required before a signal).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// 16-byte store through the peer mapping.
__device__ __forceinline__ void peer_store_v4(void* dst, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// A team copies n 16-byte vectors (dst may be a peer's memory). Four loads are in flight per thread
// before their stores: one load at a time would leave each thread waiting a full memory latency.
__device__ __forceinline__ void copy_v4_team(uint4* dst, const uint4* src, long long n, int lane,
                                             int size) {
  long long v = lane;
  for (; v + 3LL * size < n; v += 4LL * size) {
    uint4 x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = src[v + j * size];
#pragma unroll
    for (int j = 0; j < 4; ++j) peer_store_v4(dst + v + j * size, x[j]);
  }
  for (; v < n; v += size) peer_store_v4(dst + v, src[v]);
}

// dst[0..1] += {a, b} at the destination (vector red, sm_90), relaxed at system scope: several GPUs
// may add into one buffer (the GEMM engine's fp32 reduce epilogue).
__device__ __forceinline__ void red_add_v2_f32_sys(float* dst, float a, float b) {
  asm volatile("red.relaxed.sys.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b)
               : "memory");
}

// dst[0] += a at the destination, relaxed at system scope (unaligned or clipped remainders).
__device__ __forceinline__ void red_add_f32_sys(float* dst, float a) {
  asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(dst), "f"(a) : "memory");
}

// dst[0..3] += v at the destination (vector red, sm_90).
__device__ __forceinline__ void red_add_v4_f32(float* dst, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}

// dst[0..1] += v (bf16x2) at the destination.
__device__ __forceinline__ void red_add_bf16x2(__nv_bfloat162* dst, __nv_bfloat162 v) {
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(dst),
               "r"(*reinterpret_cast<uint32_t*>(&v))
               : "memory");
}

}  // namespace mk
