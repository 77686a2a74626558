// driver_entry.h: a CUDA driver function by name, through the runtime's entry-point query, so that
// nothing links libcuda (tensor_map.h's cuTensorMapEncodeTiled, the rdma proxy's
// cuStreamWriteValue32). Header-only, host code.
#pragma once
#include <cuda_runtime.h>

namespace mk::host {

// The driver's `name` at its CUDA 12.0 ABI, or nullptr (the query's error is cleared).
inline void* driver_entry_point(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

}  // namespace mk::host
