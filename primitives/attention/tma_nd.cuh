// tma_nd.cuh: rank-4 TMA tile loads and stores for [B, S, H, D] tensors (sm_90a); the maps come
// from primitives/attention/tensor_map_nd.h, coordinates are {d0, h, s0, b}.
//
// Loads:  tma_load_4d() completes on an mbarrier whose phase the caller armed with
//         mbar_arrive_expect_tx (mk::gemm). Rows beyond S are zero-filled and still counted in the
//         transaction bytes, so a clipped tile needs no special case.
// Stores: tma_store_4d() reads a swizzled shared tile (the writers ran fence_proxy_async_smem()
//         before the barrier that hands it to the issuing thread) and joins the issuing thread's
//         bulk group: bulk_commit(), then bulk_wait_read() before the tile is overwritten and
//         bulk_wait_all() before the CTA exits (mk::comm). Rows beyond S are not written.
//         tma_reduce_add_4d() is the same with an add into the destination (fp32 maps here).
// Maps must live in param / const / global memory (a __grid_constant__ kernel parameter).
#pragma once
#include <cuda.h>

#include <cstdint>

#include "../comm.cuh"

namespace mk::attn {

__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0,
                                             int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// dst tile += smem tile (fp32 maps: an element-wise add in L2, by the TMA unit), joining the
// issuing thread's bulk group like a store; rows beyond S are dropped.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem_src,
                                                  int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

}  // namespace mk::attn
