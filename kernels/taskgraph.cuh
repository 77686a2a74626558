// The TaskGraph engine: a compute engine of the persistent template (templates/engine_contract.cuh)
// whose task is one task of a TaskGraph (mkernel/taskgraph/lower.py): one tile of one op, named by
// the tile's tag, decoded from the task table and run by the whole CTA. The template runs the
// plan's waits before it (before_load) and its raises after it (after_store), as for every op.
//
//   CTA loop, per task of the unit (rows u, u + units, ... of the rank's tasks):
//     thread 0: waits (ready[j] of the tiles it reads)  -> every thread: the op's tile
//     -> every thread's stores fenced, CTA barrier -> thread 0: system fence, raises (ready[i])
//
// Buffers are reached through the pointer table (mkernel/taskgraph/device.py): a graph's values,
// weights and caches vary per graph, so they are data, not a generated Layout. All math is fp32
// on bf16 loads; every access is 16 bytes (8 bf16: column counts and offsets are multiples of 8).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/taskgraph_args.h"
#include "primitives/comm.cuh"
#include "primitives/gemm/mbarrier.cuh"
#include "primitives/protocol_gen.h"
#include "primitives/signal.cuh"

// The weight ring of batch-1 linears (below, "The weight ring"): 0 = off (the default until a GPU
// run has checked it), 1 = on. An A/B knob: tools/ab_taskgraph.sh builds both.
#ifndef MK_TG_WEIGHT_RING
#define MK_TG_WEIGHT_RING 0
#endif
// Every thread fences its stores after a task (1, the default) or only thread 0 does, after the
// CTA barrier (0: the pattern of cooperative groups' grid sync, whose release is cumulative over
// the stores the barrier ordered before it). An A/B knob (tools/ab_taskgraph.sh), not run yet.
#ifndef MK_TG_THREAD_FENCE
#define MK_TG_THREAD_FENCE 1
#endif

