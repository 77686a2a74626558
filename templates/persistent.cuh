// The persistent-kernel template: one launch, one CTA per SM, roles per CTA or per warp, a task loop
// over the plan. A fused op supplies an `Op` struct of hooks; the template supplies the rest (role
// assignment, entry barrier, task loops, register split, injected lateness, the GPU timeline):
//
//   struct Op {
//     using Engine = ...;                    // compute engine (primitives/gemm/engine.cuh)
//     struct Args {                          // the __grid_constant__ kernel parameter
//       FusedCommon common;
//       typename Engine::Params engine[kMaxLocalRanks];  // per served rank
//       ...
//     };
//     struct ComputeHooks;                   // engine hooks, built as {{args, cta, tasks}}
//     static constexpr int kCommSmemBytes;   // intra_sm comm smem, after the engine's (an inter_sm
//                                            // comm CTA gets all of the CTA's shared memory)
//     static __device__ void comm_task(const Args&, const CtaInfo&, int task, const Team&,
//                                      char* smem);   // one comm task, run by the whole team
//   };
//
// Layout of a CTA (Engine::kThreads threads):
//   inter_sm  CTA slot <  compute_units: compute CTA (warp 0 + consumer warpgroups run the engine)
//             CTA slot >= compute_units: comm CTA (every thread runs comm_role as one team)
//   intra_sm  every CTA computes; warp 1 of warpgroup 0 is the communicator warp (comm_role, team of
//             32 threads); warps 2, 3 idle.
// Both backends give unit u of a role the tasks u, u + units, u + 2 units, ... of the rank's table.
// In an emulated world CTAs [r * ctas_per_rank, (r + 1) * ctas_per_rank) serve rank r; all ranks'
// CTAs are co-resident (grid <= #SMs), so ranks can spin on each other.
//
//   rank:    0            1                W-1
//   CTAs:  [c0 c1 .. cn][c0 c1 .. cn] ... [c0 c1 .. cn]      entry barrier pairs c_i across ranks
#pragma once
#include "primitives/gemm/hooks.cuh"
#include "primitives/signal.cuh"
#include "primitives/sym.cuh"

namespace mk {

enum Overlap : int { kIntraSM = 0, kInterSM = 1 };
constexpr int kMaxLocalRanks = 16;     // ranks one launch can serve (emulated world)
constexpr int kMaxBarrierSlots = 256;  // entry-barrier flags per rank: [slot, W]

struct PlanView {
  const int* tiles;          // [T, 5]: m0, n0, rows, cols, tag
  const int* compute_order;  // [ranks_here, tc]
  const int* comm_tasks;     // [ranks_here, tm]
  int tc, tm;
  int compute_units, comm_units, ctas_per_rank;
  int overlap;
};

struct WorldView {
  int world_size;  // W
  int rank0;       // first rank served by this launch (emulated: 0, distributed: own rank)
  int ranks_here;  // ranks served by this launch (emulated: W, distributed: 1)
};

struct FaultView {
  int silent_rank;  // never raises its data signals (-1: none)
  int delay_rank;   // sleeps delay_ns before each communication step (-1: none)
  long long delay_ns;
};

struct FusedCommon {
  PlanView plan;
  WorldView world;
  WaitPolicy wait;
  FaultView faults;
  SymPtr<int> barrier;  // [kMaxBarrierSlots, W] per rank
  // GPU timeline (optional): globaltimer ns, [ranks_here, ctas_per_rank, role, timeline_cap, 2]
  // = start, end of each task a unit runs (compute: first load .. signalled; comm: the task).
  long long* timeline;
  int timeline_cap;
};

__device__ __forceinline__ long long* timeline_slot(const FusedCommon& c, int local_rank, int slot,
                                                    int role, int i) {
  if (c.timeline == nullptr || i >= c.timeline_cap) return nullptr;
  const long long unit = ((long long)local_rank * c.plan.ctas_per_rank + slot) * 2 + role;
  return c.timeline + (unit * c.timeline_cap + i) * 2;
}

struct CtaInfo {
  int rank, local_rank, slot;
};

// The tasks of one unit: row[unit], row[unit + units], ...
struct TaskList {
  const int* row;
  int unit, units, width;
  __device__ int count() const { return unit < width ? (width - unit + units - 1) / units : 0; }
  __device__ int operator[](int i) const { return row[unit + i * units]; }
};

// A group of threads running one comm unit: a warp (intra_sm) or a whole CTA (inter_sm).
struct Team {
  int lane, size;
  __device__ void sync() const {
    if (size == 32) {
      __syncwarp();
    } else {
      asm volatile("bar.sync 2, %0;" ::"r"(size) : "memory");
    }
  }
};

struct Tile {
  int m0, n0, rows, cols, tag;
};

// Engine hooks with the timeline: start when the producer begins task i, end once it is signalled.
template <class Hooks>
struct TimedHooks : Hooks {
  __device__ void stamp(int i, int which) const {
    long long* e =
        timeline_slot(this->a.common, this->cta.local_rank, this->cta.slot, kRoleCompute, i);
    if (e != nullptr) e[which] = (long long)globaltimer_ns();
  }
  __device__ void before_load(int i) const {
    stamp(i, 0);
    Hooks::before_load(i);
  }
  __device__ void after_store(int i) const {
    Hooks::after_store(i);
    stamp(i, 1);
  }
  __device__ bool signals() const {  // the end stamps come from after_store
    return this->a.common.timeline != nullptr ||
           gemm::hooks_signal(static_cast<const Hooks&>(*this));
  }
};

__device__ __forceinline__ Tile load_tile(const PlanView& p, int id) {
  const int* t = p.tiles + 5 * id;
  return Tile{t[0], t[1], t[2], t[3], t[4]};
}

// CTA `slot` of this rank meets CTA `slot` of every peer. See signal.cuh for the flag protocol.
__device__ inline void entry_barrier(const FusedCommon& c, const CtaInfo& cta) {
  const int W = c.world.world_size;
  for (int i = 1; i < W; ++i) {
    const int peer = (cta.rank + i) % W;
    int* f = c.barrier.map(peer) + cta.slot * W + cta.rank;
    const WaitSite site{cta.rank, peer, -1, kRoleBarrier, 0, cta.slot};
    spin_until(c.wait, site, [&] { return cas_acq_rel_sys(f, 0, 1) == 0; });
  }
  for (int i = 1; i < W; ++i) {
    const int peer = (cta.rank + i) % W;
    const WaitSite site{cta.rank, peer, -1, kRoleBarrier, 0, cta.slot};
    wait_acquire_reset(c.barrier.map(cta.rank) + cta.slot * W + peer, 1, c.wait, site);
  }
}

template <int Regs, bool Inc>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (Regs > 0) {
    if constexpr (Inc) {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs));
    } else {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs));
    }
  }
}

