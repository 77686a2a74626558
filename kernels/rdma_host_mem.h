// MappedHost: pinned host memory mapped into the device's address space (cudaHostAllocMapped),
// zeroed. Holds the proxy rings, the signals the proxy raises and the launch's CommStatus: memory
// that device code and host threads both read and write.
//
// NOTE: under unified virtual addressing (every 64-bit CUDA platform) the device address of such
// memory is its host address. Descriptors carry one address for both sides, so the constructor
// checks it (cudaHostGetDevicePointer) and refuses memory where they differ.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mk::rdma {

class MappedHost {
 public:
  explicit MappedHost(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) throw std::invalid_argument("MappedHost: bytes must be > 0");
    // NOTE: not write-combined: the host proxy reads this memory, and WC reads are uncached.
    check(cudaHostAlloc(&ptr_, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc");
    void* dev = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&dev, ptr_, 0);
    if (e != cudaSuccess || dev != ptr_) {
      cudaFreeHost(ptr_);
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(e));
      throw std::runtime_error(
          "MappedHost: the device address differs from the host address (no unified addressing)");
    }
    std::memset(ptr_, 0, bytes);
  }
  ~MappedHost() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;

  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  void* ptr_ = nullptr;
  size_t bytes_;
};

}  // namespace mk::rdma
