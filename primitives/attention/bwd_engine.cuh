// bwd_engine.cuh: bf16 attention backward (FlashAttention-2/3 style) for sm_90a. One CTA owns one
// K/V tile of BKV = 128 rows of one (batch, kv head) and walks every query tile (of every query
// head of its GQA group) that sees it: dK and dV stay in registers for the whole walk and are
// stored once; dQ leaves each step as fp32 reduce-adds into a zeroed accumulator.
//
//   warpgroup 0 (producer)                       warpgroups 1, 2 (consumers: 64 kv rows each)
//     warp 0, one thread: TMA K, V once;           wait K, V
//       per q tile: wait q_empty; TMA Q, dO        per q tile (stage st):
//                                                    lse2, delta rows (loaded a step ahead)
//                                                    S^T  = K_wg Q^T          (SS, k = D)
//                                                    dP^T = V_wg dO^T         (SS, k = D)
//                                                    P^T = exp2(S^T * scale * log2 e - lse2)
//                                                    dV += P^T dO             (RS, k = 64 q rows)
//                                                    dS^T = P^T (dP^T - delta) * scale -> smem
//                                                    dK += dS^T Q             (RS)
//                                                    barrier (both halves of dS^T written)
//                                                    dQ[:, half wg] = dS K    (SS, both operands
//                                                      MN-major: WgmmaTT) -> smem (fp32) ->
//                                                      TMA reduce-add into dq (one thread)
//                                                  epilogue: dK, dV rows -> global (fp32 or bf16)
//
// Why this shape: the tile sizes of FlashAttention-3's hdim-128 backward (64 q x 128 kv): five
// m64 GEMMs per step fit the 240 registers a consumer may hold (dK, dV 2 x D/2, S^T and dP^T
// 2 x 32, the bf16 P^T and dS^T fragments 2 x 16, dQ D/4). dQ is split by columns between the two
// warpgroups, so each dQ element is reduce-added once per (q tile, kv tile), not once per half.
// The reduce-add is one TMA instruction per 32 columns: per-thread red.add of the same bytes
// measured 0.61x the speed of the kernel without them (benchmarks/attention_bwd_probe.py), the TMA
// reduce 0.73x; a second staging tile per warpgroup (waiting for the reduce of two steps ago)
// measured no faster, so the reduce's cost is its L2 traffic (S_kv / 128 fp32 partials of dQ).
// Halving that traffic with clusters of two CTAs on adjacent kv tiles, the second sending its
// partial into the first's shared memory and the first reducing the sum, measured slower in three
// forms (S = 8192 full, one CTA each = 1.0): 8-byte st.async stores from registers into one
// partner tile, 0.77x (commit c46ed65); the same with two tiles and one step of slack, 0.76x
// (7401e89); the partial staged and sent by one bulk copy, 0.92x (f308563). All reverted.
// The lse / delta rows: every lane loading two and storing them into its warp's buffer (variant 1)
// measured 0.68-0.69x cuDNN at S = 8192 full, each warp's lane 0 fetching them by one bulk copy
// from rows the prep kernel packs (TMA_ROWS, the default) 0.74-0.76x (benchmarks/results/
// attention_bwd_2026-12-01_*rows*.json). Issuing half of dK's MMAs after dQ's, so that dQ's
// staging stores overlap them, read 0.70x with lane-loaded rows and no better with fetched ones
// (_split_variants.json, _warp_fetched_rows.json): not kept. Issuing all of dQ's MMAs before dK's
// (FlashAttention-3's order), with dQ's staging and reduce-add between dK's MMAs and their wait
// (no spills), read 0.66x / 0.75x cuDNN where this form read 0.80x / 0.87x in the same run
// (attention_bwd_2026-12-02_dq_first_rejected.json): the barrier on the other warpgroup's dS^T
// then stalls before any MMA of the step is in flight; removed (commit 4803a1d has it). Deferring
// a step's dQ stores into the next step (behind its S^T and dP^T MMAs) does not compile well:
// ptxas injects a wgmma wait before the reads of registers a wgmma wrote in the previous
// iteration, and (D = 128) spills.
// Each consumer warp staging and reduce-adding its own 16 rows of dQ (16-row TMA boxes, no named
// barriers) read 0.66x / 0.73x cuDNN (S = 8192 full / causal) where the warpgroup form read 0.77x /
// 0.86x in the same run (_warp_dq_rejected.json): four times the reduce instructions cost more
// than the barriers (reverted). The probes (benchmarks/attention_bwd_probe.py, S = 8192 full,
// TFLOP/s): real 435, dQ staged but not reduced 407, reduced from an unwritten tile 430, neither
// (nor the barriers) 537: no one part of the reduce is the cost alone. A dQ writer thread (producer
// warpgroup) issuing the reduce-adds from the consumers' staging tiles (dq_full / dq_empty
// mbarriers), so that the consumers only store and arrive, read 0.70x / 0.75x where this form read
// 0.77x / 0.86x in the same run (_dq_writer_rejected.json; its probes: 391 real, 529 with the
// writer reducing an unwritten tile, 393 with the tile stored and nothing reduced): the
// consumers then wait for the writer's reduce to have read the single staging tile (no room
// for two: 227 KiB), reverted.
// The mask of the tiles that cross the diagonal or the end of the keys is applied after the exp,
// under one uniform branch per step: written as a guarded `if` per element, it compiled to 32
// branch blocks that every step ran (~17% of the warps' stall samples in ncu at S = 8192 full),
// and hoisting it made the kernel 1.11x faster (benchmarks/results/
// attention_bwd_probe_2026-12-02.txt). Measured there and not kept: only the reduce-issuing warp
// waiting at dQ's staging barrier (the others arriving: no faster, and it spilled), the next
// step's row fetch issued after the step's MMAs and delta's columns read before dP^T's wait
// (together 0.98x-1.00x).
//
// Causal is top-left (as the forward): key j > query i is masked; q tiles wholly before the kv
// tile are never visited, tiles that cross the diagonal or the end of the keys are masked. A CTA
// whose kv tile no query sees still stores its (zero) dK, dV.
//
// Contract with the kernel (kernels/attention_bwd.cu): every thread calls run_cta(params, smem);
// kThreads threads, __launch_bounds__(kThreads, 1); kSmemBytes of dynamic shared memory,
// 1024-byte aligned; params in param space (__grid_constant__: TMA reads the maps). Named barriers
// 1..3 are used (0 is left to __syncthreads).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "../comm.cuh"
#include "../gemm/mbarrier.cuh"
#include "../gemm/tma.cuh"
#include "../gemm/wgmma.cuh"
#include "softmax.cuh"
#include "tma_nd.cuh"
#include "wgmma_attn.cuh"

