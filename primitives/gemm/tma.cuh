// tma.cuh: the copy-engine operations the GEMM engine uses (sm_90a).
//
// Loads:  tma_load_2d() issues one cp.async.bulk.tensor 2D tile load global -> shared that completes
//         on an mbarrier (the caller announced the bytes with mbar_arrive_expect_tx). Out-of-bounds
//         elements of the box are zero-filled by the hardware and still count toward the bytes, so a
//         clipped tile needs no special case. The tensor map must live in param/const/global space
//         (a __grid_constant__ kernel parameter, or memory reached from it).
// Stores: bulk_store_s2g() / bulk_reduce_add_f32_s2g() are NON-tensor bulk copies shared -> global
//         (any generic global address, a peer GPU's memory included: no tensor map for destinations).
//         Source and destination 16-byte aligned, size a multiple of 16. They join the issuing
//         thread's bulk group: bulk_commit() closes it; bulk_wait_read<0>() only frees the shared
//         source; bulk_wait<0>() waits for the writes themselves to be complete and visible, which is
//         what a caller must do before signalling anybody that the data landed.
// Fences: fence_proxy_async_smem() in every thread that wrote shared memory with ordinary stores
//         (st.shared / stmatrix) that the copy engine or wgmma will read next, BEFORE the barrier
//         that publishes it.
#pragma once
#include <cuda.h>  // CUtensorMap (type only; nothing links libcuda)
#include <cstdint>

#include "mbarrier.cuh"

namespace mk::gemm {

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box at (c0 = innermost/column coordinate, c1 = row coordinate), in elements.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void bulk_store_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_u32(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_reduce_add_f32_s2g(void* gmem_dst, const void* smem_src,
                                                        uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   gmem_dst),
               "r"(smem_u32(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most N of this thread's bulk groups are pending, counting full completion.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Wait until the shared-memory SOURCES of all but N groups have been read (writes may be in flight).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

}  // namespace mk::gemm
