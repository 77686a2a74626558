// Ring attention, forward: the attention engine (primitives/attention/engine.cuh) on the persistent
// template, with each rank's K / V block travelling the ring by bulk copies while it is consumed.
//
// Protocol (the plan's tables, mkernel/ops/ring_attention.py): at step s rank r holds the block of
// rank (r - s) mod W: its own k / v at step 0, else slot s of its k_ring / v_ring (W - 1 slots,
// each filled once per call, so no send waits for a reader). Comm task (s, part, row0, rows)
// copies rows [row0, row0 + rows) of K and V from the block it holds at step s into slot s + 1 of
// rank r + 1; the template then adds 1 to landed[s + 1] there (parts adds make the block whole).
// A compute task is one (q tile, K / V chunk of one step); a unit runs a q tile's tasks back to
// back while their blocks should have landed (the plan's chain_order), else turns to another
// tile, the left tile's online-softmax state in the `state` workspace until it resumes (fp32:
// unnormalised O, max, sum); out and lse stored by its last.
//
//   W = 3, contiguous, causal (Bp = the K/V block of rank p; comm parts not shown)
//   step:     0                        1                          2
//   rank 0:   q.B0; B0 -> r1 slot 1    -                          -
//   rank 1:   q.B1; B1 -> r2 slot 1    wait landed[1]: q.B0;      -
//                                      B0 -> r2 slot 2
//   rank 2:   q.B2                     wait landed[1]: q.B1       wait landed[2]: q.B0
//
// Maps: a rank's rows are C chunks of Sc = S / C rows (C = 2 for causal zigzag, else 1), so every
// map views its tensor as [B * C, Sc, H, D]: a q tile or K / V tile never crosses a chunk (TMA
// zero-fills rows past it and drops stores past it).
#include "kernels/attention_launch.cuh"
#include "kernels/fused_host.cuh"
#include "primitives/attention/engine.cuh"
#include "primitives/attention/tensor_map_nd.h"
#include "kernels/ring_kv.cuh"
#include "primitives/bulk_ring.cuh"

namespace mk {

// A compute task as the plan encodes its tile (mkernel/ops/ring_attention.py pack_tag / TAG_KEY).
struct RingTask {
  int m0, rows;          // first q row within the q chunk; q rows
  int kv_outer, kv_len;  // K / V map batch coordinate; rows of the K / V chunk
  int step, key;         // ring step; (b * Hq + h) * C + q chunk
  bool diag, first, last;
};
// The tag's fields (mkernel/ops/ring_attention.py pack_tag): diag, first, last in bits 0..2, the
// step up to kTagKey, the q tile's key above.
constexpr int kTagKey = spec::ring_attention::kTagKey;
constexpr int kStepMask = (1 << (kTagKey - 3)) - 1;

// A unit's work, in the plan's order: a work item is a run of one q tile's tasks next to each
// other on the unit (of one step or several: the producer runs each task's landed wait before
// its first K / V load), its kv tiles those of each task in turn. An
// item that does not begin its tile resumes the tile's online-softmax state from the `state`
// workspace; one that does not end it stores it there (the same consumer threads reload it: the
// plan keeps a q tile on one unit); the tile's last item stores out and lse.
template <class Hooks>
struct TaskWork {
  const attn::AttnParams& p;
  Hooks& hooks;
  int i0 = 0, i1 = -1;  // the current item's tasks

  __device__ static int tiles_of(const RingTask& t) {
    const int end = t.diag ? min(t.kv_len, t.m0 + attn::kTileRows) : t.kv_len;
    return (end + attn::kTileRows - 1) / attn::kTileRows;
  }

