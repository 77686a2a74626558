// MoE dispatch + the first grouped GEMM: every rank's tokens travel to the ranks of their experts
// (once per destination rank) and are multiplied there by w1[e], one launch.
//
// Protocol (mkernel/ops/moe_dispatch_gemm.py, whose layout twin makes the same tasks): how many
// tasks a rank runs is routing data, so both roles are device-filled. The layout phase (every
// thread of CTA slot 0 of each rank, before any task runs) reads every rank's topk_ids and computes
//   expert_offsets  counts of rows per local expert, prefix-summed (an output)
//   src, row_map    per y row: (source, token, slot) and the receive row of its token, in the
//                   order expert, source, token, slot (counts first: no row moves twice)
//   send_map        per destination d: my tokens that feed d, in token order
//   comm tasks      pushes of runs of up to kPieceRows of my tokens to a destination (each token
//                   once per rank it feeds; source s's receive rows on d start at s * T),
//                   nearest rank first, adding the run's tokens to landed[me] there; then the
//                   expands of the rows received here: per (expert e, source s) pieces of up to
//                   kPieceRows rows,
//                   each waiting landed[s] == tokens of s here, copying its rows' tokens from
//                   recv into `expanded` (expert-major) and adding its rows to expert_rows[e, s]
//   compute tasks   per local expert, tiles of tile_rows rows x BN columns, each waiting for
//                   expert_rows[e, s] == rows of e from s, for every source s that sends e rows
//                   (its counted consumers: the last tile resets them)
// A compute tile loads its rows of `expanded` by TMA (the dense engine: a gather by index in the
// engine measured 2.75x slower, benchmarks/results/moe_local_2026-12-01.json) and stores its bf16
// rows of y. Before the layout, its CTA exchanges the routing: each rank's topk_ids into every
// rank's ids_all (ids_landed[src] says it landed), so a layout reads no peer's input. Emulated
// worlds only so far (prepare): a distributed one also needs `expanded`'s rows per call (sized
// here from the stacked tensor's rank stride) and the combine's exchange (not built).
//
//   W = 2, E_local = 1; rank 0: token 0 -> experts {0, 1}, token 1 -> {1}; rank 1: token 0 -> {0}
//   rank 0 comm:    x0[0] -> recv@0 row 0 (+1 landed@0[0]) | x0[0:2] -> recv@1 rows 0, 1
//                   (+2 landed@1[0])
//                   expand (e 0, s 0): wait landed@0[0] == 1, recv@0[0] -> expanded@0[0],
//                   +1 expert_rows@0[0, 0] | (e 0, s 1): wait landed@0[1] == 1, recv@0[T] -> row 1
//   rank 1 comm:    x1[0] -> recv@0 row T (+1 landed@0[1]) | (e 0, s 0): wait landed@1[0] == 2 ...
//   rank 0 compute: wait expert_rows@0[0, 0] == 1, [0, 1] == 1 | y0 = expanded@0[0:2] @ w1_0[0]
#include "kernels/moe_engine.cuh"
#include "primitives/bulk_ring.cuh"

namespace mk {

template <class EngineT>
struct MoeDispatchGemm : CommRings<UnitRing<8, 4, 16384>, UnitRing<4, 2, 8192>> {
  using Engine = EngineT;
  using Layout = spec::moe_dispatch_gemm::Layout;
  using Args = FusedArgs<MoeDispatchGemm>;
  // The comm unit's TMA ring (primitives/bulk_ring.cuh UnitRing, kept across its tasks by the
  // comm_begin / comm_end hooks): one thread moves rows by bulk copies, many KB in flight. A warp
  // of register copies (8 loads in flight per lane) expanded ~2x slower than the GEMM consumed
  // (benchmarks/results/moe_local_2026-12-01_warp_expand_rejected.json). intra_sm: 4 x 8 KB
  // after the engine's shared memory (its ring one stage shorter, kernels/moe_engine.cuh);
  // inter_sm: 8 x 16 KB of a comm CTA's.
  static_assert(Engine::kSmemBytes + kCommSmemBytes <= gemm::kMaxDynamicSmem, "fits a CTA");
  static_assert(InterRing::kSmemBytes <= Engine::kSmemBytes, "a comm CTA's ring fits");
  static constexpr int kPush = 0;    // comm task kinds (args[0]), as the twin's PUSH
  static constexpr int kExpand = 1;  // and EXPAND
  static constexpr int kPieceRows = spec::moe_dispatch_gemm::kPieceRows;
  static constexpr int kPadIdsLanded = spec::moe_dispatch_gemm::kPadIdsLanded;
  static constexpr int kPadLanded = spec::moe_dispatch_gemm::kPadLanded;
  static constexpr int kPadLandedCount = spec::moe_dispatch_gemm::kPadLandedCount;
  static constexpr int kPadRows = spec::moe_dispatch_gemm::kPadExpertRows;
  static constexpr int kPadRowsCount = spec::moe_dispatch_gemm::kPadExpertRowsCount;

