// rdma_binding.cpp: the pybind11 module _mkernel_rdma (a separate extension, built by
// mkernel/rdma_ext.py): mapped host memory, the ring layout's sizes, the host proxy and the test
// kernel. No torch headers: tensors cross as integer addresses.
//
// Python view (mkernel/rdma.py wraps it):
//   mem = MappedHost(W * ring_bytes(capacity)); init_rings(mem.ptr, W, capacity)
//   stream = copy_stream_create(device)
//   proxy = RingProxy(ring_ptr(mem.ptr, r, capacity), device, W, signals.ptr, signals.ptr + n,
//                     stream=stream)
//   proxy.start(stalled=False); ...; proxy.stop(); proxy.error()
//   args = RdmaTestArgs(); args.src = t.data_ptr(); ...; launch_rdma_test(args, stream)  # 0 = ok
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/rdma_host_mem.h"
#include "kernels/rdma_proxy.h"
#include "kernels/rdma_streams.h"
#include "kernels/rdma_test.h"
#include "primitives/protocol_gen.h"

namespace py = pybind11;
using namespace mk::rdma;

namespace {

void check_ring(uintptr_t base, int rank, int capacity) {
  if (base == 0 || rank < 0 || capacity < 1) throw std::invalid_argument("bad ring address");
}

// Sets every ring's capacity and owner and zeroes its counters and slots (no proxy may run).
void init_rings(uintptr_t base, int world_size, int capacity) {
  for (int r = 0; r < world_size; ++r) {
    check_ring(base, r, capacity);
    RingHeader* h = ring_header(reinterpret_cast<void*>(base), r, capacity);
    std::memset(static_cast<void*>(h), 0, ring_bytes(capacity));
    h->capacity = capacity;
    h->rank = r;
  }
}

// (head, tail) of ring `rank`.
py::tuple ring_counters(uintptr_t base, int rank, int capacity) {
  check_ring(base, rank, capacity);
  const RingHeader* h = ring_header(reinterpret_cast<void*>(base), rank, capacity);
  return py::make_tuple(__atomic_load_n(&h->head, __ATOMIC_ACQUIRE),
                        __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE));
}

std::vector<int32_t> read_i32(const MappedHost& m, size_t first, size_t count) {
  if ((first + count) * sizeof(int32_t) > m.bytes()) throw std::out_of_range("read_i32");
  std::vector<int32_t> v(count);
  const auto* p = static_cast<const int32_t*>(m.ptr()) + first;
  for (size_t i = 0; i < count; ++i) v[i] = __atomic_load_n(p + i, __ATOMIC_ACQUIRE);
  return v;
}

template <class T>
void rw(py::class_<RdmaTestArgs>& c, const char* name, T RdmaTestArgs::*field) {
  c.def_readwrite(name, field);
}

}  // namespace

