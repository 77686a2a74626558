// A test of rdma_put through the proxy (primitives/rdma/put.cuh): every emulated rank puts its
// row of `src`, in `puts` tiles, to its peer on the next virtual node; receivers wait for each
// tile's signal and copy the tile into `out` (so a signal seen before its bytes shows as poison).
//
//   CTAs of rank r:  [ poster 0 .. poster C-1 | receiver 0 .. receiver C-1 ]
//   poster c of r:   tiles i = c, c + C, ..: src[r][i] --proxy of r--> dst[d][i], d = (r + W/N) % W
//   receiver c of d: the same tiles from s = (d - W/N) mod W: wait, then out[d][i] = dst[d][i]
//
// Signals (mapped host memory, zero between calls): op set: signals[d][i] = 1, waited == 1 and
// reset by the receiver; op add: signals[d][c] += 1 per tile of poster c, waited >= k + 1 for its
// k-th tile (the proxy drains a ring in order), reset after the last.
#include "kernels/rdma_test.h"
#include "primitives/comm.cuh"
#include "primitives/host/device.h"
#include "primitives/rdma/put.cuh"

namespace mk::rdma {

namespace {

__device__ int* signal_of(const RdmaTestArgs& a, int dest, int tile, int unit) {
  int* s = reinterpret_cast<int*>(a.signals) + (long long)dest * a.signals_per_rank;
  return s + (a.op == kPutSet ? tile : unit);
}

__device__ void post_tiles(const RdmaTestArgs& a, const WaitPolicy& w, int rank, int unit) {
  if (threadIdx.x != 0) return;
  const int dest = (rank + a.world_size / a.nodes) % a.world_size;
  const long long row = a.puts * a.bytes;
  const char* src = reinterpret_cast<const char*>(a.src) + rank * row;
  char* dst = reinterpret_cast<char*>(a.dst) + dest * row;
  const RingView ring = ring_view(reinterpret_cast<void*>(a.rings),
                                  reinterpret_cast<int*>(a.reserve), rank, a.capacity);
  for (int i = unit; i < a.puts; i += a.posters) {
    const Put put{dest, dst + i * a.bytes, src + i * a.bytes, (uint64_t)a.bytes,
                  signal_of(a, dest, i, unit), 1, static_cast<PutOp>(a.op)};
    if (!rdma_put(ring, put, w, kRolePoster)) return;  // timed out: the host raises CommTimeout
  }
}

__device__ void receive_tiles(const RdmaTestArgs& a, const WaitPolicy& w, int rank, int unit) {
  __shared__ int landed;
  const int source = (rank - a.world_size / a.nodes + a.world_size) % a.world_size;
  const long long row = a.puts * a.bytes;
  int k = 0;
  for (int i = unit; i < a.puts; i += a.posters, ++k) {
    int* flag = signal_of(a, rank, i, unit);
    if (threadIdx.x == 0) {
      const WaitSite site{rank, source, -1, kRoleReceiver, kWaitLanded, a.op == kPutSet ? i : unit};
      bool ok;
      if (a.op == kPutSet) {
        ok = wait_acquire_reset(flag, 1, w, site);
      } else {
        // NOTE: >=, not ==: the proxy may add the next tile's count before this poll.
        ok = spin_until(w, site, [&] { return ld_relaxed_sys(flag) >= k + 1; });
        fence_acq_rel_sys();
      }
      landed = ok;
    }
    __syncthreads();  // thread 0's acquire, then the barrier: every thread may read the tile
    const bool ok = landed;
    if (ok && a.receive == kReceiveCopy) {
      const long long off = rank * row + i * a.bytes;
      copy_v4_team(reinterpret_cast<uint4*>(a.out + off),
                   reinterpret_cast<const uint4*>(a.dst + off), a.bytes / 16, threadIdx.x,
                   blockDim.x);
    }
    __syncthreads();  // `landed` is rewritten by the next tile's wait
    if (!ok) return;
  }
  // The counter's only consumer, after its last count: no add can follow.
  if (a.op == kPutAdd && threadIdx.x == 0 && k > 0) st_relaxed_sys(signal_of(a, rank, 0, unit), 0);
}

__global__ void rdma_test_kernel(const RdmaTestArgs a) {
  const int per_rank = a.receive == kReceiveNone ? a.posters : 2 * a.posters;
  const int rank = blockIdx.x / per_rank;
  const int slot = blockIdx.x % per_rank;
  const WaitPolicy w{reinterpret_cast<CommStatus*>(a.status), a.timeout_ns, 256, a.launch};
  if (slot < a.posters) {
    post_tiles(a, w, rank, slot);
  } else {
    receive_tiles(a, w, rank, slot - a.posters);
  }
}

}  // namespace

int launch_rdma_test(const RdmaTestArgs& a, cudaStream_t stream) {
  const bool ok = a.src && a.dst && a.rings && a.reserve && a.signals && a.status &&
                  (a.out || a.receive != kReceiveCopy) && a.world_size >= 1 && a.nodes >= 1 &&
                  a.world_size % a.nodes == 0 && a.puts >= 1 && a.posters >= 1 &&
                  a.capacity >= 1 && a.bytes > 0 && a.bytes % 16 == 0 &&
                  (a.src | a.dst | a.out) % 16 == 0 && a.timeout_ns > 0 &&
                  a.signals_per_rank >= (a.op == kPutSet ? a.puts : a.posters) &&
                  (a.op == kPutSet || a.op == kPutAdd) && a.receive >= 0 &&
                  a.receive <= kReceiveNone && a.threads >= 32 && a.threads <= 1024;
  if (!ok) return kRdmaBadArgs;
  const long long ctas = (long long)a.world_size * a.posters * (a.receive == kReceiveNone ? 1 : 2);
  const int sms = host::num_sms_of_current_device();
  if (sms < 0 || ctas > sms) return kRdmaTooManyCtas;
  rdma_test_kernel<<<(int)ctas, a.threads, 0, stream>>>(a);
  return cudaGetLastError() == cudaSuccess ? kRdmaOk : kRdmaLaunch;
}

const char* rdma_test_status_string(int status) {
  switch (status) {
    case kRdmaOk: return "ok";
    case kRdmaBadArgs: return "bad arguments (sizes, 16-byte alignment, null pointers)";
    case kRdmaTooManyCtas: return "more CTAs than SMs (every CTA must be resident at once)";
    case kRdmaLaunch: return "kernel launch failed";
    default: return "unknown status";
  }
}

}  // namespace mk::rdma