  __device__ bool next(attn::WorkTile& w) {
    const int n = hooks.num_tasks();
    int i = i1 + 1;
    if (i >= n) return false;
    RingTask t = hooks.task(i);
    i0 = i;
    const int C = p.chunks;
    const int bh = t.key / C, cq = t.key - bh * C;
    w.b = bh / p.Hq;
    w.h = bh - w.b * p.Hq;
    w.hk = w.h / p.group;
    w.m_tile = t.m0 / attn::kTileRows;
    w.outer = w.b * C + cq;
    w.lse_off = (long long)bh * p.S_q * C + (long long)cq * p.S_q;
    w.n_tiles = tiles_of(t);
    w.load_state = !t.first;
    const int key = t.key, m0 = t.m0;
    while (!t.last && i + 1 < n) {  // the tile's next task, if next on the unit, joins the item
      const RingTask u = hooks.task(i + 1);
      if (u.key != key || u.m0 != m0) break;
      t = u;
      ++i;
      w.n_tiles += tiles_of(t);
    }
    i1 = i;
    w.store_state = !t.last;
    return true;
  }
  __device__ bool last_item() const { return false; }  // ping-pong only (not used here)
  __device__ void begin(const attn::WorkTile&) { hooks.before_load(i0); }  // producer

  // Every consumer thread, after the item's stores: they have landed, then its tasks'
  // after_store (one thread), when anyone waits for them or a timeline is recorded.
  __device__ void end(const attn::WorkTile&) {
    if (!hooks.signals()) return;
    __threadfence();                              // this thread's lse / state stores
    if (threadIdx.x % 128 == 0) bulk_wait_all();  // its warpgroup's O stores
    __syncwarp();
    asm volatile("bar.sync 5, 256;" ::: "memory");  // both consumer warpgroups (barrier 5)
    if (threadIdx.x == 128) {
      __threadfence_system();
      for (int i = i0; i <= i1; ++i) hooks.after_store(i);
    }
  }

  // The item's kv tiles: each task's chunk in turn, its tiles in descending order (a masked one
  // first). Entering a task, the producer's K cursor runs the task's waits. Self-contained (no
  // reference to the work source, whose address would put it in local memory) and holding only
  // what a tile needs: a task read per tile put a global load in the consumers' loop.
  struct Cursor {
    const attn::AttnParams* p;
    Hooks* hooks;
    int i, last, tiles, j;
    int kv_outer, kv_len, diag_m0, step;  // the current task's (diag_m0 < 0: no diagonal)
    __device__ void enter(int task) {
      const RingTask t = hooks->task(task);
      i = task;
      tiles = tiles_of(t);
      j = 0;
      kv_outer = t.kv_outer;
      kv_len = t.kv_len;
      diag_m0 = t.diag ? t.m0 : -1;
      step = t.step;
    }
    __device__ attn::KvTile tile() const {
      const int n0 = (tiles - 1 - j) * attn::kTileRows;
      const bool ring = step > 0;
      return attn::KvTile{ring ? &p->k_ring : &p->k,
                          ring ? &p->v_ring : &p->v,
                          kv_outer,
                          n0,
                          kv_len - n0,
                          diag_m0 >= 0 && n0 + attn::kTileRows - 1 > diag_m0};
    }
    __device__ void advance(bool waits) {
      if (++j < tiles || i >= last) return;
      enter(i + 1);
      if (waits) hooks->before_load(i);
    }
  };
  __device__ Cursor cursor(const attn::WorkTile&) const {
    Cursor c{&p, &hooks, i0, i1};
    c.enter(i0);
    return c;
  }
};

// The attention engine behind the template's engine contract (templates/engine_contract.cuh).
template <int D>
struct RingAttnEngine {
  using Cfg = attn::AttnConfig<D, true, false>;  // intra-warpgroup overlap, no ping-pong
  using Core = attn::AttnEngine<Cfg>;
  using Params = attn::AttnParams;
  using Task = RingTask;
  struct Dest {};  // a q tile's out and lse rows follow from its tasks (no per-task destination)
  static constexpr int kThreads = Core::kThreads;
  static constexpr int kSmemBytes = Core::kSmemBytes;
  static constexpr int kSpareWarp = 1;  // warp 1 of the producer warpgroup
  template <class T>
  __device__ static Task task_of(const T& tile) {
    const int tag = tile.tag;
    return Task{
        tile.m0,        tile.rows,      tile.n0,        tile.cols,     (tag >> 3) & kStepMask,
        tag >> kTagKey, (tag & 1) != 0, (tag & 2) != 0, (tag & 4) != 0};
  }
  template <class Hooks, class Spare>
  __device__ static void run_cta(const Params& p, char* smem, Hooks& hooks, Spare&& spare) {
    TaskWork<Hooks> work{p, hooks};
    Core::run_cta(p, smem, work, spare);
  }
};

template <int D>
struct RingAttention : CommRings<UnitRing<8, 4, 16384>, UnitRing<4, 2, 8192>> {
  static constexpr bool kComputePerUnit = true;  // its plans give each unit its q tiles' chains
  using Engine = RingAttnEngine<D>;
  using Layout = spec::ring_attention::Layout;
  using Args = FusedArgs<RingAttention>;
  // The comm unit's TMA ring (primitives/bulk_ring.cuh UnitRing: initialised once per unit by
  // the template's comm_begin and kept across its tasks). inter_sm: 8 pieces of 16 KB in the
  // engine's shared memory (a comm CTA runs no engine); intra_sm: 4 of 8 KB after the engine's
  // (what is left beside it at D = 128), two stores in flight.
  static_assert(Engine::kSmemBytes + kCommSmemBytes <= 227 * 1024, "fits an sm_90 CTA");
  static_assert(InterRing::kSmemBytes <= Engine::kSmemBytes, "a comm CTA's ring fits");

