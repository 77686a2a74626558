// The host proxy of one rank's ring (the `proxy` transport of rdma_put): a C++ thread, no Python,
// no GIL, that drains the ring (primitives/rdma/ring_layout.h) in count order.
//
// Per batch (the descriptors published since the last one):
//   acquire head -> copy the batch's descriptors out of the ring -> check them ->
//   cudaMemcpyAsync each (device to device, on the copy stream it is given; 2D for a tile's
//   rows; a device signal's cuStreamWriteValue32 right after its copy) ->
//   cudaStreamSynchronize -> raise each host signal (host atomic, release) in count order ->
//   release tail = last count + 1 (the slots may be rewritten).
//
// Why the signal lives in mapped host memory and is raised by the host thread: after the stream
// synchronize the copy has completed (its bytes are in the destination GPU's memory, L2 being its
// point of coherence); the host's release store or fetch_add then happens after it, and a device
// waiter that acquires the signal at system scope (ld.relaxed.sys + fence.acq_rel.sys, signal.cuh)
// reads the bytes. An "add" is a real read-modify-write (several proxies may add into one signal),
// no kernel is launched per put (a tiny signalling kernel would need a free SM while the
// receivers spin), and it is the pattern of NCCL's host proxy (device polls host-written counters).
//
// Failure modes: a descriptor that fails its checks, or a CUDA error, is recorded in error() and
// the proxy stops draining (it idles until stop()): waiters then time out on the device. stop()
// never waits for the device beyond the copies already issued.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "primitives/rdma/ring_layout.h"

namespace mk::rdma {

struct ProxyConfig {
  void* ring = nullptr;  // this rank's RingHeader (mapped host memory, capacity already set)
  int device = 0;        // the CUDA device the copies run on
  int world_size = 1;    // dest_rank must lie in [0, world_size)
  uintptr_t signal_lo = 0, signal_hi = 0;  // signals must lie in [lo, hi): the only host memory
                                           // the proxy writes besides the ring's tail
  // The stream the copies run on, required: non-blocking (they must never wait for, or be waited
  // on by, the legacy default stream, where the posting kernel may run as long as its puts
  // take), shared by the device's proxies and kept out of the launching streams' hardware queues
  // by the caller (kernels/rdma_streams.h, mkernel/rdma_streams.py).
  cudaStream_t stream = nullptr;
};

class RingProxy {
 public:
  explicit RingProxy(const ProxyConfig& cfg);
  ~RingProxy();
  RingProxy(const RingProxy&) = delete;
  RingProxy& operator=(const RingProxy&) = delete;

  // Starts the thread; it continues from the ring's tail. stalled: alive but draining nothing.
  void start(bool stalled = false);
  // Asks the thread to end and joins it (bounded: at most the copies of one batch).
  void stop();
  void set_stalled(bool stalled) { stalled_.store(stalled, std::memory_order_relaxed); }
  // Another stream for the copies (ProxyConfig::stream); only while stopped.
  void set_stream(cudaStream_t stream);
  bool running() const { return thread_.joinable(); }
  // The thread has made its stream and run one of each of its operations (warm_up): a launch
  // that waits for its puts may begin.
  bool ready() const { return ready_.load(); }
  long long done() const { return done_.load(std::memory_order_relaxed); }  // puts since start
  std::string error() const;

 private:
  void run();
  bool drain(int32_t head, cudaStream_t stream);
  bool warm_up(cudaStream_t stream);
  bool issue(const PutDescriptor& d, cudaStream_t stream);
  bool fail(const std::string& what);  // records the first error; returns false
  // kPutSetDevice: the signal's value written by `stream` after what it holds (fenced).
  bool write_device_signal(cudaStream_t stream, uint64_t signal, int32_t value);

  ProxyConfig cfg_;
  RingHeader* header_;
  std::thread thread_;
  std::atomic<bool> stop_{false}, stalled_{false}, failed_{false}, ready_{false};
  void* scratch_ = nullptr;  // warm_up's device bytes, freed by the destructor
  std::atomic<long long> done_{0};
  int32_t next_ = 0;  // the first count not yet done (the proxy thread's own)
  mutable std::mutex mu_;
  std::string error_;
};

}  // namespace mk::rdma
