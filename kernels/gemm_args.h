// gemm_args.h: the plain local GEMM op's launcher interface (raw pointers and ints, no torch).
//
//   C = A @ B      A [M, K] bf16 row-major, B [K, N] bf16 row-major,
//                  C [M, ldc] row-major: bf16 (out_kind 0), fp32 (out_kind 1: C += A@B atomically,
//                  out_kind 2: C = A@B in fp32, out_kind 3: C += A@B by TMA bulk reduce-add).
// One persistent launch: grid = min(num_sms, tiles), one CTA per SM; CTA b computes tiles
// tile_order[b], tile_order[b + grid], ... (tile id = tm * tiles_n + tn over the config's tile grid;
// a cluster config's units are CLUSTER vertically adjacent tiles, id = um * tiles_n + tn).
// The caller picks the config and builds the order: mkernel.schedule.pick_tile (its device id,
// TILE_CONFIG_IDS) and mkernel.schedule.grouped_order(..., cluster=CLUSTER); this layer has neither.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

struct GemmArgs {
  const void* a = nullptr;              // [M, K] bf16, 16-byte aligned
  const void* b = nullptr;              // [K, N] bf16, 16-byte aligned
  void* c = nullptr;                    // [M, ldc] bf16 or fp32 (see out_kind)
  int M = 0, N = 0, K = 0;              // N % 8 == 0, K % 8 == 0
  int config = -1;                      // mk::gemm config id (< 0: kGemmBadConfig)
  const int32_t* tile_order = nullptr;  // device int32[units], or nullptr for row-major order
  long ldc = 0;                         // row pitch of C in elements; 0 means N
  int out_kind = 0;                     // 0 store bf16, 1 reduce-add fp32, 2 store fp32,
                                        // 3 reduce-add fp32 by TMA (cp.reduce.async.bulk)
  int num_sms = 0;                      // 0: the device's multiprocessor count
};

enum GemmStatus : int {
  kGemmOk = 0,
  kGemmBadShape = 1,      // M, N or K < 1
  kGemmBadAlignment = 2,  // N % 8 != 0 or K % 8 != 0 (TMA needs 16-byte row strides)
  kGemmBadPointer = 3,    // a, b or c null, or a / b not 16-byte aligned
  kGemmBadConfig = 4,     // config id unknown or < 0 (the caller picks it)
  kGemmBadKind = 5,       // out_kind not in 0..3
  kGemmBadLdc = 6,        // ldc < N
  kGemmTensorMap = 7,     // cuTensorMapEncodeTiled unavailable or failed
  kGemmLaunchFailed = 8,  // a CUDA runtime error at launch (see cudaGetLastError)
};

const char* gemm_status_string(int status);

// Launches C = A @ B on `stream`; returns a GemmStatus. Nothing is launched unless kGemmOk.
int launch_gemm(const GemmArgs& args, cudaStream_t stream);

// CTAs of the last launch_gemm on this host thread's process (a diagnostic for cluster configs,
// whose grid depends on how many clusters fit on the GPU).
int gemm_last_grid();
