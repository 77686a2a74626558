// The engine contract of the persistent template: what a compute engine provides so that the
// template can run a plan's compute tasks on it. The dense GEMM engine (primitives/gemm/engine.cuh),
// the attention engine (RingAttnEngine in kernels/ring_attention.cu) and the comm-only engine
// (templates/no_compute.cuh) implement it; a grouped GEMM plugs in the same way, with no change to
// the template.
//
//   struct Engine {
//     using Params = ...;                 // per served rank, in the __grid_constant__ argument
//     using Task = ...;                   // what one compute task computes
//     using Dest = ...;                   // where a task's result goes (the op's dest() says)
//     static constexpr int kThreads;      // threads per CTA (the launch's block size)
//     static constexpr int kSmemBytes;    // its dynamic shared memory (a multiple of 16)
//     static constexpr int kSpareWarp;    // a warp the engine leaves free: spare() runs there
//     template <class T> static __device__ Task task_of(const T& tile);  // a plan tile -> a task
//     // Every thread of the CTA. The engine places its warps (and their registers), asks the hooks
//     // for its tasks (num_tasks, task(i), before_load(i), dest(i), after_store(i), signals()),
//     // and calls spare() on warp kSpareWarp: the template's intra_sm communicator.
//     template <class Hooks, class Spare>
//     static __device__ void run_cta(const Params&, char* smem, Hooks&, Spare&& spare);
//   };
//
// The hooks' order guarantees are the engine's to keep: before_load(i) before task i reads its
// inputs; after_store(i) once task i's writes are complete and visible at system scope (bulk
// copies landed, fenced). The template puts the plan's waits in before_load and its raises in
// after_store, so an engine that keeps these two promises runs every protocol correctly.
#pragma once
#include <type_traits>
#include <utility>

namespace mk {

template <class E, class = void>
struct has_engine_types : std::false_type {};
template <class E>
struct has_engine_types<
    E, std::void_t<typename E::Params, typename E::Task, typename E::Dest, decltype(E::kThreads),
                   decltype(E::kSmemBytes), decltype(E::kSpareWarp)>> : std::true_type {};

// A tile-shaped probe: task_of must accept any struct with m0, n0, rows, cols (and tag).
struct ProbeTile {
  int m0, n0, rows, cols, tag;
};
template <class E, class = void>
struct has_task_of : std::false_type {};
template <class E>
struct has_task_of<E, std::void_t<decltype(E::task_of(std::declval<const ProbeTile&>()))>>
    : std::is_same<decltype(E::task_of(std::declval<const ProbeTile&>())), typename E::Task> {};

template <class E>
struct EngineContract {
  static_assert(has_engine_types<E>::value,
                "Engine needs 'using Params, Task, Dest' and 'static constexpr int kThreads, "
                "kSmemBytes, kSpareWarp' (templates/engine_contract.cuh)");
  static_assert(has_task_of<E>::value,
                "Engine needs 'template <class T> static __device__ Task task_of(const T& tile)': "
                "the task of a plan tile (m0, n0, rows, cols, tag)");
  static_assert(E::kThreads % 32 == 0 && E::kThreads >= 32 && E::kThreads <= 1024,
                "Engine::kThreads must be a whole number of warps, at most 1024");
  static_assert(E::kSpareWarp >= 0 && E::kSpareWarp < E::kThreads / 32,
                "Engine::kSpareWarp must name a warp of the CTA (the intra_sm communicator)");
  static_assert(E::kSmemBytes >= 0 && E::kSmemBytes % 16 == 0,
                "Engine::kSmemBytes must be a multiple of 16 (the op's comm smem follows it, "
                "16-byte aligned for bulk copies)");
  static constexpr bool ok = true;
};

}  // namespace mk
