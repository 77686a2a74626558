// engine.cuh: bf16 attention forward (FlashAttention-3 style) for sm_90a: TMA loads into mbarrier
// rings, wgmma consumers with the softmax in registers, warp-specialised and persistent over
// (batch, head, query tile) work tiles.
//
//   warpgroup 0 (producer; one thread issues)    warpgroups 1, 2 (consumers: 64 query rows each)
//   for work tile:                               for work tile:
//     wait q_empty; TMA Q [BM x D]                 wait q_full
//     K_0; then for j: K_{j+1}, V_j                S_0 = Q K_0^T (SS wgmma); softmax -> P_0 (bf16)
//     (k and v rings, STAGES each; kv tiles        for j = 1..n-1:          (Cfg::OVERLAP)
//      in DESCENDING order: masked ones first)       issue S_j = Q K_j^T, O += P_{j-1} V_{j-1}
//                                                    wait S_j; softmax(S_j) while PV runs
//                                                    wait PV; O *= corr; P_j = bf16(S_j)
//                                                  O += P_{n-1} V_{n-1}
//                                                  epilogue: O / l -> bf16 -> swizzled smem ->
//                                                  TMA store (clips rows >= S); lse -> global
//   Cfg::OVERLAP false: S_j, softmax, PV_j strictly in sequence (the reference schedule).
//   Cfg::PINGPONG: the two consumer warpgroups take turns ISSUING their GEMMs (named barriers
//   kBarTurn0/1), so one warpgroup's softmax runs while the other's GEMMs occupy the tensor cores.
//
// Work tiles: id -> (b, h, m_tile). Causal: m_tile descending over ids (longest first: the static
// round-robin over CTAs then ends with the short tiles); otherwise m_tile fastest (the CTAs that
// run together share one head's K/V in L2). GQA: query head h reads kv head h / (Hq / Hkv).
// Causal masking is top-left: key position > query position is masked (S_q == S_kv in the usual
// case); kv tiles wholly above the diagonal are never loaded; only tiles that cross the diagonal or
// the end of the sequence (columns >= S_kv) are masked.
//
// Contract with the kernel (kernels/attention.cu): every thread of the CTA calls
// run_cta(params, smem); launch with kThreads threads and __launch_bounds__(kThreads, 1);
// kSmemBytes of dynamic shared memory, 1024-byte aligned (run_cta traps otherwise); params live in
// param space (a __grid_constant__ argument) because TMA reads the maps from there. Named barriers
// 1..4 are used (0 is left to __syncthreads).
#pragma once
#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "../gemm/mbarrier.cuh"
#include "../gemm/tma.cuh"
#include "../gemm/wgmma.cuh"
#include "softmax.cuh"
#include "tma_nd.cuh"
#include "wgmma_attn.cuh"

namespace mk::attn {

// Named constants of one instance (STYLE.md: a config struct, not positional template soup).
template <int D_, bool OVERLAP_, bool PINGPONG_>
struct AttnConfig {
  static constexpr int D = D_;      // head dim (64 or 128)
  static constexpr int BM = 128;    // query rows per work tile = CONSUMERS x 64
  static constexpr int BN = 128;    // kv rows per K / V stage (both kTileRows)
  static constexpr int CONSUMERS = 2;
  static constexpr int STAGES = D_ <= 64 ? 3 : 2;
  static constexpr bool OVERLAP = OVERLAP_;
  static constexpr bool PINGPONG = PINGPONG_;
  static constexpr int kThreads = 128 * (1 + CONSUMERS);
  // setmaxnreg moves registers within what the launch gave the CTA: 168 per thread (64K / 384,
  // rounded down to 8), so producer + 2 x consumer <= 3 x 168 = 504, or the consumers' increase
  // waits forever (32 + 2 x 240 hung the ring kernel). The ring kernel's producer also runs the
  // plan's waits and its spare warp the comm tasks, which spill at 24 (off the consumers' loop);
  // 56 + 2 x 224 measured no faster there (0.90 against 0.92 of the engine in one A/B run).
  static constexpr int kLaunchRegs = 168;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs + CONSUMERS * kConsumerRegs <= 3 * kLaunchRegs,
                "the warpgroups' registers fit what the launch allocates");
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(!PINGPONG || OVERLAP, "ping-pong is built on the overlapped schedule");
};

