// wgmma.cuh: warpgroup matrix multiply-accumulate (sm_90a) for bf16 inputs, fp32 accumulators.
//
// Who calls what: all 128 threads of ONE warpgroup execute every function here (they are .aligned).
//   wgmma_fence()            before the first wgmma of a batch (orders earlier register accesses to
//                            the accumulators, and shared-memory writes, before the async MMA);
//   Wgmma<N>::mma(...)       issues one m64nNk16 MMA, asynchronously;
//   wgmma_commit()           closes the batch into a wgmma group;
//   wgmma_wait<N>()          waits until at most N groups are pending: after wgmma_wait<1>() the
//                            previous batch has finished reading its shared-memory stage, so that stage
//                            may be released while the newest batch still runs;
//   fence_operands(acc)      after the final wait, before touching the accumulators from ordinary code
//                            (keeps the compiler from moving register reads above the wait).
//
// Shared-memory operands use 128-byte swizzled layouts, which is what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box:
//   A [rows][64 k] K-major: 8-row x 128-byte swizzle atoms, atoms stacked along rows (1024 B apart).
//       desc_k_major_sw128(): SBO = 1024 B; stepping k by 16 elements adds 32 B to the start address.
//   B [64 k][n] MN-major ("transposed B", N contiguous), stored as chunks of 64 columns, each chunk
//       [BK rows][128 B], chunks `chunk_bytes` apart.
//       desc_mn_major_sw128(): LBO = chunk_bytes (next 64 columns), SBO = 1024 B (next 8 k-rows);
//       stepping k by 16 rows adds 16 * 128 = 2048 B to the start address.
// Every stage buffer must be 1024-byte aligned (the swizzle pattern repeats every 1024 bytes and the
// descriptor's base-offset field is left 0).
//
// Accumulator fragment of m64nNk16 (per thread of the warpgroup, N/2 floats d[]):
//   warp w = threadIdx/32 % 4, lane l, r = 16*w + l/4, q = l%4; for 8-column group j = 0..N/8-1:
//   d[4j+0] = (r,   8j+2q)   d[4j+1] = (r,   8j+2q+1)
//   d[4j+2] = (r+8, 8j+2q)   d[4j+3] = (r+8, 8j+2q+1)
#pragma once
#include <cstdint>

namespace mk::gemm {

__device__ __forceinline__ uint64_t desc_encode(uint32_t x) {
  return (uint64_t)((x & 0x3FFFF) >> 4);
}

// Matrix descriptor: start address, leading/stride byte offsets, 128B swizzle (layout type 1).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  uint64_t d = desc_encode(smem_addr);
  d |= desc_encode(lbo_bytes) << 16;
  d |= desc_encode(sbo_bytes) << 32;
  d |= 1ull << 62;
  return d;
}

__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t smem_addr) {
  return make_desc_sw128(smem_addr, 16, 1024);  // LBO unused for swizzled K-major; 16 = "1"
}

__device__ __forceinline__ uint64_t desc_mn_major_sw128(uint32_t smem_addr, uint32_t chunk_bytes) {
  return make_desc_sw128(smem_addr, chunk_bytes, 1024);
}

// Adding `bytes` (a multiple of 16) to the start address field of a descriptor.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (uint64_t)(bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// setmaxnreg: executed by whole warpgroups (the caller's template does it before Engine::run).
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

