// The one Python binding of the device code: raw addresses and ints in, an error code out.
// No torch headers: tensors cross as data_ptr() ints, streams as their cudaStream_t handle.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "kernels/fused_launch.h"
#include "kernels/p2p_launch.h"

namespace py = pybind11;

void register_gemm(py::module_& m);  // kernels/gemm_binding.cpp: the plain GEMM engine op

namespace mk {
int launch_gemm_rs(const FusedLaunch&, cudaStream_t);
int launch_ag_gemm(const FusedLaunch&, cudaStream_t);
int launch_gemm_ar(const FusedLaunch&, cudaStream_t);
int launch_p2p(const P2PLaunch&, cudaStream_t);
}  // namespace mk

#define FIELD(name) .def_readwrite(#name, &mk::FusedLaunch::name)

PYBIND11_MODULE(_mkernel_ext, m) {
  m.doc() = "mkernel device kernels (launchers over raw pointers)";
  register_gemm(m);
  py::class_<mk::FusedLaunch>(m, "FusedLaunch")
      .def(py::init<>()) FIELD(tiles) FIELD(compute_order) FIELD(comm_tasks) FIELD(tc) FIELD(tm)
          FIELD(compute_units) FIELD(comm_units) FIELD(ctas_per_rank) FIELD(overlap)
              FIELD(tile_config) FIELD(world_size) FIELD(rank0) FIELD(ranks_here) FIELD(timeout_ns)
                  FIELD(status) FIELD(barrier_ptrs) FIELD(silent_rank) FIELD(delay_rank)
                      FIELD(delay_ns) FIELD(a) FIELD(b) FIELD(out) FIELD(a_rank_stride)
                          FIELD(b_rank_stride) FIELD(out_rank_stride) FIELD(M) FIELD(N) FIELD(K)
                              FIELD(work_ptrs) FIELD(flag_ptrs) FIELD(flag2_ptrs)
                                  FIELD(rows_per_rank) FIELD(tiles_per_rank) FIELD(chunk_rows)
                                      FIELD(backoff_ns) FIELD(timeline) FIELD(timeline_cap)
                                          FIELD(transfer) FIELD(work_local) FIELD(aux_ptr);
  m.def(
      "launch_gemm_rs",
      [](const mk::FusedLaunch& L, uintptr_t stream) {
        return mk::launch_gemm_rs(L, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("launch"), py::arg("stream"));
  m.def(
      "launch_ag_gemm",
      [](const mk::FusedLaunch& L, uintptr_t stream) {
        return mk::launch_ag_gemm(L, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("launch"), py::arg("stream"));
  m.def(
      "launch_gemm_ar",
      [](const mk::FusedLaunch& L, uintptr_t stream) {
        return mk::launch_gemm_ar(L, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("launch"), py::arg("stream"));
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
}