  static __device__ typename Engine::Dest dest(const Args&, const CtaInfo&, const Tile&) {
    return {};
  }

  // Task (s, part, row0, rows): the K / V send (kernels/ring_kv.cuh).
  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char* smem) {
    send_kv_rows<RingAttention>(a, cta, args, team, smem);
  }

  // Host: every served rank's maps over [B * C, Sc, H, D] views, and the engine's scalars.
  static bool prepare(const long long*, Args& args) {
    const Layout& l = args.layout;
    const int W = args.common.world_size, here = args.common.ranks_here;
    const int C = l.zigzag && l.causal && W > 1 ? 2 : 1;  // ring_attention.py num_chunks
    const int Sc = l.seq / C, BC = l.batch * C;
    const long long ring_elems = (long long)(W > 1 ? W - 1 : 1) * l.batch * l.seq * l.kv_heads *
                                 l.head_dim;  // one rank's k_ring (the plan's ring_rows)
    const long long state_elems = (long long)l.batch * l.heads * l.seq * (l.head_dim + 2);
    float scale;
    memcpy(&scale, &l.scale_bits, sizeof(scale));
    using host::kTensorMapOk;
    using host::make_tensor_map_bf16_bshd;
    constexpr int BM = Engine::Core::BM, BN = Engine::Core::BN;
    for (int r = 0; r < here; ++r) {
      attn::AttnParams& p = args.engine[r];
      auto map = [&](CUtensorMap* m, const void* ptr, int outer, int heads, int box) {
        return make_tensor_map_bf16_bshd(m, ptr, outer, Sc, heads, D, box, 64) == kTensorMapOk;
      };
      if (!map(&p.q, l.q.base + r * l.q.rank_stride, BC, l.heads, BM) ||
          !map(&p.k, l.k.base + r * l.k.rank_stride, BC, l.kv_heads, BN) ||
          !map(&p.v, l.v.base + r * l.v.rank_stride, BC, l.kv_heads, BN) ||
          !map(&p.o, l.out.base + r * l.out.rank_stride, BC, l.heads, 64))
        return false;
      if (W > 1 &&
          (!map(&p.k_ring, l.k_ring_local + r * ring_elems, (W - 1) * BC, l.kv_heads, BN) ||
           !map(&p.v_ring, l.v_ring_local + r * ring_elems, (W - 1) * BC, l.kv_heads, BN)))
        return false;
      p.lse = l.lse.base + r * l.lse.rank_stride;
      p.o_f32 = nullptr;
      attn::set_sizes(p, l.batch, Sc, Sc, l.heads, l.kv_heads, scale, l.causal);
      p.m_tiles = (Sc + BM - 1) / BM;
      p.total = 0;  // unused: the plan's tasks are the work
      p.chunks = C;
      p.state = l.state_local == nullptr ? nullptr : l.state_local + r * state_elems;
    }
    args.out_mapped = false;
    return true;
  }
};

int launch_ring_attention(const long long* rec, cudaStream_t s) {
  const auto l = spec::ring_attention::Layout::from(rec);
  switch (l.head_dim) {
    case 64: return launch_persistent<RingAttention<64>>(rec, s);
    case 128: return launch_persistent<RingAttention<128>>(rec, s);
    default: return kBadConfig;
  }
}

}  // namespace mk
