// The TaskGraph kernel's own extension, _mkernel_taskgraph (mkernel/taskgraph/device.py): its launch
// (the launch record's address, the stream) and the poison kernel every fused launch is followed by.
// No torch headers: tensors cross as data_ptr() ints, streams as their cudaStream_t handle.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "kernels/record_binding.h"

namespace mk {
int launch_taskgraph(const long long* record, cudaStream_t);
}  // namespace mk

PYBIND11_MODULE(_mkernel_taskgraph, m) {
  m.doc() = "mkernel's TaskGraph kernel (launcher over raw pointers)";
  mk::def_record_launch(m, "launch_taskgraph", &mk::launch_taskgraph);
  mk::def_poison(m);
}
