// pybind11 definitions both extensions make (kernels/binding.cpp, kernels/taskgraph_binding.cpp):
// a launcher over a launch record, and the poison kernel every fused launch is followed by.
// No torch headers: a record crosses as its int64 array's address, a stream as its handle.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "kernels/poison_launch.h"

namespace mk {

using RecordLaunch = int (*)(const long long* record, cudaStream_t stream);

// m.<name>(record, stream) -> fn's error code (the record: mkernel/protocol.py RECORD_FIELDS).
inline void def_record_launch(pybind11::module_& m, const char* name, RecordLaunch fn) {
  m.def(
      name,
      [fn](uintptr_t record, uintptr_t stream) {
        return fn(reinterpret_cast<const long long*>(record),
                  reinterpret_cast<cudaStream_t>(stream));
      },
      pybind11::arg("record"), pybind11::arg("stream"));
}

// After every fused launch: NaN into its float outputs if the world's status records a timeout
// (kernels/poison_launch.h: the record's layout).
inline void def_poison(pybind11::module_& m) {
  m.attr("POISON_MAX_OUTPUTS") = kPoisonMaxOutputs;
  def_record_launch(m, "launch_poison_if_failed", &launch_poison_if_failed);
  m.def("preload_poison", &preload_poison);
}

}  // namespace mk
