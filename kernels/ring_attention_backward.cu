// Ring attention, backward: the backward engine (primitives/attention/bwd_engine.cuh) on the
// persistent template, each rank's K / V block travelling the ring as in the forward and the fp32
// dK / dV partials of a block travelling with it, its sum home (bf16) to the block's owner.
//
// Protocol (the plan's tables, mkernel/ops/ring_attention_backward.py make_plan). Row tasks are
// compute-role tasks run by the engine's two consumer warpgroups (256 threads) between its tiles
// (BwdTasks::run_rows): a unit's prep first, the tails (home, dq, finish) after its last tile.
//   prep    (row task)     delta = rowsum(dO * O) - dlse and lse * log2 e, packed per (q chunk,
//                          head, 64-row q tile) into the `delta` workspace; +1 landed[0] (mine)
//   K/V     (comm)         the forward's sends: block of step s -> slot s + 1 of rank r + 1
//   compute (engine)       one K / V tile of the block held at step s against every q row of one
//                          q chunk (all q heads of its K/V head): waits landed[s] (and, a unit's
//                          first, landed[0]); dQ reduce-added (TMA, fp32) into dq_acc, dK and dV
//                          red.added (fp32) into dkv_acc slot s, or (DIRECT: nobody else adds to
//                          the block) stored in bf16 into dk, dv; a unit's last task of step s
//                          and tail group g: computed[s, g] += the unit's tasks of them
//   grad    (comm)         waits computed[s, *], dlanded[s, 0] (s > 0): slot s's rows
//                          reduce-added (TMA bulk .add.f32) into slot s + 1 of rank r + 1;
//                          zeroed; +1 dlanded[s + 1, 0] there
//   The tails, row tasks on a part (rows of one b, a range of K/V heads) of one tail group g:
//   home    (row task)     the block's last holder: waits computed[s, g], dlanded[s, 0]: slot
//                          s's part (the block's sum) -> bf16 -> the owner's dkv_home; zeroed;
//                          +1 its dlanded[0, g]
//   dq      (row task)     waits computed[*, g]: dq part = bf16(dq_acc part); zeroed
//   finish  (row task)     waits dlanded[0, g]: dk, dv part = dkv_home part
//
//   W = 3, contiguous, causal (Bp = the K/V block of rank p; g = its fp32 dK|dV partial)
//   step:     0                         1                           2
//   rank 0:   B0 tiles; g -> r1 slot 1  -                           finish: dlanded[0, *]
//   rank 1:   B1 tiles; g -> r2 slot 1  B0 tiles (+in); g -> r2 s2   finish: dlanded[0, *]
//   rank 2:   B2 tiles (dk, dv by the   B1 tiles (+in); home -> r1  B0 tiles (+in); home -> r0
//             engine: DIRECT)
//
// Maps: a rank's rows are C chunks of Sc = S / C rows (C = 2 for causal zigzag at W > 1), viewed
// as [B * C, Sc, H, D], so a q or K / V tile never crosses a chunk (TMA zero-fills rows past it).
#include "kernels/attention_launch.cuh"
#include "kernels/fused_host.cuh"
#include "primitives/attention/bwd_engine.cuh"
#include "primitives/attention/tensor_map_nd.h"
#include "kernels/ring_kv.cuh"
#include "primitives/bulk_ring.cuh"

