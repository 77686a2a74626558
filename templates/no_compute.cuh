// The comm-only engine: an op whose plan has no compute tasks (a standalone collective such as
// all_gather) runs the persistent template on it instead of a GEMM engine, so its CTAs carry no
// engine registers or shared memory. It implements the engine contract
// (templates/engine_contract.cuh) and never computes: run_cta only hands warp kSpareWarp to the
// template's intra_sm communicator.
#pragma once

namespace mk {

template <int Threads>
struct NoCompute {
  struct Params {};
  struct Task {};
  struct Dest {};
  static constexpr int kThreads = Threads;  // inter_sm: the comm team of a CTA
  static constexpr int kSmemBytes = 0;
  static constexpr int kSpareWarp = 0;
  template <class T>
  __device__ static Task task_of(const T&) {
    return Task{};
  }
  // NOTE: the template calls this only for a CTA with compute tasks, which a comm-only op's plan
  // never has: an op built on this engine with compute tasks in its plan is an authoring mistake,
  // and it stops the kernel loudly instead of skipping them.
  template <class Hooks, class Spare>
  __device__ static void run_cta(const Params&, char*, Hooks& hooks, Spare&&) {
    if (threadIdx.x == 0 && hooks.num_tasks() > 0) __trap();
  }
};

}  // namespace mk
