// The one Python binding of the device code: raw addresses and ints in, an error code out.
// No torch headers: tensors cross as data_ptr() ints, streams as their cudaStream_t handle.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "primitives/protocol_gen.h"  // MK_FUSED_OPS: the ops declared in mkernel/ops
#include "kernels/p2p_launch.h"
#include "kernels/poison_launch.h"

namespace py = pybind11;

void register_gemm(py::module_& m);  // kernels/gemm_binding.cpp: the plain GEMM engine op

namespace mk {
#define MK_DECLARE_LAUNCH(op) int launch_##op(const long long* record, cudaStream_t);
MK_FUSED_OPS(MK_DECLARE_LAUNCH)
int launch_p2p(const P2PLaunch&, cudaStream_t);
}  // namespace mk

// Every fused op: launch_<op>(record, stream), the record an int64 array's address
// (mkernel/protocol.py RECORD_FIELDS), the stream a cudaStream_t handle.
#define MK_BIND_LAUNCH(op)                                                               \
  m.def(                                                                                 \
      "launch_" #op,                                                                     \
      [](uintptr_t record, uintptr_t stream) {                                           \
        return mk::launch_##op(reinterpret_cast<const long long*>(record),               \
                               reinterpret_cast<cudaStream_t>(stream));                  \
      },                                                                                 \
      py::arg("record"), py::arg("stream"));

PYBIND11_MODULE(_mkernel_ext, m) {
  m.doc() = "mkernel device kernels (launchers over raw pointers)";
  register_gemm(m);
  MK_FUSED_OPS(MK_BIND_LAUNCH)
  py::class_<mk::P2PLaunch>(m, "P2PLaunch")
      .def(py::init<>())
      .def_readwrite("src", &mk::P2PLaunch::src)
      .def_readwrite("dst", &mk::P2PLaunch::dst)
      .def_readwrite("bytes", &mk::P2PLaunch::bytes)
      .def_readwrite("ctas", &mk::P2PLaunch::ctas)
      .def_readwrite("threads", &mk::P2PLaunch::threads)
      .def_readwrite("mode", &mk::P2PLaunch::mode)
      .def_readwrite("chunk_bytes", &mk::P2PLaunch::chunk_bytes);
  m.def(
      "launch_p2p",
      [](const mk::P2PLaunch& L, uintptr_t stream) {
        return mk::launch_p2p(L, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("launch"), py::arg("stream"));
  // After every fused launch: NaN into its float outputs if the world's status records a timeout
  // (kernels/poison_launch.h: the record's layout).
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
