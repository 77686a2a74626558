// The grouped GEMM engine behind the persistent template's engine contract (MoE experts): the dense
// engine with a batch of B matrices (kGroupedB) whose plan tiles name their matrix in the tag, and
// optionally A rows gathered by index (kGatherA: the dispatch reads its rows' tokens from the
// receive buffer through the layout phase's row map).
#pragma once
#include "kernels/fused_host.cuh"

namespace mk {

template <class Cfg, bool kGather>
struct GroupedEngine : gemm::Engine<Cfg, /*kGroupedB=*/true, kGather> {
  // A plan tile's tag is its expert (the matrix of B's batch the tile multiplies).
  template <class T>
  __device__ static gemm::TileTask task_of(const T& t) {
    return gemm::TileTask{t.m0, t.n0, t.rows, t.cols, t.tag};
  }
};

// The end of a layout phase's exchange (thread 0 of CTA slot 0, after __syncthreads: every
// thread's peer stores issued): raise flag kPad[me] on each of the W ranks, then wait for every
// rank's here, resetting each as it is seen. Half the patience: every rank has passed the entry
// barrier, so its part is due at once, and a silent rank is named here before the tasks that wait
// for what follows it time out naming me (GPU run 12 of 2026-12-01). (W from the caller, read
// before its stores: that keeps both kernels' SASS what it was when the two loops were written out.)
template <int kPad>
__device__ __forceinline__ void exchange_flags(const FusedCommon& c, int me, int W) {
  __threadfence_system();  // every thread's stores, before the flags (cumulative)
  for (int i = 0; i < W && me != c.silent_rank; ++i)
    signal_set_release(c.pads[kPad].map((me + i) % W) + me, 1);
  const WaitPolicy quick{c.wait.status, c.wait.timeout_ns / 2, c.wait.backoff_ns, c.wait.launch};
  for (int s = 0; s < W; ++s) {
    const WaitSite site{me, s, -1, kRoleBarrier, kPad, s};
    wait_acquire_reset(c.pads[kPad].map(me) + s, 1, quick, site);
  }
}

// The largest e < n with base[e] <= x (base non-decreasing, base[0] <= x < base[n]): the expert of
// row x when base is a rank's expert offsets, of tile x when it is their tile prefix (an expert
// with none has base[e] == base[e + 1] and is passed over).
__device__ inline int last_at_most(const int* base, int n, int x) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (base[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Exclusive prefix sum, in place, of v[0], v[stride], ..., v[(n - 1) * stride]; returns their
// total (the MoE layouts' counts -> first positions, one thread per sequence).
__device__ __forceinline__ int exclusive_scan(int* v, int n, int stride = 1) {
  int run = 0;
  for (int i = 0; i < n; ++i) {
    const int x = v[i * stride];
    v[i * stride] = run;
    run += x;
  }
  return run;
}

// B of every served rank: its experts' [E, K, N] weights at b.at(r) (a 3D map, box {64, 64, 1}).
template <class Params>
inline bool fill_grouped_b(int ranks_here, Params* out, const RankPtr<const __nv_bfloat16>& b,
                           int experts, int K, int N, int M) {
  for (int r = 0; r < ranks_here; ++r) {
    if (host::make_tensor_map_bf16_3d(&out[r].b, b.base + r * b.rank_stride, experts, K, N, N,
                                      (uint64_t)K * N, 64, 64, 128) != host::kTensorMapOk)
      return false;
    out[r].M = M;
    out[r].N = N;
    out[r].K = K;
  }
  return true;
}

// A config with kFewer stages less in the engine's TMA ring (room for an op's comm ring beside it).
template <class Cfg, int kFewer>
using FewerStages =
    gemm::TileConfig<Cfg::BM, Cfg::BN, Cfg::STAGES - kFewer, Cfg::kId, Cfg::kProducerRegs,
                     Cfg::kConsumerRegs, Cfg::EPI_COLS, Cfg::EPI_MODE, Cfg::CLUSTER>;

// The op on the tile configs a grouped tile may use (no clusters: B differs per tile); kWide adds
// the 128 x 256 config (an op whose plans pick it: moe_common.grouped_tile).
template <template <class> class Op, bool kGather, int kFewerStages = 0, bool kWide = false>
inline int launch_grouped(const long long* rec, cudaStream_t s) {
  using Wide = FewerStages<gemm::Tile128x256x64, kFewerStages>;
  using Big = FewerStages<gemm::Tile128x128x64, kFewerStages>;
  using Small = FewerStages<gemm::Tile64x128x64, kFewerStages>;
  const int config = (int)rec[kRecTileConfig];
  if constexpr (kWide) {
    if (config == kTile128x256x64)
      return launch_persistent<Op<GroupedEngine<Wide, kGather>>>(rec, s);
  }
  switch (config) {
    case kTile128x128x64: return launch_persistent<Op<GroupedEngine<Big, kGather>>>(rec, s);
    case kTile64x128x64: return launch_persistent<Op<GroupedEngine<Small, kGather>>>(rec, s);
    default: return kBadConfig;
  }
}

}  // namespace mk