namespace mk {

namespace rab = spec::ring_attention_backward;
constexpr int kBwdStepMask = (1 << (rab::kTagKey - 3)) - 1;

// A compute task as the plan encodes its tile (make_plan): K / V rows [m0, m0 + rows) of chunk
// ck at map coordinate kv_outer, against the q chunk cq; key = ((b * Hkv + hk) * C + cq) * C + ck.
// direct: dK, dV stored in bf16 into dk, dv (nobody else adds to them). aux: a row task of the
// consumer warpgroups instead (key = kPrep: delta tiles [m0, m0 + rows); kHome, kDq, kFinish: a
// tail part, rows [m0, m0 + rows) of the rank's B * S, K/V heads [kv_outer, kv_outer + cols)).
struct RingBwdTask {
  int m0, rows, kv_outer, cols, step, key;
  bool diag, aux, direct;
};

template <int D>
struct RingAttentionBwd;

// The engine's params and what a task needs beyond them: the chunks, the sequence, the rank's
// dK | dV slots (dkv_acc, [W * B * S, 2 * Hkv * D] fp32).
struct RingBwdParams {
  attn::AttnBwdParams e;
  int chunks, seq;
  float* dkv_acc;
};

// The producer warpgroup's registers: besides the TMA thread it runs the plan's waits (thread 0)
// and the intra_sm comm tasks (warp 1), which spill at the plain backward's 24. Kept at 24: 40
// and 56 ran slower (benchmarks/results/ring_bwd_regs_2026-12-07.txt); a knob for that A/B
// (tools/ab_ring_bwd.sh REGS).
#ifndef MK_RING_BWD_PRODUCER_REGS
#define MK_RING_BWD_PRODUCER_REGS 24
#endif
inline constexpr int kRingBwdProducerRegs = MK_RING_BWD_PRODUCER_REGS;

// A unit's compute tasks as the backward engine's work items (bwd_engine.cuh run_cta's source).
template <class Hooks, int D>
struct BwdTasks {
  const RingBwdParams& p;
  Hooks& hooks;
  int i = -1;

  // The next K / V tile task. Row tasks before it are run here by the consumer warpgroups
  // (run_rows) and skipped by the producer.
  __device__ bool next(attn::BwdWork& w) {
    const int n = hooks.num_tasks();
    RingBwdTask t;
    for (;;) {
      if (++i >= n) return false;
      t = hooks.task(i);
      if (!t.aux) break;
      if (threadIdx.x >= 128) run_rows(t);
    }
    const int C = p.chunks, Hkv = p.e.Hkv;
    const int ck = t.key % C, cq = (t.key / C) % C, bh = t.key / (C * C);
    const int b = bh / Hkv, hk = bh - b * Hkv;
    w.b = b * C + cq;
    w.hk = hk;
    w.kv_tile = 0;  // unused: kv_row0 says where the tile is
    w.kv_row0 = t.m0;
    w.kv_outer = t.kv_outer;
    w.q_begin = t.diag ? t.m0 / Cfg::BQ : 0;
    w.causal = t.diag;
    w.ring = t.step > 0;
    w.store = attn::kKvReduceAddF32;
    const long long kc = (long long)Hkv * D;
    const long long row = ((long long)t.step * p.e.B + b) * p.seq + (long long)ck * p.e.S_kv + t.m0;
    if (t.direct) {  // the block's rows on this rank, ck = 0 (one chunk): row b S + m0 of dk, dv
      const long long at = ((long long)b * p.seq + t.m0) * kc + (long long)hk * D;
      const int lr = hooks.cta.local_rank;
      w.store = attn::kKvStoreBf16;
      w.dk = hooks.a.layout.dk.at(lr) + at;
      w.dv = hooks.a.layout.dv.at(lr) + at;
      w.ld = kc;
      return true;
    }
    float* acc = p.dkv_acc + row * 2 * kc + (long long)hk * D;
    w.dk = acc;
    w.dv = acc + kc;
    w.ld = 2 * kc;
    return true;
  }

  // A row task (prep, dq or finish) by the 256 consumer threads, as the template runs a comm task:
  // one thread's waits, the team's data movement, its writes fenced, one thread's raises.
  __device__ void run_rows(const RingBwdTask& t) {
    const int ct = (int)threadIdx.x - 128;
    if (ct == 0) hooks.before_load(i);
    asm volatile("bar.sync 4, 256;" ::: "memory");  // kBarEnd: both consumer warpgroups
    RingAttentionBwd<D>::rows_task(hooks.a, hooks.cta, t, Team{ct, 256});
    __threadfence();
    asm volatile("bar.sync 4, 256;" ::: "memory");
    if (ct == 0) {
      __threadfence_system();
      hooks.after_store(i);
    }
  }
  __device__ void begin(const attn::BwdWork&) { hooks.before_load(i); }  // producer: its waits