// Shared memory, every tile 1024-byte aligned (128-byte swizzle atoms), D/64 chunks of 128-byte
// rows per tile (TMA's inner box is one 128-byte swizzle span):
//   [Q: D/64 x [BM][64]] [K: STAGES x D/64 x [BN][64]] [V: same] [O: CONSUMERS x D/64 x [64][64]]
//   [q_full, q_empty, k_full[S], k_empty[S], v_full[S], v_empty[S]]
template <class Cfg>
struct AttnSmem {
  static constexpr int kChunks = Cfg::D / 64;
  static constexpr int kQChunkBytes = Cfg::BM * 128;
  static constexpr int kKVChunkBytes = Cfg::BN * 128;
  static constexpr int kOChunkBytes = 64 * 128;
  static constexpr int kQBytes = kChunks * kQChunkBytes;
  static constexpr int kKVStageBytes = kChunks * kKVChunkBytes;
  static constexpr int kOBytesPerWG = kChunks * kOChunkBytes;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + Cfg::STAGES * kKVStageBytes;
  static constexpr int kOOffset = kVOffset + Cfg::STAGES * kKVStageBytes;
  static constexpr int kBarOffset = kOOffset + Cfg::CONSUMERS * kOBytesPerWG;
  static constexpr int kNumBars = 2 + 4 * Cfg::STAGES;
  static constexpr int kBytes = kBarOffset + 8 * kNumBars;
  static_assert(kBytes <= 227 * 1024, "fits the 227 KiB of an sm_90 CTA");
};

struct AttnParams {
  CUtensorMap q, k, v, o;  // [B, S, H, D] maps (tensor_map_nd.h): boxes {64, 1, BM | BN | 64, 1}
  // The ring's K / V slots (kernels/ring_attention.cu: [(W - 1) B C, S_q, Hkv, D]); else unused.
  CUtensorMap k_ring, v_ring;
  float* lse;              // [B, Hq, S_q] fp32
  float* o_f32;            // [B, S_q, Hq, D] fp32 or nullptr: O also stored unrounded
  int B, S_q, S_kv, Hq, Hkv;
  int group;          // Hq / Hkv
  float scale_log2;   // softmax scale * log2(e)
  int causal;         // 0 / 1
  int m_tiles;        // ceil(S_q / BM)
  int total;          // B * Hq * m_tiles
  // Ring (kernels/ring_attention.cu): a rank's rows are `chunks` chunks of S_q rows, the maps view
  // them as [B * chunks, S_q, H, D], lse rows are chunks * S_q long. Plain attention: 1.
  int chunks;
  // Ring: a q tile's online-softmax state between its tasks, [B * Hq * chunks * S_q, D + 2] fp32
  // (unnormalised O, max, row sum), rows indexed like lse. Plain attention: unused.
  float* state;
};

// A work item: q rows [m_tile * BM, + BM) of (b, h) (of one chunk: map coordinate `outer`), its
// kv tiles, and where its lse rows start.
struct WorkTile {
  int b, h, hk, m_tile, n_tiles;
  int outer;          // Q / O map's batch coordinate
  long long lse_off;  // lse (and state) index of the item's chunk row 0
  bool load_state;    // resume the rows' online softmax from p.state (else start afresh)
  bool store_state;   // leave it in p.state for a later item (else store out and lse)
};

// Query rows of a work item = kv rows of a K / V stage (AttnConfig's BM and BN).
constexpr int kTileRows = 128;

// Kv tile j of a work item, in visiting order: maps and coordinates, and its mask.
struct KvTile {
  const CUtensorMap* k;
  const CUtensorMap* v;
  int outer, row;  // map coordinates (batch, first kv row)
  int valid;       // kv rows from `row` on: columns >= valid are masked
  bool diag;       // crosses the causal diagonal: column c > query row - row is masked
};

