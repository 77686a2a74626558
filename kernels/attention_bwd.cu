// attention_bwd.cu: the attention backward launcher over mk::attn::AttnBwdEngine.
//
//   grid = B * Hkv * ceil(S_kv / 128) CTAs (not persistent: one kv tile per CTA, the engine's
//   work order puts the longest causal walks first); threads: warpgroup 0 = producer (warp 0's
//   first thread issues TMA), warpgroups 1, 2 = consumers.
//   Five TMA maps over the [B, S, H, D] tensors: Q and dO (box 64 rows), K and V (box 128 rows),
//   each box 64 columns = one 128-byte swizzle span; dQ (fp32, box 64 rows x 32 columns) for the
//   reduce-adds.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../primitives/attention/bwd_engine.cuh"
#include "../primitives/attention/tensor_map_nd.h"
#include "attention_bwd_args.h"
#include "attention_launch.cuh"

namespace {

using namespace mk::attn;

template <class Cfg>
int launch(const AttentionBwdArgs& a, cudaStream_t stream) {
  using E = AttnBwdEngine<Cfg>;
  AttnBwdParams p{};
  using mk::host::kTensorMapOk;
  using mk::host::make_tensor_map_bf16_bshd;
  if (make_tensor_map_bf16_bshd(&p.q, a.q, a.B, a.S_q, a.Hq, a.D, Cfg::BQ, 64) != kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.dout, a.dout, a.B, a.S_q, a.Hq, a.D, Cfg::BQ, 64) !=
          kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.k, a.k, a.B, a.S_kv, a.Hkv, a.D, Cfg::BKV, 64) !=
          kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.v, a.v, a.B, a.S_kv, a.Hkv, a.D, Cfg::BKV, 64) !=
          kTensorMapOk ||
      mk::host::make_tensor_map_f32_bshd(&p.dq, a.dq, a.B, a.S_q, a.Hq, a.D, Cfg::BQ) !=
          kTensorMapOk)
    return kAttnBwdTensorMap;
  p.lse = a.lse;
  p.delta = a.delta;
  p.rows = a.rows;
  p.dk = a.dk;
  p.dv = a.dv;
  set_sizes(p, a.B, a.S_q, a.S_kv, a.Hq, a.Hkv, a.scale, a.causal);
  p.scale = a.scale;
  p.kv_f32 = a.kv_f32;
  p.kv_accumulate = a.kv_accumulate;
  p.q_tiles = (a.S_q + Cfg::BQ - 1) / Cfg::BQ;
  p.kv_tiles = (a.S_kv + Cfg::BKV - 1) / Cfg::BKV;
  const int grid = a.B * a.Hkv * p.kv_tiles;  // < 2^31: checked by launch_attention_bwd

  return launch_engine<E>(p, grid, stream) == cudaSuccess ? kAttnBwdOk : kAttnBwdLaunchFailed;
}

// One warp per (b, s, h) row: delta = sum_d dout * out in fp32 (minus dlse), and the row of dq
// zeroed (the backward reduce-adds into it). 8 bf16 per lane per load: D / 8 lanes busy. With
// packed (variant 0's rows) also the row's lse * log2 e and delta there; the last row of a
// sequence pads its q tile (+inf, 0: rows past S_q see nothing).
__global__ void attention_bwd_prep_kernel(const __nv_bfloat16* dout, const __nv_bfloat16* out,
                                          const float* dlse, const float* lse, float* delta,
                                          float* dq, float* packed, long long rows, int S, int Hq,
                                          int D) {
  const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.f;
  for (int d = lane * 8; d < D; d += 256) {
    const uint4 a = *reinterpret_cast<const uint4*>(dout + row * D + d);
    const uint4 b = *reinterpret_cast<const uint4*>(out + row * D + d);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(a2[i]), y = __bfloat1622float2(b2[i]);
      acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
    }
  }
  for (int d = lane * 4; d < D; d += 128)
    *reinterpret_cast<float4*>(dq + row * D + d) = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const long long h = row % Hq, bs = row / Hq, s = bs % S, b = bs / S;
    const long long at = (b * Hq + h) * S + s;  // [B, Hq, S]
    const float d = dlse != nullptr ? acc - dlse[at] : acc;
    delta[at] = d;
    if (packed != nullptr) {  // [B, Hq, q_tiles, 2, 64]
      float* tile = packed + ((b * Hq + h) * ((S + 63) / 64) + s / 64) * 128;
      tile[s % 64] = lse2_of(lse[at]);  // +inf for -inf, NaN for +inf (issue 33)
      tile[64 + s % 64] = d;
      if (s == S - 1)
        for (int i = (int)(s % 64) + 1; i < 64; ++i) {
          tile[i] = INFINITY;
          tile[64 + i] = 0.f;
        }
    }
  }
}