namespace mk::tg {

constexpr int kVec = 8;  // bf16 per 16-byte access
constexpr int kWarps = kThreads / 32;

// Per served rank (in the launch's __grid_constant__ argument).
struct Params {
  const int* tasks;                // [T, kTaskFields]
  const long long* ptrs;           // [buffers, kPtrHead + W]
  long long io_base[kMaxSlots];    // the record's slots: a call's inputs and outputs (bytes)
  long long io_stride[kMaxSlots];  // elements between ranks' tensors (emulated world)
  int rank, world_size;
};

// A rectangle of a buffer on one rank: p at its (r0, c0), ld elements per row.
struct View {
  __nv_bfloat16* p;
  long long ld;
  int rows, cols;
  __device__ __nv_bfloat16* at(int r, int c) const { return p + r * ld + c; }
};

__device__ inline View buffer_view(const Params& p, int buf, int rank, int r0, int c0, int rows,
                                   int cols) {
  const long long* e = p.ptrs + (long long)buf * (kPtrHead + p.world_size);
  const long long ld = e[kPtrLd];
  const int slot = (int)e[kPtrSlot];
  const long long base =
      slot >= 0 ? p.io_base[slot] + 2LL * rank * p.io_stride[slot] : e[kPtrHead + rank];
  return View{reinterpret_cast<__nv_bfloat16*>(base) + r0 * ld + c0, ld, rows, cols};
}

// Read `i` of task row `d` on rank `q` (its first row moved by rank_rows per running rank).
__device__ inline View read_view(const Params& p, const int* d, int i, int q) {
  const int* r = d + kFRead0Buf + i * kReadFields;
  const int r0 = r[kFRead0R0 - kFRead0Buf] + p.rank * r[kFRead0RankRows - kFRead0Buf];
  return buffer_view(p, r[0], q, r0, r[kFRead0C0 - kFRead0Buf], r[kFRead0Rows - kFRead0Buf],
                     r[kFRead0Cols - kFRead0Buf]);
}

__device__ inline int read_rank(const Params& p, const int* d, int i) {
  const int q = d[kFRead0Rank + i * kReadFields];
  return q == kRankOwn ? p.rank : q;
}

__device__ inline View out_view(const Params& p, const int* d) {
  return buffer_view(p, d[kFOut], p.rank, d[kFOutR0], d[kFOutC0], d[kFOutRows], d[kFOutCols]);
}

// -- 16-byte accesses --------------------------------------------------------------------------

// Data written earlier in this launch (values): a plain load, after the task's acquire.
__device__ __forceinline__ uint4 ld_vec(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint4*>(p);
}
// Build-time tensors (weights, caches), never written by the kernel: streamed past L1.
__device__ __forceinline__ uint4 ld_stream(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void to_f32(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ uint4 to_bf16(const float* f) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}
__device__ __forceinline__ void st_vec(__nv_bfloat16* p, const float* f) {
  *reinterpret_cast<uint4*>(p) = to_bf16(f);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// -- the ops' tiles (every thread of the CTA) ---------------------------------------------------

// Elementwise over the output tile, 8 columns per thread step: f(row, col, out[8]).
template <class F>
__device__ inline void for_each_vec(const View& out, F&& f) {
  const int per_row = out.cols / kVec, n = out.rows * per_row;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int r = i / per_row, c = (i - r * per_row) * kVec;
    float y[kVec];
    f(r, c, y);
    st_vec(out.at(r, c), y);
  }
}

// A block-wide reduction of one value per thread (scratch: kWarps floats), every thread gets it.
template <bool kMax>
__device__ inline float block_reduce(float v, float* scratch) {
  v = kMax ? warp_max(v) : warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch is free (an earlier reduction's readers are done)
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = scratch[0];
  for (int i = 1; i < kWarps; ++i) t = kMax ? fmaxf(t, scratch[i]) : t + scratch[i];
  return t;
}

// rmsnorm: the whole CTA per row, each thread's pieces of x and w loaded at once (up to
// kNormPieces per thread, all in flight), the mean square by a block reduction, then x * rsqrt(ms +
// eps) * w from the registers. Rows longer than kThreads * kNormPieces * 8 re-read x in a loop.
// NOTE: a warp per row looping over 4096 columns one load at a time took 17 us per norm task
// (one H100): serial load latency, on the critical path of every layer twice.
constexpr int kNormPieces = 4;

__device__ inline void rmsnorm(const View& x, const View& w, const View& out, float eps,
                               float* scratch) {
  const int N = out.cols, pieces = N / kVec;
  for (int r = 0; r < out.rows; ++r) {
    if (pieces <= kThreads * kNormPieces) {
      uint4 xv[kNormPieces], wv[kNormPieces];
#pragma unroll
      for (int u = 0; u < kNormPieces; ++u) {
        const int c = (threadIdx.x + u * kThreads) * kVec;
        xv[u] = c < N ? ld_vec(x.at(r, c)) : make_uint4(0, 0, 0, 0);
        wv[u] = c < N ? ld_stream(w.at(0, c)) : make_uint4(0, 0, 0, 0);
      }
      float ss = 0.f;
#pragma unroll
      for (int u = 0; u < kNormPieces; ++u) {
        float f[kVec];
        to_f32(xv[u], f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) ss += f[j] * f[j];
      }
      const float inv = rsqrtf(block_reduce<false>(ss, scratch) / N + eps);
#pragma unroll
      for (int u = 0; u < kNormPieces; ++u) {
        const int c = (threadIdx.x + u * kThreads) * kVec;
        if (c >= N) break;
        float f[kVec], g[kVec];
        to_f32(xv[u], f);
        to_f32(wv[u], g);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f[j] = f[j] * inv * g[j];
        st_vec(out.at(r, c), f);
      }
    } else {
      float ss = 0.f;
      for (int c = threadIdx.x * kVec; c < N; c += kThreads * kVec) {
        float f[kVec];
        to_f32(ld_vec(x.at(r, c)), f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) ss += f[j] * f[j];
      }
      const float inv = rsqrtf(block_reduce<false>(ss, scratch) / N + eps);
      for (int c = threadIdx.x * kVec; c < N; c += kThreads * kVec) {
        float f[kVec], g[kVec];
        to_f32(ld_vec(x.at(r, c)), f);
        to_f32(ld_stream(w.at(0, c)), g);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f[j] = f[j] * inv * g[j];
        st_vec(out.at(r, c), f);
      }
    }
  }
}

// How a linear's tasks load 8 values of x row b at k: as the value holds them (linear,
// norm_linear), or as silu(gate) * up of its two halves (silu_linear: x [rows, 2K], rounded to
// bf16 as the unfused silu_mul stores it; the SiLU stage and its waits are gone).
struct PlainX {
  View x;
  __device__ __forceinline__ int K() const { return x.cols; }
  __device__ __forceinline__ uint4 load(int b, int k) const { return ld_vec(x.at(b, k)); }
};
// silu(gate) * up of 8 values: silu_mul's tile and silu_linear's x loads (the same math, so the
// fused path rounds as the unfused value is stored).
__device__ __forceinline__ void silu_mul_vec(const uint4& gate, const uint4& up, float* y) {
  float u[kVec];
  to_f32(gate, y);
  to_f32(up, u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) y[j] = y[j] / (1.f + __expf(-y[j])) * u[j];
}
struct SiluX {
  View x;
  __device__ __forceinline__ int K() const { return x.cols / 2; }
  __device__ __forceinline__ uint4 load(int b, int k) const {
    float y[kVec];
    silu_mul_vec(ld_vec(x.at(b, k)), ld_vec(x.at(b, K() + k)), y);
    return to_bf16(y);
  }
};

// norm_linear: 1 / rms of each row of x into rs (a warp per row), the factor its output takes
// (the norm's weight is folded into the linear's at compile: mkernel/taskgraph/ops.py).
__device__ inline void row_rsqrt(const View& x, float eps, float* rs) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int b = warp; b < x.rows; b += kWarps) {
    float ss = 0.f;
#pragma unroll 4
    for (int k = lane * kVec; k < x.cols; k += 32 * kVec) {
      float f[kVec];
      to_f32(ld_vec(x.at(b, k)), f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) ss = fmaf(f[j], f[j], ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) rs[b] = rsqrtf(ss / x.cols + eps);
  }
  __syncthreads();
}

// A linear's result: the sum times the row's factor (norm_linear; rs null: 1), plus the residual.
__device__ __forceinline__ void st_linear(const View& out, const View* res, const float* rs, int b,
                                          int n, float s) {
  if (rs != nullptr) s *= rs[b];
  if (res != nullptr) s += __bfloat162float(*res->at(b, n));
  *out.at(b, n) = __float2bfloat16_rn(s);
}

// linear as a GEMV: out[b, n] = sum_k x[b, k] w[n, k] (+ res[b, n]), B <= kGemvRows rows of x.
// Each warp takes R weight rows at a time; a lane streams 16-byte pieces of them along K, U steps
// of 32 pieces in flight (R * U loads per lane before the first use), and reuses each x piece
// (L1) for the R rows. The lanes' partial sums meet by shuffles; lane j stores value j.
template <int B, int R, int U, class XL>
__device__ inline void gemv(const XL& x, const View& w, const View* res, const float* rs,
                            const View& out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, K = x.K(), nb = out.rows;
  constexpr int kStep = 32 * kVec;
  for (int n0 = warp * R; n0 < out.cols; n0 += kWarps * R) {
    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
    const __nv_bfloat16* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w.at(min(n0 + r, out.cols - 1), 0);
    for (int k0 = lane * kVec; k0 < K; k0 += U * kStep) {
      uint4 wv[U][R];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
          wv[u][r] =
              k0 + u * kStep < K ? ld_stream(wr[r] + k0 + u * kStep) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * kStep;
        if (k >= K) break;
        float wf[R][kVec];
#pragma unroll
        for (int r = 0; r < R; ++r) to_f32(wv[u][r], wf[r]);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          if (b >= nb) break;
          float xf[kVec];
          to_f32(x.load(b, k), xf);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < kVec; ++j) acc[r][b] = fmaf(xf[j], wf[r][j], acc[r][b]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float s = warp_sum(acc[r][b]);
        const int n = n0 + r;
        if (lane == (r * B + b) % 32 && b < nb && n < out.cols) st_linear(out, res, rs, b, n, s);
      }
  }
}

// linear on the tensor cores, for 2..16 rows of x: out^T = W x^T as mma.m16n8k16 tiles (M: 16
// weight rows, N: 8 rows of x, NT tiles of them). A warp streams 16 weight rows; lane (g, t) loads
// 16 bytes of rows g and g + 8 at k = 8t.. and 16 bytes of x row g (and g + 8) at the same k: the
// products are the same whatever order K is summed in, so the fragments take K permuted (each
// lane's 8 contiguous values feed two mma) and every load is a plain 16-byte one, no shuffles or
// shared memory. Where 16-row blocks are fewer than warps, the warps split K and add their
// partial tiles in shared memory (kWarps x NT x 128 floats).
// NOTE: the fp32 FMA GEMV (gemv above) converts every x value once per weight row block: at batch
// 8 that is ~17 ops per weight element, so it was compute-bound at 0.32 of copy (one H100).
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int NT, int U, class XL>
__device__ inline void gemv_mma(const XL& x, const View& w, const View* res, const float* rs,
                                const View& out, float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int K = x.K(), nb = out.rows, blocks = (out.cols + 15) / 16;
  const int split = blocks >= kWarps ? 1 : kWarps / blocks, slots = kWarps / split;
  const int ks = warp / slots, slot = warp % slots;
  const int slice = ((K + split - 1) / split + 31) / 32 * 32;
  const int kbeg = ks * slice, kend = min(K, kbeg + slice);
  const int rounds = (blocks + slots - 1) / slots;  // the same for every warp: barriers below
  for (int round = 0; round < rounds; ++round) {
    const int blk = round * slots + slot, n0 = blk * 16;
    float acc[NT][4] = {};
    if (blk < blocks && ks < split) {
      const __nv_bfloat16* wg = w.at(min(n0 + g, out.cols - 1), 0);
      const __nv_bfloat16* wh = w.at(min(n0 + g + 8, out.cols - 1), 0);
      for (int k0 = kbeg + 8 * t; k0 < kend; k0 += U * 32) {
        uint4 a[U], h[U], xv[U][NT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = k0 + u * 32;
          const bool in = k < kend;
          a[u] = in ? ld_stream(wg + k) : make_uint4(0, 0, 0, 0);
          h[u] = in ? ld_stream(wh + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            xv[u][nt] = in && nt * 8 + g < nb ? x.load(nt * 8 + g, k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint32_t lo[4] = {a[u].x, h[u].x, a[u].y, h[u].y};
          const uint32_t hi[4] = {a[u].z, h[u].z, a[u].w, h[u].w};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma_bf16(acc[nt], lo, xv[u][nt].x, xv[u][nt].y);
            mma_bf16(acc[nt], hi, xv[u][nt].z, xv[u][nt].w);
          }
        }
      }
    }
    if (split > 1) {  // the K slices' partial tiles meet in shared memory
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[((warp * NT + nt) * 4 + i) * 32 + lane] = acc[nt][i];
      __syncthreads();
      if (ks == 0)
        for (int s = 1; s < split; ++s)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc[nt][i] += red[(((s * slots + slot) * NT + nt) * 4 + i) * 32 + lane];
      __syncthreads();  // red is free for the next round
    }
    if (ks == 0 && blk < blocks) {
      // c[i]: weight row n0 + g (+ 8 for i >= 2), x row nt * 8 + 2t (+ 1 for odd i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = n0 + g + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * t + (i & 1);
          if (n < out.cols && b < nb) st_linear(out, res, rs, b, n, acc[nt][i]);
        }
    }
  }
}

// NOTE: R * U loads of 16 bytes in flight per lane: 16 at batch 1 (the latency of HBM at 3 TB/s
// needs ~16 KB in flight per SM); the tensor-core path keeps 2 * U per lane.
template <class XL>
__device__ inline void linear(const XL& x, const View& w, const View* res, const float* rs,
                              const View& out, float* red) {
  const int nb = out.rows;
  if (nb <= 1) {
    gemv<1, 4, 4>(x, w, res, rs, out);
  } else if (nb <= 8) {
    gemv_mma<1, 8>(x, w, res, rs, out, red);
  } else {
    gemv_mma<2, 4>(x, w, res, rs, out, red);
  }
}
// gemv_mma's K-split partial tiles (kWarps x NT <= 2 x 128 floats), then norm_linear's factors.
constexpr int kRedFloats = kWarps * 2 * 128;

// -- The weight ring (MK_TG_WEIGHT_RING) --------------------------------------------------------
// A batch-1 linear task streams its slice of the weight (its output columns' rows, contiguous:
// rows x K bf16) through kRingStages shared-memory buffers filled by bulk copies (TMA), and thread
// 0 issues the first kRingStages of them BEFORE the task's waits: a weight depends on nothing, so
// up to 160 KB per CTA are in flight while the producers of x still run. After the waits x (one
// row, SiLU applied for silu_linear) goes to shared memory once, then each warp sums its rows
// (row i: warp i % kWarps) over each buffer as it lands, the CTA meets, and thread 0 refills the
// buffer with the stage kRingStages ahead. A buffer is a byte range, not whole rows: a row cut by
// its end carries its lanes' partial sums into the next stage.
// NOTE: why: the plain GEMV starts loading only after the waits, so every one of a layer's ~6
// stages pays the load latency and the ramp-up again (a 4096 x 4096 linear took ~16 us against 11
// of bytes, one H100; docs/megakernel.md).
// Batch 2-16 (the tensor-core GEMV's tasks) use the ring "blocked": a stage is one 16-row block
// of the weight x kRingChunk of K (16 bulk copies, one per row, at a padded pitch so that the
// fragments' loads meet no bank conflicts); the warps split each stage's K and keep their mma
// tiles over the block's stages, then add them in shared memory. x stays in global memory (L2),
// its fragments for the next stage loaded while the current one is summed.
// The barriers live past the engine's other shared memory (kSmemBytes ..), initialised once per
// CTA: their phases order the buffers' reuse across tasks (UnitRing's reason, bulk_ring.cuh).
constexpr bool kWeightRing = MK_TG_WEIGHT_RING != 0;
constexpr int kRingStages = 4;
constexpr int kRingStageBytes = 40 * 1024;
constexpr int kRingBytes = kRingStages * kRingStageBytes;
constexpr int kRingXBytes = 24 * 1024;  // x's row in bf16: K <= 12288
constexpr int kRingTailBytes = 8 * kRingStages;
constexpr int kRingChunk = 1024;                      // blocked: K per stage
constexpr int kRingPitch = 2 * kRingChunk + 16;       // blocked: bytes per row in a stage
constexpr int kRingSteps = kRingChunk / 32 / kWarps;  // blocked: 32-wide K steps per warp
static_assert(kRingBytes + kRingXBytes + (kGemvRows + kWarps) * 4 <= kSmemBytes,
              "the ring, x, rs and its reduction scratch fit");
static_assert(16 * kRingPitch <= kRingStageBytes && kRingSteps * 32 * kWarps == kRingChunk,
              "a blocked stage fits a buffer, its K split evenly over the warps");
static_assert(kRedFloats * 4 <= kRingXBytes, "blocked: red where flat keeps x, before rs");

struct RingJob {
  View w{};             // the task's weight rows [rows, K]
  long long bytes = 0;  // flat: rows * K * 2
  int stages = 0;       // 0: the task does not use the ring
  int chunks = 0;       // blocked: stages per 16-row block (0: flat)
};

// The ring's work for task row d (the same answer in the prologue and in the task).
__device__ inline RingJob ring_job(const Params& p, const int* d) {
  RingJob j;
  const int op = d[kFOp], nb = d[kFOutRows];
  if (!kWeightRing || nb < 1 || nb > kGemvRows) return j;
  if (op != kOpLinear && op != kOpNormLinear && op != kOpSiluLinear) return j;
  const View w = read_view(p, d, 1, read_rank(p, d, 1));
  if ((reinterpret_cast<uintptr_t>(w.p) & 15) || (w.ld & 7)) return j;
  if (nb == 1) {
    if (w.ld != w.cols || 2LL * w.cols > kRingXBytes) return j;
    j.w = w;
    j.bytes = 2LL * w.rows * w.cols;
    j.stages = (int)((j.bytes + kRingStageBytes - 1) / kRingStageBytes);
    return j;
  }
  j.w = w;
  j.chunks = (w.cols + kRingChunk - 1) / kRingChunk;
  j.stages = (w.rows + 15) / 16 * j.chunks;
  return j;
}

__device__ inline uint64_t* ring_bars(char* smem) {
  return reinterpret_cast<uint64_t*>(smem + kSmemBytes);
}

__device__ inline void ring_init(char* smem) {
  for (int b = 0; b < kRingStages; ++b) gemm::mbar_init(&ring_bars(smem)[b], 1);
  gemm::mbar_fence_init();
}
__device__ inline void ring_inval(char* smem) {
  for (int b = 0; b < kRingStages; ++b)
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(&ring_bars(smem)[b]))
                 : "memory");
}

