// GEMM + ReduceScatter: out[r] = rows r*M/W .. (r+1)*M/W of sum over ranks q of A_q @ B_q.
//
// Protocol (the plan's tables, mkernel/ops/gemm_rs.py): every rank computes every tile of its
// partial product, its peers' tiles first. A peer's tile is stored in fp32 (staged bulk copies,
// kStoreF32Bulk) into slot `me` of the owner's stage; the template then raises partial[u][me] there.
// An own tile waits (before its loads) for the W - 1 peers' partials, and its epilogue adds them in
// fp32 (Dest::add_*) before the single bf16 store into out: the fp32 sum rounded once, as the
// reference. No atomics, no zeroing, no comm role, no pass after the GEMM. W == 1: tiles go
// straight to out.
// NOTE: fp32 partials, not bf16: a bf16 partial adds one rounding per peer, which moves 1-4% of
// the elements of random products past the bf16 rounding of the exact sum (measured on the CPU);
// the link bytes double instead (a partial crosses once, half the tiles at W = 2).
//
//   W = 2, owners' tiles 0a 0b (rank 0's rows), 1a 1b; t = time ->
//   rank 0 compute:  1a 1b  -- fp32 --> stage[1] slot 0 | 0a 0b + stage[0] slot 1 -> out[0]
//   rank 1 compute:  0a 0b  -- fp32 --> stage[0] slot 1 | 1a 1b + stage[1] slot 0 -> out[1]
#include "kernels/gemm_rs.cuh"

namespace mk {

template <class EngineT>
struct GemmRS {
  using Engine = EngineT;
  using Layout = spec::gemm_rs::Layout;
  using Args = FusedArgs<GemmRS>;
  static constexpr int kCommSmemBytes = 0;

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    const long long off = owned_offset(t.m0, t.n0, t.tag, l.rows_per_rank, l.n);
    const long long slot = (long long)l.rows_per_rank * l.n;  // elements per stage slot
    if (t.tag != cta.rank)  // a peer's tile: my fp32 partial into my slot of its stage
      return gemm::Dest{l.stage.map(t.tag) + cta.rank * slot + off, l.n, gemm::kStoreF32Bulk};
    gemm::Dest d = bf16_out_dest(a, cta.local_rank, l.out.at(cta.local_rank) + off, l.n,
                                 t.m0 - t.tag * l.rows_per_rank, t.n0);
    if (a.common.world_size > 1) {  // + the peers' partials, waited for before the loads
      d.add_from = l.stage.map(cta.rank) + off;
      d.add_stride = slot;
      d.add_count = a.common.world_size;
      d.add_skip = cta.rank;
    }
    return d;
  }

  // No comm role: the owner's own compute tasks wait for the partials and finish the tiles.
  static __device__ void comm_move(const Args&, const CtaInfo&, const int*, const Team&, char*) {}

  static bool prepare(const long long*, Args& args) { return prepare_rs<Engine>(args); }
};

int launch_gemm_rs(const long long* rec, cudaStream_t s) { return launch_fused<GemmRS>(rec, s); }

}  // namespace mk