int check_common(const AttentionBwdArgs& a) {
  if (a.B < 1 || a.S_q < 1 || a.S_kv < 1 || a.Hq < 1 || a.Hkv < 1) return kAttnBwdBadShape;
  if ((long long)a.B * a.Hkv * ((a.S_kv + 127) / 128) >= (1ll << 31)) return kAttnBwdBadShape;
  if (a.D != 64 && a.D != 128) return kAttnBwdBadHeadDim;
  if (a.Hq % a.Hkv != 0) return kAttnBwdBadHeads;
  return kAttnBwdOk;
}

}  // namespace

const char* attention_bwd_status_string(int s) {
  switch (s) {
    case kAttnBwdOk: return "ok";
    case kAttnBwdBadShape:
      return "B, S_q, S_kv, Hq, Hkv must be >= 1 (and B * Hkv * kv tiles < 2^31)";
    case kAttnBwdBadHeadDim: return "head dim D must be 64 or 128";
    case kAttnBwdBadHeads: return "Hq must be a multiple of Hkv";
    case kAttnBwdBadPointer:
      return "q, k, v, dout, dq (and rows for variant 0) must be non-null and 16-byte aligned, lse "
             "and delta 4-byte, dk and dv 16-byte (bf16) or 8-byte (fp32)";
    case kAttnBwdBadScale: return "scale must be finite and > 0";
    case kAttnBwdBadFlag:
      return "causal, kv_f32, kv_accumulate must be 0 or 1, and kv_accumulate needs kv_f32";
    case kAttnBwdTensorMap: return "could not encode a TMA tensor map (cuTensorMapEncodeTiled)";
    case kAttnBwdLaunchFailed: return "CUDA launch failed";
    default: return "unknown status";
  }
}

int launch_attention_bwd_prep(const AttentionBwdArgs& a, cudaStream_t stream) {
  if (const int e = check_common(a); e != kAttnBwdOk) return e;
  if (!aligned(a.dout, 16) || !aligned(a.out, 16) || !aligned(a.delta, 4) || !aligned(a.dq, 16) ||
      (a.dlse != nullptr && !aligned(a.dlse, 4)) ||
      (a.rows != nullptr && (!aligned(a.rows, 16) || !aligned(a.lse, 4))))
    return kAttnBwdBadPointer;
  const long long rows = (long long)a.B * a.S_q * a.Hq;
  constexpr int kRowsPerBlock = 8;
  attention_bwd_prep_kernel<<<(unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                              32 * kRowsPerBlock, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.dout), static_cast<const __nv_bfloat16*>(a.out), a.dlse,
      a.lse, a.delta, a.dq, a.rows, rows, a.S_q, a.Hq, a.D);
  return cudaGetLastError() == cudaSuccess ? kAttnBwdOk : kAttnBwdLaunchFailed;
}

int launch_attention_bwd(const AttentionBwdArgs& a, cudaStream_t stream) {
  if (const int e = check_common(a); e != kAttnBwdOk) return e;
  for (int f : {a.causal, a.kv_f32, a.kv_accumulate})
    if (f != 0 && f != 1) return kAttnBwdBadFlag;
  if (a.kv_accumulate && !a.kv_f32) return kAttnBwdBadFlag;
  if (a.probe < 0 || a.probe > 5 || a.variant < 0 || a.variant > 1) return kAttnBwdBadFlag;
  if (a.variant != 0 && a.probe != 0) return kAttnBwdBadFlag;  // probes: variant 0 only
  if (a.variant == 0 && !aligned(a.rows, 16)) return kAttnBwdBadPointer;
  const uintptr_t kv_align = a.kv_f32 ? 8 : 16;
  if (!aligned(a.q, 16) || !aligned(a.k, 16) || !aligned(a.v, 16) || !aligned(a.dout, 16) ||
      !aligned(a.lse, 4) || !aligned(a.delta, 4) || !aligned(a.dq, 16) ||
      !aligned(a.dk, kv_align) || !aligned(a.dv, kv_align))
    return kAttnBwdBadPointer;
  if (!std::isfinite(a.scale) || !(a.scale > 0.f)) return kAttnBwdBadScale;
  if (a.variant == 1)
    return a.D == 64 ? launch<AttnBwdConfig<64, 0, false>>(a, stream)
                     : launch<AttnBwdConfig<128, 0, false>>(a, stream);
  if (a.D == 64) return a.probe == 0 ? launch<AttnBwdConfig<64>>(a, stream) : kAttnBwdBadFlag;
  switch (a.probe) {  // the probes are built for the benchmark's head dim only
    case 1: return launch<AttnBwdConfig<128, 1>>(a, stream);
    case 2: return launch<AttnBwdConfig<128, 2>>(a, stream);
    case 3: return launch<AttnBwdConfig<128, 3>>(a, stream);
    case 4: return launch<AttnBwdConfig<128, 4>>(a, stream);
    case 5: return launch<AttnBwdConfig<128, 5>>(a, stream);
    default: return launch<AttnBwdConfig<128>>(a, stream);
  }
}
