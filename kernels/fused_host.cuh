// Host side shared by the fused GEMM-family launchers: FusedLaunch -> FusedCommon + engine params,
// and the launch of persistent_kernel<Op>. Included by each kernels/<op>.cu.
#pragma once
#include <cuda_runtime.h>

#include "kernels/fused_launch.h"
#include "primitives/comm.cuh"
#include "primitives/gemm/engine.cuh"
#include "primitives/host/tensor_map.h"
#include "templates/persistent.cuh"

namespace mk {

// Error codes returned to Python (mkernel/ops/common.py turns them into exceptions).
enum LaunchError : int { kOk = 0, kBadConfig = 1, kTooManyRanks = 2, kCudaError = 3 };

inline FusedCommon make_common(const FusedLaunch& L) {
  FusedCommon c{};
  c.plan = PlanView{reinterpret_cast<const int*>(L.tiles),
                    reinterpret_cast<const int*>(L.compute_order),
                    reinterpret_cast<const int*>(L.comm_tasks),
                    L.tc,
                    L.tm,
                    L.compute_units,
                    L.comm_units,
                    L.ctas_per_rank,
                    L.overlap};
  c.world = WorldView{L.world_size, L.rank0, L.ranks_here};
  c.wait = WaitPolicy{reinterpret_cast<CommStatus*>(L.status), L.timeout_ns, L.backoff_ns};
  c.faults = FaultView{L.silent_rank, L.delay_rank, L.delay_ns};
  c.barrier = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.barrier_ptrs)};
  c.timeline = reinterpret_cast<long long*>(L.timeline);
  c.timeline_cap = L.timeline_cap;
  return c;
}

// The compute hooks every fused GEMM op starts from: the unit's tasks as engine tiles, no wait
// before loads, nothing after stores. An op derives from it and adds dest() and what it needs.
template <class Args>
struct ComputeHooksBase {
  const Args& a;
  const CtaInfo& cta;
  const TaskList& tasks;
  __device__ int num_tasks() const { return tasks.count(); }
  __device__ Tile tile(int i) const { return load_tile(a.common.plan, tasks[i]); }
  __device__ gemm::TileTask task(int i) const {
    const Tile t = tile(i);
    return gemm::TileTask{t.m0, t.n0, t.rows, t.cols};
  }
  __device__ void before_load(int) const {}
  __device__ void after_store(int) const {}
  // No signals() here: the engine's default (true) keeps the per-tile completion, so an op that adds
  // an after_store cannot forget it. An op opts out by returning false where nobody waits.
};

// Tile configs by id (mkernel/schedule.py TILE_CONFIG_IDS).
template <template <class> class LaunchWith>
inline int dispatch_config(int config_id, const FusedLaunch& L, cudaStream_t s) {
  switch (config_id) {
    case 0: return LaunchWith<gemm::Engine<gemm::Tile128x256x64>>::run(L, s);
    case 1: return LaunchWith<gemm::Engine<gemm::Tile128x128x64>>::run(L, s);
    case 2: return LaunchWith<gemm::Engine<gemm::Tile64x128x64>>::run(L, s);
    default: return kBadConfig;
  }
}

// Engine params (TMA tensor maps) of every rank this launch serves: rank r's A at
// a_base + r * a_stride ([M, K]), its B at L.b + r * L.b_rank_stride ([K, N]).
template <class Engine>
inline bool fill_engine_params(const FusedLaunch& L, typename Engine::Params* out,
                               const __nv_bfloat16* a_base, long long a_stride) {
  for (int r = 0; r < L.ranks_here; ++r) {
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(L.b) + r * L.b_rank_stride;
    if (host::make_tensor_map_bf16_2d(&out[r].a, a_base + r * a_stride, L.M, L.K, L.K, Engine::BM,
                                      64, 128) != host::kTensorMapOk ||
        host::make_tensor_map_bf16_2d(&out[r].b, b, L.K, L.N, L.N, 64, 64, 128) !=
            host::kTensorMapOk)
      return false;
    out[r].M = L.M;
    out[r].N = L.N;
    out[r].K = L.K;
  }
  return true;
}

// Tensor maps of the bf16 output of every rank this launch serves, rank r's at
// L.out + r * L.out_rank_stride, [rows, cols] row-major: the engine stores bf16 tiles through them
// with TMA (configs with kEpiTma). False when the engine does not use them or one cannot be encoded
// (misaligned output): the engine then writes through its row-copy passes.
template <class Engine>
inline bool fill_out_maps(const FusedLaunch& L, CUtensorMap* maps, int rows, int cols) {
  if constexpr (!Engine::kTmaStore) {
    return false;
  } else {
    if (L.out == 0) return false;
    for (int r = 0; r < L.ranks_here; ++r) {
      const auto* out = reinterpret_cast<const __nv_bfloat16*>(L.out) + r * L.out_rank_stride;
      if (host::make_tensor_map_bf16_2d(&maps[r], out, rows, cols, cols, 64, 64, 128) !=
          host::kTensorMapOk)
        return false;
    }
    return true;
  }
}

// Dest of a bf16 tile at (row, col) of this rank's output, with the output's tensor map if any.
template <class Args>
__device__ inline gemm::Dest bf16_out_dest(const Args& a, int local_rank, __nv_bfloat16* ptr,
                                           int row, int col) {
  gemm::Dest d{ptr, a.N, gemm::kStoreBF16};
  if (a.out_mapped) {
    d.map = &a.out_map[local_rank];
    d.map_col = col;
    d.map_row = row;
  }
  return d;
}

template <class Op>
inline int launch_persistent(const typename Op::Args& args, const FusedLaunch& L, cudaStream_t s) {
  using Engine = typename Op::Engine;
  if (L.ranks_here > kMaxLocalRanks) return kTooManyRanks;
  if (L.ctas_per_rank > kMaxBarrierSlots) return kBadConfig;
  const int smem = Engine::kSmemBytes + Op::kCommSmemBytes;
  auto kernel = persistent_kernel<Op>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return kCudaError;
  kernel<<<L.ranks_here * L.ctas_per_rank, Engine::kThreads, smem, s>>>(args);
  return cudaGetLastError() == cudaSuccess ? kOk : kCudaError;
}

}  // namespace mk
