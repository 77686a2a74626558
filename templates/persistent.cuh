// The persistent-kernel template: one launch, one CTA per SM, roles per CTA or per warp, and a task
// loop that executes the plan's tables (mkernel/protocol.py). For every task of a unit:
//
//   waits (one thread: acquire, reset per policy) -> the op's data movement -> its writes landed
//   (bulk wait, system fence) -> raises (one thread: release)
//
// Waits, resets, raises, injected faults, deadlines and the GPU timeline live here, once; an op only
// moves data. Its contract, checked at compile time (OpContract below):
//
//   struct Op {
//     using Engine = ...;                      // compute engine (templates/engine_contract.cuh)
//     using Layout = spec::<op>::Layout;       // named buffers and scalars (kernels/layouts_gen.h)
//     static constexpr int kCommSmemBytes;     // intra_sm comm smem, after the engine's
//     // compute data movement: where the engine's tile goes
//     static __device__ Engine::Dest dest(const FusedArgs<Op>&, const CtaInfo&, const Tile&);
//     // comm data movement of one task (args: the plan's task arguments), run by the whole team;
//     // bulk copies are issued by lane 0 (the template drains them before the raises)
//     static __device__ void comm_move(const FusedArgs<Op>&, const CtaInfo&, const int* args,
//                                      const Team&, char* smem);
//     static bool prepare(const long long* rec, FusedArgs<Op>&);  // host: engine params, maps
//     // optional, both or neither: lane 0 of a comm unit, before its first task / after its last
//     static __device__ void comm_begin(const FusedArgs<Op>&, char* smem);
//     static __device__ void comm_end(const FusedArgs<Op>&, char* smem);
//   };
//
// Layout of a CTA (Engine::kThreads threads):
//   inter_sm  CTA slot <  compute_units: compute CTA (the engine's warps)
//             CTA slot >= compute_units: comm CTA (every thread runs the comm loop as one team)
//   intra_sm  every CTA computes; the engine's spare warp (Engine::kSpareWarp) is the communicator
//             (a team of 32 threads).
// A CTA with no compute tasks skips the engine (its spare warp still communicates).
// Unit u of a role takes rows u, u + units, ... of its rank's tasks, or the rows the plan listed
// for it (PerUnit, mkernel/protocol.py: unit_span), in both backends.
// In an emulated world CTAs [r * ctas_per_rank, (r + 1) * ctas_per_rank) serve rank r; all ranks'
// CTAs are co-resident (grid <= #SMs), so ranks can spin on each other.
//
//   rank:    0            1                W-1
//   CTAs:  [c0 c1 .. cn][c0 c1 .. cn] ... [c0 c1 .. cn]      entry barrier pairs c_i across ranks
#pragma once
#include <cuda.h>

#include <type_traits>

#include "primitives/comm.cuh"
#include "primitives/gemm/engine.cuh"
#include "primitives/gemm/hooks.cuh"
#include "templates/engine_contract.cuh"
#include "templates/layout_phase.cuh"
#include "templates/no_compute.cuh"
#include "primitives/protocol_gen.h"
#include "primitives/rdma/put.cuh"
#ifdef MK_RDMA_NVSHMEM  // the nodes kernels as built into _mkernel_nvshmem (mkernel/nvshmem_ext.py)
#include "primitives/rdma/put_nvshmem.cuh"
#endif
#include "primitives/signal.cuh"
#include "primitives/sym.cuh"