// Thread 0: stage s of job j into buffer g % kRingStages (g: stages through the ring so far).
__device__ inline void ring_load(char* smem, const RingJob& j, int s, unsigned g) {
  const int b = (int)(g % kRingStages);
  uint64_t* bar = &ring_bars(smem)[b];
  char* buf = smem + b * kRingStageBytes;
  if (j.chunks == 0) {
    const long long off = (long long)s * kRingStageBytes;
    const uint32_t n = (uint32_t)min((long long)kRingStageBytes, j.bytes - off);
    gemm::mbar_arrive_expect_tx(bar, n);
    bulk_load(buf, reinterpret_cast<const char*>(j.w.p) + off, n, bar);
    return;
  }
  const int r0 = s / j.chunks * 16, k0 = s % j.chunks * kRingChunk;
  const int rows = min(16, j.w.rows - r0), kn = min(kRingChunk, j.w.cols - k0);
  gemm::mbar_arrive_expect_tx(bar, (uint32_t)(rows * kn * 2));
  for (int r = 0; r < rows; ++r) bulk_load(buf + r * kRingPitch, j.w.at(r0 + r, k0), kn * 2, bar);
}

// Every thread: buffer b's stage has landed (phase parity). NOTE: bounded, unlike the GEMM
// engine's waits: a bulk copy that never completes (a bad address) traps after 10 s (room for a
// sanitizer's slowdown) instead of hanging the launch, so the host sees a launch error.
__device__ inline void ring_wait(char* smem, int b, uint32_t parity) {
  uint64_t* bar = &ring_bars(smem)[b];
  if (gemm::mbar_try_wait(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  while (!gemm::mbar_try_wait(bar, parity))
    if (globaltimer_ns() - start > 10000000000ull) __trap();
}

// Thread 0, before the task's waits: its first stages (the CTA's earlier generic accesses of the
// buffers are ordered before these async-proxy writes by the fence).
__device__ inline void ring_prologue(char* smem, const RingJob& j, unsigned used) {
  if (j.stages == 0) return;
  fence_proxy_async_smem();
  for (int s = 0; s < j.stages && s < kRingStages; ++s) ring_load(smem, j, s, used + s);
}

// Every thread: the task's GEMV (B = 1) from the ring; `used` advances by the job's stages.
// norm_eps > 0 (norm_linear): the row's 1 / rms into rs[0] from the x values as they go to shared
// memory (no second pass over x, as row_rsqrt's).
template <class XL>
__device__ inline void gemv_ring(const XL& x, const RingJob& j, const View* res, float* rs,
                                 float norm_eps, const View& out, char* smem, unsigned& used) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, K = x.K();
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kRingBytes);
  float ss = 0.f;
#pragma unroll 4
  for (int k = threadIdx.x * kVec; k < K; k += kThreads * kVec) {
    const uint4 v = x.load(0, k);
    *reinterpret_cast<uint4*>(xs + k) = v;
    if (norm_eps > 0.f) {
      float f[kVec];
      to_f32(v, f);
#pragma unroll
      for (int t = 0; t < kVec; ++t) ss = fmaf(f[t], f[t], ss);
    }
  }
  if (norm_eps > 0.f) {  // a block reduction (scratch past rs); every thread reads rs[0] below
    const float total = block_reduce<false>(ss, rs + kGemvRows);
    if (threadIdx.x == 0) rs[0] = rsqrtf(total / K + norm_eps);
  }
  __syncthreads();
  const long long row = 2LL * K;
  float carry = 0.f;  // this lane's partial sum of a row that the last buffer cut
  for (int s = 0; s < j.stages; ++s) {
    const unsigned g = used + s;
    const int b = (int)(g % kRingStages);
    ring_wait(smem, b, (g / kRingStages) & 1);
    const long long lo = (long long)s * kRingStageBytes;
    const long long hi = min(lo + kRingStageBytes, j.bytes);
    const char* buf = smem + b * kRingStageBytes;
    const int first = (int)(lo / row);
    for (int i = first + (warp - first % kWarps + kWarps) % kWarps; i * row < hi; i += kWarps) {
      const long long a = max(lo, i * row), e = min(hi, (i + 1) * row);
      float acc = a > i * row ? carry : 0.f;
      for (long long o = a + 16 * lane; o < e; o += 16 * 32) {
        float wf[kVec], xf[kVec];
        to_f32(*reinterpret_cast<const uint4*>(buf + (o - lo)), wf);
        to_f32(*reinterpret_cast<const uint4*>(xs + (o - i * row) / 2), xf);
#pragma unroll
        for (int t = 0; t < kVec; ++t) acc = fmaf(xf[t], wf[t], acc);
      }
      if (e == (i + 1) * row) {
        const float sum = warp_sum(acc);
        if (lane == 0) st_linear(out, res, rs, 0, i, sum);
      } else {
        carry = acc;  // the row goes on in the next stage
      }
    }
    __syncthreads();  // every warp has read buffer b
    if (threadIdx.x == 0 && s + kRingStages < j.stages)
      ring_load(smem, j, s + kRingStages, g + kRingStages);
  }
  used += j.stages;
}

