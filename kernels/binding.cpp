// The one Python binding of the device code: raw addresses and ints in, an error code out.
// No torch headers: tensors cross as data_ptr() ints, streams as their cudaStream_t handle.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "primitives/protocol_gen.h"  // MK_FUSED_OPS: the ops declared in mkernel/ops
#include "kernels/p2p_launch.h"
#include "kernels/record_binding.h"

namespace py = pybind11;

void register_gemm(py::module_& m);  // kernels/gemm_binding.cpp: the plain GEMM engine op

namespace mk {
#define MK_DECLARE_LAUNCH(op) int launch_##op(const long long* record, cudaStream_t);
MK_FUSED_OPS(MK_DECLARE_LAUNCH)
int launch_p2p(const P2PLaunch&, cudaStream_t);
}  // namespace mk

// Every fused op: launch_<op>(record, stream) (kernels/record_binding.h).
#define MK_BIND_LAUNCH(op) mk::def_record_launch(m, "launch_" #op, &mk::launch_##op);

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
  mk::def_poison(m);
}