namespace mk::attn {

template <int D_, int PROBE_ = 0, bool TMA_ROWS_ = true, int PRODUCER_REGS_ = 24>
struct AttnBwdConfig {
  static constexpr int D = D_;    // head dim (64 or 128)
  // measurement only: 1 skips dQ, 2 its staging and reduce-adds, 3 loads Q alone and uses it as
  // dO (half the per-step L2 reads: whether they limit the kernel), 4 stages dQ but issues no
  // reduce-add, 5 issues the reduce-adds without the staging stores (of whatever is there)
  static constexpr int PROBE = PROBE_;
  // true: each consumer warp's lane 0 fetches the next step's lse2 / delta rows by one 512-byte
  // bulk copy (from the packed [B, Hq, q_tiles, 2, BQ] rows the host prepares) into the warp's own
  // buffer; false: every lane loads two rows and stores them there. (A form in which the producer
  // brought the rows with Q and dO into the stage got racecheck hazards between the consumers'
  // reads and the next bulk write, ordered only through the stage's mbarriers.)
  static constexpr bool TMA_ROWS = TMA_ROWS_;
  static constexpr int BQ = 64;   // query rows per step
  static constexpr int BKV = 128; // kv rows per CTA = CONSUMERS x 64
  static constexpr int CONSUMERS = 2;
  static constexpr int STAGES = 2;
  static constexpr int kThreads = 128 * (1 + CONSUMERS);
  // setmaxnreg moves registers within the launch's 168 per thread (64K / 384): producer +
  // 2 x consumer <= 504. The plain backward's producer issues TMA alone (24); a fused kernel's
  // producer also runs its plan's waits and its spare warp the comm tasks, which spill at 24.
  static constexpr int kProducerRegs = PRODUCER_REGS_;
  static constexpr int kLeftRegs = (504 - PRODUCER_REGS_) / 16 * 8;  // per consumer, by 8
  static constexpr int kConsumerRegs = kLeftRegs < 240 ? kLeftRegs : 240;
  static_assert(kProducerRegs % 8 == 0 && kProducerRegs >= 24, "setmaxnreg takes 24..256 by 8");
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
};

// Shared memory (every tile 1024-byte aligned; D/64 chunks of 128-byte rows per tile):
//   [K: D/64 x [BKV][64]] [V: same] [Q: STAGES x D/64 x [BQ][64]] [dO: same]
//   [dS^T: 2 x [BKV][64 q]] [dQ: CONSUMERS x D/64 x [BQ][32 fp32]] [lse2, delta: per consumer
//   warp 2 x 2 x 64 floats] [kv_full, q_full[S], q_empty[S], TMA_ROWS: rows_full[warp][2]]
template <class Cfg>
struct AttnBwdSmem {
  static constexpr int kChunks = Cfg::D / 64;
  static constexpr int kKVChunkBytes = Cfg::BKV * 128;
  static constexpr int kQChunkBytes = Cfg::BQ * 128;
  static constexpr int kKVBytes = kChunks * kKVChunkBytes;
  static constexpr int kQStageBytes = kChunks * kQChunkBytes;
  static constexpr int kDSBytes = Cfg::BKV * 128;  // [BKV kv rows][64 q] bf16
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKVBytes;
  static constexpr int kQOffset = kVOffset + kKVBytes;
  static constexpr int kDOOffset = kQOffset + Cfg::STAGES * kQStageBytes;
  static constexpr int kDSOffset = kDOOffset + Cfg::STAGES * kQStageBytes;
  static constexpr int kDQChunkBytes = Cfg::BQ * 128;  // [BQ][32] fp32
  static constexpr int kDQBytesPerWG = (Cfg::D / 2 / 32) * kDQChunkBytes;
  static constexpr int kDQOffset = kDSOffset + 2 * kDSBytes;
  static constexpr int kRowOffset = kDQOffset + Cfg::CONSUMERS * kDQBytesPerWG;  // lse2, delta
  static constexpr int kRowBytesPerWarp = 2 * 2 * Cfg::BQ * 4;  // [step % 2][lse2 | delta][BQ]
  static constexpr int kRowStepBytes = 2 * Cfg::BQ * 4;         // one step's [lse2 | delta][BQ]
  static constexpr int kRowBytes = 4 * Cfg::CONSUMERS * kRowBytesPerWarp;
  static constexpr int kBarOffset = kRowOffset + kRowBytes;
  // kv_full, kv_empty, q_full[S], q_empty[S], TMA_ROWS: rows_full[consumer warp][step % 2]
  static constexpr int kNumBars = 2 + 2 * Cfg::STAGES + (Cfg::TMA_ROWS ? 8 * Cfg::CONSUMERS : 0);
  static constexpr int kBytes = kBarOffset + 8 * kNumBars;
  static_assert(Cfg::BQ == 64, "a dS^T row is one 128-byte swizzle span");
  static_assert(kBytes <= 227 * 1024, "fits the 227 KiB of an sm_90 CTA");
};

struct AttnBwdParams {
  CUtensorMap q, k, v, dout;  // [B, S, H, D] maps: boxes {64, 1, BQ | BKV, 1}
  CUtensorMap dq;             // [B, S_q, Hq, D] fp32, reduce-added into: box {32, 1, BQ, 1}
  // The ring backward's K / V slots (kernels/ring_attention_bwd.cu: [(W - 1) B C, S_kv, Hkv, D]);
  // its maps view a rank's rows as C chunks ([B C, S_q, H, D]); plain backward: unused.
  CUtensorMap k_ring, v_ring;
  const float* lse;           // [B, Hq, S_q] natural log (the forward's)
  const float* delta;         // [B, Hq, S_q] rowsum(dO * O) (minus d lse, if any)
  const float* rows;          // TMA_ROWS: [B, Hq, q_tiles, 2, BQ] lse * log2 e | delta, padded
  void* dk;                   // [B, S_kv, Hkv, D] fp32 or bf16 (kv_f32)
  void* dv;
  int B, S_q, S_kv, Hq, Hkv, group;
  float scale, scale_log2;
  int causal, kv_f32, kv_accumulate;
  int q_tiles, kv_tiles;
};

// How an item's dK, dV rows are written: the plain backward's bf16 or fp32 stores (or fp32 adds
// to what is there: one writer per row), the ring's red.global.add (fp32, other writers too).
enum KvStore : int { kKvStoreBf16, kKvStoreF32, kKvAccumulateF32, kKvReduceAddF32 };

// A work item: one K / V tile (rows kv_row0.. of map coordinate kv_outer, kv head hk) against the
// q tiles [q_begin, q_tiles) of each q head of its group, at Q / dO / dq map coordinate b (and
// packed rows [b, Hq, q_tiles]); causal: key > query masked (top-left, both in one map's rows).
struct BwdWork {
  int b, hk, kv_tile, q_begin;
  int kv_row0, kv_outer;
  bool causal, ring;  // ring: K, V from the k_ring / v_ring maps
  int store;          // KvStore
  void* dk;           // the item's row 0 of dK, dV (row r at + r * ld elements)
  void* dv;
  long long ld;
};

template <class Cfg>
struct AttnBwdEngine {
  using Map = AttnBwdSmem<Cfg>;
  static constexpr int D = Cfg::D, BQ = Cfg::BQ, BKV = Cfg::BKV, STAGES = Cfg::STAGES;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kSmemBytes = Map::kBytes;
  static constexpr int kChunks = Map::kChunks;
  static constexpr int kSRegs = BQ / 2;  // S^T, dP^T: m64 x BQ
  static constexpr int kPRegs = BQ / 4;  // P^T, dS^T as bf16 pairs
  static constexpr int kKVRegs = D / 2;  // dK, dV: m64 x D
  static constexpr int kQCols = D / 2;   // dQ columns per consumer warpgroup
  static constexpr int kBarDS = 1;       // both consumers wrote their half of dS^T
  static constexpr int kBarDQ0 = 2;      // consumer wg's dQ staging tile: kBarDQ0 + wg