  // Every consumer thread, after the item's dQ reduce-adds landed and its dK, dV red.adds: both
  // warpgroups' writes fenced, then one thread raises (computed[step]). Only a unit's last task of
  // a step raises (make_plan); the others need no fence: each thread's fence at that task orders
  // its earlier tasks' writes too (program order), and nothing else waits at this barrier (the
  // row tasks and the next item synchronise by their own barriers).
  __device__ void end(const attn::BwdWork&) {
    if (!hooks.raises(i)) {
      if (threadIdx.x == 128) hooks.stamp(i, 1);
      return;
    }
    __threadfence();
    asm volatile("bar.sync 4, 256;" ::: "memory");  // kBarEnd: both consumer warpgroups
    if (threadIdx.x == 128) {
      __threadfence_system();
      hooks.after_store(i);
    }
  }

 private:
  using Cfg = attn::AttnBwdConfig<D, 0, true, kRingBwdProducerRegs>;
};

// The backward engine behind the template's engine contract (templates/engine_contract.cuh).
template <int D>
struct RingBwdEngine {
  using Cfg = attn::AttnBwdConfig<D, 0, true, kRingBwdProducerRegs>;
  using Core = attn::AttnBwdEngine<Cfg>;
  using Params = RingBwdParams;
  using Task = RingBwdTask;
  struct Dest {};  // a task's rows follow from its tile (no per-task destination)
  static constexpr int kThreads = Core::kThreads;
  static constexpr int kSmemBytes = Core::kSmemBytes;
  static constexpr int kSpareWarp = 1;  // warp 1 of the producer warpgroup
  static_assert(Core::kBarEnd == 4, "BwdTasks::end uses named barrier 4");
  template <class T>
  __device__ static Task task_of(const T& tile) {
    const int tag = tile.tag;
    return Task{tile.m0,
                tile.rows,
                tile.n0,
                tile.cols,
                (tag >> 3) & kBwdStepMask,
                tag >> rab::kTagKey,
                (tag & 1) != 0,
                (tag & rab::kAux) != 0,
                (tag & rab::kDirect) != 0};
  }
  template <class Hooks, class Spare>
  __device__ static void run_cta(const Params& p, char* smem, Hooks& hooks, Spare&& spare) {
    BwdTasks<Hooks, D> work{p, hooks};
    Core::run_cta(p.e, smem, work, spare);
  }
};

template <int D>
struct RingAttentionBwd : CommRings<UnitRing<6, 3, 16384>, UnitRing<3, 2, 8192>> {
  // NOTE: no kComputePerUnit (unlike the forward): with the trait the fused backward ran 6-8%
  // slower (W = 1 full 6.51-6.61 ms against 6.10-6.13 without it, 5.93-6.10 on 36dec36, before
  // the trait; one H100, benchmarks/results/ring_bwd_ab_2026-12-07.txt). The runtime rule
  // (unit_tasks) reads its plans' unit_span the same.
  using Engine = RingBwdEngine<D>;
  using Layout = rab::Layout;
  using Args = FusedArgs<RingAttentionBwd>;
  // The comm unit's TMA ring (K / V sends, grad reduce-adds), as the forward's: inter_sm in the
  // engine's shared memory (a comm CTA runs no engine), intra_sm after the engine's.
  static_assert(Engine::kSmemBytes + kCommSmemBytes <= 227 * 1024, "fits an sm_90 CTA");
  static_assert(InterRing::kSmemBytes <= Engine::kSmemBytes, "a comm CTA's ring fits");
  // The row tasks' loads land in the consumers' dQ staging tiles (32 KB, idle between items:
  // the item's last dQ reduce-add has read them, run_rows' first barrier orders that) by 16-byte
  // cp.async copies, which hold no register in flight: loads into registers were spilled one at
  // a time (the consumers keep most of their 240 registers live across the item loop), about
  // one load in flight per lane. A lane's slots: 16 bytes each, 256 lanes a slot.
  using StageMap = typename Engine::Core::Map;
  static constexpr int kStageLanes = 256;                               // the row tasks' team
  static constexpr int kStageBytes = 2 * StageMap::kDQBytesPerWG;       // both warpgroups' tiles
  static constexpr int kQuadsAhead = kStageBytes / (16 * kStageLanes);  // a lane's copies in flight
  static constexpr int kRowsAhead = kQuadsAhead / (2 * D / 64);  // prep: V uint4 of dO and of O
  static_assert(kQuadsAhead >= 4, "staging for a few copies a lane (D = 64: 16 KB, 128: 32 KB)");
  static_assert(kRowsAhead >= 1, "a prep row's dO and O fit a lane's slots");

