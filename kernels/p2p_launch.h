// Launch config of kernels/p2p.cu (bound to Python as _mkernel_ext.P2PLaunch).
#pragma once
#include <cstdint>

namespace mk {

struct P2PLaunch {
  uint64_t src = 0, dst = 0;  // 16-byte aligned
  long long bytes = 0;        // multiple of 16
  int ctas = 1, threads = 256, mode = 0;
  int chunk_bytes = 16384;  // per bulk op (kernels/p2p.cu: how many are in flight per mode)
};

}  // namespace mk