  struct Bars {
    uint64_t* kv_full;
    uint64_t* kv_empty;  // the consumers have read an item's K, V (a persistent CTA reloads them)
    uint64_t* q_full;   // [STAGES]: TMA bytes
    uint64_t* q_empty;  // [STAGES]
    uint64_t* rows_full;  // TMA_ROWS: [consumer warp][2], the warp's rows of a step landed
  };

  using Work = BwdWork;
  static constexpr int kBarEnd = 4;  // both consumer warpgroups stored an item (BwdTasks::end)

  __device__ static Bars bars_of(char* smem) {
    uint64_t* b = reinterpret_cast<uint64_t*>(smem + Map::kBarOffset);
    return Bars{b, b + 1, b + 2, b + 2 + STAGES, b + 2 + 2 * STAGES};
  }

  // Causal: kv tile ascending over ids (the longest walks first); otherwise kv tile fastest (the
  // CTAs that run together read one head's Q and dO from L2).
  __device__ static Work work_of(const AttnBwdParams& p, int id) {
    Work w;
    int bh;
    if (p.causal) {
      const int heads = p.B * p.Hkv;
      w.kv_tile = id / heads;
      bh = id - w.kv_tile * heads;
    } else {
      bh = id / p.kv_tiles;
      w.kv_tile = id - bh * p.kv_tiles;
    }
    w.b = bh / p.Hkv;
    w.hk = bh - w.b * p.Hkv;
    w.kv_row0 = w.kv_tile * BKV;
    w.kv_outer = w.b;
    w.q_begin = p.causal ? w.kv_row0 / BQ : 0;
    w.causal = p.causal != 0;
    w.ring = false;
    const long long at = ((long long)w.b * p.S_kv + w.kv_row0) * p.Hkv * D + (long long)w.hk * D;
    w.ld = (long long)p.Hkv * D;
    w.dk = p.kv_f32 ? (void*)(static_cast<float*>(p.dk) + at)
                    : (void*)(static_cast<__nv_bfloat16*>(p.dk) + at);
    w.dv = p.kv_f32 ? (void*)(static_cast<float*>(p.dv) + at)
                    : (void*)(static_cast<__nv_bfloat16*>(p.dv) + at);
    w.store = !p.kv_f32 ? kKvStoreBf16 : p.kv_accumulate ? kKvAccumulateF32 : kKvStoreF32;
    return w;
  }