// m64nNk16, bf16 x bf16 -> f32: D[64 x N] (N/2 fp32 registers) (+)= A[64 x 16] * B[16 x N];
// scale_d = 0 overwrites D (first k-step of a tile), 1 accumulates. N is 32, 64, 128 or 256.
//   WgmmaSS<N, kTransA, kTransB>::mma(d, desc_a, desc_b, scale_d)   A and B from shared memory
//       (descriptors); kTransA / kTransB are PTX's imm-trans-a / imm-trans-b: 0 = K-major,
//       1 = MN-major ("transposed").
//   WgmmaRS<N, kTransB>::mma(d, a0, a1, a2, a3, desc_b, scale_d)   A from REGISTERS (four b32 of
//       bf16 pairs: mk::attn's wgmma_attn.cuh gives the fragment), B from shared memory.
//   Wgmma<N>: the GEMM engine's form, A K-major, B MN-major (transposed), both from shared memory.
namespace detail {

// NOTE: nvcc takes an inline-asm template only as one string literal, rejects symbolic operand
// names (%[name]: "symbolic operand reference not supported") and expands no parameter pack in an
// operand list; so the preprocessor spells the operands. MK_WGMMA_D<R>: "%0, ..., %<R-1>", the R
// accumulator registers; MK_WGMMA_D<R>_OUT(d): their "+f" bindings to d[0 .. R-1].
#define MK_WGMMA_D16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MK_WGMMA_D32 \
  MK_WGMMA_D16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MK_WGMMA_D64                                                                   \
  MK_WGMMA_D32                                                                         \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MK_WGMMA_D128                                                                            \
  MK_WGMMA_D64                                                                                   \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MK_WGMMA_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define MK_WGMMA_F16(d, i) \
  MK_WGMMA_F4(d, i), MK_WGMMA_F4(d, i + 4), MK_WGMMA_F4(d, i + 8), MK_WGMMA_F4(d, i + 12)
#define MK_WGMMA_D16_OUT(d) MK_WGMMA_F16(d, 0)
#define MK_WGMMA_D32_OUT(d) MK_WGMMA_D16_OUT(d), MK_WGMMA_F16(d, 16)
#define MK_WGMMA_D64_OUT(d) MK_WGMMA_D32_OUT(d), MK_WGMMA_F16(d, 32), MK_WGMMA_F16(d, 48)
#define MK_WGMMA_D128_OUT(d)                                                          \
  MK_WGMMA_D64_OUT(d), MK_WGMMA_F16(d, 64), MK_WGMMA_F16(d, 80), MK_WGMMA_F16(d, 96), \
      MK_WGMMA_F16(d, 112)

// The two asm statements of m64nNk16 with R = N/2 accumulators. o0..o6 are the numbers R .. R+6 of
// the operands that follow the accumulators, written out (the preprocessor cannot add).
// clang-format off
#define MK_WGMMA_DEFINE(N, R, o0, o1, o2, o3, o4, o5, o6)                                          \
  template <>                                                                                      \
  struct WgmmaAsm<N> {                                                                             \
    template <int kTransA, int kTransB>                                                            \
    __device__ __forceinline__ static void ss(float (&d)[R], uint64_t desc_a, uint64_t desc_b,     \
                                              uint32_t scale_d) {                                  \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" #o2 ", 0;\n"                                        \
          "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "                              \
          "{" MK_WGMMA_D##R " }, "                                                                 \
          "%" #o0 ", %" #o1 ", p, 1, 1, %" #o3 ", %" #o4 ";\n}\n"                                  \
          : MK_WGMMA_D##R##_OUT(d)                                                                 \
          : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));                   \
    }                                                                                              \
    template <int kTransB>                                                                         \
    __device__ __forceinline__ static void rs(float (&d)[R], uint32_t a0, uint32_t a1,             \
                                              uint32_t a2, uint32_t a3, uint64_t desc_b,           \
                                              uint32_t scale_d) {                                  \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" #o5 ", 0;\n"                                        \
          "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "                              \
          "{" MK_WGMMA_D##R " }, "                                                                 \
          "{%" #o0 ", %" #o1 ", %" #o2 ", %" #o3 "}, %" #o4 ", p, 1, 1, %" #o6 ";\n}\n"            \
          : MK_WGMMA_D##R##_OUT(d)                                                                 \
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d), "n"(kTransB));          \
    }                                                                                              \
  };
// clang-format on

template <int N>
struct WgmmaAsm {
  static_assert(N != N, "no wgmma operand list for this N: add an MK_WGMMA_DEFINE line");
};
MK_WGMMA_DEFINE(32, 16, 16, 17, 18, 19, 20, 21, 22)
MK_WGMMA_DEFINE(64, 32, 32, 33, 34, 35, 36, 37, 38)
MK_WGMMA_DEFINE(128, 64, 64, 65, 66, 67, 68, 69, 70)
MK_WGMMA_DEFINE(256, 128, 128, 129, 130, 131, 132, 133, 134)

#undef MK_WGMMA_DEFINE
#undef MK_WGMMA_D128_OUT
#undef MK_WGMMA_D64_OUT
#undef MK_WGMMA_D32_OUT
#undef MK_WGMMA_D16_OUT
#undef MK_WGMMA_F16
#undef MK_WGMMA_F4
#undef MK_WGMMA_D128
#undef MK_WGMMA_D64
#undef MK_WGMMA_D32
#undef MK_WGMMA_D16

}  // namespace detail

template <int N, int kTransA, int kTransB>
struct WgmmaSS {
  static constexpr int kRegs = N / 2;
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    detail::WgmmaAsm<N>::template ss<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  }
};

template <int N, int kTransB>
struct WgmmaRS {
  static constexpr int kRegs = N / 2;
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint64_t desc_b,
                                             uint32_t scale_d) {
    detail::WgmmaAsm<N>::template rs<kTransB>(d, a0, a1, a2, a3, desc_b, scale_d);
  }
};

// D[64xN] (+)= A[64x16] (K-major, smem desc) * B[16xN] (MN-major = transposed, smem desc).
template <int N>
using Wgmma = WgmmaSS<N, 0, 1>;

}  // namespace mk::gemm
