// GEMM + ReduceScatter: out[r] = rows r*M/W .. (r+1)*M/W of sum over ranks q of A_q @ B_q.
//
// Each rank computes every tile of its partial product (tile order from the plan: by default all
// ranks walk the owners' blocks in step, tile j of every owner, then j + 1). The engine's epilogue
// reduce-adds the fp32 tile straight into the owner's accumulator (red.global.add through the peer
// mapping), then signals the owner flag[u][me]. The owner's comm role waits for all W flags of tile u
// (consuming them), converts the accumulator tile to bf16 into out, and zeroes it for the next call.
// W == 1: tiles go straight to out.
//
//   W = 2, owners' tiles 1a 1b .. (rank 1's rows), 0a 0b .. (rank 0's rows); t = time ->
//   rank 0 compute:  1a 0a 1b 0b ...     -- red.add --> acc[1] / acc[0]
//   rank 1 compute:  0a 1a 0b 1b ...     -- red.add --> acc[0] / acc[1]
//   rank 0 comm:          wait flags[0][a][*] -> out[0] tile a, then b ... (as contributions land)
#include "kernels/fused_host.cuh"

namespace mk {

template <class EngineT>
struct GemmRS {
  using Engine = EngineT;
  static constexpr int kCommSmemBytes = 0;
  struct Args {
    FusedCommon common;
    typename Engine::Params engine[kMaxLocalRanks];
    RankPtr<__nv_bfloat16> out;  // [Ms, N] per rank
    SymPtr<float> acc;           // [Ms, N] fp32 accumulators per rank
    SymPtr<int> flags;           // [U, W] per rank: flag[u][src]
    int N, Ms, U;
    CUtensorMap out_map[kMaxLocalRanks];  // out [Ms, N] per local rank (W == 1, TMA stores)
    bool out_mapped;
  };

  struct ComputeHooks : ComputeHooksBase<Args> {
    __device__ gemm::Dest dest(int i) const {
      const Args& a = this->a;
      const Tile t = this->tile(i);
      const long long off = (long long)(t.m0 - t.tag * a.Ms) * a.N + t.n0;
      if (a.common.world.world_size == 1)
        return bf16_out_dest(a, this->cta.local_rank, a.out.at(this->cta.local_rank) + off,
                             t.m0 - t.tag * a.Ms, t.n0);
      return gemm::Dest{a.acc.map(t.tag) + off, a.N, gemm::kReduceF32};
    }
    __device__ bool signals() const { return this->a.common.world.world_size > 1; }
    __device__ void after_store(int i) const {
      const FusedCommon& c = this->a.common;
      const int rank = this->cta.rank;
      if (c.world.world_size == 1 || rank == c.faults.silent_rank) return;
      if (rank == c.faults.delay_rank) delay_ns(c.faults.delay_ns);
      const int id = this->tasks[i], owner = load_tile(c.plan, id).tag, u = id - owner * this->a.U;
      signal_set_release(this->a.flags.map(owner) + u * c.world.world_size + rank);
    }
  };

  // Owner side: tile u of my rows is complete once every rank's flag[u][src] is raised.
  static __device__ void comm_task(const Args& a, const CtaInfo& cta, int id, const Team& team,
                                   char*) {
    const FusedCommon& c = a.common;
    const int W = c.world.world_size;
    const int u = id - cta.rank * a.U;
    const Tile t = load_tile(c.plan, id);
    if (team.lane == 0) {
      for (int j = 0; j < W; ++j) {
        const int src = (cta.rank + 1 + j) % W;
        const WaitSite site{cta.rank, src, id, kRoleComm, 1, u};
        wait_acquire_reset(a.flags.map(cta.rank) + u * W + src, 1, c.wait, site);
      }
    }
    team.sync();
    float* acc = a.acc.map(cta.rank) + (long long)(t.m0 - cta.rank * a.Ms) * a.N + t.n0;
    __nv_bfloat16* out =
        a.out.at(cta.local_rank) + (long long)(t.m0 - cta.rank * a.Ms) * a.N + t.n0;
    const int quads = t.rows * (t.cols / 4);  // cols % 8 == 0
    for (int q = team.lane; q < quads; q += team.size) {
      const long long off = (long long)(q / (t.cols / 4)) * a.N + (q % (t.cols / 4)) * 4;
      const float4 v = __ldcg(reinterpret_cast<const float4*>(acc + off));
      __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      uint2 packed =
          make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
      *reinterpret_cast<uint2*>(out + off) = packed;
      __stcg(reinterpret_cast<float4*>(acc + off), make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
};

template <class Engine>
struct LaunchGemmRS {
  static int run(const FusedLaunch& L, cudaStream_t s) {
    using Op = GemmRS<Engine>;
    typename Op::Args args{};
    args.common = make_common(L);
    if (!fill_engine_params<Engine>(L, args.engine, reinterpret_cast<const __nv_bfloat16*>(L.a),
                                    L.a_rank_stride))
      return kBadConfig;
    args.out = RankPtr<__nv_bfloat16>{reinterpret_cast<__nv_bfloat16*>(L.out), L.out_rank_stride};
    args.acc = SymPtr<float>{reinterpret_cast<const unsigned long long*>(L.work_ptrs)};
    args.flags = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.flag_ptrs)};
    args.N = L.N;
    args.Ms = L.rows_per_rank;
    args.U = L.tiles_per_rank;
    args.out_mapped =
        L.world_size == 1 && fill_out_maps<Engine>(L, args.out_map, L.rows_per_rank, L.N);
    return launch_persistent<Op>(args, L, s);
  }
};

int launch_gemm_rs(const FusedLaunch& L, cudaStream_t s) {
  return dispatch_config<LaunchGemmRS>(L.tile_config, L, s);
}

}  // namespace mk
