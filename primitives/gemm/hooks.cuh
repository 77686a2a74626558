// hooks.cuh: compile-time traits of the engine's hooks (see engine.cuh for the whole contract),
// shared by the engine and the persistent template's wrappers.
//
//   kDeferAfterStore (static, optional, default true): task i's completion runs at the start of task
//     i+1's epilogue instead of right after task i's.
//   bool defer_after_store(int i) const (optional, default true): false completes task i right
//     after its epilogue even where kDeferAfterStore holds.
//   bool signals() const (optional, default true): false when nobody waits for this launch's tiles
//     (a plain GEMM; an op whose after_store does nothing), so the engine skips the per-task
//     completion (bulk wait, consumer barrier, system fence, after_store): ~2 us per tile on H200,
//     up to 6.6% of a fused op at W=1. Safe default: an op that forgets it still signals.
#pragma once
#include <type_traits>
#include <utility>

namespace mk::gemm {

template <class H, class = void>
struct has_signals : std::false_type {};
template <class H>
struct has_signals<H, std::void_t<decltype(std::declval<const H&>().signals())>> : std::true_type {
};

template <class H>
__device__ __forceinline__ bool hooks_signal(const H& h) {
  if constexpr (has_signals<H>::value) {
    return h.signals();
  } else {
    return true;
  }
}

template <class H, class = void>
struct has_defer_hook : std::false_type {};
template <class H>
struct has_defer_hook<H, std::void_t<decltype(std::declval<const H&>().defer_after_store(0))>>
    : std::true_type {};

// Whether task i's completion may wait for task i+1's epilogue (the per-task refinement).
template <class H>
__device__ __forceinline__ bool hooks_may_defer(const H& h, int i) {
  if constexpr (has_defer_hook<H>::value) {
    return h.defer_after_store(i);
  } else {
    return true;
  }
}

template <class H, class = void>
struct defer_after_store : std::true_type {};
template <class H>
struct defer_after_store<H, std::void_t<decltype(H::kDeferAfterStore)>>
    : std::bool_constant<H::kDeferAfterStore> {};

}  // namespace mk::gemm
