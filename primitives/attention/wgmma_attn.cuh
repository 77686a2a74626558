// wgmma_attn.cuh: the wgmma forms attention needs beyond the GEMM engine's (sm_90a,
// bf16 x bf16 -> f32), as mk::gemm's generic WgmmaSS / WgmmaRS (primitives/gemm/wgmma.cuh, where
// the asm is) with the transpose bits attention uses.
//
//   WgmmaKK<N>::mma(d, desc_a, desc_b, scale_d)   S = Q K^T. A [64 x 16] K-major from shared
//       memory; B [16 x N] K-MAJOR from shared memory (imm-trans-b = 0). The K tile
//       [N kv rows][64 d] that TMA writes with a 128-byte swizzle is exactly a K-major B ("rows"
//       along N, 8-row atoms 1024 B apart): mk::gemm::desc_k_major_sw128 describes it (like A).
//   WgmmaRS<N>::mma(d, a0, a1, a2, a3, desc_b, scale_d)   O += P V. A [64 x 16] from REGISTERS
//       (four b32 holding bf16 pairs); B [16 x N] MN-major from shared memory (imm-trans-b = 1):
//       the V tile, 128-byte chunks of 64 d-columns, described by mk::gemm::desc_mn_major_sw128.
//   WgmmaTT<N>::mma(d, desc_a, desc_b, scale_d)   dQ = dS K (the backward). A [64 x 16] MN-MAJOR
//       from shared memory (imm-trans-a = 1): the dS^T tile [kv rows][64 q], 128-byte rows, whose
//       rows are A's k; B [16 x N] MN-major (imm-trans-b = 1): the K tile as V is above. Both
//       described by mk::gemm::desc_mn_major_sw128; a k-step of 16 rows adds 2048 bytes.
//
// Register A fragment of m64nNk16 (warp w of the warpgroup, lane l, r = 16w + l/4, q = l%4):
//   a0 = (r, 2q..2q+1)   a1 = (r+8, 2q..2q+1)   a2 = (r, 8+2q..9+2q)   a3 = (r+8, 8+2q..9+2q)
// i.e. the accumulator fragment of columns 16kk..16kk+15 (d[8kk..8kk+7]) packed pairwise: a P
// tile converted from an S accumulator feeds the next MMA with no shuffle (pack_rows below).
//
// Protocol (as in mk::gemm): the whole warpgroup executes these; wgmma_fence() before a batch
// whose accumulators or A registers ordinary code wrote; commit / wait from mk::gemm.
// NOTE: an RS wgmma READS its A registers asynchronously: they must stay unmodified until a
// wgmma_wait covers it (fence_regs after that wait pins them in place until then).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "../gemm/wgmma.cuh"

namespace mk::attn {

// A K-major, B K-major.
template <int N>
using WgmmaKK = gemm::WgmmaSS<N, /*kTransA=*/0, /*kTransB=*/0>;
// A from registers, B MN-major.
template <int N>
using WgmmaRS = gemm::WgmmaRS<N, /*kTransB=*/1>;
// A MN-major, B MN-major.
template <int N>
using WgmmaTT = gemm::WgmmaSS<N, /*kTransA=*/1, /*kTransB=*/1>;

// Keeps the compiler from moving reads or writes of the A registers of an RS wgmma across the wait
// that retires it (the asm statement itself only "reads" them at issue).
template <int R>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// bf16 pair, lower column in the low half (the A-fragment order).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// An m64nN accumulator (N/2 floats) -> the A registers of N/16 k-steps (N/4 b32): k-step kk uses
// p[4kk .. 4kk+3].
template <int R>
__device__ __forceinline__ void pack_rows(const float (&s)[R], uint32_t (&p)[R / 2]) {
#pragma unroll
  for (int i = 0; i < R / 2; ++i) p[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
}

}  // namespace mk::attn
