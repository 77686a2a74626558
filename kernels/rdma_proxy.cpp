// The host proxy thread of one ring: see kernels/rdma_proxy.h for the protocol and why.
#include "kernels/rdma_proxy.h"

#include "kernels/rdma_streams.h"

#include <chrono>
#include <stdexcept>
#include <vector>

namespace mk::rdma {

namespace {

// Polls that spin (with a yield) before the proxy sleeps between polls: a busy ring is seen within
// a microsecond, an idle one costs no core.
constexpr int kSpinPolls = 4096;
constexpr auto kIdleSleep = std::chrono::microseconds(20);
// NOTE: an idle proxy's sleeps double up to this: at 20 us each of many idle proxies (an
// emulated world's W, times the worlds alive) woke 50000 times a second, and on a 16-core host
// the one proxy with work was starved for seconds (GPU tests: waits for its puts timed out).
constexpr auto kLongIdleSleep = std::chrono::microseconds(640);

int32_t load_acquire(const int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(int32_t* p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

}  // namespace

bool RingProxy::write_device_signal(cudaStream_t stream, uint64_t signal, int32_t value) {
  const StreamValue32 write = stream_write_value32();
  if (write == nullptr) return fail("cuStreamWriteValue32 not found in the driver");
  // NOTE: flags 0 (not CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER): the write is preceded by a
  // memory fence, so a device waiter that sees the value (acquire) sees the copy's bytes.
  const CUresult r = write(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(signal),
                           static_cast<cuuint32_t>(value), 0);
  if (r != CUDA_SUCCESS) return fail("cuStreamWriteValue32 failed (" + std::to_string(r) + ")");
  return true;
}

RingProxy::RingProxy(const ProxyConfig& cfg)
    : cfg_(cfg), header_(static_cast<RingHeader*>(cfg.ring)) {
  if (header_ == nullptr || header_->capacity < 1)
    throw std::invalid_argument("RingProxy: the ring must be allocated with capacity >= 1");
  if (cfg.stream == nullptr) throw std::invalid_argument("RingProxy: no copy stream");
}

RingProxy::~RingProxy() {
  stop();
  if (scratch_ != nullptr) cudaFree(scratch_);
}

void RingProxy::start(bool stalled) {
  if (thread_.joinable()) throw std::logic_error("RingProxy: already running");
  stop_.store(false);
  stalled_.store(stalled);
  failed_.store(false);
  ready_.store(false);
  done_.store(0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_.clear();
  }
  next_ = load_acquire(&header_->tail);
  thread_ = std::thread([this] { run(); });
}

void RingProxy::set_stream(cudaStream_t stream) {
  if (thread_.joinable()) throw std::logic_error("RingProxy: set_stream while running");
  if (stream == nullptr) throw std::invalid_argument("RingProxy: no copy stream");
  cfg_.stream = stream;
}

void RingProxy::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  thread_.join();
}

std::string RingProxy::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool RingProxy::fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty())
      error_ = "rdma proxy of rank " + std::to_string(header_->rank) + ": " + what;
  }
  failed_.store(true);
  return false;
}

void RingProxy::run() {
  cudaStream_t stream = cfg_.stream;
  const cudaError_t e = cudaSetDevice(cfg_.device);
  if (e != cudaSuccess) fail(std::string("device: ") + cudaGetErrorString(e));
  if (e == cudaSuccess && warm_up(stream)) ready_.store(true);
  int idle = 0;
  auto sleep = kIdleSleep;
  while (!stop_.load(std::memory_order_relaxed)) {
    if (stalled_.load(std::memory_order_relaxed) || failed_.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(kIdleSleep);
      continue;
    }
    const int32_t head = load_acquire(&header_->head);
    if (head == next_) {
      if (++idle < kSpinPolls) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(sleep);
        if (sleep < kLongIdleSleep) sleep *= 2;
      }
      continue;
    }
    idle = 0;
    sleep = kIdleSleep;
    drain(head, stream);  // on failure the loop idles until stop()
  }
  cudaStreamSynchronize(stream);  // the stream is the caller's (ProxyConfig::stream)
}