PYBIND11_MODULE(_mkernel_rdma, m) {
  m.doc() = "rdma_put through a host proxy (primitives/rdma/put.cuh, kernels/rdma_proxy.cpp)";

  py::class_<MappedHost>(m, "MappedHost", "Zeroed pinned host memory mapped for the device.")
      .def(py::init<size_t>(), py::arg("bytes"))
      .def_property_readonly(
          "ptr", [](const MappedHost& h) { return reinterpret_cast<uintptr_t>(h.ptr()); })
      .def_property_readonly("bytes", &MappedHost::bytes)
      .def("read_i32", &read_i32, py::arg("first"), py::arg("count"))
      .def("zero", [](MappedHost& h) { std::memset(h.ptr(), 0, h.bytes()); });

  m.def("ring_bytes", [](int capacity) { return ring_bytes(capacity); }, py::arg("capacity"));
  m.def("init_rings", &init_rings, py::arg("base"), py::arg("world_size"), py::arg("capacity"));
  m.def("ring_counters", &ring_counters, py::arg("base"), py::arg("rank"), py::arg("capacity"));
  m.def(
      "ring_ptr",
      [](uintptr_t base, int rank, int capacity) {
        check_ring(base, rank, capacity);
        void* ring = ring_header(reinterpret_cast<void*>(base), rank, capacity);
        return reinterpret_cast<uintptr_t>(ring);
      },
      py::arg("base"), py::arg("rank"), py::arg("capacity"));

  py::class_<RingProxy>(m, "RingProxy", "The host proxy thread of one ring (kernels/rdma_proxy.h).")
      .def(py::init([](uintptr_t ring, int device, int world_size, uintptr_t lo, uintptr_t hi,
                       uintptr_t stream) {
             return new RingProxy({reinterpret_cast<void*>(ring), device, world_size, lo, hi,
                                   reinterpret_cast<cudaStream_t>(stream)});
           }),
           py::arg("ring"), py::arg("device"), py::arg("world_size"), py::arg("signal_lo"),
           py::arg("signal_hi"), py::arg("stream"))
      .def(
          "set_stream",
          [](RingProxy& p, uintptr_t s) { p.set_stream(reinterpret_cast<cudaStream_t>(s)); },
          py::arg("stream"))
      .def("start", &RingProxy::start, py::arg("stalled") = false)
      // NOTE: join without the GIL: the thread never takes it, but a caller holding it while
      // joining would block every other Python thread for the length of a batch.
      .def("stop", &RingProxy::stop, py::call_guard<py::gil_scoped_release>())
      .def("set_stalled", &RingProxy::set_stalled, py::arg("stalled"))
      .def_property_readonly("running", &RingProxy::running)
      .def_property_readonly("ready", &RingProxy::ready)
      .def_property_readonly("done", &RingProxy::done)
      .def("error", &RingProxy::error);

  m.def("copy_stream_create", &copy_stream_create, py::arg("device"));
  m.def("copy_stream_destroy", &copy_stream_destroy, py::arg("stream"));
  // NOTE: without the GIL: the probe spins for up to timeout_us
  m.def("stream_independent", &stream_independent, py::arg("copy"), py::arg("compute"),
        py::arg("device"), py::arg("timeout_us"), py::call_guard<py::gil_scoped_release>());

  py::class_<RdmaTestArgs> c(m, "RdmaTestArgs",
                             "Arguments of launch_rdma_test (addresses as ints).");
  c.def(py::init<>());
  rw(c, "src", &RdmaTestArgs::src);
  rw(c, "dst", &RdmaTestArgs::dst);
  rw(c, "out", &RdmaTestArgs::out);
  rw(c, "rings", &RdmaTestArgs::rings);
  rw(c, "reserve", &RdmaTestArgs::reserve);
  rw(c, "signals", &RdmaTestArgs::signals);
  rw(c, "status", &RdmaTestArgs::status);
  rw(c, "bytes", &RdmaTestArgs::bytes);
  rw(c, "timeout_ns", &RdmaTestArgs::timeout_ns);
  rw(c, "world_size", &RdmaTestArgs::world_size);
  rw(c, "nodes", &RdmaTestArgs::nodes);
  rw(c, "puts", &RdmaTestArgs::puts);
  rw(c, "posters", &RdmaTestArgs::posters);
  rw(c, "capacity", &RdmaTestArgs::capacity);
  rw(c, "signals_per_rank", &RdmaTestArgs::signals_per_rank);
  rw(c, "op", &RdmaTestArgs::op);
  rw(c, "receive", &RdmaTestArgs::receive);
  rw(c, "threads", &RdmaTestArgs::threads);
  rw(c, "launch", &RdmaTestArgs::launch);

  m.def(
      "launch_rdma_test",
      [](const RdmaTestArgs& a, uintptr_t stream) {
        return launch_rdma_test(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"), "Launches the test kernel; returns a status (0 = ok).");
  m.def("rdma_test_status_string", &rdma_test_status_string, py::arg("status"));

  // Names of CommStatus.pad and .role values, by id, from the enums above (one place).
  std::vector<const char*> waits(kTestWaits), roles(kTestRoles);
  waits[kWaitTail] = "rdma_tail";
  waits[kWaitHead] = "rdma_head";
  waits[kWaitLanded] = "landed";
  roles[kRolePoster] = "poster";
  roles[kRoleReceiver] = "receiver";
  m.attr("WAIT_NAMES") = waits;
  m.attr("ROLE_NAMES") = roles;
  m.attr("OPS") =
      py::make_tuple(py::make_tuple("set", int(kPutSet)), py::make_tuple("add", int(kPutAdd)));
  m.attr("RECEIVE") = py::make_tuple(py::make_tuple("copy", int(kReceiveCopy)),
                                     py::make_tuple("wait", int(kReceiveWait)),
                                     py::make_tuple("none", int(kReceiveNone)));
  m.attr("STATUS_INTS") = sizeof(mk::CommStatus) / sizeof(int32_t);
}
