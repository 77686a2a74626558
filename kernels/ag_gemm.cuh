// What AllGather + GEMM's two kernels share (kernels/ag_gemm.cu, kernels/ag_gemm_nodes.cu): the
// chunk geometry, the engine's destination and inputs, and how a comm team moves a chunk's rows
// (16-byte stores, or TMA through the comm unit's ring). Their layouts have the same buffers and
// scalars, so these take either kernel's FusedArgs.
#pragma once
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
struct AgGemmMoves {
  using Engine = EngineT;
  static constexpr int kCommSmemBytes = 0;
  // TMA pushes (inter_sm comm CTAs): a ring of 8 16 KB buffers in the engine's shared memory,
  // initialised once per comm unit (comm_begin) and kept across its tasks.
  using Ring = UnitRing<8, 4, 16384>;
  static_assert(Ring::kSmemBytes <= Engine::kSmemBytes,
                "a comm CTA's TMA ring lives in the engine's shared memory");
  template <class Args>
  static __device__ bool pushes_by_tma(const Args& a) {
    return a.layout.transfer_tma && a.common.overlap == kInterSM;  // intra_sm has no smem for it
  }
  template <class Args>
  static __device__ void comm_begin(const Args& a, char* smem) {
    if (pushes_by_tma(a)) Ring{smem}.begin();
  }
  template <class Args>
  static __device__ void comm_end(const Args& a, char* smem) {
    if (pushes_by_tma(a)) Ring{smem}.end();
  }

  template <class Args>
  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const auto& l = a.layout;
    __nv_bfloat16* out = l.out.at(cta.local_rank) + (long long)t.m0 * l.n + t.n0;
    return bf16_out_dest(a, cta.local_rank, out, l.n, t.m0, t.n0);
  }

  // `rows` rows of K from src to dst (a peer's gather buffer, or ours), by the whole team.
  template <class Args>
  static __device__ void move_rows(const Args& a, const Team& team, char* smem,
                                   const __nv_bfloat16* src, __nv_bfloat16* dst, int rows) {
    const auto& l = a.layout;
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

  template <class Args>
  static bool prepare(const long long*, Args& args) {
    const auto& l = args.layout;
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

}  // namespace mk