  // Slot j's expert id, or -1: unused, outside [0, W * E), or named by an earlier slot of the
  // token too (then it feeds nobody: no rank gets more than min(k, E) rows of one token, the
  // bound the plan's buffers have; the host refuses both before a launch, the layout reports them).
  static __device__ int slot_id(const int* ids, int j, int all) {
    const int g = ids[j];
    if (g < 0 || g >= all) return -1;
    for (int i = 0; i < j; ++i) {
      if (ids[i] == g) return -1;
    }
    return g;
  }
  // The local expert (0 .. E - 1) of id g on rank d, or -1 (another rank's, unused, or invalid).
  static __device__ int local_expert(int g, int d, int experts) {
    const int e = g - d * experts;
    return g >= 0 && e >= 0 && e < experts ? e : -1;
  }
  // The ranks token t of rank s feeds (bit d: some id in d's experts; out-of-range ids feed none).
  static __device__ unsigned fed_ranks(const int* ids, int k, int experts, int W) {
    unsigned mask = 0;
    for (int j = 0; j < k; ++j) {
      const int g = ids[j];
      if (g >= 0 && g < W * experts) mask |= 1u << (g / experts);
    }
    return mask;
  }

  // The ids exchange (every thread of CTA slot 0, before the layout): my topk_ids into every
  // rank's ids_all (rows me * T, peer stores), then ids_landed[me] := 1 there; once every rank's
  // flag is up here (each reset as it is seen), all of the routing is read locally. A distributed
  // world's layout needs nothing else from its peers.
  static __device__ const int* exchange_ids(const Args& a, const CtaInfo& cta) {
    const Layout& l = a.layout;
    const FusedCommon& c = a.common;
    const int W = c.world_size, me = cta.rank;
    const long long n = (long long)l.tokens * l.k;
    const int* mine = l.topk_ids.at(cta.local_rank);
    for (int i = 0; i < W; ++i) {
      int* to = l.ids_all.map((me + i) % W) + me * n;
      for (long long v = threadIdx.x; v < n; v += blockDim.x) to[v] = __ldg(mine + v);
    }
    __syncthreads();
    if (threadIdx.x == 0) exchange_flags<kPadIdsLanded>(c, me, W);
    __syncthreads();
    return l.ids_all.map(me);
  }

