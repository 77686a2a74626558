// Host side shared by the fused GEMM-family launchers: FusedLaunch -> FusedCommon + engine params,
// and the launch of persistent_kernel<Op>. Included by each kernels/<op>.cu.
#pragma once
#include <cuda_runtime.h>

#include "kernels/fused_launch.h"
#include "primitives/simple_gemm.cuh"
#include "templates/persistent.cuh"

namespace mk {

inline FusedCommon make_common(const FusedLaunch& L) {
  FusedCommon c{};
  c.plan = PlanView{reinterpret_cast<const int*>(L.tiles), reinterpret_cast<const int*>(L.compute_order),
                    reinterpret_cast<const int*>(L.comm_tasks), L.tc, L.tm, L.compute_units,
                    L.comm_units, L.ctas_per_rank, L.overlap};
  c.world = WorldView{L.world_size, L.rank0, L.ranks_here};
  c.wait = WaitPolicy{reinterpret_cast<CommStatus*>(L.status), L.timeout_ns};
  c.faults = FaultView{L.silent_rank, L.delay_rank, L.delay_ns};
  c.barrier = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.barrier_ptrs)};
  return c;
}

// Engine params of every rank this launch serves, for the portable engine.
template <class Engine>
inline void fill_simple_params(const FusedLaunch& L, typename Engine::Params* out,
                               const __nv_bfloat16* a_base, long long a_stride) {
  for (int r = 0; r < L.ranks_here; ++r) {
    out[r].a = a_base + r * a_stride;
    out[r].b = reinterpret_cast<const __nv_bfloat16*>(L.b) + r * L.b_rank_stride;
    out[r].M = L.M;
    out[r].N = L.N;
    out[r].K = L.K;
  }
}

// Error codes returned to Python (mkernel/ops/common.py turns them into exceptions).
enum LaunchError : int { kOk = 0, kBadConfig = 1, kTooManyRanks = 2, kCudaError = 3 };

template <class Op>
inline int launch_persistent(const typename Op::Args& args, const FusedLaunch& L, cudaStream_t s) {
  using Engine = typename Op::Engine;
  if (L.ranks_here > kMaxLocalRanks) return kTooManyRanks;
  if (L.ctas_per_rank > kMaxBarrierSlots) return kBadConfig;
  const int smem = Engine::kSmemBytes + Op::kCommSmemBytes;
  auto kernel = persistent_kernel<Op>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return kCudaError;
  kernel<<<L.ranks_here * L.ctas_per_rank, Engine::kThreads, smem, s>>>(args);
  return cudaGetLastError() == cudaSuccess ? kOk : kCudaError;
}

}  // namespace mk