  // The plain backward's one item per CTA (work_of(blockIdx.x)); no waits, no signals.
  struct OneTile {
    const AttnBwdParams& p;
    bool done = false;
    __device__ bool next(Work& w) {
      if (done) return false;
      done = true;
      w = work_of(p, blockIdx.x);
      return true;
    }
    __device__ void begin(const Work&) {}
    __device__ void end(const Work&) {}
  };

  __device__ static void run_cta(const AttnBwdParams& p, char* smem) {
    OneTile work{p};
    run_cta(p, smem, work, [] {});
  }

  // Every thread of the CTA, over a work source (OneTile; the ring kernel's BwdTasks): next(w)
  // gives each thread the same items in turn, begin(w) (the producer, before the item's loads)
  // runs its waits, end(w) (every consumer thread, after the item's dQ reduce-adds landed and
  // its dK, dV stores) publishes it. Warp 1 of the producer warpgroup runs spare() meanwhile (the
  // persistent template's intra_sm communicator).
  template <class Src, class Spare>
  __device__ static void run_cta(const AttnBwdParams& p, char* smem, Src& work, Spare&& spare) {
    if (smem_u32(smem) % 1024 != 0) __trap();
    const Bars bars = bars_of(smem);
    if (threadIdx.x == 0) {
      gemm::mbar_init(bars.kv_full, 1);
      gemm::mbar_init(bars.kv_empty, 4 * Cfg::CONSUMERS);  // lane 0 of each consumer warp
      for (int s = 0; s < STAGES; ++s) {
        gemm::mbar_init(&bars.q_full[s], 1);        // the TMA thread
        gemm::mbar_init(&bars.q_empty[s], 4 * Cfg::CONSUMERS);  // lane 0 of each consumer warp
      }
      if constexpr (Cfg::TMA_ROWS)
        for (int i = 0; i < 8 * Cfg::CONSUMERS; ++i) gemm::mbar_init(&bars.rows_full[i], 1);
      gemm::mbar_fence_init();
    }
    __syncwarp();  // converge warp 0 before the CTA barrier
    __syncthreads();
    if (threadIdx.x < 128) {
      gemm::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (threadIdx.x == 0) producer(p, smem, bars, work);
      if (threadIdx.x / 32 == 1) spare();
    } else {
      gemm::setmaxnreg_inc<Cfg::kConsumerRegs>();
      gemm::PipeState<STAGES> st;
      int step = 0;
      uint32_t kv_phase = 0;
      Work w;
      while (work.next(w)) {
        consumer(p, w, smem, bars, st, step, kv_phase);
        work.end(w);
      }
    }
  }

