// GEMM + AllReduce: out[r] = sum over ranks q of A_q @ B_q, on every rank r. No multicast.
//
// Protocol (the plan's tables, mkernel/ops/gemm_ar.py): tile t of [M, N] is owned by rank t % W.
// Every rank computes every tile of its partial product; the engine's epilogue reduce-adds the fp32
// tile into the owner's accumulator and the template raises tile_flag[t][me] on the owner. The
// owner's finalize task t waits for all W flags; its data movement, below, converts the
// accumulator tile to bf16 into EVERY rank's result (own first, 16-byte stores through the peer
// mapping) and zeroes it; the template then raises tile_ready[t] on every peer. Every rank's comm
// role finally runs a pure wait task T + t for each tile it does not own (nothing to move), so its
// kernel ends only once its whole result has landed.
//
//   W = 2, tiles t0..t3, owners 0 1 0 1
//   compute (both ranks):  t0 t1 t2 t3         -- red.add --> acc[owner]; tile_flag[t][me] on owner
//   rank 0 comm:  finalize t0, t2 -> out[0], out[1]; tile_ready[t] on 1 | wait tile_ready t1, t3
//   rank 1 comm:  finalize t1, t3 -> out[1], out[0]; tile_ready[t] on 0 | wait tile_ready t0, t2
#include "kernels/fused_host.cuh"

namespace mk {

template <class EngineT>
struct GemmAR {
  using Engine = EngineT;
  using Layout = spec::gemm_ar::Layout;
  using Args = FusedArgs<GemmAR>;
  static constexpr int kCommSmemBytes = 0;

  // Rank p's result: the symmetric result buffer in a distributed world, else p's slice of out.
  static __device__ __nv_bfloat16* out_of(const Layout& l, int p) {
    return l.result.ptrs != nullptr ? l.result.map(p) : l.out.at(p);
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    const long long off = (long long)t.m0 * l.n + t.n0;
    if (a.common.world_size == 1)  // nothing to reduce: bf16 straight to out
      return bf16_out_dest(a, cta.local_rank, l.out.at(cta.local_rank) + off, l.n, t.m0, t.n0);
    return gemm::Dest{l.acc.map(t.tag) + off, l.n, gemm::kReduceF32};
  }

  // Finalize (args[0] = t < tiles): the reduced tile into every rank's result, acc back to zero.
  // Wait tasks (args[0] = tiles + t) move nothing: their waits are the task.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    const Layout& l = a.layout;
    if (args[0] >= l.tiles) return;
    const int W = a.common.world_size, me = cta.rank;
    const Tile t = load_tile(a.common, args[0]);
    const long long base = (long long)t.m0 * l.n + t.n0;
    float* acc = l.acc.map(me) + base;
    const int per_row = t.cols / 8;  // cols % 8 == 0: 8 fp32 in, one 16-byte bf16 vector out
    for (int v = team.lane; v < t.rows * per_row; v += team.size) {
      const long long off = (long long)(v / per_row) * l.n + (v % per_row) * 8;
      const float4 x = __ldcg(reinterpret_cast<const float4*>(acc + off));
      const float4 y = __ldcg(reinterpret_cast<const float4*>(acc + off + 4));
      const uint4 packed = make_uint4(gemm::pack_bf16x2(x.x, x.y), gemm::pack_bf16x2(x.z, x.w),
                                      gemm::pack_bf16x2(y.x, y.y), gemm::pack_bf16x2(y.z, y.w));
      for (int j = 0; j < W; ++j) peer_store_v4(out_of(l, (me + j) % W) + base + off, packed);
      __stcg(reinterpret_cast<float4*>(acc + off), make_float4(0.f, 0.f, 0.f, 0.f));
      __stcg(reinterpret_cast<float4*>(acc + off + 4), make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int here = args.common.ranks_here;
    if (!fill_engine_params<Engine>(here, args.engine, l.a.base, l.a.rank_stride, l.b.base,
                                    l.b.rank_stride, l.m, l.n, l.k_local))
      return false;
    // Only W == 1 stores bf16 tiles from the engine, straight into out (no peers, no result).
    args.out_mapped = args.common.world_size == 1 &&
                      fill_out_maps<Engine>(here, args.out_map, l.out, l.m, l.n);
    return true;
  }
};

int launch_gemm_ar(const long long* rec, cudaStream_t s) { return launch_fused<GemmAR>(rec, s); }

}  // namespace mk
