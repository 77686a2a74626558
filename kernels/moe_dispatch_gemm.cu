// MoE dispatch + the first grouped GEMM: every rank's tokens travel to the ranks of their experts
// (once per destination rank) and are multiplied there by w1[e], one launch.
//
// Protocol (mkernel/ops/moe_dispatch_gemm.py, whose layout twin makes the same tasks): how many
// tasks a rank runs is routing data, so both roles are device-filled. The layout phase (thread 0
// of CTA slot 0 of each rank, before any task runs) reads every rank's topk_ids and computes
//   expert_offsets  counts of rows per local expert, prefix-summed (an output)
//   src, row_map    per y row: (source, token, slot) and the receive row of its token, in the
//                   order expert, source, token, slot (counts first: no row moves twice)
//   comm tasks      one push per (own token, destination rank it feeds), nearest rank first,
//                   adding 1 to expert_rows[e, me] on the destination per expert e it feeds there
//   compute tasks   per local expert, tiles of tile_rows rows x BN columns, each waiting for
//                   expert_rows[e, s] == rows of e from s, for every source s that sends e rows
//                   (its counted consumers: the last tile resets them; a late source is named)
// A compute tile gathers its rows' tokens from `recv` through row_map (the engine's kGatherA)
// and stores its bf16 rows of y. Emulated worlds (all ranks in this launch): the layout reads the
// peers' topk_ids directly; a distributed world would exchange the counts first (not built).
//
//   W = 2, E_local = 1; rank 0: token 0 -> experts {0, 1}, token 1 -> {1}; rank 1: token 0 -> {0}
//   rank 0 comm:    x0[0] -> recv@0 row 0 (+1 expert_rows@0[0, 0]) | x0[0] -> recv@1 row 0,
//                   x0[1] -> recv@1 row 1 (+1 expert_rows@1[0, 0] each)
//   rank 1 comm:    x1[0] -> recv@0 row 1 (+1 expert_rows@0[0, 1])
//   rank 0 compute: wait expert_rows@0[0, 0] == 1, [0, 1] == 1 | y0 = [recv0[0], recv0[1]] @ w1_0[0]
#include "kernels/moe_engine.cuh"

namespace mk {

template <class EngineT>
struct MoeDispatchGemm {
  using Engine = EngineT;
  using Layout = spec::moe_dispatch_gemm::Layout;
  using Args = FusedArgs<MoeDispatchGemm>;
  static constexpr int kCommSmemBytes = 0;
  static constexpr int kPush = 0;  // comm task kind (args[0]), as the twin's PUSH
  static constexpr int kPadRows = spec::moe_dispatch_gemm::kPadExpertRows;
  static constexpr int kPadRowsCount = spec::moe_dispatch_gemm::kPadExpertRowsCount;

  // The ranks token t of rank s feeds (bit d: some id in d's experts; out-of-range ids feed none).
  static __device__ unsigned fed_ranks(const int* ids, int t, int k, int experts, int W) {
    unsigned mask = 0;
    for (int j = 0; j < k; ++j) {
      const int g = ids[t * k + j];
      if (g >= 0 && g < W * experts) mask |= 1u << (g / experts);
    }
    return mask;
  }