// The plain engine's work (kernels/attention.cu): ids blockIdx.x, + gridDim.x, ... over
// (b, h, m_tile), one K/V sequence per head, tiles in descending order (masked ones first).
struct PlainWork {
  const AttnParams& p;
  int id = -1;
  __device__ bool next(WorkTile& t) {
    id = id < 0 ? (int)blockIdx.x : id + (int)gridDim.x;
    if (id >= p.total) return false;
    int bh;
    if (p.causal) {
      const int heads = p.B * p.Hq;
      t.m_tile = p.m_tiles - 1 - id / heads;
      bh = id - (id / heads) * heads;
    } else {
      bh = id / p.m_tiles;
      t.m_tile = id - bh * p.m_tiles;
    }
    t.b = bh / p.Hq;
    t.h = bh - t.b * p.Hq;
    t.hk = t.h / p.group;
    const int kv_end = p.causal ? min(p.S_kv, (t.m_tile + 1) * kTileRows) : p.S_kv;
    t.n_tiles = (kv_end + kTileRows - 1) / kTileRows;
    t.outer = t.b;
    t.lse_off = ((long long)t.b * p.Hq + t.h) * p.S_q;
    t.load_state = t.store_state = false;
    return true;
  }
  __device__ bool last_item() const { return id + (int)gridDim.x >= p.total; }
  __device__ void begin(const WorkTile&) {}
  __device__ void end(const WorkTile&) {}
  // Tiles visited in descending order: tile n_tiles - 1 - j.
  struct Cursor {
    const AttnParams& p;
    const WorkTile& t;
    int j;
    __device__ KvTile tile() const {
      const int n0 = (t.n_tiles - 1 - j) * kTileRows;
      const bool diag = p.causal && n0 + kTileRows - 1 > t.m_tile * kTileRows;
      return KvTile{&p.k, &p.v, t.b, n0, p.S_kv - n0, diag};
    }
    __device__ void advance(bool) { ++j; }
  };
  __device__ Cursor cursor(const WorkTile& t) const { return Cursor{p, t, 0}; }
};

