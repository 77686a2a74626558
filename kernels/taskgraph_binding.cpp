// The TaskGraph kernel's own extension, _mkernel_taskgraph (mkernel/taskgraph/device.py): its launch
// (the launch record's address, the stream) and the poison kernel every fused launch is followed by.
// No torch headers: tensors cross as data_ptr() ints, streams as their cudaStream_t handle.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "kernels/poison_launch.h"

namespace py = pybind11;

namespace mk {
int launch_taskgraph(const long long* record, cudaStream_t);
}  // namespace mk

PYBIND11_MODULE(_mkernel_taskgraph, m) {
  m.doc() = "mkernel's TaskGraph kernel (launcher over raw pointers)";
  m.def(
      "launch_taskgraph",
      [](uintptr_t record, uintptr_t stream) {
        return mk::launch_taskgraph(reinterpret_cast<const long long*>(record),
                                    reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("record"), py::arg("stream"));
  m.attr("POISON_MAX_OUTPUTS") = mk::kPoisonMaxOutputs;
  m.def(
      "launch_poison_if_failed",
      [](uintptr_t record, uintptr_t stream) {
        return mk::launch_poison_if_failed(reinterpret_cast<const long long*>(record),
                                           reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("record"), py::arg("stream"));
  m.def("preload_poison", &mk::preload_poison);
}
