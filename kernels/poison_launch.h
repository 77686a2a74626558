// A failed call's outputs are poisoned (issue 33): after every fused launch, on its stream, a small
// kernel reads the world's CommStatus and, when it records a timeout, fills the launch's
// floating-point outputs with NaN. So the result of an asynchronous call that timed out cannot pass
// for a valid one, whenever the host learns of the timeout (the next call, world.check(), the
// watchdog). One flag read per CTA when nothing failed.
//
// The record is an int64 array (mkernel/runtime/gpu.py poison_record):
//   [0] the CommStatus address (pinned, mapped host memory), [1] the number of outputs n <= 8,
//   then per output: [2 + 3i] its address, [3 + 3i] its element count, [4 + 3i] its PoisonDtype.
#pragma once
#include <cuda_runtime.h>

namespace mk {

enum PoisonDtype : int { kPoisonBf16 = 0, kPoisonF16 = 1, kPoisonF32 = 2 };
constexpr int kPoisonMaxOutputs = 8;

// 0, or cudaErrorInvalidValue for a record the kernel cannot serve (checked before launching).
int launch_poison_if_failed(const long long* record, cudaStream_t stream);

// Loads the poison kernel's module now (CUDA loads modules lazily, at a kernel's first launch). A
// module load waits for the device: the first poison launch, queued right after a fused kernel
// over emulated nodes that waits for the host's rdma proxies, would stall the proxies' copies
// until the kernel timed out (mkernel/runtime/gpu.py run_gpu calls this before a device's first
// fused launch). Returns the cudaError_t.
int preload_poison();

}  // namespace mk