// x fragments of one blocked stage for this warp: rows nt * 8 + g, K steps u (zero past K or nb).
template <int NT, class XL>
__device__ __forceinline__ void ring_x(const XL& x, int nb, int k0, int kn,
                                       uint4 (&xv)[kRingSteps][NT]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int u = 0; u < kRingSteps; ++u) {
    const int kk = (u * kWarps + warp) * 32 + 8 * t;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      xv[u][nt] = kk < kn && nt * 8 + g < nb ? x.load(nt * 8 + g, k0 + kk) : make_uint4(0, 0, 0, 0);
  }
}

// Every thread: the task's GEMV (batch 2..16, NT tiles of 8 rows of x) from the blocked ring,
// mma.m16n8k16 as gemv_mma (the same permuted K); `used` advances by the job's stages.
template <int NT, class XL>
__device__ inline void gemv_mma_ring(const XL& x, const RingJob& j, const View* res,
                                     const float* rs, const View& out, char* smem, unsigned& used) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int nb = out.rows, K = j.w.cols;
  float* red = reinterpret_cast<float*>(smem + kRingBytes);
  float acc[NT][4];
  uint4 xv[kRingSteps][NT], xn[kRingSteps][NT];
  ring_x<NT>(x, nb, 0, min(kRingChunk, K), xv);
  for (int s = 0; s < j.stages; ++s) {
    const unsigned gs = used + s;
    const int b = (int)(gs % kRingStages), c = s % j.chunks;
    const int k0 = c * kRingChunk, kn = min(kRingChunk, K - k0);
    if (s + 1 < j.stages) {  // the next stage's x while this one is summed
      const int k1 = (s + 1) % j.chunks * kRingChunk;
      ring_x<NT>(x, nb, k1, min(kRingChunk, K - k1), xn);
    }
    if (c == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    }
    ring_wait(smem, b, (gs / kRingStages) & 1);
    const char* buf = smem + b * kRingStageBytes;
#pragma unroll
    for (int u = 0; u < kRingSteps; ++u) {
      const int base = (u * kWarps + warp) * 32;
      if (base >= kn) break;  // warp-uniform: mma.sync needs the whole warp
      const int kk = base + 8 * t;
      const bool in = kk < kn;
      const uint4 a = in ? *reinterpret_cast<const uint4*>(buf + g * kRingPitch + 2 * kk)
                         : make_uint4(0, 0, 0, 0);
      const uint4 h = in ? *reinterpret_cast<const uint4*>(buf + (g + 8) * kRingPitch + 2 * kk)
                         : make_uint4(0, 0, 0, 0);
      const uint32_t lo[4] = {a.x, h.x, a.y, h.y};
      const uint32_t hi[4] = {a.z, h.z, a.w, h.w};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_bf16(acc[nt], lo, xv[u][nt].x, xv[u][nt].y);
        mma_bf16(acc[nt], hi, xv[u][nt].z, xv[u][nt].w);
      }
    }
    const bool last = c == j.chunks - 1;  // the block's tiles are summed over K: meet in red
    if (last) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[((warp * NT + nt) * 4 + i) * 32 + lane] = acc[nt][i];
    }
    __syncthreads();  // every warp has read buffer b (and written red)
    if (threadIdx.x == 0 && s + kRingStages < j.stages)
      ring_load(smem, j, s + kRingStages, gs + kRingStages);
    if (last && warp == 0) {
      const int n0 = s / j.chunks * 16;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = 0.f;
          for (int w = 0; w < kWarps; ++w) v += red[((w * NT + nt) * 4 + i) * 32 + lane];
          const int n = n0 + g + (i >= 2 ? 8 : 0), bb = nt * 8 + 2 * t + (i & 1);
          if (n < out.cols && bb < nb) st_linear(out, res, rs, bb, n, v);
        }
    }
    if (last) __syncthreads();  // red is free again (the next stage may be a block's last too)
