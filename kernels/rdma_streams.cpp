// The proxies' copy streams and the hardware-queue probe: see kernels/rdma_streams.h.
#include "kernels/rdma_streams.h"

#include <cuda.h>

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "kernels/rdma_host_mem.h"
#include "primitives/host/driver_entry.h"

namespace mk::rdma {

namespace {

StreamValue32 required(StreamValue32 fn, const char* name) {
  if (fn == nullptr) throw std::runtime_error(std::string(name) + " not found in the driver");
  return fn;
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string(what) + " failed (" + std::to_string(r) + ")");
}

// Runs `f` with `device` current, then restores the caller's device (torch keeps its own).
template <class F>
auto on_device(int device, F&& f) {
  int prev = 0;
  cudaGetDevice(&prev);
  if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
  struct Restore {
    int d;
    ~Restore() { cudaSetDevice(d); }
  } restore{prev};
  return f();
}

// NOTE: a ring of words, one per probe: a rejected stream's write lands late, once its queue moves
// on; in a word of its own it cannot overwrite a later probe's reset `seen` after that probe's
// write (it would then be missed) unless kWords probes pass meanwhile.
constexpr int kWords = 256;

struct ProbeWords {
  MappedHost mem{2 * kWords * sizeof(uint32_t)};  // [release | seen]; never freed (see below)
  uint32_t gen = 0;
  std::mutex mu;
};

// NOTE: kept for the process's life: freeing pinned memory synchronizes the device, which here
// could wait for a fused kernel that waits for a proxy being moved to another stream.
ProbeWords& words() {
  static ProbeWords* w = new ProbeWords();
  return *w;
}

}  // namespace

StreamValue32 stream_write_value32() {
  static const auto fn =
      reinterpret_cast<StreamValue32>(host::driver_entry_point("cuStreamWriteValue32"));
  return fn;
}

StreamValue32 stream_wait_value32() {
  static const auto fn =
      reinterpret_cast<StreamValue32>(host::driver_entry_point("cuStreamWaitValue32"));
  return fn;
}

uintptr_t copy_stream_create(int device) {
  return on_device(device, [] {
    cudaStream_t s = nullptr;
    // NOTE: non-blocking: the proxy's copies must never wait for (or be waited on by) the legacy
    // default stream, where the posting kernel may run for as long as its puts take.
    const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("copy stream: ") + cudaGetErrorString(e));
    return reinterpret_cast<uintptr_t>(s);
  });
}

void copy_stream_destroy(uintptr_t stream) {
  if (stream != 0) cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream));
}

bool stream_independent(uintptr_t copy, uintptr_t compute, int device, int timeout_us) {
  const StreamValue32 wait = required(stream_wait_value32(), "cuStreamWaitValue32");
  const StreamValue32 write = required(stream_write_value32(), "cuStreamWriteValue32");
  ProbeWords& w = words();
  std::lock_guard<std::mutex> lock(w.mu);
  const uint32_t gen = ++w.gen;
  auto* release = static_cast<uint32_t*>(w.mem.ptr()) + gen % kWords;
  auto* seen = release + kWords;
  __atomic_store_n(seen, 0u, __ATOMIC_RELEASE);
  return on_device(device, [&] {
    check(wait(reinterpret_cast<CUstream>(compute), reinterpret_cast<CUdeviceptr>(release), gen,
               CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue32");
    bool landed = false;
    try {
      check(write(reinterpret_cast<CUstream>(copy), reinterpret_cast<CUdeviceptr>(seen), gen, 0),
            "cuStreamWriteValue32");
      const auto deadline =
          std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
      while (!(landed = __atomic_load_n(seen, __ATOMIC_ACQUIRE) == gen) &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    } catch (...) {
      __atomic_store_n(release, gen, __ATOMIC_RELEASE);  // never leave `compute` waiting
      throw;
    }
    __atomic_store_n(release, gen, __ATOMIC_RELEASE);
    return landed;
  });
}

}  // namespace mk::rdma
