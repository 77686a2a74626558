// A test of rdma_put through the nvshmem transport (primitives/rdma/put_nvshmem.cuh), the twin of
// kernels/rdma_test.cu for a distributed world (one process per GPU, PE = rank): this PE puts its
// row of `src`, in `puts` tiles, to its peer on the next virtual node; its receivers wait for each
// tile of the peer on the previous node and copy it into `out` (a signal seen before its bytes
// shows as poison in `out`).
//
//   CTAs:          [ poster 0 .. poster C-1 | receiver 0 .. receiver C-1 ]
//   poster c:      tiles i = c, c + C, ..: src[i] --> dst[i] of PE d = (rank + W/N) % W
//   receiver c:    the same tiles from PE s = (rank - W/N) mod W: wait, then out[i] = dst[i]
#include "kernels/nvshmem_test.h"
#include "primitives/comm.cuh"
#include "primitives/host/device.h"
#include "primitives/rdma/put_nvshmem.cuh"

namespace mk::rdma::nv {

namespace {

__device__ uint64_t* signal_of(const NvTestArgs& a, int tile, int unit) {
  return reinterpret_cast<uint64_t*>(a.signals) + (a.op == kNvSet ? tile : unit);
}

__device__ void post_tiles(const NvTestArgs& a, int unit) {
  const int dest = (a.rank + a.world_size / a.nodes) % a.world_size;
  const char* src = reinterpret_cast<const char*>(a.src);
  char* dst = reinterpret_cast<char*>(a.dst);
  for (int i = unit; i < a.puts; i += a.posters)
    put_signal_block(dst + i * a.bytes, src + i * a.bytes, a.bytes, signal_of(a, i, unit), 1,
                     a.op == kNvAdd, dest);
  // NOTE: the puts are non-blocking: the source is the caller's again only once they completed
  if (threadIdx.x == 0) nvshmem_quiet();
}

// Waits for one signal (bounded, thread 0), then the barrier: every thread may read what it covers.
__device__ bool wait_landed(const NvTestArgs& a, const WaitPolicy& w, const uint64_t* flag,
                            uint64_t value, int index) {
  __shared__ int landed;
  const int source = (a.rank - a.world_size / a.nodes + a.world_size) % a.world_size;
  if (threadIdx.x == 0) {
    const WaitSite site{a.rank, source, -1, kNvReceiver, kNvWaitLanded, index};
    landed = wait_signal_geq(flag, value, w, site);
  }
  __syncthreads();
  const bool ok = landed;
  __syncthreads();  // `landed` is rewritten by the next wait
  return ok;
}

__device__ void copy_tile(const NvTestArgs& a, int i) {
  if (a.receive != kNvReceiveCopy) return;
  const long long off = (long long)i * a.bytes;
  copy_v4_team(reinterpret_cast<uint4*>(a.out + off), reinterpret_cast<const uint4*>(a.dst + off),
               a.bytes / 16, threadIdx.x, blockDim.x);
}

__device__ void receive_tiles(const NvTestArgs& a, const WaitPolicy& w, int unit) {
  if (a.op == kNvAdd) {
    // NOTE: a count says how many of the poster's puts landed, not which (over a network puts may
    // complete out of order): wait for all of them, then read.
    const int tiles = (a.puts - unit + a.posters - 1) / a.posters;
    uint64_t* flag = signal_of(a, 0, unit);
    if (tiles == 0 || !wait_landed(a, w, flag, tiles, unit)) return;
    for (int i = unit; i < a.puts; i += a.posters) copy_tile(a, i);
    if (threadIdx.x == 0) *flag = 0;  // the counter's only consumer, after its last count
    return;
  }
  for (int i = unit; i < a.puts; i += a.posters) {
    uint64_t* flag = signal_of(a, i, unit);
    if (!wait_landed(a, w, flag, 1, i)) return;
    copy_tile(a, i);
    if (threadIdx.x == 0) *flag = 0;  // consumed: zero for the next call
  }
}

__global__ void nvshmem_test_kernel(const NvTestArgs a) {
  const WaitPolicy w{reinterpret_cast<CommStatus*>(a.status), a.timeout_ns, 256, a.launch};
  if ((int)blockIdx.x < a.posters) {
    post_tiles(a, blockIdx.x);
  } else {
    receive_tiles(a, w, blockIdx.x - a.posters);
  }
}

}  // namespace

int launch_nvshmem_test(const NvTestArgs& a, cudaStream_t stream) {
  const bool ok =
      a.src && a.dst && a.signals && a.status && (a.out || a.receive != kNvReceiveCopy) &&
      a.world_size >= 2 && a.nodes >= 2 && a.world_size % a.nodes == 0 && a.rank >= 0 &&
      a.rank < a.world_size && a.puts >= 1 && a.posters >= 1 && a.bytes > 0 && a.bytes % 16 == 0 &&
      (a.src | a.dst | a.out) % 16 == 0 && a.timeout_ns > 0 && (a.op == kNvSet || a.op == kNvAdd) &&
      (a.receive == kNvReceiveCopy || a.receive == kNvReceiveWait) && a.threads >= 32 &&
      a.threads <= 1024 && a.threads % 32 == 0;
  if (!ok) return kNvBadArgs;
  const int sms = host::num_sms_of_current_device();
  if (sms < 0 || 2 * a.posters > sms) return kNvTooManyCtas;
  nvshmem_test_kernel<<<2 * a.posters, a.threads, 0, stream>>>(a);
  return cudaGetLastError() == cudaSuccess ? kNvOk : kNvLaunch;
}

const char* nvshmem_test_status_string(int status) {
  switch (status) {
    case kNvOk: return "ok";
    case kNvBadArgs: return "bad arguments (sizes, 16-byte alignment, null pointers, W, nodes)";
    case kNvTooManyCtas: return "more CTAs than SMs (every CTA must be resident at once)";
    case kNvLaunch: return "kernel launch failed";
    default: return "unknown status";
  }
}

}  // namespace mk::rdma::nv
