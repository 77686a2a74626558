// tma.cuh: the copy-engine operations the GEMM engine uses (sm_90a).
//
// Loads:  tma_load_2d() (tma_load_3d(): a box of one matrix of a batch) issues one
//         cp.async.bulk.tensor tile load global -> shared that completes
//         on an mbarrier (the caller announced the bytes with mbar_arrive_expect_tx). Out-of-bounds
//         elements of the box are zero-filled by the hardware and still count toward the bytes, so a
//         clipped tile needs no special case. The tensor map must live in param/const/global space
//         (a __grid_constant__ kernel parameter, or memory reached from it).
// Stores and fences: the engine uses the project's transfer primitives (primitives/comm.cuh):
//         tile_send_bulk() is a NON-tensor bulk copy shared -> global (any generic global address, a
//         peer GPU's memory included: no tensor map for destinations), 16-byte aligned, size a
//         multiple of 16, joining the issuing thread's bulk group: bulk_commit() closes it;
//         bulk_wait_read() only frees the shared source; bulk_wait_all() waits for the writes
//         themselves, which a caller must do before signalling anybody that the data landed.
//         fence_proxy_async_smem() in every thread that wrote shared memory with ordinary stores
//         (st.shared / stmatrix) that the copy engine or wgmma will read next, BEFORE the barrier
//         that publishes it.
#pragma once
#include <cuda.h>  // CUtensorMap (type only; nothing links libcuda)
#include <cstdint>

#include "../comm.cuh"
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

// Box at (c0 = column, c1 = row, c2 = batch) of a 3D map (a batch of matrices, e.g. one expert's
// weights per batch index): a box never crosses into the next batch; rows past the matrix zero-fill.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Gathered A rows (Engine kGatherA): one 16-byte cp.async global -> shared; src_bytes < 16 zero-fills
// the rest (0: a zero chunk, for rows past the tile's valid rows and k past K). The writes are
// generic-proxy: a reader through the async proxy (wgmma) fences after the mbarrier that publishes
// them (fence_proxy_async_smem).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
// This thread's cp.async copies so far, committed as a group and waited for: their bytes are in
// shared memory, visible to this thread (others: after a barrier).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ uint4 lds_16(uint32_t smem_src) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "r"(smem_src)
               : "memory");
  return x;
}
// The mbarrier's arrival when all of this thread's earlier cp.async copies have landed; counts as
// one of the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

}  // namespace mk::gemm
