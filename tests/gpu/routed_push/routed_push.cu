// A test-only fused op on the layout phase: the GPU side of tests/test_layout_phase.py's toy (MoE
// dispatch in miniature). Rank s sends row i of x to rank route[s][i] (-1: nowhere); how many
// tasks each rank runs is data, so the comm role is device-filled: layout() makes the tasks, the
// template runs them. Emulated worlds only: layout() reads every rank's route through l.route.
#include "kernels/fused_host.cuh"
#include "routed_push_layout.h"  // generated from the test's SPEC (mkernel.codegen), -I at build

namespace mk {

struct RoutedPush {
  using Engine = NoCompute<128>;
  using Layout = spec::routed_push::Layout;
  using Args = FusedArgs<RoutedPush>;
  static constexpr int kCommSmemBytes = 0;
  static constexpr int kPush = 0, kArrived = 1;

  static __device__ Engine::Dest dest(const Args&, const CtaInfo&, const Tile&) { return {}; }

  // One thread: this rank's pushes (raising arrived[me, i] at the destination), then one wait per
  // row routed here (the single consumer resets it). The same tasks as the twin, in its order.
  static __device__ void layout(const Args& a, const CtaInfo& cta, TableWriter&, TableWriter& comm,
                                char*) {
    if (threadIdx.x != 0) return;  // appends: one thread
    const Layout& l = a.layout;
    const int W = a.common.world_size, me = cta.rank, rows = l.rows;
    const int* mine = l.route.at(cta.local_rank);
    for (int i = 0; i < rows; ++i) {
      if (mine[i] < 0) continue;
      comm.task(kPush, i, mine[i]);
      comm.add_raise(spec::routed_push::kPadArrived, mine[i], me * rows + i);
    }
    for (int s = 0; s < W; ++s) {
      const int* theirs = l.route.at(s);  // emulated: rank s is local rank s
      for (int i = 0; i < rows; ++i) {
        if (theirs[i] != me) continue;
        comm.task(kArrived, s, i);
        comm.add_wait(spec::routed_push::kPadArrived, me, s * rows + i, 1, 1, -1, 1, s);
      }
    }
  }

  static __device__ void comm_move(const Args& a, const CtaInfo& cta, const int* args,
                                   const Team& team, char*) {
    if (args[0] != kPush) return;
    const Layout& l = a.layout;
    const int i = args[1], dest = args[2];
    const float* src = l.x.at(cta.local_rank) + (long long)i * l.cols;
    float* dst = l.out.at(dest) + ((long long)cta.rank * l.rows + i) * l.cols;
    for (int c = team.lane; c < l.cols; c += team.size) dst[c] = src[c];
  }

  static bool prepare(const long long*, Args&) { return true; }
};

int launch_routed_push(const long long* rec, cudaStream_t s) {
  return launch_persistent<RoutedPush>(rec, s);
}

}  // namespace mk
