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

// The sizes every attention params struct holds (AttnParams, AttnBwdParams), from a launcher's
// arguments: the softmax scale folded into log2(e), since the engines exponentiate with exp2.
template <class Params>
inline void set_sizes(Params& p, int B, int S_q, int S_kv, int Hq, int Hkv, float scale,
                      int causal) {
  p.B = B;
  p.S_q = S_q;
  p.S_kv = S_kv;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.group = Hq / Hkv;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = causal;
}

// A launcher's argument check: non-null and `bytes`-aligned (bytes a power of two).
inline bool aligned(const void* ptr, uintptr_t bytes) {
  return ptr != nullptr && (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

}  // namespace mk::attn