  // Slot k of this lane (k < kQuadsAhead) in the staging tiles.
  static __device__ __forceinline__ uint32_t slot(const Team& team, int k) {
    extern __shared__ __align__(1024) char smem[];  // the kernel's dynamic shared memory
    return smem_u32(smem + StageMap::kDQOffset) + (k * kStageLanes + team.lane) * 16;
  }

  static __device__ typename Engine::Dest dest(const Args&, const CtaInfo&, const Tile&) {
    return {};
  }

  __device__ static int chunks(const Layout& l, int W) {
    return l.zigzag && l.causal && W > 1 ? 2 : 1;  // ring_attention.py num_chunks
  }

  // Task (s, kind, row0, rows): see the file's protocol; bulk copies by lane 0 (the template
  // waits for them to land before the raises), the rest by the whole team.
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    if (args[1] < rab::kGrad) {
      send_kv_rows<RingAttentionBwd>(a, cta, args, team, smem);  // kernels/ring_kv.cuh
    } else {  // kGrad
      send_grad(a, cta, args, team, smem);
    }
  }

  // A row task of the compute role (BwdTasks::run_rows: the consumer warpgroups, their staging
  // tiles as shared memory): the prep's delta tiles, or a tail part (home: of the block held at
  // step s).
  static __device__ void rows_task(const Args& a, const CtaInfo& cta, const RingBwdTask& t,
                                   const Team& team) {
    if (t.key == rab::kPrep) {
      prep(a, cta, t.m0, t.rows, team);
    } else if (t.key == rab::kDq) {
      store_dq(a, cta, t, team);
    } else if (t.key == rab::kHome) {
      home(a, cta, t, team);
    } else {  // kFinish
      finish(a, cta, t, team);
    }
  }