#pragma unroll
    for (int u = 0; u < kRingSteps; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xv[u][nt] = xn[u][nt];
  }
  used += j.stages;
}

// A linear task on the ring: flat (batch 1) or blocked. norm_eps > 0: norm_linear, the rows'
// factors into rs (blocked: by row_rsqrt first).
template <class XL>
__device__ inline void linear_ring(const XL& x, const RingJob& j, const View* res, float* rs,
                                   float norm_eps, const View& out, char* smem, unsigned& used) {
  if (j.chunks == 0) {
    gemv_ring(x, j, res, norm_eps > 0.f ? rs : nullptr, norm_eps, out, smem, used);
    return;
  }
  if (norm_eps > 0.f)
    row_rsqrt(x.x, norm_eps, rs);
  else
    rs = nullptr;
  if (out.rows <= 8)
    gemv_mma_ring<1>(x, j, res, rs, out, smem, used);
  else
    gemv_mma_ring<2>(x, j, res, rs, out, smem, used);
}

// Before a task's waits (thread 0): the first kPrefetchBytes of the build-time tensor it streams
// (a linear's weight rows, an attention's K and V rows: contiguous, never written by the kernel)
// into L2, so a CTA waiting for its input already fetches what it will read most of.
// NOTE: capped per task so that every CTA's prefetch together stays well inside L2 (50 MB).
constexpr long long kPrefetchBytes = 256 * 1024;

