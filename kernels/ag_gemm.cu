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
    RankPtr<const __nv_bfloat16> a;                  // [Ms, K] per rank: the own shard
    RankPtr<__nv_bfloat16> out;                      // [M, N] per rank
    SymPtr<__nv_bfloat16> gather;                    // [M, K] per rank
    SymPtr<int> ready, consumed;                     // [W * C] per rank
    const int* consumers;                            // [W * C]: tiles overlapping each chunk
    int N, K, Ms, C, CR;
    int transfer_tma;                     // 1: TMA bulk pushes (inter_sm only), 0: 16-byte stores
    CUtensorMap out_map[kMaxLocalRanks];  // out [M, N] per local rank (TMA stores)
    bool out_mapped;
    __device__ int chunk_of(int row) const { return row / Ms * C + row % Ms / CR; }
  };

  struct ComputeHooks : ComputeHooksBase<Args> {
    // after_store is the base's (empty): nobody waits for a compute tile, so no per-tile completion.
    __device__ bool signals() const { return false; }
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
      return bf16_out_dest(this->a, this->cta.local_rank, out + (long long)t.m0 * this->a.N + t.n0,
                           t.m0, t.n0);
    }
  };

  // Chunk-major pushes: chunk c reaches every rank before chunk c+1 leaves.
  static __device__ void comm_task(const Args& a, const CtaInfo& cta, int g, const Team& team,
                                   char* smem) {
    const int r0 = (g - cta.rank * a.C) * a.CR, rows = min(a.CR, a.Ms - r0);
    const __nv_bfloat16* src = a.a.at(cta.local_rank) + (long long)r0 * a.K;
    const long long dst_off = ((long long)cta.rank * a.Ms + r0) * a.K;  // in every gather buffer
    if (a.transfer_tma && a.common.plan.overlap == kInterSM) {  // intra_sm has no smem to stage
      push_bulk(a, cta, g, team, smem, src, dst_off, (long long)rows * a.K * 2);
      return;
    }
    const int W = a.common.world.world_size;
    for (int j = 0; j < W; ++j) {  // 16-byte stores, each rank signalled as soon as its copy landed
      const int p = (cta.rank + j) % W;
      copy_v4_team(reinterpret_cast<uint4*>(a.gather.map(p) + dst_off),
                   reinterpret_cast<const uint4*>(src), (long long)rows * a.K / 8, team.lane,
                   team.size);
      team.sync();
      if (team.lane == 0) {
        __threadfence_system();
        signal(a, cta, p, g);
      }
    }
  }

  // TMA push (inter_sm comm CTAs, which own the whole shared memory): the team stages 16 KB pieces
  // in a ring of 8 buffers; one thread sends each piece to every rank with bulk copies, then, once
  // all have fully landed (wait_group 0, not .read), signals every rank.
  static __device__ void push_bulk(const Args& a, const CtaInfo& cta, int g, const Team& team,
                                   char* smem, const __nv_bfloat16* src, long long dst_off,
                                   long long bytes) {
    constexpr int kPiece = 16384, kBufs = 8;
    const int W = a.common.world.world_size;
    const char* from = reinterpret_cast<const char*>(src);
    for (long long off = 0, i = 0; off < bytes; off += kPiece, ++i) {
      const int n = (int)min((long long)kPiece, bytes - off);  // a multiple of 16: K % 8 == 0
      char* stage = smem + (i % kBufs) * kPiece;
      if (team.lane == 0) bulk_wait_read_n<kBufs - 1>();  // the piece that used this buffer
      team.sync();
      for (int v = team.lane; v < n / 16; v += team.size)
        reinterpret_cast<uint4*>(stage)[v] = reinterpret_cast<const uint4*>(from + off)[v];
      fence_proxy_async_smem();
      team.sync();
      if (team.lane == 0) {
        for (int j = 0; j < W; ++j) {
          char* dst = reinterpret_cast<char*>(a.gather.map((cta.rank + j) % W) + dst_off);
          tile_send_bulk(dst + off, stage, n);
        }
        bulk_commit();
      }
    }
    if (team.lane == 0) {
      bulk_wait_all();
      for (int j = 0; j < W; ++j) signal(a, cta, (cta.rank + j) % W, g);
    }
  }

  static __device__ void signal(const Args& a, const CtaInfo& cta, int p, int g) {
    if (cta.rank != a.common.faults.silent_rank) signal_set_release(a.ready.map(p) + g);
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
    if (!fill_engine_params<Engine>(L, args.engine, a_base,
                                    alone ? L.a_rank_stride : (long long)L.M * L.K))
      return kBadConfig;
    args.a =
        RankPtr<const __nv_bfloat16>{reinterpret_cast<const __nv_bfloat16*>(L.a), L.a_rank_stride};
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
    args.transfer_tma = L.transfer;
    args.out_mapped = fill_out_maps<Engine>(L, args.out_map, L.M, L.N);
    return launch_persistent<Op>(args, L, s);
  }
};

int launch_ag_gemm(const FusedLaunch& L, cudaStream_t s) {
  return dispatch_config<LaunchAgGemm>(L.tile_config, L, s);
}

}  // namespace mk
