// Signals and waits between ranks (peer GPUs, or virtual ranks in one launch).
//
// Protocol
// - A producer writes data, then raises a signal with a release at system scope
//   (signal_set_release / signal_add_release): every earlier write of the producer (and, through a
//   preceding CTA barrier, of its CTA) is visible to whoever acquires that value.
//   NOTE: TMA bulk stores / reduce-stores must be complete (cp.async.bulk.wait_group 0, not .read)
//   before the release; the caller owns that.
// - A consumer spins with ld.acquire.sys until the flag holds the expected value (wait_acquire),
//   and, when it is the flag's only consumer, sets it back to 0 (wait_acquire_reset). That is how
//   signal pads reset themselves: no host-side reset, safe across loops and CUDA-graph replays.
// - Every wait is bounded by a deadline on %globaltimer. On expiry the first waiter records rank,
//   peer, task, role and signal in the launch's CommStatus and raises `abort`; every later wait then
//   returns at once. Waits report failure but the caller carries on (its data is garbage), so the
//   kernel always exits cleanly and the host raises CommTimeout.
// - The entry barrier (entry_barrier) pairs CTA `slot` of every rank; arrivals CAS 0 -> 1, so an
//   arrival for the next call waits until the previous call's flag was consumed.
#pragma once
#include <cstdint>

#include "primitives/protocol_gen.h"  // CommStatus, Role: layouts shared with Python

