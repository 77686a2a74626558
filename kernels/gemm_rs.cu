// GEMM + ReduceScatter: out[r] = rows r*M/W .. (r+1)*M/W of sum over ranks q of A_q @ B_q.
//
// Protocol (the plan's tables, mkernel/ops/gemm_rs.py): every rank computes every tile of its
// partial product; the engine's epilogue reduce-adds the fp32 tile straight into the owner's
// accumulator (red.global.add through the peer mapping) and the template then raises
// tile_flag[u][me] on the owner. The owner's comm task u waits for all W flags (consuming them);
// its data movement, below, converts the accumulator tile to bf16 into out and zeroes it for the
// next call. W == 1: tiles go straight to out.
//
//   W = 2, owners' tiles 1a 1b .. (rank 1's rows), 0a 0b .. (rank 0's rows); t = time ->
//   rank 0 compute:  1a 0a 1b 0b ...     -- red.add --> acc[1] / acc[0]
//   rank 1 compute:  0a 1a 0b 1b ...     -- red.add --> acc[0] / acc[1]
//   rank 0 comm:          wait tile_flag[a][*] -> out[0] tile a, then b ... (as they land)
#include "kernels/fused_host.cuh"

namespace mk {

// Offset of a tile's element (0, 0) in its owner's [Ms, N] rows (host-tested against the twin).
MK_HD inline long long owned_offset(int m0, int n0, int owner, int ms, int n) {
  return (long long)(m0 - owner * ms) * n + n0;
}

template <class EngineT>
struct GemmRS {
  using Engine = EngineT;
  using Layout = spec::gemm_rs::Layout;
  using Args = FusedArgs<GemmRS>;
  static constexpr int kCommSmemBytes = 0;

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    const long long off = owned_offset(t.m0, t.n0, t.tag, l.rows_per_rank, l.n);
    if (a.common.world_size == 1)
      return bf16_out_dest(a, cta.local_rank, l.out.at(cta.local_rank) + off, l.n,
                           t.m0 - t.tag * l.rows_per_rank, t.n0);
    return gemm::Dest{l.acc.map(t.tag) + off, l.n, gemm::kReduceF32};
  }

  // Owner side, after its W flags: accumulator tile -> bf16 out, and zero it for the next call.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    const Layout& l = a.layout;
    const Tile t = load_tile(a.common, args[0]);
    const long long base = owned_offset(t.m0, t.n0, cta.rank, l.rows_per_rank, l.n);
    float* acc = l.acc.map(cta.rank) + base;
    __nv_bfloat16* out = l.out.at(cta.local_rank) + base;
    const int quads = t.rows * (t.cols / 4);  // cols % 8 == 0
    for (int q = team.lane; q < quads; q += team.size) {
      const long long off = (long long)(q / (t.cols / 4)) * l.n + (q % (t.cols / 4)) * 4;
      const float4 v = __ldcg(reinterpret_cast<const float4*>(acc + off));
      __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      uint2 packed =
          make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
      *reinterpret_cast<uint2*>(out + off) = packed;
      __stcg(reinterpret_cast<float4*>(acc + off), make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int W = args.common.world_size, here = args.common.ranks_here;
    if (!fill_engine_params<Engine>(here, args.engine, l.a.base, l.a.rank_stride, l.b.base,
                                    l.b.rank_stride, l.rows_per_rank * W, l.n, l.k_local))
      return false;
    args.out_mapped = W == 1 && fill_out_maps<Engine>(here, args.out_map, l.out, l.rows_per_rank,
                                                      l.n);
    return true;
  }
};

int launch_gemm_rs(const long long* rec, cudaStream_t s) { return launch_fused<GemmRS>(rec, s); }

}  // namespace mk
