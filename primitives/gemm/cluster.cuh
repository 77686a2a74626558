// cluster.cuh: thread-block-cluster operations the GEMM engine uses when two CTAs share one operand
// (sm_90a): the CTA's rank in its cluster, a cluster-wide barrier, an mbarrier arrive on a peer CTA's
// barrier, and a TMA tile load multicast into every CTA of a mask.
//
// Why clusters: with 128 x 256 tiles a CTA reads 48 KiB from L2 per 64-deep k-slice, ~8 TB/s over
// 132 SMs at cuBLAS speed - close to what L2 delivers. Two CTAs computing vertically adjacent tiles
// need the same B slice; each loads half of it and multicasts it to both, so each reads 32 KiB.
//
// Memory semantics: a multicast load completes its bytes on the mbarrier at the SAME shared-memory
// offset in every destination CTA. A remote arrive only has to order this CTA's wgmma reads of a
// stage (already complete: wgmma.wait_group) before the peer's next TMA write into it, so it keeps
// the default .release.cta semantics; .release.cluster would fence every arrive at cluster scope.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "../comm.cuh"  // smem_u32

namespace mk::gemm {

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t num_clusters_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster must call this (warp-aligned): a release/acquire barrier.
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

// Arrive (count 1) on the mbarrier at `bar`'s offset in cluster CTA `cta` (this CTA included).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}

// TMA 2D tile load written to `smem_dst`'s offset in every CTA of `cta_mask`, each completing the
// bytes on its own mbarrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map,
                                                      uint64_t* bar, int c0, int c1,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

}  // namespace mk::gemm
