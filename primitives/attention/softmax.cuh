// softmax.cuh: the online softmax of one consumer warpgroup over its m64nN score fragments, in
// fp32 with exp2 (the softmax scale is folded into scale_log2 = scale * log2(e)).
//
// Fragment (mk::gemm::Wgmma accumulator layout, per thread): rows r = 16w + l/4 (half 0) and r + 8
// (half 1); element d[4j + 2*half + e] is column 8j + 2q + e (q = l%4). The 4 threads of a quad
// share their two rows, so a row maximum is a local maximum plus two xor-shuffles.
//
// Per kv tile:  mask (optional) -> step(): m_new = max(m, rowmax(s)); s <- exp2(s*c - m_new*c);
//               corr = exp2(m*c - m_new*c); l = l*corr + rowsum(s). The caller rescales O by corr.
// l is kept as a per-thread PARTIAL sum (each thread sums its own columns): a sum needs no
// reduction until the end, finish() reduces it over the quad once.
// A row whose every score so far is -inf (fully masked) keeps m = -inf; its exponent base is taken
// as 0 so that exp2(-inf - base) = 0 instead of NaN.
#pragma once
#include <cmath>
#include <cstdint>

namespace mk::attn {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Sets s to `value` at the columns where masked(column, half) (columns relative to the tile, per
// row half): selects, no branches. The callers branch once per tile on whether any column is
// masked: in the backward, a guarded `if` per element compiled to a branch block per element that
// every step ran (~17% of its warps' stall samples in ncu at S = 8192 full).
template <int R, class Masked>
__device__ __forceinline__ void set_columns_where(float (&s)[R], int q, float value,
                                                  Masked&& masked) {
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * q + (e & 1);
      if (masked(col, e >> 1)) s[4 * j + e] = value;
    }
  }
}

struct OnlineSoftmax {
  float m[2];  // running row maximum of the RAW scores (unscaled), per row half
  float l[2];  // per-thread partial row sum of exp2(s*c - m*c)

  __device__ __forceinline__ void init() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  // s (raw scores, masked entries -inf) -> probabilities relative to the new maximum, in place;
  // corr[h]: factor the caller multiplies row half h of O by (0 on the first tile, where m was
  // -inf: O is still zero then).
  template <int R>
  __device__ __forceinline__ void step(float (&s)[R], float scale_log2, float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int j = 0; j < R / 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = quad_max(mx);
      const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
      corr[h] = fast_exp2(m[h] * scale_log2 - base);  // m = -inf -> 0
      m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = fast_exp2(fmaf(s[4 * j + 2 * h + e], scale_log2, -base));
          s[4 * j + 2 * h + e] = p;
          sum += p;
        }
      }
      l[h] = l[h] * corr[h] + sum;
    }
  }

  // After the last tile: inv[h] = 1 / rowsum (0 for an empty row) and the row's natural-log
  // log-sum-exp of the scaled scores, lse = (m*c + log2(l)) * ln 2 (-inf for an empty row).
  // NaN and +inf as torch.softmax / torch.logsumexp give them: a NaN score (fmaxf leaves it out of
  // m, but its exp2 is NaN) or a +inf one (exp2(inf - inf)) makes the sum NaN, so inv and out are
  // NaN and lse is NaN, except that a +inf max gives lse +inf.
  __device__ __forceinline__ void finish(float scale_log2, float (&inv)[2], float (&lse)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(l[h]);
      // NOTE: sum == 0, not !(sum > 0): the sum is never negative, and a NaN sum is not an empty
      // row (issue 33: it was taken for one, out 0 and lse -inf)
      const bool empty = sum == 0.f;
      inv[h] = empty ? 0.f : 1.f / sum;
      const float lse2 = m[h] == INFINITY ? INFINITY : m[h] * scale_log2 + log2f(sum);
      lse[h] = empty ? -INFINITY : lse2 * 0.69314718055994531f;
    }
  }
};

// The backward's row value lse2 = lse * log2(e) (P = exp2(s * scale_log2 - lse2)): +inf for an
// empty row (lse -inf: P = 0, not NaN); NaN for lse +inf (a +inf score): torch's softmax of such a
// row is NaN in every column (its sum has an exp(inf - inf)), where exp2(s*c - inf) would give 0 at
// the finite scores and a finite dV (issue 33). Packed once per row, never in the kv loop.
// Two selects, no branch (an early return compiled to branches in the per-step row loads).
__device__ __forceinline__ float lse2_of(float lse) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float lse2 = lse == INFINITY ? __int_as_float(0x7fffffff) : lse * kLog2e;
  return lse == -INFINITY ? INFINITY : lse2;
}

// O (an m64nD accumulator, D/2 floats) *= corr per row half.
template <int R>
__device__ __forceinline__ void rescale_rows(float (&o)[R], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    o[4 * j + 0] *= corr[0];
    o[4 * j + 1] *= corr[0];
    o[4 * j + 2] *= corr[1];
    o[4 * j + 3] *= corr[1];
  }
}

}  // namespace mk::attn
