// device.h: host facts of the current CUDA device that launchers size their grids by.
// Header-only; include from host code (.cu or .cpp compiled with the CUDA runtime).
#pragma once
#include <cuda_runtime.h>

namespace mk::host {

// Multiprocessors of the current device (persistent grids launch one CTA per SM), -1 on error.
inline int num_sms_of_current_device() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
  return n;
}

}  // namespace mk::host
