// The second grouped GEMM of an MoE layer + the combine: each expert row times w2 comes back to its
// token's rank, which sums its slots weighted in fp32 and stores the token once in bf16.
//
// Protocol (mkernel/ops/moe_gemm_combine.py, whose layout twin makes the same tasks; both roles
// device-filled). The layout phase of rank me (every thread of CTA slot 0) makes
//   compute tasks  per local expert, row tiles of tile_rows rows (row tile i of the rank, in
//                  expert order) cut into BN-wide column tiles: h rows @ w2[e] stored in fp32
//                  into my `partial` rows, each column tile adding 1 to tile_done[i] here
//   slot_rows      per (token, slot) of a source s: rank d + 1 (0: unused), row, row tile and
//                  its rows of the expert row, written by d (the row's holder) into s's table
//                  from d's own src / expert_offsets (the dispatch's outputs); slots_landed[d]
//                  set on every rank after; each layout waits for every rank's flag
//   comm tasks     one reduce per own token: for each used slot, in slot order, a wait for its
//                  row tile on d (all column tiles; the tile's rows, one token's each, are its
//                  counted consumers), then out[t] = bf16(sum_j w[t, j] * partial@d[row])
// No atomics: every row is stored once where it was computed and read once by its token's rank;
// the sum runs in slot order whatever order the tiles finished in; a reduce zeroes its token's
// slot entries after reading them (the next call starts from "unused"). The rows live in
// `partial` (a per-call tensor, every rank's in an emulated world: all ranks in this launch) or in
// the symmetric `partial_peers` (a distributed world, a process per GPU): rows_of picks.
//
//   W = 2, E_local = 1; rank 0: token 0 -> experts {0, 1}; rank 1: token 0 -> {0}
//   rank 0 compute: tile 0 = rows (x0[0], x1[0]) @ w2_0[0] -> partial@0 rows 0, 1; tile_done@0[0]
//   rank 1 compute: tile 0 = row x0[0] @ w2_1[0] -> partial@1 row 0; tile_done@1[0]
//   rank 0 comm:    token 0: wait tile_done@0[0], @1[0] | w00 p@0[0] + w01 p@1[0] -> out0[0]
#include "kernels/moe_engine.cuh"

namespace mk {

template <class EngineT>
struct MoeGemmCombine {
  using Engine = EngineT;
  using Layout = spec::moe_gemm_combine::Layout;
  using Args = FusedArgs<MoeGemmCombine>;
  static constexpr int kCommSmemBytes = 0;
  // The reduces are independent (each writes its own token): the SM's warps share them as they
  // leave the engine (templates/persistent.cuh claim_comm).
  static constexpr bool kCommAnyOrder = spec::moe_gemm_combine::kCommAnyOrder != 0;
  static constexpr int kReduce = 2;  // comm task kind (args[0]), as the twin's REDUCE
  static constexpr int kPadSlots = spec::moe_gemm_combine::kPadSlotsLanded;
  static constexpr int kPadDone = spec::moe_gemm_combine::kPadTileDone;
  static constexpr int kPadDoneCount = spec::moe_gemm_combine::kPadTileDoneCount;
  static constexpr int kSlot = spec::moe_gemm_combine::kSlotFields;  // rank, row, tile, rows

  // Row tiles of rank d before its expert e, from d's offsets ([E + 1]): into base[0 .. E].
  static __device__ void tile_prefix(const int* offs, int E, int tr, int* base) {
    base[0] = 0;
    for (int e = 0; e < E; ++e) base[e + 1] = base[e] + (offs[e + 1] - offs[e] + tr - 1) / tr;
  }
  // After every thread's peer stores of slot entries: slots_landed[me] := 1 on every rank, then
  // wait for every rank's here (moe_engine.cuh exchange_flags).
  static __device__ void exchange_done(const Args& a, const CtaInfo& cta) {
    const int W = a.common.world_size;
    __syncthreads();
    if (threadIdx.x == 0) exchange_flags<kPadSlots>(a.common, cta.rank, W);
    __syncthreads();
  }

