// nvshmem_binding.cpp: the pybind11 module _mkernel_nvshmem (built by mkernel/nvshmem_ext.py with
// -rdc and NVSHMEM's libraries): bootstrap by unique id, the symmetric heap, and the transport's
// test kernel. No torch headers: tensors cross as integer addresses.
//
// Python view (mkernel/rdma_nvshmem.py wraps it):
//   uid = get_unique_id()            # rank 0; broadcast to the others (torch.distributed)
//   init(rank, world_size, uid)      # every rank, collective
//   p = malloc(bytes); free(p)       # symmetric heap, collective (same sizes on every rank)
//   launch_nvshmem_test(args, stream); barrier_all_on_stream(stream); finalize()
//   peer_ptr(p, pe)                  # nvshmem_ptr: p's NVLink address on pe, 0 if none
//   launch_<op>_nodes(record, stream) # the fused ops over nodes (MK_NODES_OPS), as in binding.cpp
#include <nvshmem.h>
#include <nvshmemx.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/nvshmem_test.h"
#include "primitives/protocol_gen.h"  // MK_NODES_OPS

namespace py = pybind11;
using namespace mk::rdma::nv;

// The fused ops' kernels over several nodes, built here with MK_RDMA_NVSHMEM (their raises across
// nodes are NVSHMEM puts, templates/persistent.cuh): the same record as _mkernel_ext's launchers.
namespace mk {
#define MK_DECLARE_LAUNCH(op) int launch_##op(const long long* record, cudaStream_t);
MK_NODES_OPS(MK_DECLARE_LAUNCH)
#undef MK_DECLARE_LAUNCH
}  // namespace mk

namespace {

bool g_initialized = false;

void require_init(const char* what) {
  if (!g_initialized) throw std::runtime_error(std::string(what) + ": nvshmem is not initialized");
}

py::bytes get_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
  return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

void init(int rank, int world_size, const py::bytes& uid) {
  if (g_initialized) throw std::runtime_error("nvshmem is initialized already in this process");
  const std::string raw = uid;
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (raw.size() != sizeof(id)) throw std::invalid_argument("unique id of the wrong size");
  std::memcpy(&id, raw.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr) != 0)
    throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    throw std::runtime_error("nvshmemx_init_attr failed");
  g_initialized = true;
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world_size)
    throw std::runtime_error("nvshmem PE numbering differs from the process group's ranks");
}

uintptr_t sym_malloc(size_t bytes) {
  require_init("malloc");
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr && bytes > 0)
    throw std::runtime_error("nvshmem_malloc of " + std::to_string(bytes) +
                             " bytes failed (NVSHMEM_SYMMETRIC_SIZE sets the heap)");
  return reinterpret_cast<uintptr_t>(p);
}

}  // namespace

PYBIND11_MODULE(_mkernel_nvshmem, m) {
  m.doc() = "rdma_put through NVSHMEM (primitives/rdma/put_nvshmem.cuh, kernels/nvshmem_test.cu)";
  m.def("get_unique_id", &get_unique_id);
  m.def("init", &init, py::arg("rank"), py::arg("world_size"), py::arg("uid"));
  m.def("initialized", [] { return g_initialized; });
  m.def("finalize", [] {
    if (g_initialized) nvshmem_finalize();
    g_initialized = false;
  });
  m.def("my_pe", [] {
    require_init("my_pe");
    return nvshmem_my_pe();
  });
  m.def("n_pes", [] {
    require_init("n_pes");
    return nvshmem_n_pes();
  });
  m.def("malloc", &sym_malloc, py::arg("bytes"));
  m.def(
      "peer_ptr",
      [](uintptr_t p, int pe) {
        require_init("peer_ptr");
        return reinterpret_cast<uintptr_t>(nvshmem_ptr(reinterpret_cast<void*>(p), pe));
      },
      py::arg("ptr"), py::arg("pe"));
  m.def(
      "free",
      [](uintptr_t p) {
        require_init("free");
        nvshmem_free(reinterpret_cast<void*>(p));
      },
      py::arg("ptr"));
  // NOTE: without the GIL: a barrier waits for the other processes
  m.def(
      "barrier_all_on_stream",
      [](uintptr_t stream) {
        require_init("barrier_all_on_stream");
        nvshmemx_barrier_all_on_stream(reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  py::class_<NvTestArgs> c(m, "NvTestArgs",
                           "Arguments of launch_nvshmem_test (addresses as ints).");
  c.def(py::init<>());
  c.def_readwrite("src", &NvTestArgs::src);
  c.def_readwrite("dst", &NvTestArgs::dst);
  c.def_readwrite("out", &NvTestArgs::out);
  c.def_readwrite("signals", &NvTestArgs::signals);
  c.def_readwrite("status", &NvTestArgs::status);
  c.def_readwrite("bytes", &NvTestArgs::bytes);
  c.def_readwrite("timeout_ns", &NvTestArgs::timeout_ns);
  c.def_readwrite("rank", &NvTestArgs::rank);
  c.def_readwrite("world_size", &NvTestArgs::world_size);
  c.def_readwrite("nodes", &NvTestArgs::nodes);
  c.def_readwrite("puts", &NvTestArgs::puts);
  c.def_readwrite("posters", &NvTestArgs::posters);
  c.def_readwrite("op", &NvTestArgs::op);
  c.def_readwrite("receive", &NvTestArgs::receive);
  c.def_readwrite("threads", &NvTestArgs::threads);
  c.def_readwrite("launch", &NvTestArgs::launch);
  m.def(
      "launch_nvshmem_test",
      [](const NvTestArgs& a, uintptr_t stream) {
        require_init("launch_nvshmem_test");
        return launch_nvshmem_test(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"));
  m.def("nvshmem_test_status_string", &nvshmem_test_status_string, py::arg("status"));
#define MK_BIND_LAUNCH(op)                                                 \
  m.def(                                                                   \
      "launch_" #op,                                                       \
      [](uintptr_t record, uintptr_t stream) {                             \
        require_init("launch_" #op);                                       \
        return mk::launch_##op(reinterpret_cast<const long long*>(record), \
                               reinterpret_cast<cudaStream_t>(stream));    \
      },                                                                   \
      py::arg("record"), py::arg("stream"));
  MK_NODES_OPS(MK_BIND_LAUNCH)
#undef MK_BIND_LAUNCH
  m.attr("OPS") =
      py::make_tuple(py::make_tuple("set", (int)kNvSet), py::make_tuple("add", (int)kNvAdd));
  m.attr("RECEIVE") = py::make_tuple(py::make_tuple("copy", (int)kNvReceiveCopy),
                                     py::make_tuple("wait", (int)kNvReceiveWait));
}
