// A portable reference GEMM engine (WMMA, no TMA): the same contract as the Hopper engine in
// primitives/gemm/engine.cuh, at a fraction of its speed. It exists so every fused kernel can be
// checked on any sm_80+ GPU and as the plain, readable statement of the engine contract:
//
//   Engine::run(params, smem, hooks) is called by warp 0 and every consumer warpgroup (1..) of the
//   CTA; warps 1..3 of warpgroup 0 never call it (the template may run its communicator there).
//   For each task i < hooks.num_tasks():
//     t = hooks.task(i)          origin (m0, n0) and valid extent (rows, cols) of the C tile
//     hooks.before_load(i)       one thread, before any load of the tile (may wait on a signal)
//     C tile = A[m0:, :K] @ B[:K, n0:]   (fp32 accumulation; reads past M, N, K are zero)
//     d = hooks.dest(i)          where the tile goes: d.ptr = element (0, 0), d.ld, d.kind
//     store the clipped tile     kind 0: bf16 store, 1: fp32 reduce-add, 2: fp32 store
//     hooks.after_store(i)       one thread, after every thread's stores are complete and fenced
#pragma once
#include <cuda_bf16.h>
#include <mma.h>

#include "primitives/comm.cuh"

namespace mk::simple {

enum DestKind : int { kStoreBf16 = 0, kReduceAddF32 = 1, kStoreF32 = 2 };

template <int BM_, int BN_>
struct Cfg {
  static constexpr int BM = BM_, BN = BN_, BK = 32;
  static constexpr int kConsumerWarpgroups = 2;
};

__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

template <class C>
struct Engine {
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static constexpr int kConsumerThreads = 128 * C::kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 0, kConsumerRegs = 0;  // no setmaxnreg
  static constexpr int kLdS = BN + 4;                         // fp32 staging row, padded
  static constexpr int kSmemBytes = (BM * BK + BK * BN) * 2 + BM * kLdS * 4;
  // 8 warps as a 2 x 4 grid over the tile; each warp owns (BM/2) x (BN/4) in 16x16 fragments.
  static constexpr int WM = BM / 2, WN = BN / 4, FM = WM / 16, FN = WN / 16;

  struct Params {
    const __nv_bfloat16* a;  // [M, K] row-major
    const __nv_bfloat16* b;  // [K, N] row-major
    int M, N, K;
  };

  // Loads a [rows, cols] bf16 block at (r0, c0) of a row-major [R, C] matrix; zeros past the edge.
  // NOTE: C % 8 == 0 and c0 % 8 == 0 (checked on the host), so 16-byte chunks never straddle it.
  __device__ static void load_block(__nv_bfloat16* dst, const __nv_bfloat16* src, int R, int Cn,
                                    int r0, int c0, int rows, int cols, int t) {
    const int chunks = rows * cols / 8;
    for (int c = t; c < chunks; c += kConsumerThreads) {
      const int r = c / (cols / 8), k = (c % (cols / 8)) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r0 + r < R && c0 + k < Cn) v = *reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * Cn + c0 + k);
      *reinterpret_cast<uint4*>(dst + r * cols + k) = v;
    }
  }

  template <class Hooks>
  __device__ static void run(const Params& p, char* smem, Hooks& hooks) {
    using namespace nvcuda;
    if (threadIdx.x < 128) return;  // this engine has no producer warp
    const int t = threadIdx.x - 128, warp = t / 32;
    const int wm = warp / 4, wn = warp % 4;
    __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem);  // [BM, BK]
    __nv_bfloat16* Bs = As + BM * BK;                           // [BK, BN]
    float* Cs = reinterpret_cast<float*>(Bs + BK * BN);         // [BM, kLdS]
    for (int i = 0; i < hooks.num_tasks(); ++i) {
      const auto tile = hooks.task(i);
      if (t == 0) hooks.before_load(i);
      consumer_sync(kConsumerThreads);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
      for (int x = 0; x < FM; ++x)
#pragma unroll
        for (int y = 0; y < FN; ++y) wmma::fill_fragment(acc[x][y], 0.f);
      for (int k0 = 0; k0 < p.K; k0 += BK) {
        load_block(As, p.a, p.M, p.K, tile.m0, k0, BM, BK, t);
        load_block(Bs, p.b, p.K, p.N, k0, tile.n0, BK, BN, t);
        consumer_sync(kConsumerThreads);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[FM];
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
#pragma unroll
          for (int x = 0; x < FM; ++x) wmma::load_matrix_sync(fa[x], As + (wm * WM + x * 16) * BK + kk, BK);
#pragma unroll
          for (int y = 0; y < FN; ++y) {
            wmma::load_matrix_sync(fb, Bs + kk * BN + wn * WN + y * 16, BN);
#pragma unroll
            for (int x = 0; x < FM; ++x) wmma::mma_sync(acc[x][y], fa[x], fb, acc[x][y]);
          }
        }
        consumer_sync(kConsumerThreads);
      }
#pragma unroll
      for (int x = 0; x < FM; ++x)
#pragma unroll
        for (int y = 0; y < FN; ++y)
          wmma::store_matrix_sync(Cs + (wm * WM + x * 16) * kLdS + wn * WN + y * 16, acc[x][y], kLdS,
                                  wmma::mem_row_major);
      consumer_sync(kConsumerThreads);
      store_tile(Cs, hooks.dest(i), tile.rows, tile.cols, t);
      consumer_sync(kConsumerThreads);
      if (t == 0) {
        __threadfence_system();
        hooks.after_store(i);
      }
    }
  }

  // Clipped epilogue: pairs of columns (cols is even: N % 8 == 0 and tiles start at multiples of 8).
  template <class Dest>
  __device__ static void store_tile(const float* Cs, const Dest& d, int rows, int cols, int t) {
    const int pairs = rows * (cols / 2);
    for (int q = t; q < pairs; q += kConsumerThreads) {
      const int r = q / (cols / 2), c = (q % (cols / 2)) * 2;
      const float v0 = Cs[r * kLdS + c], v1 = Cs[r * kLdS + c + 1];
      const long long off = r * d.ld + c;
      if (d.kind == kStoreBf16) {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(d.ptr) + off) =
            __floats2bfloat162_rn(v0, v1);
      } else if (d.kind == kReduceAddF32) {
        red_add_v2_f32(static_cast<float*>(d.ptr) + off, v0, v1);
      } else {
        *reinterpret_cast<float2*>(static_cast<float*>(d.ptr) + off) = make_float2(v0, v1);
      }
    }
  }
};

}  // namespace mk::simple
