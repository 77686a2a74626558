// AllGather + GEMM: out[r] = all_gather(A) @ B_r, with A's shards pushed chunk by chunk.
//
// Every rank's shard [Ms, K] is cut into C chunks of CR rows (the last one may be short); global
// chunk g = src * C + c. The comm role of rank r pushes each own chunk into every rank's gather
// buffer (own copy first, then r+1, ...) with 16-byte stores and raises ready[g] on that rank right
// after its copy. The compute role walks output tiles of [M, N] (plan order: own shard first, then
// the shards as they arrive); before a tile is loaded, one thread waits for every chunk its rows
// overlap, then counts itself in consumed[g]; the chunk's last consumer (consumers[g] tiles, a plan
// table) sets ready[g] and consumed[g] back to 0, so the pads reset themselves.
//
//   W = 2, C = 2; gather rows on each rank: [ s0c0 s0c1 | s1c0 s1c1 ]
//   rank 0 comm:    s0c0 -> r0, r1; s0c1 -> r0, r1           (ready[0], ready[1] on each)
//   rank 1 comm:    s1c0 -> r1, r0; s1c1 -> r1, r0           (ready[2], ready[3] on each)
//   rank 0 compute: tiles of rows s0 (wait ready[0..1]), then rows s1 (wait ready[2..3])
#include "kernels/fused_host.cuh"

namespace mk {

constexpr int kSignalChunkReady = 2;  // mkernel/ops/common.py SIGNAL_NAMES

template <class EngineT>
struct AgGemm {
  using Engine = EngineT;
  static constexpr int kCommSmemBytes = 0;
  struct Args {
    FusedCommon common;
    typename Engine::Params engine[kMaxLocalRanks];  // A: the local gather buffer [M, K]
    RankPtr<const __nv_bfloat16> a;                   // [Ms, K] per rank: the own shard
    RankPtr<__nv_bfloat16> out;                       // [M, N] per rank
    SymPtr<__nv_bfloat16> gather;                     // [M, K] per rank
    SymPtr<int> ready, consumed;                      // [W * C] per rank
    const int* consumers;                             // [W * C]: tiles overlapping each chunk
    int N, K, Ms, C, CR;
    __device__ int chunk_of(int row) const { return row / Ms * C + row % Ms / CR; }
  };

  struct ComputeHooks : ComputeHooksBase<Args> {
    // One thread: wait for the tile's chunks (tag = its first), then consume them.
    __device__ void before_load(int i) const {
      const Args& a = this->a;
      if (a.common.world.world_size == 1) return;  // the engine reads a itself: nothing to wait for
      const int rank = this->cta.rank;
      const Tile t = this->tile(i);
      const int last = a.chunk_of(t.m0 + t.rows - 1);
      int* ready = a.ready.map(rank);
      int* consumed = a.consumed.map(rank);
      for (int g = t.tag; g <= last; ++g) {
        const WaitSite site{rank, g / a.C, this->tasks[i], kRoleCompute, kSignalChunkReady, g};
        wait_acquire(ready + g, 1, a.common.wait, site);
      }
      fence_proxy_async_global();  // the gathered rows are read next, by TMA
      for (int g = t.tag; g <= last; ++g) {
        // NOTE: every consumer of g has passed its wait before its add, so the last one may reset.
        if (atomicAdd(consumed + g, 1) + 1 == a.consumers[g]) {
          st_relaxed_sys(ready + g, 0);
          st_relaxed_sys(consumed + g, 0);
        }
      }
    }
    __device__ gemm::Dest dest(int i) const {
      const Tile t = this->tile(i);
      __nv_bfloat16* out = this->a.out.at(this->cta.local_rank);
      return gemm::Dest{out + (long long)t.m0 * this->a.N + t.n0, this->a.N, gemm::kStoreBF16};
    }
  };

  // Chunk-major pushes: chunk c reaches every rank before chunk c+1 leaves.
  static __device__ void comm_task(const Args& a, const CtaInfo& cta, int g, const Team& team,
                                   char*) {
    const FusedCommon& c = a.common;
    const int W = c.world.world_size;
    {
      const int r0 = (g - cta.rank * a.C) * a.CR, rows = min(a.CR, a.Ms - r0);
      const uint4* src = reinterpret_cast<const uint4*>(a.a.at(cta.local_rank) + (long long)r0 * a.K);
      const int vecs = rows * a.K / 8;  // K % 8 == 0: whole 16-byte vectors
      for (int j = 0; j < W; ++j) {
        const int p = (cta.rank + j) % W;
        uint4* dst = reinterpret_cast<uint4*>(a.gather.map(p) + ((long long)cta.rank * a.Ms + r0) * a.K);
        copy_v4_team(dst, src, vecs, team.lane, team.size);
        team.sync();
        if (team.lane == 0 && cta.rank != c.faults.silent_rank) {
          __threadfence_system();
          signal_set_release(a.ready.map(p) + g);
        }
      }
    }
  }
};

template <class Engine>
struct LaunchAgGemm {
  static int run(const FusedLaunch& L, cudaStream_t s) {
  using Op = AgGemm<Engine>;
  typename Op::Args args{};
  args.common = make_common(L);
  // The engine's A is the local gather buffer: rank r's at work_local + r * M * K (emulated);
  // with one rank, a itself ([M, K]: nothing to gather).
  const bool alone = L.world_size == 1;
  const auto* a_base = reinterpret_cast<const __nv_bfloat16*>(alone ? L.a : L.work_local);
  if (!fill_engine_params<Engine>(L, args.engine, a_base, alone ? L.a_rank_stride : (long long)L.M * L.K))
    return kBadConfig;
  args.a = RankPtr<const __nv_bfloat16>{reinterpret_cast<const __nv_bfloat16*>(L.a), L.a_rank_stride};
  args.out = RankPtr<__nv_bfloat16>{reinterpret_cast<__nv_bfloat16*>(L.out), L.out_rank_stride};
  args.gather = SymPtr<__nv_bfloat16>{reinterpret_cast<const unsigned long long*>(L.work_ptrs)};
  args.ready = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.flag_ptrs)};
  args.consumed = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.flag2_ptrs)};
  args.consumers = reinterpret_cast<const int*>(L.aux_ptr);
  args.N = L.N;
  args.K = L.K;
  args.Ms = L.rows_per_rank;
  args.C = L.tiles_per_rank;
  args.CR = L.chunk_rows;
  return launch_persistent<Op>(args, L, s);
  }
};

int launch_ag_gemm(const FusedLaunch& L, cudaStream_t s) {
  return dispatch_config<LaunchAgGemm>(L.tile_config, L, s);
}

}  // namespace mk
