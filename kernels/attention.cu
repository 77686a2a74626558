// attention.cu: the attention forward launcher, a persistent kernel that drives
// mk::attn::AttnEngine.
//
//   grid = min(#SMs, work tiles) CTAs, one per SM; CTA c owns work tiles c, c + grid, c + 2 grid...
//   threads: warpgroup 0 = producer (one thread issues TMA; warps 1..3 idle), warpgroups 1, 2 =
//   consumers (64 query rows each).
//   Four TMA maps over the [B, S, H, D] tensors: Q (box 128 rows), K and V (box 128 rows), O (box
//   64 rows: one per consumer warpgroup), each box 64 columns = one 128-byte swizzle span.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../primitives/attention/engine.cuh"
#include "../primitives/attention/tensor_map_nd.h"
#include "../primitives/host/device.h"
#include "attention_args.h"
#include "attention_launch.cuh"

namespace {

using namespace mk::attn;

template <class Cfg>
int launch(const AttentionArgs& a, cudaStream_t stream, int num_sms) {
  using E = AttnEngine<Cfg>;
  AttnParams p{};
  using mk::host::kTensorMapOk;
  using mk::host::make_tensor_map_bf16_bshd;
  if (make_tensor_map_bf16_bshd(&p.q, a.q, a.B, a.S_q, a.Hq, a.D, Cfg::BM, 64) != kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.k, a.k, a.B, a.S_kv, a.Hkv, a.D, Cfg::BN, 64) != kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.v, a.v, a.B, a.S_kv, a.Hkv, a.D, Cfg::BN, 64) != kTensorMapOk ||
      make_tensor_map_bf16_bshd(&p.o, a.o, a.B, a.S_q, a.Hq, a.D, 64, 64) != kTensorMapOk)
    return kAttnTensorMap;
  p.lse = a.lse;
  p.o_f32 = a.o_f32;
  set_sizes(p, a.B, a.S_q, a.S_kv, a.Hq, a.Hkv, a.scale, a.causal);
  p.m_tiles = (a.S_q + Cfg::BM - 1) / Cfg::BM;
  p.total = a.B * a.Hq * p.m_tiles;  // < 2^31: checked by launch_attention

  const int grid = num_sms < p.total ? num_sms : p.total;
  return launch_engine<E>(p, grid, stream) == cudaSuccess ? kAttnOk : kAttnLaunchFailed;
}

template <int D>
int launch_variant(const AttentionArgs& a, cudaStream_t stream, int num_sms) {
  switch (a.variant) {
    case 0: return launch<AttnConfig<D, true, true>>(a, stream, num_sms);
    case 1: return launch<AttnConfig<D, true, false>>(a, stream, num_sms);
    case 2: return launch<AttnConfig<D, false, false>>(a, stream, num_sms);
    default: return kAttnBadFlag;
  }
}

}  // namespace

const char* attention_status_string(int s) {
  switch (s) {
    case kAttnOk: return "ok";
    case kAttnBadShape: return "B, S_q, S_kv, Hq, Hkv must be >= 1 (and B * Hq * tiles < 2^31)";
    case kAttnBadHeadDim: return "head dim D must be 64 or 128";
    case kAttnBadHeads: return "Hq must be a multiple of Hkv";
    case kAttnBadPointer:
      return "q, k, v, o must be non-null and 16-byte aligned, lse non-null and 4-byte aligned, "
             "o_f32 null or 8-byte aligned";
    case kAttnBadScale: return "scale must be finite and > 0";
    case kAttnBadFlag: return "causal must be 0 or 1 and variant 0, 1 or 2";
    case kAttnTensorMap: return "could not encode a TMA tensor map (cuTensorMapEncodeTiled)";
    case kAttnLaunchFailed: return "CUDA launch failed";
    default: return "unknown status";
  }
}

int launch_attention(const AttentionArgs& a, cudaStream_t stream) {
  if (a.B < 1 || a.S_q < 1 || a.S_kv < 1 || a.Hq < 1 || a.Hkv < 1) return kAttnBadShape;
  const long long tiles = (long long)a.B * a.Hq * ((a.S_q + 127) / 128);
  if (tiles >= (1ll << 31)) return kAttnBadShape;
  if (a.D != 64 && a.D != 128) return kAttnBadHeadDim;
  if (a.Hq % a.Hkv != 0) return kAttnBadHeads;
  if (!aligned(a.q, 16) || !aligned(a.k, 16) || !aligned(a.v, 16) || !aligned(a.o, 16) ||
      !aligned(a.lse, 4) || (a.o_f32 != nullptr && !aligned(a.o_f32, 8)))
    return kAttnBadPointer;
  if (!std::isfinite(a.scale) || !(a.scale > 0.f)) return kAttnBadScale;
  if ((a.causal != 0 && a.causal != 1) || a.variant < 0 || a.variant > 2) return kAttnBadFlag;
  const int num_sms = a.num_sms > 0 ? a.num_sms : mk::host::num_sms_of_current_device();
  if (num_sms < 1) return kAttnLaunchFailed;
  return a.D == 64 ? launch_variant<64>(a, stream, num_sms)
                   : launch_variant<128>(a, stream, num_sms);
}