  static __device__ void layout(const Args& a, const CtaInfo& cta, TableWriter& compute,
                                TableWriter& comm) {
    const Layout& l = a.layout;
    const int W = a.common.world_size, me = cta.rank, T = l.tokens, k = l.k, E = l.experts;
    const int lo = me * E;
    int* offs = l.expert_offsets.at(cta.local_rank);  // [E + 1]
    int* src = l.src.at(cta.local_rank);              // [max_rows, 3]
    int* row_map = l.row_map.map(me);                 // [max_rows] receive rows, then [E] cursors
    int* cursor = row_map + l.max_rows;
    // Counts of rows per local expert, then their prefix sums (emulated: rank s is local rank s).
    for (int e = 0; e <= E; ++e) offs[e] = 0;
    for (int s = 0; s < W; ++s) {
      const int* ids = l.topk_ids.at(s);
      for (int i = 0; i < T * k; ++i) {
        const int e = ids[i] - lo;
        if (e >= 0 && e < E) ++offs[e + 1];
      }
    }
    for (int e = 0; e < E; ++e) offs[e + 1] += offs[e];
    for (int e = 0; e < E; ++e) cursor[e] = offs[e];
    // Every row's place: by expert (cursor), source, token, slot; its token's receive row here.
    int recv = 0;
    for (int s = 0; s < W; ++s) {
      const int* ids = l.topk_ids.at(s);
      for (int t = 0; t < T; ++t) {
        bool fed = false;
        for (int j = 0; j < k; ++j) {
          const int e = ids[t * k + j] - lo;
          if (e < 0 || e >= E) continue;
          const int r = cursor[e]++;
          src[3 * r] = s;
          src[3 * r + 1] = t;
          src[3 * r + 2] = j;
          row_map[r] = recv;
          fed = true;
        }
        recv += fed;
      }
    }
    // Pushes: the first receive row of my tokens on each rank d follows the tokens of ranks < me
    // that feed d; my tokens go to d in token order, nearest destination first (me, me + 1, ...).
    int base[kMaxLocalRanks] = {};
    for (int q = 0; q < me; ++q) {
      for (int t = 0; t < T; ++t) {
        const unsigned mask = fed_ranks(l.topk_ids.at(q), t, k, E, W);
        for (int d = 0; d < W; ++d) base[d] += (mask >> d) & 1;
      }
    }
    const int* mine = l.topk_ids.at(cta.local_rank);
    for (int i = 0; i < W; ++i) {
      const int d = (me + i) % W;
      for (int t = 0; t < T; ++t) {
        if (!((fed_ranks(mine, t, k, E, W) >> d) & 1)) continue;
        comm.task(kPush, t, d, base[d]++);
        for (int j = 0; j < k; ++j) {
          const int e = mine[t * k + j] - d * E;
          if (e >= 0 && e < E) comm.add_raise(kPadRows, d, e * W + me, 1, kRaiseAdd);
        }
      }
    }
    // GEMM tiles: expert e's rows in tiles of tile_rows x BN; all of them count as its consumers
    // of each source's flag (its rows are by source: one run of rows per source).
    const int N = l.inter, tr = l.tile_rows, tiles_n = (N + Engine::BN - 1) / Engine::BN;
    for (int e = 0; e < E; ++e) {
      const int r0 = offs[e], r1 = offs[e + 1];
      if (r1 == r0) continue;
      int from[kMaxLocalRanks] = {};
      for (int r = r0; r < r1; ++r) ++from[src[3 * r]];
      const int consumers = (r1 - r0 + tr - 1) / tr * tiles_n;
      for (int m0 = r0; m0 < r1; m0 += tr) {
        for (int n0 = 0; n0 < N; n0 += Engine::BN) {
          compute.tile_task(m0, n0, min(tr, r1 - m0), min(Engine::BN, N - n0), e);
          for (int s = 0; s < W; ++s) {
            if (from[s] > 0)
              compute.add_wait(kPadRows, me, e * W + s, from[s], consumers, kPadRowsCount, 1, s);
          }
        }
      }
    }
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    return gemm::Dest{l.y.at(cta.local_rank) + (long long)t.m0 * l.inter + t.n0, l.inter,
                      gemm::kStoreBF16};
  }

  // One token copy: x row t -> row `row` of the destination's receive buffer (16-byte stores).
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    if (args[0] != kPush) return;
    const Layout& l = a.layout;
    const uint4* from =
        reinterpret_cast<const uint4*>(l.x.at(cta.local_rank) + (long long)args[1] * l.hidden);
    uint4* to = reinterpret_cast<uint4*>(l.recv.map(args[2]) + (long long)args[3] * l.hidden);
    copy_v4_team(to, from, l.hidden / 8, team.lane, team.size);
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int W = args.common.world_size, here = args.common.ranks_here;
    if (here != W) return false;  // the layout reads every rank's routing: emulated worlds only
    const long long recv_rows = (long long)W * l.tokens;
    if (!fill_grouped_b(here, args.engine, l.w1, l.experts, l.hidden, l.inter, l.max_rows))
      return false;
    for (int r = 0; r < here; ++r) {
      args.engine[r].a_src = l.recv_local + r * recv_rows * l.hidden;
      args.engine[r].a_rows = l.row_map_local + r * ((long long)l.max_rows + l.experts);
      args.engine[r].lda = l.hidden;
      args.engine[r].a_src_rows = (int)recv_rows;
    }
    return true;
  }
};

int launch_moe_dispatch_gemm(const long long* rec, cudaStream_t s) {
  return launch_grouped<MoeDispatchGemm, /*kGather=*/true>(rec, s);
}

}  // namespace mk