 private:
  // ------------------------------------------------------------------------------- producer
  template <class Src>
  __device__ static void producer(const AttnBwdParams& p, char* smem, const Bars& bars, Src work) {
    using namespace gemm;
    tma_prefetch_map(&p.q);
    tma_prefetch_map(&p.dout);
    tma_prefetch_map(&p.dq);
    gemm::PipeState<STAGES> st;
    uint32_t kv_phase = 0;
    Work w;
    while (work.next(w)) {
      work.begin(w);                            // the item's waits
      mbar_wait(bars.kv_empty, kv_phase ^ 1u);  // the previous item's K, V are read
      kv_phase ^= 1u;
      load_item(p, w, smem, bars, st);
    }
  }

  __device__ static void load_item(const AttnBwdParams& p, const Work& w, char* smem,
                                   const Bars& bars, gemm::PipeState<STAGES>& st) {
    using namespace gemm;
    const CUtensorMap* k = w.ring ? &p.k_ring : &p.k;
    const CUtensorMap* v = w.ring ? &p.v_ring : &p.v;
    mbar_arrive_expect_tx(bars.kv_full, 2 * Map::kKVBytes);
    for (int c = 0; c < kChunks; ++c) {
      tma_load_4d(smem + Map::kKOffset + c * Map::kKVChunkBytes, k, bars.kv_full, c * 64, w.hk,
                  w.kv_row0, w.kv_outer);
      tma_load_4d(smem + Map::kVOffset + c * Map::kKVChunkBytes, v, bars.kv_full, c * 64, w.hk,
                  w.kv_row0, w.kv_outer);
    }
    for (int g = 0; g < p.group; ++g) {
      const int hq = w.hk * p.group + g;
      for (int i = w.q_begin; i < p.q_tiles; ++i) {
        mbar_wait(&bars.q_empty[st.stage], st.phase ^ 1u);
        constexpr uint32_t kTx = (Cfg::PROBE == 3 ? 1 : 2) * Map::kQStageBytes;
        mbar_arrive_expect_tx(&bars.q_full[st.stage], kTx);
        char* q = smem + Map::kQOffset + st.stage * Map::kQStageBytes;
        char* dout = smem + Map::kDOOffset + st.stage * Map::kQStageBytes;
        for (int c = 0; c < kChunks; ++c) {
          tma_load_4d(q + c * Map::kQChunkBytes, &p.q, &bars.q_full[st.stage], c * 64, hq, i * BQ,
                      w.b);
          if constexpr (Cfg::PROBE != 3)
            tma_load_4d(dout + c * Map::kQChunkBytes, &p.dout, &bars.q_full[st.stage], c * 64, hq,
                        i * BQ, w.b);
        }
        st.advance();
      }
    }
  }