  // Every thread of CTA slot 0. Counts first (shared-memory atomics), then prefix sums give every
  // row, task, wait and raise its index, and each thread writes its own: the order is the twin's
  // (rows by expert, source, token; pushes nearest rank first, then token order) whatever the
  // number of threads. The engine's shared memory is the scratch (it starts after the layout).
  static __device__ void layout(const Args& a, const CtaInfo& cta, TableWriter& compute,
                                TableWriter& comm, char* smem) {
    const Layout& l = a.layout;
    const int W = a.common.world_size, me = cta.rank, T = l.tokens, k = l.k, E = l.experts;
    const int N = l.inter, tr = l.tile_rows, tiles_n = (N + Engine::BN - 1) / Engine::BN;
    const int nt = blockDim.x, tid = threadIdx.x;
    int* offs = l.expert_offsets.at(cta.local_rank);  // [E + 1]
    int* src = l.src.at(cta.local_rank);              // [max_rows, 3]
    int* row_map = l.row_map.map(me);                 // [max_rows]: receive row of each y row
    // Scratch (ints): per (expert, source) rows; per (source, destination) tokens; per expert
    // offsets, tile and wait prefixes, sources; per (expert, source in my order) the first expand
    // piece, then per source its pieces; per my-token chunk pushes per rank; push bases per rank;
    // per token chunk: receive rows, then rows per expert.
    int* es = reinterpret_cast<int*>(smem);  // [E, W]
    int* fed = es + E * W;                   // [W, W]
    int* eoff = fed + W * W;                 // [E + 1]
    int* tile_base = eoff + E + 1;           // [E + 1]
    int* wait_base = tile_base + E + 1;      // [E + 1]
    int* nz = wait_base + E + 1;             // [E]
    int* xb = nz + E;                        // [E * W + 1]
    int* xs = xb + E * W + 1;                // [W]
    int* rbase = xs + W;                     // [W]
    int* pc = rbase + W;                     // [nt, W]
    int* tb = pc + nt * W;                   // [W]: my tokens per destination
    int* pb = tb + W;                        // [W + 1]: push pieces before each destination
    int* recv_c = pb + W + 1;                // [C + 1]
    const int used = (int)(recv_c - es);
    const int C = min(nt, (Engine::kSmemBytes / 4 - used - 1) / (E + 1));
    int* cnt = recv_c + C + 1;  // [C, E]
    if (C < 1) {  // E too large for the scratch: the plan's bound is broken, stop loudly
      compute.fail();
      return;
    }
    for (int i = tid; i < E * W + W * W; i += nt) es[i] = 0;
    const int* all_ids = exchange_ids(a, cta);  // [W * T, k]: every rank's routing, here
    // 1. Counts: token chunk c of the W * T tokens (source-major) per expert; every token's ranks.
    const int L = (W * T + C - 1) / C;
    if (tid < C) {
      int* mine = cnt + tid * E;
      for (int e = 0; e < E; ++e) mine[e] = 0;
      int rc = 0;
      for (int u = tid * L; u < min((tid + 1) * L, W * T); ++u) {
        const int s = u / T;
        const int* ids = all_ids + (long long)u * k;
        for (int j = 0; j < k; ++j) {
          // an id outside [-1, W * E) or a repeated one feeds nobody (every layout ignores it);
          // rank 0's layout reports it
          const int g = slot_id(ids, j, W * E);
          if (g < 0 && ids[j] != -1 && me == 0)
            record_bad_input(a.common.wait, s, u - s * T, j, ids[j]);
          const int e = local_expert(g, me, E);
          if (e < 0) continue;
          ++mine[e];
          atomicAdd(&es[e * W + s], 1);
        }
        const unsigned mask = fed_ranks(ids, k, E, W);
        rc += (mask >> me) & 1;
        for (int d = 0; d < W; ++d) {
          if ((mask >> d) & 1) atomicAdd(&fed[s * W + d], 1);
        }
      }
      recv_c[tid] = rc;
    }
    __syncthreads();
    // 2. Prefix sums: per expert over chunks; receive rows over chunks; then over experts.
    for (int e = tid; e < E; e += nt) {
      eoff[e + 1] = exclusive_scan(cnt + e, C, E);
      int n = 0;
      for (int s = 0; s < W; ++s) n += es[e * W + s] > 0;
      nz[e] = n;
    }
    if (tid == nt - 1) {
      int run = 0;
      for (int c = 0; c < C; ++c) {
        const int v = recv_c[c];
        recv_c[c] = run;
        run += v;
      }
    }
    __syncthreads();
    if (tid == 0) {
      eoff[0] = tile_base[0] = wait_base[0] = 0;
      for (int e = 0; e < E; ++e) {
        const int tiles = (eoff[e + 1] + tr - 1) / tr * tiles_n;  // eoff[e + 1]: e's rows here
        eoff[e + 1] += eoff[e];
        tile_base[e + 1] = tile_base[e] + tiles;
        wait_base[e + 1] = wait_base[e] + tiles * nz[e];
      }
    }
    if (tid == nt - 1) {  // expand pieces: expert-major, sources nearest first, kPieceRows rows
      // source s's receive rows here start at s * T: rbase[s] takes a count over all sources
      // (the chunks' prefix) to s's own rows
      for (int s = 0, run = 0; s < W; ++s) {
        rbase[s] = s * T - run;
        run += fed[s * W + me];
      }
      for (int s = 0; s < W; ++s) xs[s] = 0;
      xb[0] = 0;
      for (int p = 0; p < E * W; ++p) {
        const int s = (me + p % W) % W, n = (es[p / W * W + s] + kPieceRows - 1) / kPieceRows;
        xb[p + 1] = xb[p] + n;
        xs[s] += n;
      }
    }
    __syncthreads();
    for (int e = tid; e <= E; e += nt) offs[e] = eoff[e];
    // 3. Every row's place (expert, then source, token, slot) and its token's receive row here.
    if (tid < C) {
      int* next = cnt + tid * E;
      int recv = recv_c[tid];
      for (int u = tid * L; u < min((tid + 1) * L, W * T); ++u) {
        const int s = u / T, t = u - s * T;
        const int* ids = all_ids + (long long)u * k;
        bool fedme = false;
        for (int j = 0; j < k; ++j) {
          const int e = local_expert(slot_id(ids, j, W * E), me, E);
          if (e < 0) continue;
          const int r = eoff[e] + next[e]++;
          src[3 * r] = s;
          src[3 * r + 1] = t;
          src[3 * r + 2] = j;
          row_map[r] = recv + rbase[s];
          fedme = true;
        }
        recv += fedme;
      }
    }
    // 4. GEMM tiles: expert e's rows in tiles of tile_rows x BN, each waiting for e's rows from
    // every source that sends some to be expanded (all of e's tiles are the counted consumers of
    // each flag; twice the patience: the expand's wait for a late source times out first).
    const int tiles = tile_base[E];
    for (int x = tid; x < tiles; x += nt) {
      const int e = last_at_most(tile_base, E, x), i = x - tile_base[e];
      const int m0 = eoff[e] + i / tiles_n * tr;
      const int n0 = i % tiles_n * Engine::BN, w0 = wait_base[e] + i * nz[e];
      compute.put_tile(x, m0, n0, min(tr, eoff[e + 1] - m0), min(Engine::BN, N - n0), e, w0, nz[e],
                       0, 0);
      const int consumers = tile_base[e + 1] - tile_base[e];
      for (int s = 0, q = 0; s < W; ++s) {
        const int n = es[e * W + s];
        if (n > 0)
          compute.put_wait(w0 + q++, kPadRows, me, e * W + s, n, consumers, kPadRowsCount, 2, s);
      }
    }
    compute.count(tiles);
    // 5. Pushes of my tokens: per (my-token chunk, destination) counts and prefix sums give each
    // token its position among mine that feed d (send_map[d], token order; its receive row there
    // is me * T + position); then pieces of up to kPieceRows positions, destinations nearest
    // first (me, me + 1, ...), each adding its tokens to landed[me] at d (raise index = task's).
    const int* mine = l.topk_ids.at(cta.local_rank);
    int* send_map = l.send_map.map(me);  // [W, T]
    const int Lm = (T + nt - 1) / nt;
    for (int d = 0; d < W; ++d) pc[tid * W + d] = 0;
    for (int t = tid * Lm; t < min((tid + 1) * Lm, T); ++t) {
      const unsigned mask = fed_ranks(mine + (long long)t * k, k, E, W);
      for (int d = 0; d < W; ++d) pc[tid * W + d] += (mask >> d) & 1;
    }
    __syncthreads();
    for (int d = tid; d < W; d += nt) tb[d] = exclusive_scan(pc + d, nt, W);
    __syncthreads();
    if (tid == 0) {
      pb[0] = 0;
      for (int i = 0, run = 0; i < W; ++i) {
        const int d = (me + i) % W;
        pb[d] = run;
        run += (tb[d] + kPieceRows - 1) / kPieceRows;
        pb[W] = run;
      }
    }
    __syncthreads();
    for (int t = tid * Lm; t < min((tid + 1) * Lm, T); ++t) {
      const unsigned mask = fed_ranks(mine + (long long)t * k, k, E, W);
      for (int d = 0; d < W; ++d) {
        if ((mask >> d) & 1) send_map[d * T + pc[tid * W + d]++] = t;
      }
    }
    for (int d = 0; d < W; ++d) {
      for (int j = tid; j * kPieceRows < tb[d]; j += nt) {
        const int i = pb[d] + j, n = min(kPieceRows, tb[d] - j * kPieceRows);
        comm.put_task(i, kPush, d, j * kPieceRows, n, 0, 0, i, 1);
        comm.put_raise(i, kPadLanded, d, me, n, kRaiseAdd);
      }
    }
    // 6. Expands of the rows I receive, after the pushes: piece j of (expert e, source s) copies
    // up to kPieceRows of e's rows from s (contiguous y rows) once every token of s has landed,
    // and adds its rows to expert_rows[e, s] here (the GEMM tiles' flags). All of s's pieces are
    // the counted consumers of landed[s]. Waits: one per piece; raises after the pushes'.
    const int pushes = pb[W];
    for (int p = tid; p < E * W; p += nt) {
      const int e = p / W, s = (me + p % W) % W, n = es[e * W + s];
      int r0 = eoff[e];  // e's rows: by source
      for (int q = 0; q < s; ++q) r0 += es[e * W + q];
      for (int c = 0; c * kPieceRows < n; ++c) {
        const int j = xb[p] + c, rows = min(kPieceRows, n - c * kPieceRows);
        comm.put_task(pushes + j, kExpand, r0 + c * kPieceRows, rows, s, j, 1, pushes + j, 1);
        comm.put_wait(j, kPadLanded, me, s, fed[s * W + me], xs[s], kPadLandedCount, 1, s);
        comm.put_raise(pushes + j, kPadRows, me, e * W + s, rows, kRaiseAdd);
      }
    }
    comm.count(pushes + xb[E * W]);
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    return gemm::Dest{l.y.at(cta.local_rank) + (long long)t.m0 * l.inter + t.n0, l.inter,
                      gemm::kStoreBF16};
  }


