// GEMM + AllReduce: out[r] = sum over ranks q of A_q @ B_q, on every rank r. No multicast.
//
// Tile t of [M, N] is owned by rank t % W. Every rank computes every tile of its partial product;
// the engine's epilogue reduce-adds the fp32 tile into the owner's accumulator (red.global.add
// through the peer mapping), then raises flag[t][me] on the owner. The owner's comm role waits for
// all W flags of t (consuming them), converts the accumulator tile to bf16 into EVERY rank's result
// (own first, 16-byte stores through the peer mapping), zeroes the accumulator tile for the next
// call and raises ready[t] on every peer; every rank's comm role finally waits ready[t] of the tiles
// it does not own (consuming them), so its kernel ends only once its whole result has landed.
//
//   W = 2, tiles t0..t3, owners 0 1 0 1
//   compute (both ranks):  t0 t1 t2 t3         -- red.add --> acc[owner]; flag[t][me] on owner
//   rank 0 comm:  finalize t0, t2 -> out[0], out[1]; ready[t] on 1 | wait ready t1, t3
//   rank 1 comm:  finalize t1, t3 -> out[1], out[0]; ready[t] on 0 | wait ready t0, t2
#include "kernels/fused_host.cuh"

namespace mk {

constexpr int kSignalTileFlag = 1, kSignalTileReady = 3;  // mkernel/ops/common.py SIGNAL_NAMES

__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <class EngineT>
struct GemmAR {
  using Engine = EngineT;
  static constexpr int kCommSmemBytes = 0;
  struct Args {
    FusedCommon common;
    typename Engine::Params engine[kMaxLocalRanks];
    RankPtr<__nv_bfloat16> out;          // [M, N] per rank (emulated: slices of one tensor)
    const unsigned long long* out_ptrs;  // [W] result addresses (distributed), or null
    SymPtr<float> acc;                   // [M, N] fp32 per rank; only owned tiles are used
    SymPtr<int> flags, ready;            // [T, W] and [T] per rank
    int N, T;
    CUtensorMap out_map[kMaxLocalRanks];  // out [M, N] per local rank (W == 1, TMA stores)
    bool out_mapped;
    __device__ __nv_bfloat16* out_of(int p) const {
      return out_ptrs ? reinterpret_cast<__nv_bfloat16*>(out_ptrs[p]) : out.at(p);
    }
  };

  struct ComputeHooks : ComputeHooksBase<Args> {
    __device__ gemm::Dest dest(int i) const {
      const Tile t = this->tile(i);
      const long long off = (long long)t.m0 * this->a.N + t.n0;
      if (this->a.common.world.world_size == 1)  // nothing to reduce: bf16 straight to out
        return bf16_out_dest(this->a, this->cta.local_rank, this->a.out_of(this->cta.rank) + off,
                             t.m0, t.n0);
      return gemm::Dest{this->a.acc.map(t.tag) + off, this->a.N, gemm::kReduceF32};
    }
    __device__ bool signals() const { return this->a.common.world.world_size > 1; }
    __device__ void after_store(int i) const {
      const FusedCommon& c = this->a.common;
      const int rank = this->cta.rank;
      if (c.world.world_size == 1 || rank == c.faults.silent_rank) return;
      if (rank == c.faults.delay_rank) delay_ns(c.faults.delay_ns);
      const int id = this->tasks[i], owner = load_tile(c.plan, id).tag;
      signal_set_release(this->a.flags.map(owner) + id * c.world.world_size + rank);
    }
  };

  // Tasks: t < T finalize owned tile t; T + t wait until tile t landed here. Each unit runs its
  // finalizes before its waits (plan order), and finalizes wait only on compute epilogues: no cycle.
  static __device__ void comm_task(const Args& a, const CtaInfo& cta, int id, const Team& team,
                                   char*) {
    const FusedCommon& c = a.common;
    const int W = c.world.world_size, me = cta.rank;
    const int t = id % a.T;
    if (id >= a.T) {  // NOTE: twice the deadline, so that a stuck owner's own wait reports first
      const WaitSite site{me, t % W, id, kRoleComm, kSignalTileReady, t};
      const WaitPolicy patient{c.wait.status, 2 * c.wait.timeout_ns, c.wait.backoff_ns};
      if (team.lane == 0) wait_acquire_reset(a.ready.map(me) + t, 1, patient, site);
      return;
    }
    if (team.lane == 0) {
      for (int j = 0; j < W; ++j) {
        const int src = (me + 1 + j) % W;
        const WaitSite site{me, src, id, kRoleComm, kSignalTileFlag, t};
        wait_acquire_reset(a.flags.map(me) + t * W + src, 1, c.wait, site);
      }
    }
    team.sync();
    const Tile tl = load_tile(c.plan, t);
    const long long base = (long long)tl.m0 * a.N + tl.n0;
    float* acc = a.acc.map(me) + base;
    const int per_row = tl.cols / 8;  // cols % 8 == 0: 8 fp32 in, one 16-byte bf16 vector out
    for (int v = team.lane; v < tl.rows * per_row; v += team.size) {
      const long long off = (long long)(v / per_row) * a.N + (v % per_row) * 8;
      const float4 x = __ldcg(reinterpret_cast<const float4*>(acc + off));
      const float4 y = __ldcg(reinterpret_cast<const float4*>(acc + off + 4));
      const uint4 packed = make_uint4(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w),
                                      pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
      for (int j = 0; j < W; ++j) peer_store_v4(a.out_of((me + j) % W) + base + off, packed);
      __stcg(reinterpret_cast<float4*>(acc + off), make_float4(0.f, 0.f, 0.f, 0.f));
      __stcg(reinterpret_cast<float4*>(acc + off + 4), make_float4(0.f, 0.f, 0.f, 0.f));
    }
    team.sync();
    if (team.lane == 0 && me != c.faults.silent_rank) {
      __threadfence_system();
      for (int j = 1; j < W; ++j) signal_set_release(a.ready.map((me + j) % W) + t);
    }
  }
};

template <class Engine>
struct LaunchGemmAR {
  static int run(const FusedLaunch& L, cudaStream_t s) {
    using Op = GemmAR<Engine>;
    typename Op::Args args{};
    args.common = make_common(L);
    if (!fill_engine_params<Engine>(L, args.engine, reinterpret_cast<const __nv_bfloat16*>(L.a),
                                    L.a_rank_stride))
      return kBadConfig;
    args.out = RankPtr<__nv_bfloat16>{reinterpret_cast<__nv_bfloat16*>(L.out), L.out_rank_stride};
    args.out_ptrs = reinterpret_cast<const unsigned long long*>(L.aux_ptr);
    args.acc = SymPtr<float>{reinterpret_cast<const unsigned long long*>(L.work_ptrs)};
    args.flags = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.flag_ptrs)};
    args.ready = SymPtr<int>{reinterpret_cast<const unsigned long long*>(L.flag2_ptrs)};
    args.N = L.N;
    args.T = L.tiles_per_rank;
    args.out_mapped = L.world_size == 1 && fill_out_maps<Engine>(L, args.out_map, L.M, L.N);
    return launch_persistent<Op>(args, L, s);
  }
};

int launch_gemm_ar(const FusedLaunch& L, cudaStream_t s) {
  return dispatch_config<LaunchGemmAR>(L.tile_config, L, s);
}

}  // namespace mk