  // ------------------------------------------------------------------------------- consumer
  // One item: its K / V tile's walk, dK and dV in registers, stored at the end.
  __device__ static void consumer(const AttnBwdParams& p, const Work& w, char* smem,
                                  const Bars& bars, gemm::PipeState<STAGES>& st, int& step,
                                  uint32_t& kv_phase) {
    using namespace gemm;
    const int wg = (int)threadIdx.x / 128 - 1;
    const int lt = threadIdx.x % 128;
    const int lane = lt % 32, q4 = lane % 4;
    const int row_wg = 16 * (lt / 32) + lane / 4;  // this thread's half-0 row within the 64
    const int kv_row0 = w.kv_row0 + 64 * wg;       // first kv row of this warpgroup
    const uint32_t k_base = smem_u32(smem + Map::kKOffset);
    const uint32_t v_base = smem_u32(smem + Map::kVOffset);
    const uint32_t k_wg = k_base + wg * 64 * 128, v_wg = v_base + wg * 64 * 128;
    // dQ columns of this warpgroup inside the K tile (B of dQ = dS K): chunk, then byte offset.
    const uint32_t k_cols =
        k_base + (wg * kQCols / 64) * Map::kKVChunkBytes + (wg * kQCols % 64) * 2;
    // this warp's own lse / delta rows (every warp reads all BQ columns)
    float* rows = reinterpret_cast<float*>(smem + Map::kRowOffset +
                                           (threadIdx.x / 32 - 4) * Map::kRowBytesPerWarp);
    char* dq_smem = smem + Map::kDQOffset + wg * Map::kDQBytesPerWG;
    const bool kv_clipped = kv_row0 + 64 > p.S_kv;

    float dk[kKVRegs], dv[kKVRegs];
#pragma unroll
    for (int i = 0; i < kKVRegs; ++i) dk[i] = dv[i] = 0.f;
    float s[kSRegs], dp[kSRegs], dq[kQCols / 2];
    uint32_t pp[kPRegs], dsp[kPRegs];

    float row_lse2[2] = {0.f, 0.f}, row_delta[2] = {0.f, 0.f};  // rows lane, lane + 32 of the
    uint64_t* rows_full = bars.rows_full + 2 * (threadIdx.x / 32 - 4);  // next step (TMA_ROWS:
    // NOTE: after the item's kv_full: the producer has run its waits (in the ring kernel the rows
    // were written in this launch by the preps of other CTAs, at every step; proxy fence: they
    // are read by a bulk copy).                                                   this warp's
    mbar_wait(bars.kv_full, kv_phase);  // barriers)
    kv_phase ^= 1u;
    if (w.q_begin < p.q_tiles) {
      if constexpr (Cfg::TMA_ROWS) {
        __syncwarp();  // every lane has read the buffer of step - 2 (the one refilled here)
        if (lane == 0) {
          fence_proxy_async_global();
          fetch_rows(p, w, 0, w.q_begin, rows + (step & 1) * 2 * BQ, rows_full + (step & 1));
        }
      } else {
        load_rows(p, w, 0, w.q_begin, lane, row_lse2, row_delta);
      }
    }
    for (int g = 0; g < p.group; ++g) {
      const int hq = w.hk * p.group + g;
      for (int i = w.q_begin; i < p.q_tiles; ++i, ++step) {
        const int q0 = i * BQ;
        const uint32_t q_st = smem_u32(smem + Map::kQOffset + st.stage * Map::kQStageBytes);
        const uint32_t do_st =
            Cfg::PROBE == 3 ? q_st : smem_u32(smem + Map::kDOOffset + st.stage * Map::kQStageBytes);
        // this step's rows (loaded one step ahead, 2 per lane) -> the warp's buffer of the step's
        // parity; __syncwarp hands them to the warp's lanes, and a buffer is rewritten two steps
        // later, after the next step's __syncwarp, which every lane passes after its reads of it
        const float* lse2;
        if constexpr (Cfg::TMA_ROWS) {
          // the other buffer held the previous step's rows: every lane has read them (program
          // order, then __syncwarp) before lane 0 rewrites it with the next step's
          const int buf = step & 1;
          __syncwarp();
          if (lane == 0) {
            with_next(p, w, g, i, [&](int ng, int ni) {
              fetch_rows(p, w, ng, ni, rows + (buf ^ 1) * 2 * BQ, rows_full + (buf ^ 1));
            });
          }
          mbar_wait(&rows_full[buf], (step >> 1) & 1);
          lse2 = rows + buf * 2 * BQ;
        } else {
          float* mine = rows + (step & 1) * 2 * BQ;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            mine[lane + 32 * r] = row_lse2[r];
            mine[BQ + lane + 32 * r] = row_delta[r];
          }
          with_next(p, w, g, i,
                    [&](int ng, int ni) { load_rows(p, w, ng, ni, lane, row_lse2, row_delta); });
          __syncwarp();
          lse2 = mine;
        }
        const float* delta = lse2 + BQ;
        char* ds = smem + Map::kDSOffset + (step & 1) * Map::kDSBytes;
        mbar_wait(&bars.q_full[st.stage], st.phase);

        wgmma_fence();
        mma_kk(s, k_wg, q_st);  // S^T = K_wg Q^T
        wgmma_commit();
        mma_kk(dp, v_wg, do_st);  // dP^T = V_wg dO^T
        wgmma_commit();

        // this thread's columns' lse2 (8j + 2 q4 + e), read while the MMAs run
        float2 col_lse2[kSRegs / 4];
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j)
          col_lse2[j] = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * q4);