// Arrive on a named barrier without waiting. The unaligned form (like
// mk::gemm::named_barrier_sync_unaligned): the ping-pong barriers are reached from several static
// sites (first tile, loop, last tile) and from different warpgroups.
__device__ __forceinline__ void named_barrier_arrive_unaligned(int id, int count) {
  asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

template <class Cfg>
struct AttnEngine {
  using Map = AttnSmem<Cfg>;
  static constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN, STAGES = Cfg::STAGES;
  static constexpr int CONSUMERS = Cfg::CONSUMERS;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kSmemBytes = Map::kBytes;
  static constexpr int kChunks = Map::kChunks;
  static constexpr int kSRegs = BN / 2;  // S accumulator floats per thread (m64 x BN)
  static constexpr int kORegs = D / 2;   // O accumulator floats per thread (m64 x D)
  static constexpr int kPRegs = BN / 4;  // P as bf16 pairs
  static constexpr int kBarWG0 = 1;      // epilogue barrier of consumer wg: kBarWG0 + wg
  static constexpr int kBarTurn0 = 3;    // ping-pong: "consumer wg may issue": kBarTurn0 + wg
  static constexpr uint32_t kQTxBytes = Map::kQBytes;
  static constexpr uint32_t kKVTxBytes = Map::kKVStageBytes;

  struct Bars {
    uint64_t* q_full;
    uint64_t* q_empty;
    uint64_t* k_full;   // [STAGES]
    uint64_t* k_empty;  // [STAGES]
    uint64_t* v_full;   // [STAGES]
    uint64_t* v_empty;  // [STAGES]
  };

  __device__ static Bars bars_of(char* smem) {
    uint64_t* b = reinterpret_cast<uint64_t*>(smem + Map::kBarOffset);
    return Bars{b, b + 1, b + 2, b + 2 + STAGES, b + 2 + 2 * STAGES, b + 2 + 3 * STAGES};
  }

  // Every thread of the CTA: plain attention (kernels/attention.cu), one launch per call.
  __device__ static void run_cta(const AttnParams& p, char* smem) {
    PlainWork work{p};
    run_cta(p, smem, work, [] {});
  }

  // Every thread of the CTA, over a work source (PlainWork; the ring kernel's TaskWork); warp 1 of
  // the producer warpgroup runs spare() meanwhile (the persistent template's intra_sm
  // communicator).
  template <class Work, class Spare>
  __device__ static void run_cta(const AttnParams& p, char* smem, Work& work, Spare&& spare) {
    static_assert(BM == kTileRows && BN == kTileRows, "work sources count kTileRows rows");
    if (smem_u32(smem) % 1024 != 0) __trap();
    const Bars bars = bars_of(smem);
    if (threadIdx.x == 0) mbar_init_all(bars);
    __syncwarp();  // converge warp 0 before the CTA barrier
    __syncthreads();
    if (threadIdx.x < 128) {
      gemm::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (threadIdx.x == 0) producer(p, smem, bars, work);
      if (threadIdx.x / 32 == 1) spare();
    } else {
      gemm::setmaxnreg_inc<Cfg::kConsumerRegs>();
      consumer(p, smem, bars, work);
    }
  }

 private:
  __device__ static void mbar_init_all(const Bars& b) {
    using namespace gemm;
    const uint32_t releasers = 4 * CONSUMERS;  // lane 0 of every consumer warp
    mbar_init(b.q_full, 1);
    mbar_init(b.q_empty, releasers);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&b.k_full[s], 1);
      mbar_init(&b.k_empty[s], releasers);
      mbar_init(&b.v_full[s], 1);
      mbar_init(&b.v_empty[s], releasers);
    }
    mbar_fence_init();
  }

  // ------------------------------------------------------------------------------- producer
  template <class Work>
  __device__ static void producer(const AttnParams& p, char* smem, const Bars& bars, Work work) {
    using namespace gemm;
    tma_prefetch_map(&p.q);
    tma_prefetch_map(&p.k);
    tma_prefetch_map(&p.v);
    tma_prefetch_map(&p.o);
    PipeState<STAGES> ks, vs;
    uint32_t q_phase = 0;
    WorkTile t;
    while (work.next(t)) {
      work.begin(t);  // the item's first task may load (its waits)
      mbar_wait(bars.q_empty, q_phase ^ 1u);
      mbar_arrive_expect_tx(bars.q_full, kQTxBytes);
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        tma_load_4d(smem + Map::kQOffset + c * Map::kQChunkBytes, &p.q, bars.q_full, c * 64, t.h,
                    t.m_tile * BM, t.outer);
      q_phase ^= 1u;
      auto load = [&](bool is_k, int offset, uint64_t* full, uint64_t* empty, PipeState<STAGES>& st,
                      const KvTile& kt) {
        mbar_wait(&empty[st.stage], st.phase ^ 1u);
        mbar_arrive_expect_tx(&full[st.stage], kKVTxBytes);
        char* dst = smem + offset + st.stage * Map::kKVStageBytes;
        const CUtensorMap* map = is_k ? kt.k : kt.v;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
          tma_load_4d(dst + c * Map::kKVChunkBytes, map, &full[st.stage], c * 64, t.hk, kt.row,
                      kt.outer);
        st.advance();
      };
      // K runs one tile ahead of V: the consumers need S_{j+1} before P_j V_j (Cfg::OVERLAP).
      // The K cursor enters each of the item's tasks first: it runs the task's waits (advance).
      auto kc = work.cursor(t), vc = work.cursor(t);
      load(true, Map::kKOffset, bars.k_full, bars.k_empty, ks, kc.tile());
      for (int j = 0; j < t.n_tiles; ++j) {
        if (j + 1 < t.n_tiles) {
          kc.advance(true);
          load(true, Map::kKOffset, bars.k_full, bars.k_empty, ks, kc.tile());
        }
        load(false, Map::kVOffset, bars.v_full, bars.v_empty, vs, vc.tile());
        vc.advance(false);
      }
    }
  }

  // ------------------------------------------------------------------------------- consumer
  struct Consumer {
    const AttnParams& p;
    int wg, lt, q4, row_wg;  // row_wg: this thread's half-0 row within the warpgroup's 64
    uint32_t q_base, k_base, v_base;

    __device__ __forceinline__ void release(uint64_t* bar) const {
      if (lt % 32 == 0) gemm::mbar_arrive(bar);
    }

    // S = Q K^T over D (D/16 k-steps; 4 per 128-byte chunk).
    __device__ __forceinline__ void issue_s(float (&s)[kSRegs], int stage) const {
      const uint32_t kb = k_base + stage * Map::kKVStageBytes;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk / 4, off = (kk % 4) * 32;
        const uint64_t da = gemm::desc_k_major_sw128(q_base + c * Map::kQChunkBytes + off);
        const uint64_t db = gemm::desc_k_major_sw128(kb + c * Map::kKVChunkBytes + off);
        WgmmaKK<BN>::mma(s, da, db, kk > 0 ? 1u : 0u);
      }
      gemm::wgmma_commit();
    }

    // O += P V over the BN kv rows (BN/16 k-steps of 16 rows = 2048 bytes each).
    __device__ __forceinline__ void issue_pv(float (&o)[kORegs], const uint32_t (&pr)[kPRegs],
                                             int stage) const {
      const uint32_t vb = v_base + stage * Map::kKVStageBytes;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint64_t db = gemm::desc_mn_major_sw128(vb + kk * 16 * 128, Map::kKVChunkBytes);
        WgmmaRS<D>::mma(o, pr[4 * kk], pr[4 * kk + 1], pr[4 * kk + 2], pr[4 * kk + 3], db, 1u);
      }
      gemm::wgmma_commit();
    }

    // Masks kv tile kt of work tile t if it crosses the sequence's end or the diagonal, then the
    // softmax step.
    __device__ __forceinline__ void softmax(float (&s)[kSRegs], OnlineSoftmax& sm,
                                            const WorkTile& t, const KvTile& kt,
                                            float (&corr)[2]) const {
      if (kt.valid < BN || kt.diag) {
        int limit[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int lim = kt.valid;
          const int row = t.m_tile * BM + 64 * wg + row_wg + 8 * h;
          if (kt.diag) lim = min(lim, row + 1 - kt.row);
          limit[h] = lim;
        }
        set_columns_where(s, q4, -INFINITY, [&](int col, int h) { return col >= limit[h]; });
      }
      sm.step(s, p.scale_log2, corr);
    }

    // A resumed item's rows (of the chunk): O, max and sum from p.state. The row sum is kept as
    // per-thread partials: lane q4 = 0 takes the stored total, the others start at 0.
    __device__ __forceinline__ void load_state(const WorkTile& t, float (&o)[kORegs],
                                               OnlineSoftmax& sm) const {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = t.m_tile * BM + 64 * wg + row_wg + 8 * h;
        if (row >= p.S_q) continue;  // past the chunk: a row nobody stores
        const float* src = p.state + (t.lse_off + row) * (D + 2);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          const float2 x = *reinterpret_cast<const float2*>(src + 8 * j + 2 * q4);
          o[4 * j + 2 * h] = x.x;
          o[4 * j + 2 * h + 1] = x.y;
        }
        sm.m[h] = src[D];
        sm.l[h] = q4 == 0 ? src[D + 1] : 0.f;
      }
    }

    // The item's rows for a later item of the same q tile (the same threads load them back).
    __device__ __forceinline__ void store_state(const WorkTile& t, const float (&o)[kORegs],
                                                const OnlineSoftmax& sm) const {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(sm.l[h]);  // every lane: a shuffle
        const int row = t.m_tile * BM + 64 * wg + row_wg + 8 * h;
        if (row >= p.S_q) continue;
        float* dst = p.state + (t.lse_off + row) * (D + 2);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j + 2 * q4) =
              make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
        if (q4 == 0) {
          dst[D] = sm.m[h];
          dst[D + 1] = sum;
        }
      }
      __syncwarp();  // lanes q4 = 1..3 read what lane 0 stored, in a later item
    }

    // Ping-pong turn: wait for this warpgroup's turn to issue / hand the turn to the other one.
    __device__ __forceinline__ void turn_wait() const {
      if constexpr (Cfg::PINGPONG) gemm::named_barrier_sync_unaligned(kBarTurn0 + wg, 256);
    }
    __device__ __forceinline__ void turn_pass(bool last) const {
      // NOTE: warpgroup 1 handed warpgroup 0 the first turn at start; it skips its very last
      // hand-over so that every barrier phase is completed exactly (no arrival left at exit).
      if constexpr (Cfg::PINGPONG) {
        if (!(last && wg == 1)) named_barrier_arrive_unaligned(kBarTurn0 + (wg ^ 1), 256);
      }
    }
  };

  template <class Work>
  __device__ static void consumer(const AttnParams& p, char* smem, const Bars& bars, Work work) {
    using namespace gemm;
    const int lt = threadIdx.x % 128;
    const int lane = lt % 32;
    Consumer c{p,
               (int)threadIdx.x / 128 - 1,
               lt,
               lane % 4,
               16 * (lt / 32) + lane / 4,
               0,
               smem_u32(smem + Map::kKOffset),
               smem_u32(smem + Map::kVOffset)};
    c.q_base = smem_u32(smem + Map::kQOffset) + c.wg * 64 * 128;  // this wg's 64 rows of Q
    char* o_smem = smem + Map::kOOffset + c.wg * Map::kOBytesPerWG;

    float s[kSRegs];
    float o[kORegs];
    uint32_t pr[kPRegs];
    PipeState<STAGES> ks, vs;
    uint32_t q_phase = 0;
    if constexpr (Cfg::PINGPONG) {
      if (c.wg == 1) named_barrier_arrive_unaligned(kBarTurn0, 256);  // warpgroup 0 issues first
    }

    WorkTile t;
    while (work.next(t)) {
      const bool last_item = work.last_item();
      const int n = t.n_tiles;
      auto cur = work.cursor(t);  // the kv tile whose scores come next
      OnlineSoftmax sm;
      sm.init();
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
      if (t.load_state) c.load_state(t, o, sm);
      float corr[2];
      mbar_wait(bars.q_full, q_phase);
      q_phase ^= 1u;

      if constexpr (Cfg::OVERLAP) {
        // S_0, softmax -> P_0
        mbar_wait(&bars.k_full[ks.stage], ks.phase);
        c.turn_wait();
        wgmma_fence();
        c.issue_s(s, ks.stage);
        c.turn_pass(false);
        wgmma_wait<0>();
        fence_operands(s);
        c.release(&bars.k_empty[ks.stage]);
        ks.advance();
        if (n == 1) c.release(bars.q_empty);
        c.softmax(s, sm, t, cur.tile(), corr);  // O is zero unless resumed
        cur.advance(false);
        if (t.load_state) rescale_rows(o, corr);
        pack_rows(s, pr);
        for (int j = 1; j < n; ++j) {
          mbar_wait(&bars.k_full[ks.stage], ks.phase);
          c.turn_wait();
          wgmma_fence();
          c.issue_s(s, ks.stage);  // S_j
          // NOTE: V_{j-1} is loaded after K_j: waiting for it only now lets S_j start earlier.
          mbar_wait(&bars.v_full[vs.stage], vs.phase);
          wgmma_fence();  // the wait's branch ends the fenced region (ptxas would inject one)
          c.issue_pv(o, pr, vs.stage);  // O += P_{j-1} V_{j-1}
          c.turn_pass(false);
          wgmma_wait<1>();  // S_j done; PV still running
          fence_operands(s);
          c.release(&bars.k_empty[ks.stage]);
          ks.advance();
          if (j == n - 1) c.release(bars.q_empty);
          c.softmax(s, sm, t, cur.tile(), corr);
          cur.advance(false);
          wgmma_wait<0>();  // PV done: O and P may be touched again
          fence_operands(o);
          fence_regs(pr);
          c.release(&bars.v_empty[vs.stage]);
          vs.advance();
          rescale_rows(o, corr);
          pack_rows(s, pr);
        }
        mbar_wait(&bars.v_full[vs.stage], vs.phase);
        c.turn_wait();
        wgmma_fence();
        c.issue_pv(o, pr, vs.stage);
        c.turn_pass(last_item);
        wgmma_wait<0>();
        fence_operands(o);
        fence_regs(pr);
        c.release(&bars.v_empty[vs.stage]);
        vs.advance();
      } else {
        for (int j = 0; j < n; ++j) {
          mbar_wait(&bars.k_full[ks.stage], ks.phase);
          wgmma_fence();
          c.issue_s(s, ks.stage);
          wgmma_wait<0>();
          fence_operands(s);
          c.release(&bars.k_empty[ks.stage]);
          ks.advance();
          if (j == n - 1) c.release(bars.q_empty);
          c.softmax(s, sm, t, cur.tile(), corr);
          cur.advance(false);
          rescale_rows(o, corr);
          pack_rows(s, pr);
          mbar_wait(&bars.v_full[vs.stage], vs.phase);
          wgmma_fence();
          c.issue_pv(o, pr, vs.stage);
          wgmma_wait<0>();
          fence_operands(o);
          fence_regs(pr);
          c.release(&bars.v_empty[vs.stage]);
          vs.advance();
        }
      }
      if (t.store_state) {
        c.store_state(t, o, sm);
      } else {
        epilogue(c, t, sm, o, o_smem);
      }
      work.end(t);  // the item's tasks are complete (TaskWork: their after_store)
    }
    if (lt == 0) bulk_wait_all();  // the last O tile has been read (and written) before exit
  }

  // O / l -> bf16 into this warpgroup's swizzled [64][64] chunks -> TMA store; lse per row.
  __device__ static void epilogue(const Consumer& c, const WorkTile& t, OnlineSoftmax& sm,
                                  float (&o)[kORegs], char* o_smem) {
    using namespace gemm;
    const AttnParams& p = c.p;
    float inv[2], lse[2];
    sm.finish(p.scale_log2, inv, lse);
    const int row0 = t.m_tile * BM + 64 * c.wg;  // first query row of this warpgroup
    if (c.q4 == 0) {
      float* dst = p.lse + t.lse_off;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + c.row_wg + 8 * h;
        if (row < p.S_q) dst[row] = lse[h];
      }
    }
    if (p.o_f32 != nullptr) {  // unrounded O for an lse merge: straight from the registers
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + c.row_wg + 8 * h;
        if (row >= p.S_q) continue;
        float* dst = p.o_f32 + (((size_t)t.b * p.S_q + row) * p.Hq + t.h) * D + 2 * c.q4;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j) =
              make_float2(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      }
    }
    if (c.lt == 0) bulk_wait_read();  // the previous tile's store has read the staging tile
    named_barrier_sync(kBarWG0 + c.wg, 128);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {  // 8-column group j: chunk j/8, 16-byte unit j%8
      char* chunk = o_smem + (j / 8) * Map::kOChunkBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = c.row_wg + 8 * h;
        const int unit = (j % 8) ^ (r % 8);  // the 128-byte swizzle: 16-byte unit ^ row % 8
        *reinterpret_cast<uint32_t*>(chunk + r * 128 + unit * 16 + c.q4 * 4) =
            pack_bf16(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      }
    }
    fence_proxy_async_smem();
    named_barrier_sync(kBarWG0 + c.wg, 128);
    if (c.lt == 0 && row0 < p.S_q) {
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch)
        tma_store_4d(&p.o, o_smem + ch * Map::kOChunkBytes, ch * 64, t.h, row0, t.outer);
      bulk_commit();
    }
  }
};

}  // namespace mk::attn
