// The NaN fill of a timed-out launch's outputs (kernels/poison_launch.h says why and the record).
// NOTE: a few CTAs only: on the success path each reads one word of host memory and returns; the
// fill itself runs only after a timeout, where its speed does not matter.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/poison_launch.h"
#include "primitives/protocol_gen.h"

namespace mk {

struct PoisonOutputs {
  const CommStatus* status;
  int n;
  void* ptr[kPoisonMaxOutputs];
  long long count[kPoisonMaxOutputs];
  int dtype[kPoisonMaxOutputs];
};

constexpr int kPoisonCtas = 16;
constexpr int kPoisonThreads = 256;

__global__ void __launch_bounds__(kPoisonThreads)
    poison_if_failed(const __grid_constant__ PoisonOutputs p) {
  __shared__ int failed;
  // NOTE: volatile: the fused kernel before this one on the stream wrote it with system scope;
  // the kernel boundary orders those writes before this read.
  if (threadIdx.x == 0) failed = *reinterpret_cast<const volatile int*>(&p.status->error);
  __syncthreads();
  if (failed != kErrorTimeout) return;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (int o = 0; o < p.n; ++o) {
    if (p.dtype[o] == kPoisonF32) {
      uint32_t* d = static_cast<uint32_t*>(p.ptr[o]);
      for (long long i = first; i < p.count[o]; i += stride) d[i] = 0x7FC00000u;  // fp32 NaN
    } else {
      const uint16_t nan = p.dtype[o] == kPoisonBf16 ? 0x7FC0 : 0x7E00;  // bf16 / fp16 NaN
      uint16_t* d = static_cast<uint16_t*>(p.ptr[o]);
      for (long long i = first; i < p.count[o]; i += stride) d[i] = nan;
    }
  }
}

int launch_poison_if_failed(const long long* record, cudaStream_t stream) {
  PoisonOutputs p{};
  p.status = reinterpret_cast<const CommStatus*>(record[0]);
  p.n = (int)record[1];
  if (p.status == nullptr || p.n < 0 || p.n > kPoisonMaxOutputs) return cudaErrorInvalidValue;
  for (int i = 0; i < p.n; ++i) {
    p.ptr[i] = reinterpret_cast<void*>(record[2 + 3 * i]);
    p.count[i] = record[3 + 3 * i];
    p.dtype[i] = (int)record[4 + 3 * i];
    if (p.dtype[i] < kPoisonBf16 || p.dtype[i] > kPoisonF32 || p.count[i] < 0) {
      return cudaErrorInvalidValue;
    }
  }
  poison_if_failed<<<kPoisonCtas, kPoisonThreads, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

int preload_poison() {
  cudaFuncAttributes attr;
  return (int)cudaFuncGetAttributes(&attr, poison_if_failed);
}

}  // namespace mk
