// A TaskGraph as one persistent launch (issue 36): the TaskGraph engine (kernels/taskgraph.cuh) on
// the persistent template, which runs the plan's tables (mkernel/taskgraph/lower.py): counted pads
// ready[task] and ready_group[group] per rank, each task waiting for the tiles it reads (a read
// of several tiles: its group's count at once) and raising its own.
//
//   rank r's CTAs: unit u runs tasks u, u + n, ... in order; task i is the same tile on every
//   rank and every rank's list is a topological order, so a wait of task i needs only tasks < i:
//
//   unit 0:  rmsnorm rows 0:8 -> raise ready[0]   | q cols 0:32 (wait ready[0]) -> ready[n] ...
//   unit 1:  q cols 32:64 (wait ready[0]) -> ...  | ...
//
// No comm role: the collectives pull their peers' tiles (all ranks of an emulated world are CTAs
// of this launch, split by the template, so a peer's tile is a plain load after its ready flag).
#include "kernels/fused_host.cuh"
#include "kernels/taskgraph.cuh"

namespace mk {

// The launch record's slots as this op reads them: the task and pointer tables, then the call's
// inputs and outputs (addresses and rank strides, mkernel/taskgraph/device.py io_buffers).
struct TaskGraphLayout {
  const int* tasks;
  const long long* ptrs;
  long long slot[kMaxSlots], stride[kMaxSlots];
  static TaskGraphLayout from(const long long* rec) {
    TaskGraphLayout l{};
    l.tasks = reinterpret_cast<const int*>(rec[kRecSlot0]);
    l.ptrs = reinterpret_cast<const long long*>(rec[kRecSlot0 + 1]);
    for (int i = 0; i < kMaxSlots; ++i) {
      l.slot[i] = rec[kRecSlot0 + i];
      l.stride[i] = rec[kRecStride0 + i];
    }
    return l;
  }
};

struct TaskGraphOp {
  using Engine = tg::Engine;
  using Layout = TaskGraphLayout;
  using Args = FusedArgs<TaskGraphOp>;
  static constexpr int kCommSmemBytes = 0;
  // Its worlds are one GPU (mkernel/taskgraph refuses distributed ones): gpu-scope flags.
  static constexpr bool kOneGpu = true;
  static __device__ Engine::Dest dest(const Args&, const CtaInfo&, const Tile&) { return {}; }
  // NOTE: a TaskGraph plan has no comm tasks; the template's comm loop never calls this.
  static __device__ void comm_move(const Args&, const CtaInfo&, const int*, const Team&, char*) {}
  // Host: every served rank's engine params (the tables, the call's buffers, its rank).
  static bool prepare(const long long*, Args& a) {
    const Layout& l = a.layout;
    if (l.tasks == nullptr || l.ptrs == nullptr) return false;
    for (int r = 0; r < a.common.ranks_here; ++r) {
      tg::Params& p = a.engine[r];
      p.tasks = l.tasks;
      p.ptrs = l.ptrs;
      for (int i = 0; i < kMaxSlots; ++i) {
        p.io_base[i] = l.slot[i];
        p.io_stride[i] = l.stride[i];
      }
      p.rank = a.common.rank0 + r;
      p.world_size = a.common.world_size;
    }
    a.out_mapped = false;
    return true;
  }
};

int launch_taskgraph(const long long* rec, cudaStream_t s) {
  return launch_persistent<TaskGraphOp>(rec, s);
}

}  // namespace mk