__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
  bytes = min(bytes, kPrefetchBytes) & ~15LL;
  if (bytes <= 0 || (reinterpret_cast<uintptr_t>(p) & 15) != 0) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"((int)bytes) : "memory");
}

__device__ inline void prefetch_task(const Params& p, int id) {
  const int* d = p.tasks + id * kTaskFields;
  const int op = d[kFOp];
  const bool lin = op == kOpLinear || op == kOpNormLinear || op == kOpSiluLinear;
  if (!lin && op != kOpAttentionPartial) return;
  const RingJob j = ring_job(p, d);
  if (j.stages > 0 && j.chunks == 0) {  // the ring's first stages are on their way: after them
    const long long ahead = min(j.bytes, (long long)kRingBytes);
    prefetch_l2(reinterpret_cast<const char*>(j.w.p) + ahead, j.bytes - ahead);
    return;
  }
  for (int i = 1; i < (lin ? 2 : 3); ++i) {
    const View t = read_view(p, d, i, read_rank(p, d, i));
    // an attention's K and V share the budget: each whole up to 128 KB (it was half of each's
    // bytes: 8 KB of a 64-position chunk's 16 KB K)
    const long long bytes = 2LL * t.rows * t.cols;
    if (t.ld == t.cols) prefetch_l2(t.p, lin ? bytes : min(bytes, kPrefetchBytes / 2));
  }
}

constexpr int kAttnBatch = 8;  // loads in flight per thread in attention's two streaming loops