  // Every thread of CTA slot 0: indices from prefix sums, each thread writes its own tasks.
  static __device__ void layout(const Args& a, const CtaInfo& cta, TableWriter& compute,
                                TableWriter& comm, char* smem) {
    const Layout& l = a.layout;
    const int me = cta.rank, T = l.tokens, k = l.k, E = l.experts;
    const int H = l.hidden, tr = l.tile_rows, tiles_n = (H + Engine::BN - 1) / Engine::BN;
    const int nt = blockDim.x, tid = threadIdx.x;
    int* base = reinterpret_cast<int*>(smem);  // [E + 1]: my row tiles before expert e
    int* waits = base + E + 1;                 // [nt + 1]: waits of my token chunks, prefixed
    if ((E + 1 + nt + 1) * 4 > Engine::kSmemBytes) {
      compute.fail();  // E too large for the scratch: stop loudly
      return;
    }
    const int* offs = l.expert_offsets.at(cta.local_rank);
    if (tid == 0) tile_prefix(offs, E, tr, base);
    __syncthreads();
    // My row tiles (numbered in expert order), each cut into column tiles adding 1 to its flag.
    const int tasks = base[E] * tiles_n;
    for (int x = tid; x < tasks; x += nt) {
      const int tile = x / tiles_n, n0 = x % tiles_n * Engine::BN, e = last_at_most(base, E, tile);
      const int m0 = offs[e] + (tile - base[e]) * tr;
      compute.put_tile(x, m0, n0, min(tr, offs[e + 1] - m0), min(Engine::BN, H - n0), e, 0, 0, x,
                       1);
      compute.put_raise(x, kPadDone, me, tile, 1, kRaiseAdd);
    }
    compute.count(tasks);
    // My rows' places into their sources' tables (peer stores), then every rank's here.
    const int* src = l.src.at(cta.local_rank);
    for (int row = tid; row < offs[E]; row += nt) {
      const int e = last_at_most(offs, E, row);  // the row's expert
      const int i = (row - offs[e]) / tr, m0 = offs[e] + i * tr;
      int* s = l.slot_rows.map(src[3 * row]) + kSlot * (src[3 * row + 1] * k + src[3 * row + 2]);
      s[0] = me + 1;
      s[1] = row;
      s[2] = base[e] + i;
      s[3] = min(tr, offs[e + 1] - m0);
    }
    exchange_done(a, cta);
    int* slots = l.slot_rows.map(me);
    // One reduce per own token, its waits (used slots, slot order) at prefix-summed positions.
    const int Lt = (T + nt - 1) / nt, t0 = min(tid * Lt, T), t1 = min(t0 + Lt, T);
    int mine = 0;
    for (int q = t0 * k; q < t1 * k; ++q) mine += slots[kSlot * q] > 0;
    waits[tid] = mine;
    __syncthreads();
    if (tid == 0) exclusive_scan(waits, nt);
    __syncthreads();
    int w = waits[tid];
    for (int t = t0; t < t1; ++t) {
      int used = 0;
      for (int j = 0; j < k; ++j) used += slots[kSlot * (t * k + j)] > 0;
      comm.put_task(t, kReduce, t, 0, 0, w, used, 0, 0);
      for (int j = 0; j < k; ++j) {
        const int* s = slots + kSlot * (t * k + j);
        if (s[0] > 0)
          comm.put_wait(w++, kPadDone, s[0] - 1, s[2], tiles_n, s[3], kPadDoneCount, 1, s[0] - 1);
      }
    }
    comm.count(T);
  }

  // Rank p's fp32 rows: the symmetric partial_peers in a distributed world, else p's slice of
  // the per-call partial (emulated: every rank local, p == its local rank).
  static __device__ float* rows_of(const Layout& l, int p) {
    return l.partial_peers.ptrs != nullptr ? l.partial_peers.map(p) : l.partial.at(p);
  }

  static __device__ gemm::Dest dest(const Args& a, const CtaInfo& cta, const Tile& t) {
    const Layout& l = a.layout;
    return gemm::Dest{rows_of(l, cta.rank) + (long long)t.m0 * l.hidden + t.n0, l.hidden,
                      gemm::kStoreF32};
  }

  // One own token: its used slots' fp32 rows (read from the ranks that computed them, through L2:
  // written in this launch) weighted and summed in slot order, one bf16 store; zeros if none.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    if (args[0] != kReduce) return;
    const Layout& l = a.layout;
    const int t = args[1], k = l.k, H = l.hidden;
    const int* slots = l.slot_rows.map(cta.rank) + kSlot * t * k;
    const float* w = l.topk_weights.at(cta.local_rank) + (long long)t * k;
    __nv_bfloat16* o = l.out.at(cta.local_rank) + (long long)t * H;
    for (int c = 4 * team.lane; c < H; c += 4 * team.size) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      // Slots in groups of 4: their loads in flight together (one at a time left the reduce
      // bound by memory latency: 15 ms for 940 MB of rows). An unused slot adds 0 * 0: the sum
      // stays in slot order.
      for (int j0 = 0; j0 < k; j0 += 4) {
        float4 p[4];
        float wj[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = j0 + q;
          const int d = j < k ? __ldcg(slots + kSlot * j) - 1 : -1;
          wj[q] = d >= 0 ? w[j] : 0.f;
          p[q] = d >= 0 ? __ldcg(reinterpret_cast<const float4*>(
                              rows_of(l, d) + (long long)__ldcg(slots + kSlot * j + 1) * H + c))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc.x += wj[q] * p[q].x;
          acc.y += wj[q] * p[q].y;
          acc.z += wj[q] * p[q].z;
          acc.w += wj[q] * p[q].w;
        }
      }
      const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z, acc.w);
      uint2 v;
      v.x = *reinterpret_cast<const uint32_t*>(&lo);
      v.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(o + c) = v;
    }
    // The token's entries back to 0 (unused) for the next call, once every lane has read them.
    team.sync();
    int* mine = l.slot_rows.map(cta.rank) + kSlot * t * k;
    for (int q = team.lane; q < kSlot * k; q += team.size) mine[q] = 0;
  }

  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int here = args.common.ranks_here;
    // h's rows (per call) from its rank stride: one rank's elements, emulated or not
    if (l.h.rank_stride % l.inter != 0) return false;
    const long long h_rows = l.h.rank_stride / l.inter;  // of each rank's [rows, I]
    if (h_rows < 1 ||
        !fill_grouped_b(here, args.engine, l.w2, l.experts, l.inter, l.hidden, (int)h_rows))
      return false;
    for (int r = 0; r < here; ++r) {
      if (host::make_tensor_map_bf16_2d(&args.engine[r].a, l.h.base + r * l.h.rank_stride, h_rows,
                                        l.inter, l.inter, Engine::BM, 64,
                                        128) != host::kTensorMapOk)
        return false;
    }
    return true;
  }
};

int launch_moe_gemm_combine(const long long* rec, cudaStream_t s) {
  return launch_grouped<MoeGemmCombine, /*kGather=*/false>(rec, s);
}

}  // namespace mk