// One of each operation a drain issues, on the proxy's own bytes, before any put: measured on
// the H200, a fused kernel's first call could wait seconds for a new proxy's first copy while
// its CTAs held every SM it could run on (same-device copies run as kernels); done here, before
// the launch that needs them, nothing of the first put waits for that kernel.
bool RingProxy::warm_up(cudaStream_t stream) {
  constexpr size_t kBytes = 4096;
  if (scratch_ == nullptr) {
    const cudaError_t e = cudaMalloc(&scratch_, 2 * kBytes);
    if (e != cudaSuccess) return fail(std::string("warm-up: ") + cudaGetErrorString(e));
  }
  // as a drain issues them: a copy, a 2D copy and its device signal (into the scratch itself)
  char* a = static_cast<char*>(scratch_);
  PutDescriptor copy{};
  copy.dst = reinterpret_cast<uint64_t>(a + kBytes);
  copy.src = reinterpret_cast<uint64_t>(a);
  copy.bytes = kBytes;
  copy.rows = 1;
  PutDescriptor copy_2d = copy;
  copy_2d.bytes = 128;
  copy_2d.rows = 8;
  copy_2d.dst_pitch = copy_2d.src_pitch = 256;
  copy_2d.op = kPutSetDevice;
  copy_2d.signal = reinterpret_cast<uint64_t>(a);
  if (!issue(copy, stream) || !issue(copy_2d, stream)) return false;
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(std::string("warm-up: ") + cudaGetErrorString(e));
  return true;
}

// One put on the proxy's stream: its copy (2D for several rows) and, for a device signal, the
// signal's write after it.
bool RingProxy::issue(const PutDescriptor& d, cudaStream_t stream) {
  if (d.bytes > 0) {
    auto* dst = reinterpret_cast<void*>(d.dst);
    const auto* src = reinterpret_cast<const void*>(d.src);
    const cudaError_t e = d.rows == 1
                              ? cudaMemcpyAsync(dst, src, d.bytes, cudaMemcpyDeviceToDevice, stream)
                              : cudaMemcpy2DAsync(dst, d.dst_pitch, src, d.src_pitch, d.bytes,
                                                  d.rows, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return fail(std::string("copy: ") + cudaGetErrorString(e));
  }
  // ordered after the copy above on this stream, fenced
  return d.op != kPutSetDevice || write_device_signal(stream, d.signal, d.value);
}

bool RingProxy::drain(int32_t head, cudaStream_t stream) {
  const int cap = header_->capacity;
  const int32_t n = head - next_;
  if (n < 0 || n > cap) {
    return fail("head " + std::to_string(head) + " is not within capacity " +
                std::to_string(cap) + " of the next count " + std::to_string(next_));
  }
  // A private copy: once checked, the batch no longer depends on the ring's memory.
  std::vector<PutDescriptor> batch(n);
  const PutDescriptor* slots = ring_slots(header_);
  for (int32_t i = 0; i < n; ++i) batch[i] = slots[(next_ + i) % cap];
  for (int32_t i = 0; i < n; ++i) {
    const PutDescriptor& d = batch[i];
    const std::string at = "descriptor " + std::to_string(next_ + i) + ": ";
    if (d.ticket != next_ + i)
      return fail(at + "stale slot (ticket " + std::to_string(d.ticket) + ")");
    if (d.dest_rank < 0 || d.dest_rank >= cfg_.world_size)
      return fail(at + "dest_rank " + std::to_string(d.dest_rank) + " out of range");
    if (d.op != kPutSet && d.op != kPutAdd && d.op != kPutSetDevice) return fail(at + "unknown op");
    const bool host_signal = d.op != kPutSetDevice;
    if (host_signal &&
        (d.signal < cfg_.signal_lo || d.signal + sizeof(int32_t) > cfg_.signal_hi || d.signal % 4))
      return fail(at + "signal address outside the signal block");
    if (d.signal == 0 || d.signal % 4) return fail(at + "no signal");
    // NOTE: the fused ops' puts of no bytes (a rank's arrival) are signals only; the exchange's
    // puts always carry bytes.
    if (d.bytes > 0 && (d.dst == 0 || d.src == 0)) return fail(at + "no source or destination");
    if (host_signal && d.bytes == 0) return fail(at + "empty put");
    if (d.rows < 1 || (d.rows > 1 && (d.dst_pitch < d.bytes || d.src_pitch < d.bytes)))
      return fail(at + "rows " + std::to_string(d.rows) + " with pitches below the row's bytes");
  }
  for (const PutDescriptor& d : batch) {
    if (!issue(d, stream)) return false;
  }
  // The copies have completed once this returns: only now may the signals say so.
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(std::string("copy: ") + cudaGetErrorString(e));
  for (const PutDescriptor& d : batch) {
    auto* sig = reinterpret_cast<int32_t*>(d.signal);
    if (d.op == kPutSetDevice) continue;  // written by the stream, after its copy
    if (d.op == kPutSet) {
      __atomic_store_n(sig, d.value, __ATOMIC_RELEASE);
    } else {
      __atomic_fetch_add(sig, d.value, __ATOMIC_RELEASE);
    }
  }
  // The slots were read into `batch` above and the signals are raised: posters may reuse them.
  next_ = head;
  store_release(&header_->tail, head);
  done_.fetch_add(n, std::memory_order_relaxed);
  return true;
}

}  // namespace mk::rdma
