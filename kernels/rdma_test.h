// Arguments of the rdma_put test kernel (kernels/rdma_test.cu), bound to Python as
// _mkernel_rdma.RdmaTestArgs (kernels/rdma_binding.cpp, used by mkernel/rdma.py).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "primitives/rdma/ring_layout.h"

namespace mk::rdma {

// CommStatus.pad of the test's own wait, after the ring's (RingWait).
enum TestWait : int32_t { kWaitLanded = kRingWaits, kTestWaits };
// CommStatus.role of a timed-out wait.
enum TestRole : int32_t { kRolePoster = 0, kRoleReceiver = 1, kTestRoles };
// What the receivers do: copy what landed into `out`, only wait for the signals, or nothing
// (no receiver CTAs: only the posters' waits can time out).
enum TestReceive : int32_t { kReceiveCopy = 0, kReceiveWait = 1, kReceiveNone = 2 };

struct RdmaTestArgs {
  // device, [W, puts * bytes] each: rank r's row starts at base + r * puts * bytes
  uint64_t src = 0;  // rank r puts its row to rank (r + W / nodes) % W
  uint64_t dst = 0;  // where the puts land
  uint64_t out = 0;  // receivers copy each put here after its signal (kReceiveCopy)
  uint64_t rings = 0;    // mapped host: W rings back to back (ring_layout.h)
  uint64_t reserve = 0;  // device int32 [W]: the rings' tickets
  uint64_t signals = 0;  // mapped host int32 [W, signals_per_rank]: zero between calls
  uint64_t status = 0;   // mapped host CommStatus
  long long bytes = 0;   // per put; a multiple of 16
  long long timeout_ns = 0;
  int world_size = 0, nodes = 0;
  int puts = 0;     // per rank
  int posters = 1;  // poster CTAs per rank (put i is posted by CTA i % posters); receivers alike
  int capacity = 1, signals_per_rank = 0;
  int op = kPutSet;  // set: a flag per put, waited == 1 and reset; add: a counter per poster CTA
  int receive = kReceiveCopy;
  int threads = 256;
  int launch = 0;  // recorded with a timeout
};

enum RdmaTestStatus : int { kRdmaOk = 0, kRdmaBadArgs = 1, kRdmaTooManyCtas = 2, kRdmaLaunch = 3 };

// Validates (every CTA must be resident at once: receivers spin while posters post) and launches.
int launch_rdma_test(const RdmaTestArgs& a, cudaStream_t stream);
const char* rdma_test_status_string(int status);

}  // namespace mk::rdma