  // One thread (lane 0) drives the ring; the template waits for the stores to land, then raises.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    if (team.lane != 0) return;
    const Layout& l = a.layout;
    const long long row_bytes = 2LL * l.hidden;
    if (args[0] == kPush) {  // my tokens at send_map[d][i0 ..] -> d's receive rows me * T + i0 ..
      const int d = args[1], i0 = args[2];
      char* to = reinterpret_cast<char*>(l.recv.map(d)) +
                 ((long long)cta.rank * l.tokens + i0) * row_bytes;
      move_rows(a, smem, to, l.x.at(cta.local_rank), l.send_map.map(cta.rank) + d * l.tokens + i0,
                args[3]);
    } else if (args[0] == kExpand) {  // y rows r0 ..: recv rows row_map[r] -> expanded rows r
      const int r0 = args[1];
      char* to = reinterpret_cast<char*>(l.expanded.at(cta.local_rank)) + r0 * row_bytes;
      move_rows(a, smem, to, l.recv.map(cta.rank), l.row_map.map(cta.rank) + r0, args[2]);
    }
  }

  // n <= kPieceRows rows gathered by index: row index[i] of `from` -> row i of `to` (consecutive
  // rows), as one stream of chunks through the ring (no drain between rows).
  static __device__ void move_rows(const Args& a, char* smem, char* to, const __nv_bfloat16* from,
                                   const int* index, int n) {
    const long long row_bytes = 2LL * a.layout.hidden;
    int rows[kPieceRows];  // loaded together: one latency, not n
#pragma unroll
    for (int i = 0; i < kPieceRows; ++i) rows[i] = i < n ? __ldcg(index + i) : 0;
    const char* src = reinterpret_cast<const char*>(from);
    with_ring(a, smem, [&](const auto& ring) {
      const long long chunk = ring.kChunk, per_row = (row_bytes + chunk - 1) / chunk;
      ring.stream(
          n * per_row,
          [&](long long c) {
            const long long i = c / per_row, off = (c - i * per_row) * chunk;
            const long long rest = row_bytes - off;
            return BulkChunk{to + i * row_bytes + off, src + rows[i] * row_bytes + off,
                             (uint32_t)(rest < chunk ? rest : chunk)};
          },
          Drain::kStore);
    });
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int here = args.common.ranks_here;
    // `expanded`'s rows (per call) from its rank stride: one rank's elements, emulated or not
    if (l.expanded.rank_stride % l.hidden != 0) return false;
    const long long rows = l.expanded.rank_stride / l.hidden;  // of each rank's [rows, H]
    if (rows < 1 ||
        !fill_grouped_b(here, args.engine, l.w1, l.experts, l.hidden, l.inter, (int)rows))
      return false;
    for (int r = 0; r < here; ++r) {
      if (host::make_tensor_map_bf16_2d(&args.engine[r].a, l.expanded.base + r * rows * l.hidden,
                                        rows, l.hidden, l.hidden, Engine::BM, 64,
                                        128) != host::kTensorMapOk)
        return false;
    }
    return true;
  }
};

int launch_moe_dispatch_gemm(const long long* rec, cudaStream_t s) {
  // one stage less in the engine's ring: room for the intra_sm comm ring; 128-row tiles are
  // 128 x 256 (mkernel/ops/moe_dispatch_gemm.py make_plan)
  return launch_grouped<MoeDispatchGemm, /*kGather=*/false, /*kFewerStages=*/1, /*kWide=*/true>(rec,
                                                                                                s);
}

}  // namespace mk