namespace mk {

// One role's tables (int32; spans are (first, end) pairs). Not const: a device-filled role's
// tables are written by the layout phase (templates/layout_phase.cuh) before any CTA reads them.
struct RoleTables {
  int* task_span;   // [W, 2]: rank r's tasks are rows task_span[2r] .. task_span[2r + 1]
  int* args;        // [rows, kTaskArgs]
  int* wait_span;   // [rows, 2]
  int* waits;       // [*, kWaitFields]
  int* raise_span;  // [rows, 2]
  int* raises;      // [*, kRaiseFields]
  int* unit_span;   // [W * units, 2]: each unit's own rows (a plan given PerUnit), or nullptr
  int cap[3];       // per-rank capacity (rows, waits, raises) of a device-filled role, else 0
};

struct FusedCommon {
  RoleTables role[2];  // kRoleCompute, kRoleComm
  int* tiles;          // [T, 5]: m0, n0, rows, cols, tag (device-filled: the layout writes them)
  int compute_units, comm_units, ctas_per_rank, overlap;
  bool compute_signals;               // some compute task raises: the engine completes each tile
  int world_size, rank0, ranks_here;  // emulated: rank0 0, ranks_here W; distributed: own rank, 1
  WaitPolicy wait;
  int silent_rank, delay_rank;  // faults (tests): never raises / sleeps before its raises
  long long delay_ns;
  SymPtr<int> pads[kMaxPads];  // pad 0: the entry barrier [kMaxBarrierSlots, W]
  // GPU timeline (optional): globaltimer ns (start, end) of task i of a unit at
  // timeline + local_rank * stride[0] + slot * stride[1] + role * stride[2] + 2 * i (the host's
  // tensor decides the layout: its strides come in the launch record).
  long long* timeline;
  int timeline_cap;
  long long timeline_stride[3];
};

// A plan over several nodes (an op with kNodes, below): the `proxy` transport's rings that carry
// its raises across nodes (primitives/rdma/put.cuh); all zero for one node. Built with
// MK_RDMA_NVSHMEM (distributed worlds over nodes) the raises go by NVSHMEM instead: no rings.
struct RdmaArgs {
  void* rings;   // the rings of the ranks served, back to back (mapped host memory)
  int* reserve;  // their ticket counters (device memory)
  int capacity;  // descriptor slots per ring
  int ranks_per_node;
};

// Host: what an op over several nodes needs from the launch (its launch refuses it otherwise).
inline bool rdma_args_ok(const RdmaArgs& r, int world_size) {
#ifdef MK_RDMA_NVSHMEM
  const bool rings_ok = true;
#else
  const bool rings_ok = r.rings != nullptr && r.reserve != nullptr && r.capacity >= 1;
#endif
  return rings_ok && r.ranks_per_node >= 1 && world_size % r.ranks_per_node == 0 &&
         r.ranks_per_node < world_size;
}

template <class Op>
struct FusedArgs {  // the __grid_constant__ kernel parameter
  FusedCommon common;
  typename Op::Engine::Params engine[kMaxLocalRanks];  // per served rank
  typename Op::Layout layout;
  CUtensorMap out_map[kMaxLocalRanks];  // bf16 output per served rank (TMA stores), if mapped
  bool out_mapped;
  RdmaArgs rdma;  // NOTE: last, so the fields above keep their offsets in every op
};

struct CtaInfo {
  int rank, local_rank, slot;
};

struct Tile {
  int m0, n0, rows, cols, tag;
};

__device__ __forceinline__ Tile load_tile(const FusedCommon& c, int id) {
  const int* t = c.tiles + 5 * id;
  return Tile{t[0], t[1], t[2], t[3], t[4]};
}

// The rows of one unit: rows first + unit, first + unit + units, ... below end.
struct TaskList {
  int first, end, unit, units;
  __device__ int count() const {
    const int n = end - first;
    return unit < n ? (n - unit + units - 1) / units : 0;
  }
  __device__ int operator[](int i) const { return first + unit + i * units; }
};

// Unit `unit` of a role on `rank`: its own span when the plan listed each unit's tasks (no unit
// padded to the longest; a unit past `units` has none), else rows unit, unit + units, ... of the
// rank's (the default rule).
__device__ __forceinline__ TaskList unit_tasks(const RoleTables& t, int rank, int unit, int units) {
  if (t.unit_span != nullptr) {
    if (unit >= units) return TaskList{0, 0, 0, 1};
    const int* s = t.unit_span + 2 * (rank * units + unit);
    return TaskList{s[0], s[1], 0, 1};
  }
  return TaskList{t.task_span[2 * rank], t.task_span[2 * rank + 1], unit, units};
}

// A group of threads running one comm unit: a warp (intra_sm) or a whole CTA (inter_sm).
struct Team {
  int lane, size;
  __device__ void sync() const {
    __syncwarp();  // lane 0 may come from a wait alone: bar.sync needs a converged warp
    if (size != 32) asm volatile("bar.sync 2, %0;" ::"r"(size) : "memory");
  }
};

__device__ __forceinline__ long long* timeline_slot(const FusedCommon& c, const CtaInfo& cta,
                                                    int role, int i) {
  if (c.timeline == nullptr || i >= c.timeline_cap) return nullptr;
  return c.timeline + cta.local_rank * c.timeline_stride[0] + cta.slot * c.timeline_stride[1] +
         role * c.timeline_stride[2] + 2LL * i;
}

// -- the protocol executor: one thread runs a task's waits, another time its raises --------------

__device__ __forceinline__ int task_id(const FusedCommon& c, int role, int row) {
  return c.role[role].args[row * kTaskArgs];  // args[0] names the task (tile id for compute)
}

// Every wait of task `row`, then the resets it owns: the single consumer sets the flag back to 0,
// counted consumers add themselves to the pad's counter and the last one resets flag and counter.
template <bool kGpu = false>  // kGpu: gpu-scope flags (an op of one GPU, `kOneGpu`)
__device__ inline void run_waits(const FusedCommon& c, int role, int row, int rank) {
  const RoleTables& t = c.role[role];
  const int first = t.wait_span[2 * row], end = t.wait_span[2 * row + 1];
  if (first == end) return;
  for (int i = first; i < end; ++i) {
    const int* w = t.waits + i * kWaitFields;
    const WaitSite site{rank, w[kWPeer], task_id(c, role, row), role, w[kWPad], w[kWIndex]};
    const WaitPolicy policy{c.wait.status, c.wait.timeout_ns * w[kWPatience], c.wait.backoff_ns,
                            c.wait.launch};
    wait_acquire_at<kGpu>(c.pads[w[kWPad]].map(w[kWRank]) + w[kWIndex], w[kWValue], policy, site);
  }
  for (int i = first; i < end; ++i) {
    const int* w = t.waits + i * kWaitFields;
    int* flag = c.pads[w[kWPad]].map(w[kWRank]) + w[kWIndex];
    if (w[kWConsumers] == 1) {
      st_relaxed_at<kGpu>(flag, 0);
    } else if (w[kWConsumers] > 1) {
      // NOTE: every consumer has passed its wait before its add, so the last one may reset.
      int* count = c.pads[w[kWCounter]].map(w[kWRank]) + w[kWIndex];
      if (atomicAdd(count, 1) + 1 == w[kWConsumers]) {
        st_relaxed_at<kGpu>(flag, 0);
        st_relaxed_at<kGpu>(count, 0);
      }
    }
  }
  fence_proxy_async_global();  // the data is read next, possibly by TMA (the async proxy)
}

// The raises of task `row`, once its writes are complete and fenced at system scope. `across(r,
// flag)` may take a raise over (an op over several nodes: a put), returning true.
template <bool kGpu = false, class Across>
__device__ inline void run_raises(const FusedCommon& c, int role, int row, int rank,
                                  Across&& across) {
  const RoleTables& t = c.role[role];
  const int first = t.raise_span[2 * row], end = t.raise_span[2 * row + 1];
  if (first == end || rank == c.silent_rank) return;
  if (rank == c.delay_rank) delay_ns(c.delay_ns);
  for (int i = first; i < end; ++i) {
    const int* r = t.raises + i * kRaiseFields;
    int* flag = c.pads[r[kRPad]].map(r[kRRank]) + r[kRIndex];
    if (across(r, flag)) continue;
    if (r[kROp] == kRaiseAdd) {
      signal_add_release_at<kGpu>(flag, r[kRValue]);
    } else {
      signal_set_release_at<kGpu>(flag, r[kRValue]);
    }
  }
}

template <bool kGpu = false>
__device__ inline void run_raises(const FusedCommon& c, int role, int row, int rank) {
  run_raises<kGpu>(c, role, row, rank, [](const int*, int*) { return false; });
}

// -- over several nodes: raises across nodes travel as rdma puts ----------------------------------
//
// An op whose plan spans nodes declares `static constexpr bool kNodes = true` and
//   static __device__ rdma::Put put_rect(const FusedArgs<Op>&, const CtaInfo&, int role, int row,
//                                        int dest);
// the bytes that go with task `row`'s raise on `dest` (a rank of another node: dst, src, bytes per
// row, rows and pitches; bytes = 0 for none, an arrival); the template fills in the rest: the put
// carries the raise (put-with-signal: the proxy's stream sets the flag after the copy). The
// interpreter's twin is program.put_on_completion; a cross-node raise is a "set" (the host
// refuses a plan with an "add" across nodes). Every CTA of such an op ends with the
// quiet: its rank's ring has finished every put, so the caller may rewrite their sources.
template <class Op, class = void>
struct op_nodes : std::false_type {};
template <class Op>
struct op_nodes<Op, std::void_t<decltype(Op::kNodes)>> : std::bool_constant<Op::kNodes> {};

// The rank of `rank`'s node with local index `local` (its rail peer of that index).
__device__ __forceinline__ int node_rank(int rank, int per_node, int local) {
  return rank - rank % per_node + local;
}

template <class Op>
__device__ __forceinline__ rdma::RingView ring_of(const FusedArgs<Op>& a, const CtaInfo& cta) {
  return rdma::ring_view(a.rdma.rings, a.rdma.reserve, cta.local_rank, a.rdma.capacity);
}

// The put that carries raise `r` of task `row` (onto `flag`, on a rank of another node): the
// bytes the op names for it, then the flag set.
template <class Op>
__device__ __forceinline__ rdma::Put raise_put(const FusedArgs<Op>& a, const CtaInfo& cta, int role,
                                               int row, const int* r, int* flag) {
  rdma::Put put = Op::put_rect(a, cta, role, row, r[kRRank]);
  put.dest_rank = r[kRRank];
  put.signal = flag;
  put.value = r[kRValue];
  put.op = rdma::kPutSetDevice;
  return put;
}

// run_raises over several nodes: a raise on a rank of another node is a put into this rank's
// ring, with the bytes the op names for it.
template <class Op>
__device__ inline void run_raises_nodes(const FusedArgs<Op>& a, const CtaInfo& cta, int role,
                                        int row) {
  const int per_node = a.rdma.ranks_per_node;
  run_raises(a.common, role, row, cta.rank, [&](const int* r, int* flag) {
    if (r[kRRank] / per_node == cta.rank / per_node) return false;
    const rdma::Put put = raise_put<Op>(a, cta, role, row, r, flag);
#ifdef MK_RDMA_NVSHMEM
    rdma::nv::put_then_set(put);  // dst and flag: tagged symmetric addresses (put_nvshmem.cuh)
#else
    rdma::rdma_put(ring_of(a, cta), put, a.common.wait, kRoleRdma);  // false: recorded, carry on
#endif
    return true;
  });
}

// Optional: `static constexpr bool kOneGpu = true`: every rank of the op's launches is a CTA group
// of this GPU (TaskGraph), so its compute role's waits and raises use gpu-scope flags.
template <class Op, class = void>
struct one_gpu : std::false_type {};
template <class Op>
struct one_gpu<Op, std::void_t<decltype(Op::kOneGpu)>> : std::bool_constant<Op::kOneGpu> {};

// The raises of task `row` of an op: as puts across nodes for an op over several nodes.
template <class Op>
__device__ __forceinline__ void run_raises_of(const FusedArgs<Op>& a, const CtaInfo& cta, int role,
                                              int row) {
  if constexpr (op_nodes<Op>::value) {
    run_raises_nodes<Op>(a, cta, role, row);
  } else {
    run_raises<one_gpu<Op>::value>(a.common, role, row, cta.rank);
  }
}

// -- the hook contract ----------------------------------------------------------------------------

template <class Op, class = void>
struct has_dest : std::false_type {};
template <class Op>
struct has_dest<Op, std::void_t<decltype(Op::dest(std::declval<const FusedArgs<Op>&>(),
                                                  std::declval<const CtaInfo&>(),
                                                  std::declval<const Tile&>()))>>
    : std::is_same<decltype(Op::dest(std::declval<const FusedArgs<Op>&>(),
                                     std::declval<const CtaInfo&>(), std::declval<const Tile&>())),
                   typename Op::Engine::Dest> {};
template <class Op, class = void>
struct has_comm_move : std::false_type {};
template <class Op>
struct has_comm_move<
    Op, std::void_t<decltype(Op::comm_move(
            std::declval<const FusedArgs<Op>&>(), std::declval<const CtaInfo&>(),
            std::declval<const int*>(), std::declval<const Team&>(), std::declval<char*>()))>>
    : std::true_type {};
template <class Op, class = void>
struct has_prepare : std::false_type {};
template <class Op>
struct has_prepare<Op, std::void_t<decltype(Op::prepare(std::declval<const long long*>(),
                                                        std::declval<FusedArgs<Op>&>()))>>
    : std::true_type {};

template <class Op>
struct OpContract {
  static_assert(has_dest<Op>::value,
                "Op needs 'static __device__ Engine::Dest dest(const FusedArgs<Op>&, const "
                "CtaInfo&, const Tile&)': where the engine writes a compute tile");
  static_assert(has_comm_move<Op>::value,
                "Op needs 'static __device__ void comm_move(const FusedArgs<Op>&, const CtaInfo&, "
                "const int* args, const Team&, char* smem)': the data movement of one comm task");
  static_assert(has_prepare<Op>::value,
                "Op needs 'static bool prepare(const long long* rec, FusedArgs<Op>&)': the host "
                "side that fills the engine's params (and output maps)");
  static_assert(EngineContract<typename Op::Engine>::ok);
  static_assert(std::is_integral_v<decltype(Op::kCommSmemBytes)>,
                "Op needs 'static constexpr int kCommSmemBytes' (0 if the comm role needs none)");
  static constexpr bool ok = true;
};

// -- the compute role: the engine's hooks, generated from the plan --------------------------------

template <class Op>
struct PlanHooks {
  const FusedArgs<Op>& a;
  const CtaInfo& cta;
  const TaskList& tasks;
  __device__ const FusedCommon& c() const { return a.common; }
  __device__ int num_tasks() const { return tasks.count(); }
  __device__ Tile tile(int i) const { return load_tile(c(), task_id(c(), kRoleCompute, tasks[i])); }
  __device__ typename Op::Engine::Task task(int i) const { return Op::Engine::task_of(tile(i)); }
  __device__ void stamp(int i, int which) const {
    long long* e = timeline_slot(c(), cta, kRoleCompute, i);
    if (e != nullptr) e[which] = (long long)globaltimer_ns();
  }
  __device__ void before_load(int i) const {  // producer lane
    stamp(i, 0);
    run_waits<one_gpu<Op>::value>(c(), kRoleCompute, tasks[i], cta.rank);
  }
  __device__ typename Op::Engine::Dest dest(int i) const { return Op::dest(a, cta, tile(i)); }
  __device__ void after_store(int i) const {  // one consumer thread, the tile's writes landed
    run_raises_of<Op>(a, cta, kRoleCompute, tasks[i]);
    stamp(i, 1);
  }
  __device__ bool raises(int i) const {  // task i raises a signal (its writes must be fenced)
    const int* span = c().role[kRoleCompute].raise_span + 2 * tasks[i];
    return span[1] > span[0];
  }
  // Nobody waits for this launch's tiles (and no timeline): skip the per-tile completion.
  __device__ bool signals() const { return c().compute_signals || c().timeline != nullptr; }
  // NOTE: a completion deferred to task i+1's epilogue runs after task i+1's waits. When task i
  // raises and task i+1 waits, a peer may wait for the first while we wait for its twin: complete
  // task i right away (mkernel/interp/program.py may_defer_completion models the same rule).
  __device__ bool defer_after_store(int i) const {
    const RoleTables& t = c().role[kRoleCompute];
    const int row = tasks[i];
    if (t.raise_span[2 * row] == t.raise_span[2 * row + 1] || i + 1 >= tasks.count()) return true;
    const int next = tasks[i + 1];
    return t.wait_span[2 * next] == t.wait_span[2 * next + 1];
  }
};

// -- the comm role: waits, the op's data movement, then raises, per task --------------------------

// Optional: `static __device__ void comm_begin(const FusedArgs<Op>&, char* smem)` and
// `comm_end(...)`, run by lane 0 of a comm unit before its first task and after its last (state
// that lives as long as the unit, such as a TMA ring's mbarriers, rather than one task).
template <class Op, class = void>
struct has_comm_unit_hooks : std::false_type {};
template <class Op>
struct has_comm_unit_hooks<
    Op, std::void_t<
            decltype(Op::comm_begin(std::declval<const FusedArgs<Op>&>(), std::declval<char*>())),
            decltype(Op::comm_end(std::declval<const FusedArgs<Op>&>(), std::declval<char*>()))>>
    : std::true_type {};

// One comm task (table row `row`, the unit's i-th): waits, the op's data movement, then raises.
// A comm unit's TMA ring kept across its tasks (a UnitRing of primitives/bulk_ring.cuh), as an
// op's base: Inter in a comm CTA (inter_sm: no engine, all of the shared memory), Intra beside the
// engine (intra_sm: what is left after it). It gives the op kCommSmemBytes and the comm_begin /
// comm_end hooks; the op's comm_move reaches the launch's ring through with_ring.
template <class Inter, class Intra>
struct CommRings {
  using InterRing = Inter;
  using IntraRing = Intra;
  static constexpr int kCommSmemBytes = Intra::kSmemBytes;
  template <class Args, class F>
  static __device__ void with_ring(const Args& a, char* smem, F&& f) {
    if (a.common.overlap == kInterSM) {
      f(Inter{smem});
    } else {
      f(Intra{smem});
    }
  }
  template <class Args>
  static __device__ void comm_begin(const Args& a, char* smem) {
    with_ring(a, smem, [](const auto& ring) { ring.begin(); });
  }
  template <class Args>
  static __device__ void comm_end(const Args& a, char* smem) {
    with_ring(a, smem, [](const auto& ring) { ring.end(); });
  }
};

#ifdef MK_RDMA_NVSHMEM
// A comm task's raises over several nodes through NVSHMEM, by the whole team (every member calls
// it): a cross-node raise is a put the team copies together (put_then_set_team); a raise within
// the node is lane 0's flag store (run_raises takes it over on the other lanes). The team's
// writes (and lane 0's bulk copies, waited for and fenced) come first: a put may read them.
template <class Op>
__device__ void run_raises_team(const FusedArgs<Op>& a, const CtaInfo& cta, int row,
                                const Team& team) {
  const int* span = a.common.role[kRoleComm].raise_span + 2 * row;
  if (team.lane == 0) {
    bulk_wait_all();
    if (span[1] > span[0]) __threadfence_system();
  }
  team.sync();
  const int per_node = a.rdma.ranks_per_node;
  run_raises(a.common, kRoleComm, row, cta.rank, [&](const int* r, int* flag) {
    if (r[kRRank] / per_node == cta.rank / per_node) return team.lane != 0;  // lane 0 raises it
    rdma::nv::put_then_set_team(raise_put<Op>(a, cta, kRoleComm, row, r, flag), team);
    return true;
  });
}
#endif

template <class Op>
__device__ void run_comm_task(const FusedArgs<Op>& a, const CtaInfo& cta, int row, int i,
                              const Team& team, char* smem) {
  const FusedCommon& c = a.common;
  long long* e = team.lane == 0 ? timeline_slot(c, cta, kRoleComm, i) : nullptr;
  if (e != nullptr) e[0] = (long long)globaltimer_ns();
  if (team.lane == 0) run_waits(c, kRoleComm, row, cta.rank);
  team.sync();
  Op::comm_move(a, cta, c.role[kRoleComm].args + row * kTaskArgs, team, smem);
  team.sync();  // the team's writes are done before lane 0 fences and raises
#ifdef MK_RDMA_NVSHMEM
  if constexpr (op_nodes<Op>::value) {
    run_raises_team<Op>(a, cta, row, team);  // puts copied by the team, not by lane 0 alone
    if (e != nullptr) e[1] = (long long)globaltimer_ns();
    return;
  }
#endif
  if (team.lane == 0) {
    bulk_wait_all();  // lane 0's bulk copies fully landed (not only read)
    const int* span = c.role[kRoleComm].raise_span + 2 * row;
    if (span[1] > span[0]) {
      __threadfence_system();
      run_raises_of<Op>(a, cta, kRoleComm, row);
    }
    if (e != nullptr) e[1] = (long long)globaltimer_ns();
  }
}

template <class Op>
__device__ void run_comm(const FusedArgs<Op>& a, const CtaInfo& cta, const TaskList& tasks,
                         const Team& team, char* smem) {
  if constexpr (has_comm_unit_hooks<Op>::value) {
    if (team.lane == 0) Op::comm_begin(a, smem);
  }
  for (int i = 0; i < tasks.count(); ++i) run_comm_task<Op>(a, cta, tasks[i], i, team, smem);
  if constexpr (has_comm_unit_hooks<Op>::value) {
    if (team.lane == 0) Op::comm_end(a, smem);
  }
}

// Optional: `static constexpr bool kCommAnyOrder = true`: the op's comm tasks are independent (none
// needs another's effect, any order and any overlap of them is correct: MoE's combine reduces), so
// the warps of a CTA claim the unit's tasks one at a time from a counter in shared memory, each
// warp a team of 32. intra_sm: the spare warp from the start, the consumer warps as they leave the
// engine (the reduces that wait for the last tiles then run on most of the SM, not one warp);
// inter_sm: every warp of a comm CTA. No comm shared memory, no unit hooks.
template <class Op, class = void>
struct comm_any_order : std::false_type {};
template <class Op>
struct comm_any_order<Op, std::void_t<decltype(Op::kCommAnyOrder)>>
    : std::bool_constant<Op::kCommAnyOrder> {};

// Optional: `static constexpr bool kComputePerUnit = true`: every plan of the op gives its compute
// role unit by unit (PerUnit: unit_span), so the kernel is compiled for that rule alone; a plan
// without the span would run no compute task (tests/test_per_unit.py holds the ring ops' plans to
// it). NOTE: the runtime choice between the two rules (unit_tasks) cost the causal ring kernels 3-5%
// against the tree before per-unit lists (one H100, ring_local_2026-12-07_ab3_*.json: within noise
// with the trait).
template <class Op, class = void>
struct compute_per_unit : std::false_type {};
template <class Op>
struct compute_per_unit<Op, std::void_t<decltype(Op::kComputePerUnit)>>
    : std::bool_constant<Op::kComputePerUnit> {};

template <class Op>
__device__ void claim_comm(const FusedArgs<Op>& a, const CtaInfo& cta, const TaskList& tasks,
                           int* next) {
  static_assert(Op::kCommSmemBytes == 0 && !has_comm_unit_hooks<Op>::value,
                "kCommAnyOrder: warps run tasks side by side, no shared comm state");
  const Team team{(int)threadIdx.x % 32, 32};
  __syncwarp();
  for (;;) {
    int i = 0;
    if (team.lane == 0) i = atomicAdd(next, 1);
    i = __shfl_sync(0xffffffffu, i, 0);
    if (i >= tasks.count()) return;
    run_comm_task<Op>(a, cta, tasks[i], i, team, nullptr);
  }
}

// The shared-memory counter of claim_comm (after the engine's and the op's comm shared memory).
template <class Op>
constexpr int claim_bytes() {
  return comm_any_order<Op>::value ? 16 : 0;
}

// CTA `slot` of this rank meets CTA `slot` of every peer (kNodeScoped: of every peer in its
// node: no memory of another node is touched). See signal.cuh for the flag protocol.
template <bool kNodeScoped = false>
__device__ inline void entry_barrier(const FusedCommon& c, const CtaInfo& cta, int per_node = 0) {
  const int W = c.world_size;
  const SymPtr<int>& barrier = c.pads[kBarrierPad];
  // the group met: the world, or the node (ranks base .. base + G - 1); peer i of this rank
  const int G = kNodeScoped ? per_node : W, base = kNodeScoped ? cta.rank - cta.rank % G : 0;
  auto peer_at = [&](int i) { return base + (cta.rank - base + i) % G; };
  for (int i = 1; i < G; ++i) {
    const int peer = peer_at(i);
    int* f = barrier.map(peer) + cta.slot * W + cta.rank;
    const WaitSite site{cta.rank, peer, -1, kRoleBarrier, kBarrierPad, cta.slot * W + cta.rank};
    spin_until(c.wait, site, [&] { return cas_acq_rel_sys(f, 0, 1) == 0; });
  }
  for (int i = 1; i < G; ++i) {
    const int peer = peer_at(i);
    const WaitSite site{cta.rank, peer, -1, kRoleBarrier, kBarrierPad, cta.slot * W + peer};
    wait_acquire_reset(barrier.map(cta.rank) + cta.slot * W + peer, 1, c.wait, site);
  }
}

// -- the layout phase (optional): an op with device-filled roles defines
//   static __device__ void layout(const FusedArgs<Op>&, const CtaInfo&, TableWriter& compute,
//                                 TableWriter& comm, char* smem);
// run by every thread of CTA slot 0 (templates/layout_phase.cuh).
template <class Op, class = void>
struct has_layout : std::false_type {};
template <class Op>
struct has_layout<
    Op, std::void_t<decltype(Op::layout(
            std::declval<const FusedArgs<Op>&>(), std::declval<const CtaInfo&>(),
            std::declval<TableWriter&>(), std::declval<TableWriter&>(), std::declval<char*>()))>>
    : std::true_type {};

// The writer of `rank`'s region of a role (rows, waits, raises from rank * capacity on).
__device__ inline TableWriter table_writer(const RoleTables& t, int rank, int* tiles) {
  TableWriter w{t.task_span, t.args, t.wait_span, t.waits, t.raise_span, t.raises, tiles};
  w.rank = rank;
  w.first = w.row = rank * t.cap[0];
  w.row_end = w.row + t.cap[0];
  w.wait = rank * t.cap[1];
  w.wait_end = w.wait + t.cap[1];
  w.raise = rank * t.cap[2];
  w.raise_end = w.raise + t.cap[2];
  w.overflow = false;
  return w;
}

// CTA slot 0 of the rank writes the tables (all of its threads), every other CTA waits for them.
template <class Op>
__device__ void layout_phase(const FusedArgs<Op>& args, const CtaInfo& cta, char* smem) {
  const FusedCommon& c = args.common;
  int* const own = c.pads[kBarrierPad].map(cta.rank);
  int* flag = own + 0 * c.world_size + cta.rank;   // barrier[0, rank]
  int* count = own + 1 * c.world_size + cta.rank;  // barrier[1, rank]
  const int readers = c.ctas_per_rank - 1;
  if (cta.slot == 0) {
    TableWriter compute = table_writer(c.role[kRoleCompute], cta.rank, c.tiles);
    TableWriter comm = table_writer(c.role[kRoleComm], cta.rank, nullptr);
    Op::layout(args, cta, compute, comm, smem);
    __threadfence();  // every thread's table writes, before thread 0 raises the flag
    // NOTE: a task beyond the plan's capacity would be lost: stop loudly, it is the op's bug.
    if (__syncthreads_or(compute.overflow || comm.overflow)) __trap();
    if (threadIdx.x == 0) {
      compute.finish();
      comm.finish();
      __threadfence();
      if (readers > 0) signal_set_release(flag, 1);
    }
  } else if (threadIdx.x == 0) {
    const WaitSite site{cta.rank, cta.rank, -1, kRoleBarrier, kBarrierPad, cta.rank};
    wait_acquire(flag, 1, c.wait, site);
    // Counted consumers: the last reader resets flag and counter for the next launch.
    if (atomicAdd(count, 1) + 1 == readers) {
      st_relaxed_sys(flag, 0);
      st_relaxed_sys(count, 0);
    }
  }
  __syncwarp();
  __syncthreads();
}

// The end of every CTA of an op over several nodes (called by all of its threads): the quiet, so
// that its rank's ring has done every put of this CTA (their sources are the caller's again).
template <class Op>
__device__ __forceinline__ void end_nodes(const FusedArgs<Op>& args, const CtaInfo& cta) {
  __syncwarp();
  __syncthreads();
#ifdef MK_RDMA_NVSHMEM
  // NOTE: every thread: a put is posted by whichever thread ran the task's raises, and the quiet
  // is not relied on to complete other threads' puts (over NVLink it is a system fence)
  nvshmem_quiet();
#else
  if (threadIdx.x == 0) rdma::rdma_quiet(ring_of(args, cta), args.common.wait, kRoleRdma);
#endif
}

template <class Op>
__global__ void __launch_bounds__(Op::Engine::kThreads, 1)
    persistent_kernel(const __grid_constant__ FusedArgs<Op> args) {
  static_assert(OpContract<Op>::ok);
  using Engine = typename Op::Engine;
  extern __shared__ __align__(1024) char smem[];
  const FusedCommon& c = args.common;
  CtaInfo cta;
  cta.local_rank = blockIdx.x / c.ctas_per_rank;
  cta.slot = blockIdx.x % c.ctas_per_rank;
  cta.rank = c.rank0 + cta.local_rank;
  constexpr bool kAnyOrder = comm_any_order<Op>::value;
  constexpr bool kNodes = op_nodes<Op>::value;
  int* next = reinterpret_cast<int*>(smem + Engine::kSmemBytes + Op::kCommSmemBytes);
  if constexpr (kAnyOrder) {
    if (threadIdx.x == 0) *next = 0;  // the claim counter (the layout's scratch ends before it)
  }
  if (threadIdx.x == 0) entry_barrier<kNodes>(c, cta, args.rdma.ranks_per_node);
  __syncwarp();  // converge warp 0 before the CTA barrier
  __syncthreads();

  if constexpr (has_layout<Op>::value) layout_phase<Op>(args, cta, smem);

  const RoleTables& ctab = c.role[kRoleCompute];
  const RoleTables& mtab = c.role[kRoleComm];
  // An inter_sm comm CTA has no compute unit (slot >= compute_units: unit_tasks gives a PerUnit
  // role an empty list there; under the stride rule the list is never read, the CTA returns
  // below). NOTE: selects around these calls instead of inside unit_tasks cost the ring kernel ~3%
  // (W = 2 full, one H100, benchmarks/results/ring_local_2026-12-07_ab2_*.json).
  TaskList compute;
  if constexpr (compute_per_unit<Op>::value) {
    const int* span = ctab.unit_span + 2 * (cta.rank * c.compute_units + cta.slot);
    const bool mine = ctab.unit_span != nullptr && cta.slot < c.compute_units;
    compute = mine ? TaskList{span[0], span[1], 0, 1} : TaskList{0, 0, 0, 1};
  } else {
    compute = unit_tasks(ctab, cta.rank, cta.slot, c.compute_units);
  }
  if (c.overlap == kInterSM && cta.slot >= c.compute_units) {
    const TaskList comm = unit_tasks(mtab, cta.rank, cta.slot - c.compute_units, c.comm_units);
    if constexpr (kAnyOrder) {
      claim_comm<Op>(args, cta, comm, next);
    } else {
      // NOTE: a comm CTA runs no engine, so all of the shared memory is its own.
      run_comm<Op>(args, cta, comm, Team{(int)threadIdx.x, (int)blockDim.x}, smem);
    }
    if constexpr (kNodes) end_nodes<Op>(args, cta);
    return;
  }
  // The intra_sm communicator, on the warp the engine leaves free.
  const TaskList comm = unit_tasks(mtab, cta.rank, cta.slot, c.comm_units);
  auto spare = [&] {
    if (c.overlap != kIntraSM) return;
    if constexpr (kAnyOrder) {
      claim_comm<Op>(args, cta, comm, next);
    } else {
      run_comm<Op>(args, cta, comm, Team{(int)threadIdx.x % 32, 32}, smem + Engine::kSmemBytes);
    }
  };
  if (compute.count() == 0) {  // CTA-uniform: nothing to compute (e.g. a comm-only op)
    if (kAnyOrder || (int)threadIdx.x / 32 == Engine::kSpareWarp) spare();
    if constexpr (kNodes) end_nodes<Op>(args, cta);
    return;
  }
  PlanHooks<Op> hooks{args, cta, compute};
  Engine::run_cta(args.engine[cta.local_rank], smem, hooks, spare);
  if constexpr (kAnyOrder) {
    // The consumer warps, once the CTA's tiles are done. NOTE: not the producer warpgroup's
    // idle warps from the start: their waits' polling beside the GEMM made a combine 30x slower
    // (run 12: 309 ms against 10); nor warp 0, whose lane 0 may still be producing.
    if (c.overlap == kIntraSM && threadIdx.x >= 128) claim_comm<Op>(args, cta, comm, next);
  }
  if constexpr (kNodes) end_nodes<Op>(args, cta);
}

}  // namespace mk
