// gemm_binding.cpp: pybind11 registration of the plain and the grouped GEMM launchers (no torch
// headers).
// kernels/binding.cpp (the package's module) calls register_gemm(m); the dev harness does too.
//
// Python view:
//   args = GemmArgs(); args.a = A.data_ptr(); args.b = B.data_ptr(); args.c = C.data_ptr()
//   cfg = mkernel.schedule.pick_tile(M, N, K, sms)      # the heuristic lives in Python only
//   order = grouped_order(-(-M // cfg.bm), -(-N // cfg.bn), cfg, sms)   # as a device int32 tensor
//   args.M, args.N, args.K = M, N, K; args.config = TILE_CONFIG_IDS[cfg.name]
//   args.tile_order = order.data_ptr()                  # 0: row-major order
//   status = launch_gemm(args, torch.cuda.current_stream().cuda_stream)   # 0 = ok
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../primitives/gemm/config.cuh"
#include "gemm_args.h"
#include "grouped_gemm_args.h"

namespace py = pybind11;

void register_gemm(py::module_& m) {
  py::class_<GemmArgs>(m, "GemmArgs", "Arguments of launch_gemm (pointers as integer addresses).")
      .def(py::init<>())
      .def_property(
          "a", [](const GemmArgs& g) { return reinterpret_cast<uintptr_t>(g.a); },
          [](GemmArgs& g, uintptr_t v) { g.a = reinterpret_cast<const void*>(v); })
      .def_property(
          "b", [](const GemmArgs& g) { return reinterpret_cast<uintptr_t>(g.b); },
          [](GemmArgs& g, uintptr_t v) { g.b = reinterpret_cast<const void*>(v); })
      .def_property(
          "c", [](const GemmArgs& g) { return reinterpret_cast<uintptr_t>(g.c); },
          [](GemmArgs& g, uintptr_t v) { g.c = reinterpret_cast<void*>(v); })
      .def_property(
          "tile_order", [](const GemmArgs& g) { return reinterpret_cast<uintptr_t>(g.tile_order); },
          [](GemmArgs& g, uintptr_t v) { g.tile_order = reinterpret_cast<const int32_t*>(v); })
      .def_readwrite("M", &GemmArgs::M)
      .def_readwrite("N", &GemmArgs::N)
      .def_readwrite("K", &GemmArgs::K)
      .def_readwrite("config", &GemmArgs::config)
      .def_readwrite("ldc", &GemmArgs::ldc)
      .def_readwrite("out_kind", &GemmArgs::out_kind)
      .def_readwrite("num_sms", &GemmArgs::num_sms);

  m.def(
      "launch_gemm",
      [](const GemmArgs& a, uintptr_t stream) {
        return launch_gemm(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"),
      "C = A @ B on the given CUDA stream handle; returns a GemmStatus (0 = ok).");
  m.def("gemm_status_string", &gemm_status_string, py::arg("status"));
  m.def(
      "gemm_config_info",
      [](int id) {
        mk::gemm::ConfigInfo c = mk::gemm::config_info(id);
        if (c.id < 0) throw py::value_error("gemm_config_info: unknown config");
        py::dict d;
        d["id"] = c.id;
        d["BM"] = c.bm;
        d["BN"] = c.bn;
        d["BK"] = c.bk;
        d["stages"] = c.stages;
        d["consumers"] = c.consumers;
        d["threads"] = c.threads;
        d["smem_bytes"] = c.smem_bytes;
        d["cluster"] = c.cluster;
        return d;
      },
      py::arg("config"));
  m.def("gemm_last_grid", &gemm_last_grid, "CTAs launched by the last launch_gemm call.");
  m.attr("gemm_num_configs") = mk::gemm::kNumConfigs;

  py::class_<GroupedGemmArgs>(m, "GroupedGemmArgs",
                              "Arguments of launch_grouped_gemm (pointers as integer addresses).")
      .def(py::init<>())
      .def_property(
          "a", [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.a); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.a = reinterpret_cast<const void*>(v); })
      .def_property(
          "b", [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.b); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.b = reinterpret_cast<const void*>(v); })
      .def_property(
          "c", [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.c); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.c = reinterpret_cast<void*>(v); })
      .def_property(
          "offsets", [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.offsets); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.offsets = reinterpret_cast<const int32_t*>(v); })
      .def_property(
          "workspace",
          [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.workspace); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.workspace = reinterpret_cast<int32_t*>(v); })
      .def_property(
          "a_rows", [](const GroupedGemmArgs& g) { return reinterpret_cast<uintptr_t>(g.a_rows); },
          [](GroupedGemmArgs& g, uintptr_t v) { g.a_rows = reinterpret_cast<const int32_t*>(v); })
      .def_readwrite("a_src_rows", &GroupedGemmArgs::a_src_rows)
      .def_readwrite("M", &GroupedGemmArgs::M)
      .def_readwrite("N", &GroupedGemmArgs::N)
      .def_readwrite("K", &GroupedGemmArgs::K)
      .def_readwrite("G", &GroupedGemmArgs::G)
      .def_readwrite("config", &GroupedGemmArgs::config)
      .def_readwrite("out_kind", &GroupedGemmArgs::out_kind)
      .def_readwrite("num_sms", &GroupedGemmArgs::num_sms);
  m.def(
      "launch_grouped_gemm",
      [](const GroupedGemmArgs& a, uintptr_t stream) {
        return launch_grouped_gemm(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"),
      "C[rows of g] = A[rows of g] @ B[g] for every group g; returns a GroupedGemmStatus (0 = ok).");
  m.def("grouped_gemm_status_string", &grouped_gemm_status_string, py::arg("status"));
}