namespace mk {

// Who waits for what: copied into CommStatus when the wait times out.
struct WaitSite {
  int rank, peer, task, role, pad, index;  // pad, index: the flag (named by the op's spec)
};

struct WaitPolicy {
  CommStatus* status;  // may be null (then waits never time out: tests must not do that)
  long long timeout_ns;
  int backoff_ns;  // longest __nanosleep between polls (0: spin)
  int launch;      // the launch's id, recorded with a timeout (the host names the flag by it)
};

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int cas_acq_rel_sys(int* p, int expected, int desired) {
  int old;
  asm volatile("atom.acq_rel.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(expected), "r"(desired)
               : "memory");
  return old;
}

// One GPU (every rank of the launch on this device, an emulated world): gpu-scope twins. NOTE:
// sys-scope fences and polls cost a TaskGraph launch 30x (one H100: one decode layer 24 ms against
// 0.7 ms, docs/megakernel.md) while ~128 CTAs poll; gpu scope is enough where no peer GPU or host
// reads the flags.
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_gpu(int* p, int v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_gpu(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// The raise and reset at either scope (kGpu: every reader of the flag is on this GPU).
template <bool kGpu>
__device__ __forceinline__ void signal_set_release_at(int* flag, int v) {
  if constexpr (kGpu) {
    st_release_gpu(flag, v);
  } else {
    st_release_sys(flag, v);
  }
}
template <bool kGpu>
__device__ __forceinline__ void signal_add_release_at(int* flag, int v) {
  if constexpr (kGpu) {
    red_add_release_gpu(flag, v);
  } else {
    red_add_release_sys(flag, v);
  }
}
template <bool kGpu>
__device__ __forceinline__ void st_relaxed_at(int* p, int v) {
  if constexpr (kGpu) {
    st_relaxed_gpu(p, v);
  } else {
    st_relaxed_sys(p, v);
  }
}

// Whether another wait of the launch gave up. NOTE: the status block is mapped host memory: a
// sys-scope poll of it crosses PCIe, and ~128 CTAs polling so (every 64th poll of each) made a
// one-GPU TaskGraph decode layer 22 ms instead of 0.7 ms (one H100, docs/megakernel.md). Its only
// writers are CTAs of the launch, so one GPU's launches (kGpu) read it at gpu scope.
template <bool kGpu = false>
__device__ __forceinline__ bool aborting(const WaitPolicy& w) {
  if (w.status == nullptr) return false;
  return (kGpu ? ld_relaxed_gpu(&w.status->abort) : ld_relaxed_sys(&w.status->abort)) != 0;
}

// Named after what they do, so kernels read as the protocol above.
__device__ __forceinline__ void signal_set_release(int* flag, int v = 1) {
  st_release_sys(flag, v);
}
__device__ __forceinline__ void signal_add_release(int* flag, int v = 1) {
  red_add_release_sys(flag, v);
}

// Records the first timeout of the launch; later ones only see `abort`.
__device__ inline void record_timeout(const WaitPolicy& w, const WaitSite& s) {
  if (w.status == nullptr) return;
  if (atomicCAS(&w.status->error, kErrorNone, kErrorTimeout) == kErrorNone) {
    w.status->rank = s.rank;
    w.status->peer = s.peer;
    w.status->task = s.task;
    w.status->role = s.role;
    w.status->pad = s.pad;
    w.status->index = s.index;
    w.status->launch = w.launch;
    __threadfence_system();
  }
  st_release_sys(&w.status->abort, 1);
}

// Records an input value a layout phase cannot use (the first error of the launch wins; no abort:
// the caller ignores the value and the launch completes). The host raises it as it does a timeout.
__device__ inline void record_bad_input(const WaitPolicy& w, int rank, int task, int index,
                                        int value) {
  if (w.status == nullptr) return;
  if (atomicCAS(&w.status->error, kErrorNone, kErrorBadInput) == kErrorNone) {
    w.status->rank = rank;
    w.status->peer = -1;
    w.status->task = task;
    w.status->index = index;
    w.status->value = value;
    w.status->launch = w.launch;
    __threadfence_system();
  }
}

__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Spin until poll() holds, bounded by the deadline, sleeping backoff_ns between polls.
// kGpu: every writer of the flags and the status block is on this GPU (aborting<kGpu>).
template <bool kGpu = false, class Poll>
__device__ inline bool spin_until(const WaitPolicy& w, const WaitSite& site, Poll poll) {
  if (poll()) return true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t i = 1;; ++i) {
    // NOTE: exponential backoff up to backoff_ns: a flag that is nearly ready is seen within tens of
    // ns, while a long wait polls rarely, leaving issue slots and memory to the compute warps.
    if (w.backoff_ns > 0) __nanosleep(min(w.backoff_ns, 32 << min(i, 12u)));
    if (poll()) return true;
    if ((i & 63) == 0) {
      if (aborting<kGpu>(w)) return false;
      if (w.timeout_ns > 0 && (long long)(globaltimer_ns() - start) > w.timeout_ns) {
        record_timeout(w, site);
        return false;
      }
    }
  }
}

// Wait until *flag == value, acquire. False on timeout / abort (then the caller carries on).
// NOTE: polls with relaxed loads and acquires once, with a fence after the value is seen: an
// acquire load per poll would invalidate the SM's L1 on every iteration, next to the compute warps.
__device__ inline bool wait_acquire(const int* flag, int value, const WaitPolicy& w,
                                    const WaitSite& site) {
  const bool ok = spin_until(w, site, [&] { return ld_relaxed_sys(flag) == value; });
  fence_acq_rel_sys();
  return ok;
}

// wait_acquire at gpu scope (kGpu: every reader and writer of the flag on this GPU) or sys scope.
template <bool kGpu>
__device__ inline bool wait_acquire_at(const int* flag, int value, const WaitPolicy& w,
                                       const WaitSite& site) {
  if constexpr (!kGpu) return wait_acquire(flag, value, w, site);
  const bool ok = spin_until<true>(w, site, [&] { return ld_relaxed_gpu(flag) == value; });
  fence_acq_rel_gpu();
  return ok;
}

// wait_acquire, then consume: the single consumer sets the flag back to 0.
__device__ inline bool wait_acquire_reset(int* flag, int value, const WaitPolicy& w,
                                          const WaitSite& site) {
  const bool ok = wait_acquire(flag, value, w, site);
  st_relaxed_sys(flag, 0);
  return ok;
}

// Injected lateness (tests): sleep `ns` on the global timer.
__device__ inline void delay_ns(long long ns) {
  if (ns <= 0) return;
  const uint64_t start = globaltimer_ns();
  while ((long long)(globaltimer_ns() - start) < ns) __nanosleep(1000);
}

}  // namespace mk
