// The proxies' copy streams, and the probe that tells whether one shares a hardware queue with a
// stream that launches fused kernels.
//
// Why: CUDA feeds the streams of a context to the GPU through a few hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS, default 8, at most 32; streams are dealt to them in turn). A
// command that must wait (the next launch, an event record, a copy of the result: anything queued
// behind a running fused kernel in its stream) holds up every later command of its queue,
// whatever their stream. A proxy stream in that queue cannot run the copies the kernel waits for:
// deadlock until the deadline. Measured on the H200 (tools/queue_probe.py): with one connection
// every asynchronous loop stalled; with 8, W = 8 proxies (one stream each) stalled; with 32 none;
// stream priority changed nothing. Two proxy streams in one queue stalled as well, so the proxies
// of a device share one copy stream (mkernel/rdma_streams.py).
//
// The probe: `compute` waits (cuStreamWaitValue32) for a host word while `copy` writes another
// (cuStreamWriteValue32). If the write lands while `compute` still waits, the two do not share a
// queue. Neither command needs an SM; neither waits for anything but the other's queue.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mk::rdma {

// cuStreamWriteValue32 / cuStreamWaitValue32 from the driver (the runtime has neither; no -lcuda
// needed): nullptr when the driver lacks them. The proxy's device signals use the first
// (RingProxy::write_device_signal), the probe below both.
using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
StreamValue32 stream_write_value32();
StreamValue32 stream_wait_value32();

// A non-blocking stream on `device` (throws std::runtime_error on failure).
uintptr_t copy_stream_create(int device);
// Destroys it: returns at once; CUDA frees it once its queued work is done.
void copy_stream_destroy(uintptr_t stream);
// Whether work on `copy` proceeds while `compute`'s next command waits (see above), within
// `timeout_us`. `compute` must not be capturing a graph; 0 is the legacy default stream. False
// also when the GPU is too busy to run the write in time (the caller then takes another stream).
bool stream_independent(uintptr_t copy, uintptr_t compute, int device, int timeout_us);

}  // namespace mk::rdma
