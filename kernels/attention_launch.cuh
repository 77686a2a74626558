// attention_launch.cuh: the kernel and launch shared by the attention launchers (attention.cu over
// mk::attn::AttnEngine, attention_bwd.cu over mk::attn::AttnBwdEngine). Both engines keep one
// contract with their kernel: every thread of the CTA calls Engine::run_cta(params, smem); launch
// with Engine::kThreads threads and __launch_bounds__(kThreads, 1); Engine::kSmemBytes of dynamic
// shared memory, 1024-byte aligned; params in param space (a __grid_constant__ argument: TMA reads
// the maps from there).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace mk::attn {

template <class Engine, class Params>
__global__ void __launch_bounds__(Engine::kThreads, 1)
    engine_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) char smem[];
  Engine::run_cta(p, smem);
}

// Launches engine_kernel<Engine> over `grid` CTAs; the first call of each instance raises its
// dynamic shared-memory limit to Engine::kSmemBytes. Returns the CUDA error of either step.
template <class Engine, class Params>
cudaError_t launch_engine(const Params& p, int grid, cudaStream_t stream) {
  auto* kernel = engine_kernel<Engine, Params>;
  static bool configured = false;  // NOTE: per process and instance; fine for one device kind
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               Engine::kSmemBytes);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  kernel<<<grid, Engine::kThreads, Engine::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// A launcher's argument check: non-null and `bytes`-aligned (bytes a power of two).
inline bool aligned(const void* ptr, uintptr_t bytes) {
  return ptr != nullptr && (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

}  // namespace mk::attn
