// Arguments of the nvshmem transport's test kernel (kernels/nvshmem_test.cu), bound to Python as
// _mkernel_nvshmem.NvTestArgs (kernels/nvshmem_binding.cpp, used by mkernel/rdma_nvshmem.py).
// One process per GPU: this PE is `rank` of a distributed world of `world_size` PEs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace mk::rdma::nv {

enum NvTestWait : int32_t { kNvWaitLanded = 0 };               // CommStatus.pad
enum NvTestRole : int32_t { kNvPoster = 0, kNvReceiver = 1 };  // CommStatus.role
enum NvTestOp : int32_t { kNvSet = 0, kNvAdd = 1 };
enum NvTestReceive : int32_t { kNvReceiveCopy = 0, kNvReceiveWait = 1 };

struct NvTestArgs {
  uint64_t src = 0;      // device, puts * bytes: this PE's row, put to PE (rank + W / nodes) % W
  uint64_t dst = 0;      // symmetric, puts * bytes: where the source PE's puts land
  uint64_t out = 0;      // device, puts * bytes: receivers copy each tile here after its signal
  uint64_t signals = 0;  // symmetric uint64 [puts] (set) or [posters] (add): zero between calls
  uint64_t status = 0;   // mapped host CommStatus
  long long bytes = 0;   // per put; a multiple of 16
  long long timeout_ns = 0;
  int rank = 0, world_size = 1, nodes = 1;
  int puts = 1;     // tiles of the row
  int posters = 1;  // poster CTAs (tile i by CTA i % posters); as many receiver CTAs
  int op = kNvSet;  // set: a signal per tile, waited >= 1; add: a counter per poster, >= k + 1
  int receive = kNvReceiveCopy;
  int threads = 256;
  int launch = 0;  // recorded with a timeout
};

enum NvTestStatus : int { kNvOk = 0, kNvBadArgs = 1, kNvTooManyCtas = 2, kNvLaunch = 3 };

int launch_nvshmem_test(const NvTestArgs& a, cudaStream_t stream);
const char* nvshmem_test_status_string(int status);

}  // namespace mk::rdma::nv