// attention_partial of one (sequence, kv head, chunk): G query heads of D over the chunk's L
// cached positions (k, v: its rows). Scores by position (a thread per position), softmax per
// head, then P @ V with threads split into position groups x 8-column pieces, the groups'
// partial sums added in shared memory. Writes the chunk's softmax average of V per head, then
// each head's log-sum-exp as a bf16 pair (hi, lo: ~16 bits through bf16 stores), zeros to
// kStatCols (mkernel/taskgraph/ops.py _partial). Shared memory (device.py attention_smem): q
// [G, D], scores [G, L], partials [groups, G, D], 1 / sum and lse [2G], reduction scratch.
constexpr int kStatCols = 16;
__device__ inline void attention_partial(const View& q, const View& k, const View& v,
                                         const View& out, int G, int D, float scale, float* smem) {
  const int L = k.rows, pieces = D / kVec, groups = kThreads / pieces;
  float* qs = smem;
  float* s = qs + G * D;
  float* part = s + G * L;
  float* inv = part + groups * G * D;
  float* scratch = inv + 2 * G;
  for (int i = threadIdx.x * kVec; i < G * D; i += kThreads * kVec) {
    float f[kVec];
    to_f32(ld_vec(q.at(0, i)), f);
#pragma unroll
    for (int j = 0; j < kVec; ++j) qs[i + j] = f[j];
  }
  __syncthreads();
  // NOTE: kAttnBatch 16-byte loads in flight per thread before the first use: one at a time
  // (the loads are volatile asm, which the compiler does not hoist) left one (sequence, head)
  // task ~90 us over 512 KB of cache (one H100).
  for (int l = threadIdx.x; l < L; l += kThreads) {
    float acc[kMaxGroup] = {};
    for (int c0 = 0; c0 < D; c0 += kAttnBatch * kVec) {
      uint4 kv[kAttnBatch];
#pragma unroll
      for (int u = 0; u < kAttnBatch; ++u)
        kv[u] = c0 + u * kVec < D ? ld_stream(k.at(l, c0 + u * kVec)) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kAttnBatch; ++u) {
        const int c = c0 + u * kVec;
        if (c >= D) break;
        float f[kVec];
        to_f32(kv[u], f);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= G) break;
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[g] = fmaf(qs[g * D + c + j], f[j], acc[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < G) s[g * L + l] = acc[g] * scale;
  }
  for (int g = 0; g < G; ++g) {  // softmax of head g: exp(s - max), 1 / sum kept for the end
    float m = -INFINITY;
    for (int l = threadIdx.x; l < L; l += kThreads) m = fmaxf(m, s[g * L + l]);
    m = block_reduce<true>(m, scratch);
    float sum = 0.f;
    for (int l = threadIdx.x; l < L; l += kThreads) {
      const float e = __expf(s[g * L + l] - m);
      s[g * L + l] = e;
      sum += e;
    }
    sum = block_reduce<false>(sum, scratch);
    if (threadIdx.x == 0) {
      inv[g] = 1.f / sum;
      inv[G + g] = m + __logf(sum);
    }
  }
  __syncthreads();
  const int grp = threadIdx.x / pieces, c = (threadIdx.x % pieces) * kVec;
  if (grp < groups) {
    float acc[kMaxGroup][kVec] = {};
    for (int l0 = grp; l0 < L; l0 += kAttnBatch * groups) {
      uint4 vv[kAttnBatch];  // kAttnBatch positions' pieces in flight (as for the scores)
#pragma unroll
      for (int u = 0; u < kAttnBatch; ++u) {
        const int l = l0 + u * groups;
        vv[u] = l < L ? ld_stream(v.at(l, c)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kAttnBatch; ++u) {
        const int l = l0 + u * groups;
        if (l >= L) break;
        float f[kVec];
        to_f32(vv[u], f);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= G) break;
          const float p = s[g * L + l];
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[g][j] = fmaf(p, f[j], acc[g][j]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < G)
#pragma unroll
        for (int j = 0; j < kVec; ++j) part[(grp * G + g) * D + c + j] = acc[g][j];
  }
  __syncthreads();
  for (int i = threadIdx.x * kVec; i < G * D; i += kThreads * kVec) {
    float y[kVec] = {};
    for (int gr = 0; gr < groups; ++gr)
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] += part[gr * G * D + i + j];
    const float sc = inv[i / D];
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] *= sc;
    st_vec(out.at(0, i), y);
  }
  if (threadIdx.x < kStatCols / 2) {  // (hi, lo) of head threadIdx.x; zeros past G
    const int g = threadIdx.x;
    const float lse = g < G ? inv[G + g] : 0.f;
    const __nv_bfloat16 hi = __float2bfloat16_rn(lse);
    *reinterpret_cast<__nv_bfloat162*>(out.at(0, G * D + 2 * g)) =
        __halves2bfloat162(hi, __float2bfloat16_rn(lse - __bfloat162float(hi)));
  }
}

// attention_combine of one (sequence, kv head): its C chunks' partials (one row of C x (G D +
// kStatCols)) weighed by exp(lse - max lse) per head. Warp g finds head g's weights (G <=
// kWarps); then every 8 columns of the G heads' output sum C partial pieces. Shared memory:
// weights [G, C], 1 / their sum [G].
__device__ inline void attention_combine(const View& part, const View& out, int G, int D, int C,
                                         float* smem) {
  const int P = G * D + kStatCols, lane = threadIdx.x % 32, g = threadIdx.x / 32;
  float* w = smem;
  float* inv = w + G * C;
  if (g < G) {
    float m = -INFINITY;
    for (int c = lane; c < C; c += 32) {
      const __nv_bfloat162 st =
          *reinterpret_cast<const __nv_bfloat162*>(part.at(0, c * P + G * D + 2 * g));
      w[g * C + c] = __low2float(st) + __high2float(st);
      m = fmaxf(m, w[g * C + c]);
    }
    m = warp_max(m);
    float sum = 0.f;
    for (int c = lane; c < C; c += 32) {
      const float e = __expf(w[g * C + c] - m);
      w[g * C + c] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) inv[g] = 1.f / sum;
  }
  __syncthreads();
  for (int i = threadIdx.x * kVec; i < G * D; i += kThreads * kVec) {
    const int h = i / D;
    float y[kVec] = {};
    for (int c = 0; c < C; ++c) {
      float f[kVec];
      to_f32(ld_vec(part.at(0, c * P + i)), f);
      const float wc = w[h * C + c];
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[j] = fmaf(wc, f[j], y[j]);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] *= inv[h];
    st_vec(out.at(0, i), y);
  }
}

// One task: decode its row of the task table, run its op's tile.
// `used`: the weight ring's stages so far (every thread's copy the same).
__device__ inline void run_task(const Params& p, int id, char* smem, unsigned& used) {
  const int* d = p.tasks + id * kTaskFields;
  const View out = out_view(p, d);
  const int op = d[kFOp];
  auto rd = [&](int i) { return read_view(p, d, i, read_rank(p, d, i)); };
  switch (op) {
    case kOpRmsnorm:
      rmsnorm(rd(0), rd(1), out, __int_as_float(d[kFAttr0]), reinterpret_cast<float*>(smem));
      break;
    case kOpLinear:
    case kOpNormLinear:
    case kOpSiluLinear: {
      const View x = rd(0), res = d[kFReads] > 2 ? rd(2) : View{};
      const View* r = d[kFReads] > 2 ? &res : nullptr;
      float* red = reinterpret_cast<float*>(smem);
      const RingJob j = ring_job(p, d);
      // with the ring, its buffers hold weight rows since before the waits: rs goes past x's row
      float* rs = j.stages > 0 ? reinterpret_cast<float*>(smem + kRingBytes + kRingXBytes)
                               : red + kRedFloats;
      const float eps = op == kOpNormLinear ? __int_as_float(d[kFAttr0]) : 0.f;
      if (op == kOpSiluLinear) {
        if (j.stages > 0)
          linear_ring(SiluX{x}, j, r, rs, 0.f, out, smem, used);
        else
          linear(SiluX{x}, rd(1), r, nullptr, out, red);
      } else if (j.stages > 0) {
        linear_ring(PlainX{x}, j, r, rs, eps, out, smem, used);
      } else {
        if (op == kOpNormLinear) row_rsqrt(x, eps, rs);
        linear(PlainX{x}, rd(1), r, op == kOpNormLinear ? rs : nullptr, out, red);
      }
      break;
    }
    case kOpSiluMul: {
      const View g = rd(0), u = rd(1);
      for_each_vec(out, [&](int r, int c, float* y) {
        silu_mul_vec(ld_vec(g.at(r, c)), ld_vec(u.at(r, c)), y);
      });
      break;
    }
    case kOpAdd: {
      const View a = rd(0), b = rd(1);
      for_each_vec(out, [&](int r, int c, float* y) {
        float f[kVec];
        to_f32(ld_vec(a.at(r, c)), y);
        to_f32(ld_vec(b.at(r, c)), f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) y[j] += f[j];
      });
      break;
    }
    case kOpAttentionPartial:
      attention_partial(rd(0), rd(1), rd(2), out, d[kFAttr0], d[kFAttr1],
                        __int_as_float(d[kFAttr3]), reinterpret_cast<float*>(smem));
      break;
    case kOpAttentionCombine:
      attention_combine(rd(0), out, d[kFAttr0], d[kFAttr1], d[kFAttr2],
                        reinterpret_cast<float*>(smem));
      break;
    case kOpAllGather: {
      const View x = rd(0);
      for_each_vec(out, [&](int r, int c, float* y) { to_f32(ld_vec(x.at(r, c)), y); });
      break;
    }
    case kOpAllReduce:
    case kOpReduceScatter:  // pull-reduce: every rank's tile, added in rank order (same bits)
      for_each_vec(out, [&](int r, int c, float* y) {
        to_f32(ld_vec(read_view(p, d, 0, 0).at(r, c)), y);
        for (int q = 1; q < p.world_size; ++q) {
          float f[kVec];
          to_f32(ld_vec(read_view(p, d, 0, q).at(r, c)), f);
#pragma unroll
          for (int j = 0; j < kVec; ++j) y[j] += f[j];
        }
      });
      break;
    default: __trap();  // a table this engine does not know: the host and device encodings differ
  }
}

// The engine contract (templates/engine_contract.cuh).
struct Engine {
  using Params = tg::Params;
  struct Task {
    int id;
  };
  struct Dest {};  // a task's output is in its table row
  static constexpr int kThreads = tg::kThreads;
  static constexpr int kSmemBytes = tg::kSmemBytes + (kWeightRing ? kRingTailBytes : 0);
  static constexpr int kSpareWarp = kWarps - 1;
  template <class T>
  __device__ static Task task_of(const T& tile) {
    return Task{tile.tag};  // the tag is the task id (mkernel/taskgraph/lower.py)
  }
  template <class Hooks, class Spare>
  __device__ static void run_cta(const Params& p, char* smem, Hooks& hooks, Spare&& spare) {
    const bool signals = hooks.signals();
    unsigned used = 0;  // the weight ring's stages so far
    if constexpr (kWeightRing) {
      if (threadIdx.x == 0) ring_init(smem);
      __syncthreads();
    }
    for (int i = 0; i < hooks.num_tasks(); ++i) {
      const Task t = hooks.task(i);
      if (threadIdx.x == 0) {
        if constexpr (kWeightRing)
          ring_prologue(smem, ring_job(p, p.tasks + t.id * kTaskFields), used);
        prefetch_task(p, t.id);
        hooks.before_load(i);
      }
      __syncwarp();
      __syncthreads();
      run_task(p, t.id, smem, used);
      if (signals) {
        if constexpr (MK_TG_THREAD_FENCE != 0) __threadfence();  // this thread's stores
        __syncthreads();
        if (threadIdx.x == 0) {
          // NOTE: gpu scope: every reader of the tile is a CTA of this GPU (Op::kOneGpu); a
          // system-scope fence here cost the decode launch 30x (docs/megakernel.md)
          if (hooks.raises(i)) __threadfence();
          hooks.after_store(i);
        }
      }
      __syncthreads();  // shared memory and thread 0's waits belong to the next task
    }
    if constexpr (kWeightRing) {
      if (threadIdx.x == 0) ring_inval(smem);  // every stage landed and was read
    }
    // NOTE: a TaskGraph plan has no comm role; the spare warp's comm loop finds no task
    if ((int)threadIdx.x / 32 == kSpareWarp) spare();
  }
};

}  // namespace mk::tg
