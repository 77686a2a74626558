// grouped_gemm_args.h: the grouped GEMM op's launcher interface (raw pointers and ints, no torch).
//
//   for g in 0..G-1:  C[lo_g:hi_g] = A[lo_g:hi_g] @ B[g]
//     A [M, K] bf16 row-major, rows of group g at [lo_g, hi_g); B [G, K, N] bf16 (one matrix per
//     group, e.g. one per local expert); C [M, N] row-major, bf16 (out_kind 0) or fp32 (out_kind
//     2: the accumulators as they are, e.g. for a weighted combine); fp32 accumulation.
//     With a_rows (gather): row m of A is row a_rows[m] of a [a_src_rows, K] (clamped into it), so
//     M counts the gathered rows (e.g. an MoE rank's (token, slot) rows, gathered from its tokens).
//     lo_g = clamp(offsets[g], 0, M), hi_g = clamp(offsets[g + 1], lo_g, M): whatever the device
//     array holds, no tile reads or writes outside A, B, C; rows in no group are not written.
// Two launches on `stream`: a one-CTA prefix pass writes tile_prefix[g] (tiles of groups < g, g in
// 0..G) into the caller's workspace, then a persistent grid of num_sms CTAs takes tile ids
// b, b + grid, ...; a tile id maps to (group, m-tile, n-tile), m-tile-major within its group.
// The caller picks the config (mkernel.schedule.pick_tile; a config with CLUSTER == 1).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

struct GroupedGemmArgs {
  const void* a = nullptr;            // [M, K] bf16 (gather: [a_src_rows, K]), 16-byte aligned
  const int32_t* a_rows = nullptr;    // device int32 [M], or nullptr: A's rows in order
  int a_src_rows = 0;                 // rows of a when gathering (>= 1)
  const void* b = nullptr;            // [G, K, N] bf16, 16-byte aligned
  void* c = nullptr;                  // [M, N] bf16 or fp32 (out_kind)
  const int32_t* offsets = nullptr;   // device int32 [G + 1]: group g's rows start at offsets[g]
  int32_t* workspace = nullptr;       // device int32 [G + 1], overwritten (the tile prefix)
  int M = 0, N = 0, K = 0, G = 0;     // M >= 0, N, K >= 1 and multiples of 8, G >= 1
  int config = -1;                    // mk::gemm config id with CLUSTER == 1
  int out_kind = 0;                   // 0: bf16 store, 2: fp32 store
  int num_sms = 0;                    // 0: the device's multiprocessor count
};

enum GroupedGemmStatus : int {
  kGroupedOk = 0,
  kGroupedBadShape = 1,      // N, K or G < 1, M < 0, or a_src_rows < 1 with a_rows
  kGroupedBadAlignment = 2,  // N % 8 != 0 or K % 8 != 0
  kGroupedBadPointer = 3,    // a null pointer, or a / b / c not 16-byte aligned
  kGroupedBadConfig = 4,     // unknown config id, or a clustered config
  kGroupedTensorMap = 5,     // cuTensorMapEncodeTiled unavailable or failed
  kGroupedLaunchFailed = 6,  // a CUDA runtime error at launch
  kGroupedBadKind = 7,       // out_kind not 0 or 2
};

const char* grouped_gemm_status_string(int status);

// Launches the grouped GEMM on `stream`; nothing is launched unless it returns kGroupedOk.
int launch_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);
