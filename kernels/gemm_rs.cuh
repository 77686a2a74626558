// What GEMM + ReduceScatter's two kernels share (kernels/gemm_rs.cu, kernels/gemm_rs_nodes.cu):
// their layouts name the same operands and sizes.
#pragma once
#include "kernels/fused_host.cuh"

namespace mk {

// Offset of a tile's element (0, 0) in its owner's [Ms, N] rows (host-tested against the twin).
MK_HD inline long long owned_offset(int m0, int n0, int owner, int ms, int n) {
  return (long long)(m0 - owner * ms) * n + n0;
}

// Host: the engine's params over every served rank's a [M, K/W] and b [K/W, N], and (TMA-store
// configs) the maps of its bf16 out [M/W, N]: every rank's own tiles store into its out (through
// the map, full tiles), at any W.
template <class Engine, class Args>
inline bool prepare_rs(Args& args) {
  const auto& l = args.layout;
  const int W = args.common.world_size, here = args.common.ranks_here;
  if (!fill_engine_params<Engine>(here, args.engine, l.a.base, l.a.rank_stride, l.b.base,
                                  l.b.rank_stride, l.rows_per_rank * W, l.n, l.k_local))
    return false;
  args.out_mapped = fill_out_maps<Engine>(here, args.out_map, l.out, l.rows_per_rank, l.n);
  return true;
}

}  // namespace mk
