// attention_bwd_args.h: the attention backward launcher's interface (raw pointers and ints, no
// torch). The forward's meaning (attention_args.h) differentiated, given its lse:
//
//   P      = exp(scale * q k^T - lse)            (causal: key j > query i masked, top-left)
//   dV     = P^T dO;  dP = dO V^T;  dS = P * (dP - delta);  dQ = scale dS K;  dK = scale dS^T Q
//   delta  = rowsum(dO * O) (minus the gradient of lse, when lse is an output that has one)
//   GQA: dK, dV of kv head h are summed over the Hq / Hkv query heads that read it.
// dq is REDUCE-ADDED into (fp32: zero it first, or pass partial sums to accumulate); dk, dv are
// stored (bf16 or fp32) or, with kv_accumulate (fp32 only), added to what they hold.
// One launch: grid = B * Hkv * ceil(S_kv / 128) CTAs, one kv tile each.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

struct AttentionBwdArgs {
  const void* q = nullptr;     // [B, S_q, Hq, D] bf16, 16-byte aligned
  const void* k = nullptr;     // [B, S_kv, Hkv, D] bf16, 16-byte aligned
  const void* v = nullptr;     // [B, S_kv, Hkv, D] bf16, 16-byte aligned
  const void* dout = nullptr;  // [B, S_q, Hq, D] bf16, 16-byte aligned
  const float* lse = nullptr;  // [B, Hq, S_q] fp32 (natural log), 4-byte aligned
  float* delta = nullptr;      // [B, Hq, S_q] fp32, 4-byte aligned (launch_attention_bwd_prep
                               // writes it, launch_attention_bwd reads it)
  const void* out = nullptr;   // prep only: the forward's out [B, S_q, Hq, D] bf16, 16-byte
  const float* dlse = nullptr; // prep only: [B, Hq, S_q] fp32 gradient of lse, or nullptr
  float* dq = nullptr;         // [B, S_q, Hq, D] fp32, 16-byte aligned: reduce-added into
  void* dk = nullptr;          // [B, S_kv, Hkv, D] bf16 (16-byte) or fp32 (kv_f32, 8-byte)
  void* dv = nullptr;
  int B = 0, S_q = 0, S_kv = 0, Hq = 0, Hkv = 0, D = 0;  // D in {64, 128}; Hq % Hkv == 0
  float scale = 0.f;       // the forward's softmax scale, finite and > 0
  int causal = 0;          // 0 or 1
  int kv_f32 = 0;          // 1: dk, dv are fp32
  int kv_accumulate = 0;   // 1 (with kv_f32): dk += result, dv += result
  float* rows = nullptr;   // variant 0: [B, Hq, ceil(S_q / 64), 2, 64] fp32, 16-byte aligned: per
                           // 64-row q tile lse * log2(e) (+inf past S_q or where lse is -inf),
                           // then delta (0 past S_q). Read by the backward; the prep kernel
                           // writes it when set (then lse is read there too)
  int variant = 0;  // 0: each consumer warp fetches its lse / delta rows from `rows` by a bulk
                    // copy; 1: every lane loads them from lse and delta and stages them
  int probe = 0;    // measurement only, D = 128 (results wrong): 1 skips dQ, 2 its staging and
                    // reduce-adds, 3 loads Q alone (used as dO too), 4 no reduce-add issued, 5 no
                    // staging stores
};

enum AttentionBwdStatus : int {
  kAttnBwdOk = 0,
  kAttnBwdBadShape = 1,      // a size < 1, or B * Hkv * kv tiles beyond 2^31
  kAttnBwdBadHeadDim = 2,    // D not in {64, 128}
  kAttnBwdBadHeads = 3,      // Hq % Hkv != 0
  kAttnBwdBadPointer = 4,    // a pointer null or misaligned (rows: variant 0 only)
  kAttnBwdBadScale = 5,      // scale not finite or <= 0
  kAttnBwdBadFlag = 6,       // a flag not 0 / 1, accumulate on bf16, variant / probe unknown
  kAttnBwdTensorMap = 7,     // cuTensorMapEncodeTiled unavailable or failed
  kAttnBwdLaunchFailed = 8,  // a CUDA runtime error at launch
};

const char* attention_bwd_status_string(int status);

// Launches the backward on `stream`; returns an AttentionBwdStatus. Nothing is launched unless ok.
int launch_attention_bwd(const AttentionBwdArgs& args, cudaStream_t stream);

// The step before it, one small launch: delta = rowsum(dout * out) - dlse (fp32) and dq = 0.
// Reads dout, out, dlse (optional); writes delta, dq. Same checks on the shared fields.
int launch_attention_bwd_prep(const AttentionBwdArgs& args, cudaStream_t stream);