  // Rows [row0, row0 + n) of slot s: reduce-added into slot s + 1 of rank r + 1 (GRAD) by lane
  // 0's TMA ring, then zeroed by the team (every bulk load of them has completed when copy()
  // returns).
  static __device__ void send_grad(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    const Layout& l = a.layout;
    const int s = args[0], W = a.common.world_size;
    const long long cols = 2LL * l.kv_heads * l.head_dim, block = (long long)l.batch * l.seq;
    float* src = l.dkv_acc.map(cta.rank) + (s * block + args[2]) * cols;
    const long long n = (long long)args[3] * cols;
    if (team.lane == 0) {
      float* dst = l.dkv_acc.map((cta.rank + 1) % W) + ((s + 1) * block + args[2]) * cols;
      with_ring(a, smem, [&](const auto& ring) {
        ring.copy(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), n * 4,
                  Drain::kReduceAddF32);
      });
    }
    team.sync();
    zero(src, n, team);
  }

  static __device__ void zero(float* p, long long n, const Team& team) {
    float4* q = reinterpret_cast<float4*>(p);
    for (long long e = team.lane; e < n / 4; e += team.size) q[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  // 64-row tiles [first, first + n) of `delta` (tile t: rows of (q chunk, head) pair t / qt): per
  // row, lse * log2 e and delta (+inf, 0 past the chunk: those rows see nothing). G = 8 lanes a
  // row (D / 8 columns each, summed by shuffles), kRowsAhead rows a lane group in flight.
  static __device__ void prep(const Args& a, const CtaInfo& cta, int first, int n,
                              const Team& team) {
    constexpr int G = 8, V = D / 64, U = kRowsAhead;  // V: uint4 of dO (and of O) per lane
    const Layout& l = a.layout;
    const int lr = cta.local_rank, H = l.heads, S = l.seq;
    const int C = chunks(l, a.common.world_size), Sc = S / C;
    constexpr int T = rab::kRowTile;
    const int qt = (Sc + T - 1) / T;
    const __nv_bfloat16* dout = l.dout.at(lr);
    const __nv_bfloat16* out = l.out.at(lr);
    const float* lse = l.lse.at(lr);
    const float* dlse = l.dlse.at(lr);
    float* packed = l.delta.map(cta.rank);
    const int sub = team.lane % G, groups = team.size / G;
    if (team.size != kStageLanes) __trap();  // the slots are laid out for the consumer team
    const int total = n * T;  // rows; every lane of a warp runs the same trips (shuffles)
    for (int e0 = team.lane / G; e0 - team.lane / G < total; e0 += U * groups) {
      int t[U], j[U];
      float lv[U], dl[U];  // lane sub == 0: the row's lse and dlse
      bool live[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int e = e0 + u * groups;
        t[u] = first + e / T;
        j[u] = e % T;
        const int pair = t[u] / qt, i = (t[u] - pair * qt) * T + j[u];
        live[u] = e < total && i < Sc;
        const int outer = pair / H, h = pair - outer * H, b = outer / C, cq = outer - b * C;
        const long long row = ((long long)b * S + (long long)cq * Sc + i) * H + h;  // of dO, O
        if (live[u]) {
          const uint4* px = reinterpret_cast<const uint4*>(dout + row * D) + sub * V;
          const uint4* py = reinterpret_cast<const uint4*>(out + row * D) + sub * V;
#pragma unroll
          for (int c = 0; c < V; ++c) {
            gemm::cp_async_16(slot(team, 2 * (u * V + c)), px + c, 16);
            gemm::cp_async_16(slot(team, 2 * (u * V + c) + 1), py + c, 16);
          }
          if (sub == 0) {
            const long long at = ((long long)b * H + h) * S + (long long)cq * Sc + i;  // [B, H, S]
            lv[u] = lse[at];
            dl[u] = dlse[at];
          }
        }
      }
      gemm::cp_async_wait_all();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float acc = 0.f;
        if (live[u]) {
#pragma unroll
          for (int c = 0; c < V; ++c) {
            const uint4 x = gemm::lds_16(slot(team, 2 * (u * V + c)));
            const uint4 y = gemm::lds_16(slot(team, 2 * (u * V + c) + 1));
            const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&x);
            const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float2 f = __bfloat1622float2(u2[k]), g = __bfloat1622float2(v2[k]);
              acc = fmaf(f.x, g.x, fmaf(f.y, g.y, acc));
            }
          }
        }
#pragma unroll
        for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        const int e = e0 + u * groups;
        if (sub != 0 || e >= total) continue;
        float* tile = packed + (long long)t[u] * 2 * T;
        if (!live[u]) {  // past the chunk
          tile[j[u]] = INFINITY;
          tile[T + j[u]] = 0.f;
          continue;
        }
        tile[j[u]] = attn::lse2_of(lv[u]);  // +inf for -inf, NaN for +inf (issue 33)
        tile[T + j[u]] = acc - dl[u];
      }
    }
  }

  // A dq part: its rows of dq_acc, the q heads of its K/V heads (one run of columns a row): dq =
  // bf16, the accumulator back to zero.
  static __device__ void store_dq(const Args& a, const CtaInfo& cta, const RingBwdTask& t,
                                  const Team& team) {
    const Layout& l = a.layout;
    const int group = l.heads / l.kv_heads, ld = l.heads * D / 4;  // quads a row
    const int run = t.cols * group * D / 4, c0 = t.kv_outer * group * D / 4;
    const long long at = (long long)t.m0 * ld + c0;
    float4* acc = reinterpret_cast<float4*>(l.dq_acc.map(cta.rank)) + at;
    uint2* dst = reinterpret_cast<uint2*>(l.dq.at(cta.local_rank)) + at;
    drain_bf16(t.rows, run, team, acc, dst, [=](int r, int c) { return (long long)r * ld + c; });
  }

  // A home part: its rows and K/V heads of slot s (the block's sum: mine and the previous
  // holders' partials), dK and dV runs of each row: bf16 into the owner's dkv_home, the slot back
  // to zero.
  static __device__ void home(const Args& a, const CtaInfo& cta, const RingBwdTask& t,
                              const Team& team) {
    const Layout& l = a.layout;
    const int W = a.common.world_size, owner = ((cta.rank - t.step) % W + W) % W;
    const int half = l.kv_heads * D / 4, ld = 2 * half;  // quads: dK of a row, dK | dV row
    const int run = t.cols * D / 4, c0 = t.kv_outer * D / 4;
    const long long row0 = (long long)t.step * l.batch * l.seq + t.m0;
    float4* acc = reinterpret_cast<float4*>(l.dkv_acc.map(cta.rank)) + row0 * ld + c0;
    uint2* dst = reinterpret_cast<uint2*>(l.dkv_home.map(owner)) + (long long)t.m0 * ld + c0;
    // element (r, c) of the part: c < run in dK, else dV (column half + c - run)
    auto at = [=](int r, int c) { return (long long)r * ld + (c < run ? c : half + c - run); };
    drain_bf16(t.rows, 2 * run, team, acc, dst, at);
  }

  // The fp32 accumulator's elements at(r, c) of a rows x row_elems rectangle (4 floats each) into
  // bf16 at dst's same elements, the accumulator back to zero (a dq part, a home part).
  template <class At>
  static __device__ __forceinline__ void drain_bf16(int rows, int row_elems, const Team& team,
                                                    float4* acc, uint2* dst, At&& at) {
    for_rect(
        rows, row_elems, team, [&](int r, int c) { return acc + at(r, c); },
        [&](int r, int c, const float4& x) {
          const long long e = at(r, c);
          acc[e] = make_float4(0.f, 0.f, 0.f, 0.f);
          dst[e] = make_uint2(attn::pack_bf16(x.x, x.y), attn::pack_bf16(x.z, x.w));
        });
  }

  // A finish part: its rows and K/V heads of my block's sum (dkv_home, bf16 dK | dV): dk, dv.
  static __device__ void finish(const Args& a, const CtaInfo& cta, const RingBwdTask& t,
                                const Team& team) {
    const Layout& l = a.layout;
    const int kc = l.kv_heads * D / 8;  // 16-byte elements (8 bf16) of dK in a row
    const int run = t.cols * D / 8, c0 = t.kv_outer * D / 8;
    const uint4* src =
        reinterpret_cast<const uint4*>(l.dkv_home.map(cta.rank)) + (long long)t.m0 * 2 * kc + c0;
    uint4* dk = reinterpret_cast<uint4*>(l.dk.at(cta.local_rank)) + (long long)t.m0 * kc + c0;
    uint4* dv = reinterpret_cast<uint4*>(l.dv.at(cta.local_rank)) + (long long)t.m0 * kc + c0;
    for_rect(
        t.rows, 2 * run, team,
        [&](int r, int c) { return src + (long long)r * 2 * kc + (c < run ? c : kc + c - run); },
        [&](int r, int c, const uint4& x) {
          const long long row = (long long)r * kc;
          if (c < run) {
            dk[row + c] = x;
          } else {
            dv[row + c - run] = x;
          }
        });
  }

  // f(r, c, *src(r, c)) for every 16-byte element (r, c) of a rows x row_elems rectangle (r <
  // rows, c < row_elems), the team's share (the 256 consumer threads, element r * row_elems + c
  // to lane (r * row_elems + c) % 256), kQuadsAhead copies a lane in flight into its staging slots
  // before any use. A lane steps its (r, c) by the team's size: two divisions a part, none an
  // element (a division per element made these loops instruction-bound).
  template <class Src, class F>
  static __device__ __forceinline__ void for_rect(int rows, int row_elems, const Team& team,
                                                  Src&& src, F&& f) {
    constexpr int U = kQuadsAhead;
    if (team.size != kStageLanes) __trap();  // the slots are laid out for the consumer team
    const int dr = kStageLanes / row_elems, dc = kStageLanes % row_elems;
    auto step = [&](int& r, int& c) {
      r += dr;
      c += dc;
      if (c >= row_elems) {
        c -= row_elems;
        ++r;
      }
    };
    int r0 = team.lane / row_elems, c0 = team.lane % row_elems;
    while (r0 < rows) {
      int r = r0, c = c0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r < rows) gemm::cp_async_16(slot(team, u), src(r, c), 16);
        step(r, c);
      }
      gemm::cp_async_wait_all();
      r = r0;
      c = c0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r < rows) {
          const uint4 x = gemm::lds_16(slot(team, u));
          using T = std::remove_cv_t<std::remove_pointer_t<decltype(src(0, 0))>>;
          static_assert(sizeof(T) == 16, "16-byte elements");
          f(r, c, *reinterpret_cast<const T*>(&x));
        }
        step(r, c);
      }
      r0 = r;
      c0 = c;
    }
  }

  // Host: every served rank's maps over [B * C, Sc, H, D] views, and the engine's scalars.
  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int W = args.common.world_size, here = args.common.ranks_here;
    const int C = l.zigzag && l.causal && W > 1 ? 2 : 1;  // ring_attention.py num_chunks
    const int Sc = l.seq / C, BC = l.batch * C;
    const int qt = (Sc + rab::kRowTile - 1) / rab::kRowTile;
    const long long ring_elems = (long long)(W > 1 ? W - 1 : 1) * l.batch * l.seq * l.kv_heads *
                                 l.head_dim;  // one rank's k_ring (the plan's ring_rows)
    const long long delta_elems = (long long)BC * l.heads * qt * 2 * rab::kRowTile;
    const long long dq_elems = (long long)l.batch * l.seq * l.heads * l.head_dim;
    const long long acc_elems = (long long)W * l.batch * l.seq * 2 * l.kv_heads * l.head_dim;
    float scale;
    memcpy(&scale, &l.scale_bits, sizeof(scale));
    using host::kTensorMapOk;
    using host::make_tensor_map_bf16_bshd;
    using Cfg = typename Engine::Cfg;
    for (int r = 0; r < here; ++r) {
      RingBwdParams& rp = args.engine[r];
      attn::AttnBwdParams& p = rp.e;
      auto map = [&](CUtensorMap* m, const void* ptr, int outer, int heads, int box) {
        return make_tensor_map_bf16_bshd(m, ptr, outer, Sc, heads, D, box, 64) == kTensorMapOk;
      };
      if (!map(&p.q, l.q.base + r * l.q.rank_stride, BC, l.heads, Cfg::BQ) ||
          !map(&p.dout, l.dout.base + r * l.dout.rank_stride, BC, l.heads, Cfg::BQ) ||
          !map(&p.k, l.k.base + r * l.k.rank_stride, BC, l.kv_heads, Cfg::BKV) ||
          !map(&p.v, l.v.base + r * l.v.rank_stride, BC, l.kv_heads, Cfg::BKV))
        return false;
      if (W > 1 &&
          (!map(&p.k_ring, l.k_ring_local + r * ring_elems, (W - 1) * BC, l.kv_heads, Cfg::BKV) ||
           !map(&p.v_ring, l.v_ring_local + r * ring_elems, (W - 1) * BC, l.kv_heads, Cfg::BKV)))
        return false;
      if (host::make_tensor_map_f32_bshd(&p.dq, l.dq_acc_local + r * dq_elems, BC, Sc, l.heads, D,
                                         Cfg::BQ) != kTensorMapOk)
        return false;
      p.lse = l.lse.base + r * l.lse.rank_stride;  // unused: the packed rows (TMA_ROWS)
      p.delta = nullptr;
      p.rows = l.delta_local + r * delta_elems;
      p.dk = p.dv = nullptr;  // the items' own destinations (BwdTasks::next)
      attn::set_sizes(p, l.batch, Sc, Sc, l.heads, l.kv_heads, scale, l.causal);
      p.scale = scale;
      p.kv_f32 = 1;
      p.kv_accumulate = 0;
      p.q_tiles = qt;
      p.kv_tiles = (Sc + Cfg::BKV - 1) / Cfg::BKV;
      rp.chunks = C;
      rp.seq = l.seq;
      rp.dkv_acc = l.dkv_acc_local + r * acc_elems;
    }
    args.out_mapped = false;
    return true;
  }
};

int launch_ring_attention_backward(const long long* rec, cudaStream_t s) {
  const auto l = rab::Layout::from(rec);
  switch (l.head_dim) {
    case 64: return launch_persistent<RingAttentionBwd<64>>(rec, s);
    case 128: return launch_persistent<RingAttentionBwd<128>>(rec, s);
    default: return kBadConfig;
  }
}

}  // namespace mk
