// attention_args.h: the attention forward launcher's interface (raw pointers and ints, no torch).
//
//   out[b, s, h, :] = softmax_j(scale * q[b, s, h, :] . k[b, j, h / (Hq/Hkv), :]) @ v[b, j, ., :]
//   lse[b, h, s]    = log(sum_j exp(scale * q . k_j))           (natural log, fp32)
//   q, out [B, S_q, Hq, D] bf16;  k, v [B, S_kv, Hkv, D] bf16; all contiguous (D innermost).
//   causal: key position j > query position s is masked (top-left aligned when S_q != S_kv).
// One persistent launch: grid = min(num_sms, work tiles), work tile = (b, h, 128 query rows).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

struct AttentionArgs {
  const void* q = nullptr;  // [B, S_q, Hq, D] bf16, 16-byte aligned
  const void* k = nullptr;  // [B, S_kv, Hkv, D] bf16, 16-byte aligned
  const void* v = nullptr;  // [B, S_kv, Hkv, D] bf16, 16-byte aligned
  void* o = nullptr;        // [B, S_q, Hq, D] bf16, 16-byte aligned
  float* lse = nullptr;     // [B, Hq, S_q] fp32, 4-byte aligned
  float* o_f32 = nullptr;   // optional [B, S_q, Hq, D] fp32, 8-byte aligned: O unrounded as well
                            // (partial results that are merged by lse later, e.g. ring steps)
  int B = 0, S_q = 0, S_kv = 0, Hq = 0, Hkv = 0, D = 0;  // D in {64, 128}; Hq % Hkv == 0
  float scale = 0.f;        // softmax scale, finite and > 0 (1/sqrt(D) is the usual one)
  int causal = 0;           // 0 or 1
  int num_sms = 0;          // 0: the device's multiprocessor count
  int variant = 0;          // schedule: 0 overlap + ping-pong, 1 overlap, 2 plain (sequential)
};

enum AttentionStatus : int {
  kAttnOk = 0,
  kAttnBadShape = 1,         // a size < 1, or B * Hq * query tiles beyond 2^31
  kAttnBadHeadDim = 2,       // D not in {64, 128}
  kAttnBadHeads = 3,         // Hq % Hkv != 0
  kAttnBadPointer = 4,       // a pointer null or misaligned
  kAttnBadScale = 5,         // scale not finite or <= 0
  kAttnBadFlag = 6,          // causal not 0/1, or variant unknown
  kAttnTensorMap = 7,        // cuTensorMapEncodeTiled unavailable or failed
  kAttnLaunchFailed = 8,     // a CUDA runtime error at launch
};

const char* attention_status_string(int status);

// Launches the forward on `stream`; returns an AttentionStatus. Nothing is launched unless kAttnOk.
int launch_attention(const AttentionArgs& args, cudaStream_t stream);