template <class Op>
__device__ __forceinline__ void run_compute(const typename Op::Args& args, const CtaInfo& cta,
                                            const TaskList& tasks, char* smem) {
  TimedHooks<typename Op::ComputeHooks> hooks{{{args, cta, tasks}}};
  Op::Engine::run(args.engine[cta.local_rank], smem, hooks);
}

// The comm role's task loop: lateness injected before each task, the timeline around it, a team
// barrier after it (so a task's writes are done before the next task's lane-0 waits or signals).
template <class Op>
__device__ void run_comm(const typename Op::Args& args, const CtaInfo& cta, const TaskList& tasks,
                         const Team& team, char* smem) {
  const FusedCommon& c = args.common;
  for (int i = 0; i < tasks.count(); ++i) {
    long long* e =
        team.lane == 0 ? timeline_slot(c, cta.local_rank, cta.slot, kRoleComm, i) : nullptr;
    if (e != nullptr) e[0] = (long long)globaltimer_ns();
    if (cta.rank == c.faults.delay_rank) delay_ns(c.faults.delay_ns);
    Op::comm_task(args, cta, tasks[i], team, smem);
    team.sync();
    if (e != nullptr) e[1] = (long long)globaltimer_ns();
  }
}

template <class Op>
__global__ void __launch_bounds__(Op::Engine::kThreads, 1)
    persistent_kernel(const __grid_constant__ typename Op::Args args) {
  using Engine = typename Op::Engine;
  extern __shared__ __align__(1024) char smem[];
  const FusedCommon& c = args.common;
  const PlanView& p = c.plan;
  CtaInfo cta;
  cta.local_rank = blockIdx.x / p.ctas_per_rank;
  cta.slot = blockIdx.x % p.ctas_per_rank;
  cta.rank = c.world.rank0 + cta.local_rank;
  if (threadIdx.x == 0) entry_barrier(c, cta);
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const TaskList compute{p.compute_order + cta.local_rank * p.tc, cta.slot, p.compute_units, p.tc};
  char* comm_smem = smem + Engine::kSmemBytes;
  if (p.overlap == kInterSM && cta.slot >= p.compute_units) {
    const TaskList comm{p.comm_tasks + cta.local_rank * p.tm, cta.slot - p.compute_units,
                        p.comm_units, p.tm};
    // NOTE: a comm CTA runs no engine, so all of the shared memory is its own.
    run_comm<Op>(args, cta, comm, Team{(int)threadIdx.x, (int)blockDim.x}, smem);
    return;
  }
  if (warp < 4) {
    set_max_regs<Engine::kProducerRegs, false>();
    if (warp == 0) {
      run_compute<Op>(args, cta, compute, smem);
    } else if (warp == 1 && p.overlap == kIntraSM) {
      const TaskList comm{p.comm_tasks + cta.local_rank * p.tm, cta.slot, p.comm_units, p.tm};
      run_comm<Op>(args, cta, comm, Team{(int)threadIdx.x % 32, 32}, comm_smem);
    }
  } else {
    set_max_regs<Engine::kConsumerRegs, true>();
    run_compute<Op>(args, cta, compute, smem);
  }
}

}  // namespace mk
