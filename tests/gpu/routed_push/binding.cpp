// Binding of the test-only routed_push op (tests/gpu/test_layout_phase_gpu.py).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace mk {
int launch_routed_push(const long long* record, cudaStream_t);
}

PYBIND11_MODULE(_mk_routed_push, m) {
  m.def(
      "launch_routed_push",
      [](uintptr_t record, uintptr_t stream) {
        return mk::launch_routed_push(reinterpret_cast<const long long*>(record),
                                      reinterpret_cast<cudaStream_t>(stream));
      },
      pybind11::arg("record"), pybind11::arg("stream"));
}
