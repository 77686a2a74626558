// AllGather + GEMM: out[r] = all_gather(A) @ B_r, with A's shards pushed chunk by chunk.
//
// Protocol (the plan's tables, mkernel/ops/ag_gemm.py): every rank's shard [Ms, K] is cut into C
// chunks of CR rows (the last one may be short); global chunk g = src * C + c. Rank r's comm tasks
// push (g, p) = one own chunk into rank p's gather buffer, chunk-major (own copy first, then r+1,
// ...); the template raises chunk_ready[g] on p once the copy landed. Before the engine loads a
// compute tile the template waits for every chunk its rows overlap; chunk_ready is a counted pad
// (every tile over chunk g consumes it; the last one resets flag and counter).
//
//   W = 2, C = 2; gather rows on each rank: [ s0c0 s0c1 | s1c0 s1c1 ]
//   rank 0 comm:    s0c0 -> r0, r1; s0c1 -> r0, r1           (chunk_ready[0], [1] on each)
//   rank 1 comm:    s1c0 -> r1, r0; s1c1 -> r1, r0           (chunk_ready[2], [3] on each)
//   rank 0 compute: tiles of rows s0 (wait chunk_ready[0..1]), then rows s1 (wait [2..3])
#include "kernels/fused_host.cuh"
#include "primitives/bulk_ring.cuh"

namespace mk {

// Own chunk g of rank src: its first row in the shard and in the gathered A, and its row count
// (the last chunk of a shard may be short). Host-tested against the twin (tests/test_codegen.py).
struct ChunkSpan {
  int shard_row, gather_row, rows;
};
MK_HD inline ChunkSpan chunk_span(int g, int src, int chunks, int chunk_rows, int ms) {
  const int r0 = (g - src * chunks) * chunk_rows;
  return ChunkSpan{r0, src * ms + r0, ms - r0 < chunk_rows ? ms - r0 : chunk_rows};
}

template <class EngineT>
struct AgGemm {
  using Engine = EngineT;
  using Layout = spec::ag_gemm::Layout;
  using Args = FusedArgs<AgGemm>;
  static constexpr int kCommSmemBytes = 0;
  // TMA pushes (inter_sm comm CTAs): a ring of 8 16 KB buffers in the engine's shared memory,
  // initialised once per comm unit (comm_begin) and kept across its tasks.
  using Ring = UnitRing<8, 4, 16384>;
  static_assert(Ring::kSmemBytes <= Engine::kSmemBytes,
                "a comm CTA's TMA ring lives in the engine's shared memory");
  static __device__ bool pushes_by_tma(const Args& a) {
    return a.layout.transfer_tma && a.common.overlap == kInterSM;  // intra_sm has no smem for it
  }
  static __device__ void comm_begin(const Args& a, char* smem) {
    if (pushes_by_tma(a)) Ring{smem}.begin();
  }
  static __device__ void comm_end(const Args& a, char* smem) {
    if (pushes_by_tma(a)) Ring{smem}.end();
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    __nv_bfloat16* out = l.out.at(cta.local_rank) + (long long)t.m0 * l.n + t.n0;
    return bf16_out_dest(a, cta.local_rank, out, l.n, t.m0, t.n0);
  }

  // Task (g, p): own chunk g (of src = this rank) into rank p's gather buffer.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    const Layout& l = a.layout;
    const int p = args[1];
    const ChunkSpan c = chunk_span(args[0], cta.rank, l.chunks, l.chunk_rows, l.ms);
    const __nv_bfloat16* src = l.a.at(cta.local_rank) + (long long)c.shard_row * l.k;
    __nv_bfloat16* dst = l.gather.map(p) + (long long)c.gather_row * l.k;
    const int rows = c.rows;
    if (pushes_by_tma(a)) {
      push_bulk(team, smem, src, dst, (long long)rows * l.k * 2);
    } else {
      copy_v4_team(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src),
                   (long long)rows * l.k / 8, team.lane, team.size);
    }
  }

  // TMA push (inter_sm comm CTAs, which own the whole shared memory): lane 0 alone moves the chunk
  // through the unit's ring, 4 bulk loads and 4 bulk stores in flight (primitives/bulk_ring.cuh);
  // the template waits for the stores to land before it raises. Staging by the team's threads
  // kept one piece in flight: 8 GB/s per CTA.
  static __device__ void push_bulk(const Team& team, char* smem, const __nv_bfloat16* src,
                                   __nv_bfloat16* dst, long long bytes) {
    if (team.lane != 0) return;
    Ring{smem}.copy(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), bytes,
                    Drain::kStore);
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int here = args.common.ranks_here;
    // The engine's A is the local gather buffer [M, K] (emulated: rank r's at + r * M * K); with
    // one rank, a itself: nothing to gather.
    const bool alone = args.common.world_size == 1;
    const __nv_bfloat16* a_base = alone ? l.a.base : l.gather_local;
    if (!fill_engine_params<Engine>(here, args.engine, a_base,
                                    alone ? l.a.rank_stride : (long long)l.m * l.k, l.b.base,
                                    l.b.rank_stride, l.m, l.n, l.k))
      return false;
    args.out_mapped = fill_out_maps<Engine>(here, args.out_map, l.out, l.m, l.n);
    return true;
  }
};

int launch_ag_gemm(const long long* rec, cudaStream_t s) { return launch_fused<AgGemm>(rec, s); }

}  // namespace mk