        wgmma_wait<1>();  // S^T done
        fence_operands(s);
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float l = (e & 1) ? col_lse2[j].y : col_lse2[j].x;
            s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], p.scale_log2, -l));
          }
        }
        // key kv >= S_kv, or (causal) kv > query q0 + col, i.e. col < kv - q0: P = 0
        if (kv_clipped || (w.causal && kv_row0 + 63 > q0)) {
          int lo[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int kv = kv_row0 + row_wg + 8 * h;
            lo[h] = kv >= p.S_kv ? BQ : w.causal ? kv - q0 : 0;
          }
          set_columns_where(s, q4, 0.f, [&](int col, int h) { return col < lo[h]; });
        }
        pack_rows(s, pp);
        wgmma_fence();
        mma_rs(dv, pp, do_st);  // dV += P^T dO
        wgmma_commit();

        wgmma_wait<1>();  // dP^T done (dV still running)
        fence_operands(dp);
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = 8 * j + 2 * q4 + (e & 1);
            dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - delta[col]) * p.scale;
          }
        }
        pack_rows(dp, dsp);
        // dS^T -> this warpgroup's 64 rows of the swizzled [BKV][64] tile (A of dQ = dS K).
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 64 * wg + row_wg + 8 * h;
            *reinterpret_cast<uint32_t*>(ds + r * 128 + ((j ^ (r % 8)) * 16) + q4 * 4) =
                dsp[2 * j + h];
          }
        }
        // dK's MMAs first: they keep the tensor cores busy through the wait for the other
        // warpgroup's half of dS^T
        wgmma_fence();
        mma_rs(dk, dsp, q_st);  // dK += dS^T Q
        wgmma_commit();
        if constexpr (Cfg::PROBE != 1) {
          fence_proxy_async_smem();  // the dS^T stores, before wgmma reads them (async proxy)
          named_barrier_sync(kBarDS, 128 * Cfg::CONSUMERS);
          const uint32_t ds_u32 = smem_u32(ds);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BKV / 16; ++kk)  // dQ[:, cols of wg] = dS K
            WgmmaTT<kQCols>::mma(dq, desc_mn_major_sw128(ds_u32 + kk * 16 * 128, Map::kDSBytes),
                                 desc_mn_major_sw128(k_cols + kk * 16 * 128, Map::kKVChunkBytes),
                                 kk > 0);
          wgmma_commit();
        }
        wgmma_wait<0>();
        fence_operands(dq);
        fence_operands(dk);
        fence_operands(dv);
        fence_regs(pp);
        fence_regs(dsp);
        // Q, dO: read by wgmma only
        if (lane == 0) mbar_arrive(&bars.q_empty[st.stage]);
        st.advance();
        if constexpr (Cfg::PROBE != 1 && Cfg::PROBE != 2)
          reduce_dq(p, w, wg, lt, hq, q0, dq, dq_smem);
      }
    }
    if (lane == 0) gemm::mbar_arrive(bars.kv_empty);  // K, V read (every wgmma waited)
    if (lt == 0) bulk_wait_all();                     // the item's dQ reduce-adds have landed
    store_kv(p, w, 64 * wg + row_wg, q4, dk, w.dk);
    store_kv(p, w, 64 * wg + row_wg, q4, dv, w.dv);
  }

  // f(group head, q tile) of the step after (g, i) in a CTA's walk (q tiles of one head, then the
  // next head of the GQA group), if there is one: whose rows to bring one step ahead.
  template <class F>
  __device__ static __forceinline__ void with_next(const AttnBwdParams& p, const Work& w, int g,
                                                   int i, F&& f) {
    if (i + 1 < p.q_tiles)
      f(g, i + 1);
    else if (g + 1 < p.group)
      f(g + 1, w.q_begin);
  }

  // acc += A B over a step's BQ query rows: A (P^T or dS^T) from registers as bf16 pairs (RS),
  // B (dO or Q) the stage's tile, MN-major.
  __device__ static __forceinline__ void mma_rs(float (&acc)[kKVRegs], const uint32_t (&a)[kPRegs],
                                                uint32_t b) {
    using namespace gemm;
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
      WgmmaRS<D>::mma(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3],
                      desc_mn_major_sw128(b + kk * 16 * 128, Map::kQChunkBytes), 1u);
  }

  // acc = A_wg B^T over D: both operands K-major in 128-byte swizzled chunks (S^T from K and Q,
  // dP^T from V and dO).
  __device__ static __forceinline__ void mma_kk(float (&acc)[kSRegs], uint32_t a, uint32_t b) {
    using namespace gemm;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk / 4, off = (kk % 4) * 32;
      WgmmaKK<BQ>::mma(acc, desc_k_major_sw128(a + c * Map::kKVChunkBytes + off),
                       desc_k_major_sw128(b + c * Map::kQChunkBytes + off), kk > 0);
    }
  }

  // TMA_ROWS, one lane: q tile i of group head g's packed rows (lse2, delta) -> dst, landing on bar.
  __device__ static void fetch_rows(const AttnBwdParams& p, const Work& w, int g, int i, float* dst,
                                    uint64_t* bar) {
    gemm::mbar_arrive_expect_tx(bar, Map::kRowStepBytes);
    const size_t tile = ((size_t)w.b * p.Hq + w.hk * p.group + g) * p.q_tiles + i;
    bulk_load(dst, p.rows + tile * 2 * BQ, Map::kRowStepBytes, bar);
  }

  // Rows lane and lane + 32 of q tile i of group head g: lse as log2 and delta. Rows past S_q get
  // lse = +inf and delta = 0, so P and dS are exactly 0 there whatever TMA's zero fill makes of S
  // and dP; an empty row's lse (-inf: nothing seen in the forward) likewise gives P = 0, not inf
  // (lse2_of, softmax.cuh: and lse +inf gives NaN).
  __device__ static void load_rows(const AttnBwdParams& p, const Work& w, int g, int i,
                                   int lane, float (&lse2)[2], float (&delta)[2]) {
    const size_t head = ((size_t)w.b * p.Hq + w.hk * p.group + g) * p.S_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = i * BQ + lane + 32 * r;
      const float l = row < p.S_q ? p.lse[head + row] : -INFINITY;
      lse2[r] = lse2_of(l);
      delta[r] = row < p.S_q ? p.delta[head + row] : 0.f;
    }
  }

  // This warpgroup's m64 x kQCols dQ -> its swizzled fp32 staging tile -> one TMA reduce-add per
  // 32 columns into dq (rows >= S_q dropped by TMA), issued by the warpgroup's first thread.
  __device__ static void reduce_dq(const AttnBwdParams& p, const Work& w, int wg, int lt, int hq,
                                   int q0, const float (&dq)[kQCols / 2], char* dq_smem) {
    using namespace gemm;
    const int lane = lt % 32, q4 = lane % 4;
    const int row_wg = 16 * (lt / 32) + lane / 4;
    if (lt == 0) bulk_wait_read();  // the previous step's reduce has read the tile
    named_barrier_sync(kBarDQ0 + wg, 128);
    // 8-column group j: chunk j / 4, 16-byte unit below (probe 5: none stored)
#pragma unroll
    for (int j = 0; j < (Cfg::PROBE == 5 ? 0 : kQCols / 8); ++j) {
      char* chunk = dq_smem + (j / 4) * Map::kDQChunkBytes;
      const int unit = 2 * (j % 4) + q4 / 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_wg + 8 * h;
        *reinterpret_cast<float2*>(chunk + r * 128 + ((unit ^ (r % 8)) * 16) + 8 * (q4 % 2)) =
            make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
      }
    }
    fence_proxy_async_smem();
    named_barrier_sync(kBarDQ0 + wg, 128);
    if (lt == 0 && Cfg::PROBE != 4) {
#pragma unroll
      for (int c = 0; c < kQCols / 32; ++c)
        tma_reduce_add_4d(&p.dq, dq_smem + c * Map::kDQChunkBytes, wg * kQCols + c * 32, hq, q0,
                          w.b);
      bulk_commit();
    }
  }

  // Rows row0 and row0 + 8 (of the item's tile) of an m64 x D accumulator -> the item's rows
  // (row r at out + r * w.ld), in w.store's way; rows past S_kv are left alone.
  __device__ static void store_kv(const AttnBwdParams& p, const Work& w, int row0, int q4,
                                  const float (&acc)[kKVRegs], void* out) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      if (w.kv_row0 + row >= p.S_kv) continue;
      const long long base = row * w.ld + 2 * q4;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float x = acc[4 * j + 2 * h], y = acc[4 * j + 2 * h + 1];
        float* f = static_cast<float*>(out) + base + 8 * j;
        switch (w.store) {
          case kKvStoreBf16:
            *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(out) + base + 8 * j) =
                pack_bf16(x, y);
            break;
          case kKvStoreF32: *reinterpret_cast<float2*>(f) = make_float2(x, y); break;
          case kKvAccumulateF32: {
            const float2 old = *reinterpret_cast<float2*>(f);
            *reinterpret_cast<float2*>(f) = make_float2(old.x + x, old.y + y);
            break;
          }
          default: red_add_v2_f32_sys(f, x, y); break;  // kKvReduceAddF32
        }
      }
    }
  }
};

}  // namespace mk::attn
