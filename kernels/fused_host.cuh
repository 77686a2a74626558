// Host side shared by the fused launchers: the launch record (an int64 array filled by name in
// mkernel/ops/common.py, field ids generated into primitives/protocol_gen.h) -> FusedArgs<Op>, and
// the launch of persistent_kernel<Op> for the tile config the plan chose. Included by each
// kernels/<op>.cu, whose launcher is one line: `return launch_fused<MyOp>(rec, stream);`.
#pragma once
#include <cuda_runtime.h>

#include "kernels/layouts_gen.h"
#include "primitives/host/tensor_map.h"
#include "templates/persistent.cuh"

namespace mk {

// Error codes returned to Python (mkernel/ops/common.py turns them into exceptions).
enum LaunchError : int { kOk = 0, kBadConfig = 1, kTooManyRanks = 2, kCudaError = 3 };

template <class T>
inline const T* rec_ptr(const long long* rec, int field) {
  return reinterpret_cast<const T*>(rec[field]);
}

// A role's tables and, for a device-filled role, its per-rank capacity (record fields cap_field..).
inline RoleTables role_tables(const long long* rec, int first_field, int cap_field) {
  auto table = [&](int i) { return reinterpret_cast<int*>(rec[first_field + i]); };
  return RoleTables{table(0), table(1), table(2), table(3), table(4), table(5), table(6),
                    {(int)rec[cap_field], (int)rec[cap_field + 1], (int)rec[cap_field + 2]}};
}

inline FusedCommon make_common(const long long* rec) {
  FusedCommon c{};
  c.role[kRoleCompute] = role_tables(rec, kRecComputeTaskSpan, kRecComputeCapRows);
  c.role[kRoleComm] = role_tables(rec, kRecCommTaskSpan, kRecCommCapRows);
  c.tiles = reinterpret_cast<int*>(rec[kRecTiles]);
  c.compute_units = (int)rec[kRecComputeUnits];
  c.comm_units = (int)rec[kRecCommUnits];
  c.ctas_per_rank = (int)rec[kRecCtasPerRank];
  c.overlap = (int)rec[kRecOverlap];
  c.compute_signals = rec[kRecComputeSignals] != 0;
  c.world_size = (int)rec[kRecWorldSize];
  c.rank0 = (int)rec[kRecRank0];
  c.ranks_here = (int)rec[kRecRanksHere];
  c.wait = WaitPolicy{reinterpret_cast<CommStatus*>(rec[kRecStatus]), rec[kRecTimeoutNs],
                      (int)rec[kRecBackoffNs], (int)rec[kRecLaunch]};
  c.silent_rank = (int)rec[kRecSilentRank];
  c.delay_rank = (int)rec[kRecDelayRank];
  c.delay_ns = rec[kRecDelayNs];
  for (int p = 0; p < kMaxPads; ++p)
    c.pads[p] = SymPtr<int>{rec_ptr<unsigned long long>(rec, kRecPad0 + p)};
  c.timeline = reinterpret_cast<long long*>(rec[kRecTimeline]);
  c.timeline_cap = (int)rec[kRecTimelineCap];
  c.timeline_stride[0] = rec[kRecTimelineStrideRank];
  c.timeline_stride[1] = rec[kRecTimelineStrideSlot];
  c.timeline_stride[2] = rec[kRecTimelineStrideRole];
  return c;
}

// Engine params (TMA tensor maps) of every rank this launch serves: rank r's A at
// a_base + r * a_stride ([M, K]), its B at b_base + r * b_stride ([K, N]).
template <class Engine>
inline bool fill_engine_params(int ranks_here, typename Engine::Params* out,
                               const __nv_bfloat16* a_base, long long a_stride,
                               const __nv_bfloat16* b_base, long long b_stride, int M, int N,
                               int K) {
  for (int r = 0; r < ranks_here; ++r) {
    if (host::make_tensor_map_bf16_2d(&out[r].a, a_base + r * a_stride, M, K, K, Engine::BM, 64,
                                      128) != host::kTensorMapOk ||
        host::make_tensor_map_bf16_2d(&out[r].b, b_base + r * b_stride, K, N, N, 64, 64, 128) !=
            host::kTensorMapOk)
      return false;
    out[r].M = M;
    out[r].N = N;
    out[r].K = K;
  }
  return true;
}

// Tensor maps of the bf16 output of every rank this launch serves ([rows, cols] row-major): the
// engine stores full bf16 tiles through them with TMA (configs with kEpiTma). False when the engine
// does not use them or one cannot be encoded (misaligned output): it then writes by row copies.
template <class Engine>
inline bool fill_out_maps(int ranks_here, CUtensorMap* maps, const RankPtr<__nv_bfloat16>& out,
                          int rows, int cols) {
  if constexpr (!Engine::kTmaStore) {
    return false;
  } else {
    if (out.base == nullptr) return false;
    for (int r = 0; r < ranks_here; ++r) {
      if (host::make_tensor_map_bf16_2d(&maps[r], out.base + r * out.rank_stride, rows, cols, cols,
                                        64, 64, 128) != host::kTensorMapOk)
        return false;
    }
    return true;
  }
}

// Dest of a bf16 tile at (row, col) of this rank's mapped output ([*, ld]), with its tensor map.
template <class Args>
__device__ inline gemm::Dest bf16_out_dest(const Args& a, int local_rank, __nv_bfloat16* ptr,
                                           int ld, int row, int col) {
  gemm::Dest d{ptr, ld, gemm::kStoreBF16};
  if (a.out_mapped) {
    d.map = &a.out_map[local_rank];
    d.map_col = col;
    d.map_row = row;
  }
  return d;
}

template <class Op>
inline int launch_persistent(const long long* rec, cudaStream_t s) {
  using Engine = typename Op::Engine;
  FusedArgs<Op> args{};
  args.common = make_common(rec);
  args.layout = Op::Layout::from(rec);
  args.rdma = RdmaArgs{reinterpret_cast<void*>(rec[kRecRdmaRings]),
                       reinterpret_cast<int*>(rec[kRecRdmaReserve]), (int)rec[kRecRdmaCapacity],
                       (int)rec[kRecRanksPerNode]};
  const FusedCommon& c = args.common;
  if (c.ranks_here > kMaxLocalRanks) return kTooManyRanks;
  if (c.ctas_per_rank > kMaxBarrierSlots) return kBadConfig;
  if constexpr (op_nodes<Op>::value) {
    if (!rdma_args_ok(args.rdma, c.world_size)) return kBadConfig;
  }
  if (!Op::prepare(rec, args)) return kBadConfig;
  const int smem = Engine::kSmemBytes + Op::kCommSmemBytes + claim_bytes<Op>();
  auto kernel = persistent_kernel<Op>;
  // NOTE: the attribute is set once per device (host time per call matters for small calls).
  static bool attribute_set[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return kCudaError;
  if (!attribute_set[device]) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return kCudaError;
    attribute_set[device] = true;
  }
  kernel<<<c.ranks_here * c.ctas_per_rank, Engine::kThreads, smem, s>>>(args);
  return cudaGetLastError() == cudaSuccess ? kOk : kCudaError;
}

// The op for the tile config the plan chose (Schedule.tile; ids in primitives/protocol_gen.h).
template <template <class> class Op>
inline int launch_fused(const long long* rec, cudaStream_t s) {
  switch ((int)rec[kRecTileConfig]) {
    case kTile128x256x64: return launch_persistent<Op<gemm::Engine<gemm::Tile128x256x64>>>(rec, s);
    case kTile128x128x64: return launch_persistent<Op<gemm::Engine<gemm::Tile128x128x64>>>(rec, s);
    case kTile64x128x64: return launch_persistent<Op<gemm::Engine<gemm::Tile64x128x64>>>(rec, s);
    default: return kBadConfig;
  }
}

}  // namespace mk
