// GEMM + AllReduce: out[r] = sum over ranks q of A_q @ B_q, on every rank r. No multicast.
//
// Protocol (the plan's tables, mkernel/ops/gemm_ar.py): tile t of [M, N] is owned by rank t % W,
// the j-th of its tiles (j = t / W). Every rank computes every tile of its partial product, its
// peers' tiles first: a peer's tile leaves as an fp32 partial (staged bulk copies, kStoreF32Bulk)
// into tile j of slot `me` of the owner's stage ([BM, BN], row pitch BN) and the template raises
// partial[t][me] there. An own tile waits for its W - 1 partials, adds them in its epilogue
// (Dest::add_*), stores the bf16 tile into its own result and raises tile_done[t]. The owner's comm
// task t waits for tile_done[t] and copies the bf16 tile into every peer's result (16-byte stores
// through the peer mapping); the template then raises tile_ready[t] on every peer. Every rank's
// comm role finally runs a pure wait task T + t for each tile it does not own (nothing to move).
//
//   W = 2, tiles t0..t3, owners 0 1 0 1
//   rank 0 compute:  t1 t3 -- fp32 --> stage[1] | t0 t2 + stage[0] slot 1 -> out[0], tile_done
//   rank 1 compute:  t0 t2 -- fp32 --> stage[0] | t1 t3 + stage[1] slot 0 -> out[1], tile_done
//   rank 0 comm:  t0, t2 -> out[1], tile_ready on 1 | wait tile_ready t1, t3
//   rank 1 comm:  t1, t3 -> out[0], tile_ready on 0 | wait tile_ready t0, t2
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
    const int W = a.common.world_size, me = cta.rank;
    const long long off = (long long)t.m0 * l.n + t.n0;
    constexpr long long kTile = (long long)Engine::BM * Engine::BN;  // a stage tile, pitch BN
    const long long slot = (long long)l.own_tiles * kTile;            // elements per stage slot
    // The tile's id (the plan's row-major grid, mkernel/schedule.py grid_tiles); owner = id % W
    const int tiles_n = (l.n + Engine::BN - 1) / Engine::BN;
    const long long j = ((t.m0 / Engine::BM) * tiles_n + t.n0 / Engine::BN) / W;  // owner's j-th
    if (W > 1 && t.tag != me)  // a peer's tile: my fp32 partial into my slot of its stage
      return gemm::Dest{l.stage.map(t.tag) + me * slot + j * kTile, Engine::BN,
                        gemm::kStoreF32Bulk};
    gemm::Dest d = l.result.ptrs != nullptr
                       ? gemm::Dest{out_of(l, me) + off, l.n, gemm::kStoreBF16}
                       : bf16_out_dest(a, cta.local_rank, l.out.at(cta.local_rank) + off, l.n,
                                       t.m0, t.n0);
    if (W > 1) {  // + the peers' partials, waited for before the loads
      d.add_from = l.stage.map(me) + j * kTile;
      d.add_stride = slot;
      d.add_ld = Engine::BN;
      d.add_count = W;
      d.add_skip = me;
    }
    return d;
  }

  // Broadcast (args[0] = t < tiles, an owned tile): the reduced bf16 tile from my result into
  // every peer's. Wait tasks (args[0] = tiles + t) move nothing: their waits are the task.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    const Layout& l = a.layout;
    if (args[0] >= l.tiles) return;
    const int W = a.common.world_size, me = cta.rank;
    const Tile t = load_tile(a.common, args[0]);
    const long long base = (long long)t.m0 * l.n + t.n0;
    const __nv_bfloat16* mine = out_of(l, me) + base;
    const int per_row = t.cols / 8;  // cols % 8 == 0: 16-byte vectors of 8 bf16
    for (int v = team.lane; v < t.rows * per_row; v += team.size) {
      const long long off = (long long)(v / per_row) * l.n + (v % per_row) * 8;
      // NOTE: written by this GPU's compute role in this launch (tile_done acquired): .cg
      const uint4 x = __ldcg(reinterpret_cast<const uint4*>(mine + off));
      for (int j = 1; j < W; ++j) peer_store_v4(out_of(l, (me + j) % W) + base + off, x);
    }
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int here = args.common.ranks_here;
    if (!fill_engine_params<Engine>(here, args.engine, l.a.base, l.a.rank_stride, l.b.base,
                                    l.b.rank_stride, l.m, l.n, l.k_local))
      return false;
    // Own tiles store through out's maps wherever the result is out itself (emulated worlds, and
    // W == 1); a distributed world's own tiles go to the symmetric result, stored row by row.
    args.out_mapped = l.result.ptrs == nullptr &&
                      fill_out_maps<Engine>(here, args.out_map, l.out, l.m, l.n);
    return true;
  }
};

int launch_gemm_ar(const long long* rec, cudaStream_t s) { return launch_fused<GemmAR>(rec, s); }

}  // namespace mk
