// attention_binding.cpp: the pybind11 module _mkernel_attention (a separate extension, built by
// mkernel/attention_ext.py) over the attention forward and backward launchers. No torch headers:
// tensors cross as integer addresses.
//
// Python view:
//   args = AttentionArgs(); args.q, args.k, args.v, args.o, args.lse = (t.data_ptr() for ...)
//   args.B, args.S_q, args.S_kv, args.Hq, args.Hkv, args.D = ...; args.scale = 1 / D ** 0.5
//   args.causal = 1; args.variant = 0
//   status = launch_attention(args, torch.cuda.current_stream().cuda_stream)   # 0 = ok
#include <pybind11/pybind11.h>

#include <cstdint>

#include "attention_args.h"
#include "attention_bwd_args.h"

namespace py = pybind11;

namespace {

template <class Args, class T>
void bind_ptr(py::class_<Args>& c, const char* name, T* Args::*field) {
  c.def_property(
      name, [field](const Args& a) { return reinterpret_cast<uintptr_t>(a.*field); },
      [field](Args& a, uintptr_t v) { a.*field = reinterpret_cast<T*>(v); });
}

void bind_backward(py::module_& m) {
  py::class_<AttentionBwdArgs> c(
      m, "AttentionBwdArgs", "Arguments of launch_attention_bwd (pointers as integer addresses).");
  c.def(py::init<>());
  bind_ptr(c, "q", &AttentionBwdArgs::q);
  bind_ptr(c, "k", &AttentionBwdArgs::k);
  bind_ptr(c, "v", &AttentionBwdArgs::v);
  bind_ptr(c, "dout", &AttentionBwdArgs::dout);
  bind_ptr(c, "lse", &AttentionBwdArgs::lse);
  bind_ptr(c, "delta", &AttentionBwdArgs::delta);
  bind_ptr(c, "dq", &AttentionBwdArgs::dq);
  bind_ptr(c, "dk", &AttentionBwdArgs::dk);
  bind_ptr(c, "dv", &AttentionBwdArgs::dv);
  bind_ptr(c, "out", &AttentionBwdArgs::out);
  bind_ptr(c, "dlse", &AttentionBwdArgs::dlse);
  bind_ptr(c, "rows", &AttentionBwdArgs::rows);
  c.def_readwrite("B", &AttentionBwdArgs::B)
      .def_readwrite("S_q", &AttentionBwdArgs::S_q)
      .def_readwrite("S_kv", &AttentionBwdArgs::S_kv)
      .def_readwrite("Hq", &AttentionBwdArgs::Hq)
      .def_readwrite("Hkv", &AttentionBwdArgs::Hkv)
      .def_readwrite("D", &AttentionBwdArgs::D)
      .def_readwrite("scale", &AttentionBwdArgs::scale)
      .def_readwrite("causal", &AttentionBwdArgs::causal)
      .def_readwrite("kv_f32", &AttentionBwdArgs::kv_f32)
      .def_readwrite("kv_accumulate", &AttentionBwdArgs::kv_accumulate)
      .def_readwrite("variant", &AttentionBwdArgs::variant)
      .def_readwrite("probe", &AttentionBwdArgs::probe);
  m.def(
      "launch_attention_bwd",
      [](const AttentionBwdArgs& a, uintptr_t stream) {
        return launch_attention_bwd(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"),
      "Attention backward on the given CUDA stream handle; returns an AttentionBwdStatus "
      "(0 = ok).");
  m.def(
      "launch_attention_bwd_prep",
      [](const AttentionBwdArgs& a, uintptr_t stream) {
        return launch_attention_bwd_prep(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"),
      "delta = rowsum(dout * out) - dlse and dq = 0, before launch_attention_bwd.");
  m.def("attention_bwd_status_string", &attention_bwd_status_string, py::arg("status"));
}

}  // namespace

PYBIND11_MODULE(_mkernel_attention, m) {
  m.doc() = "bf16 attention forward and backward for sm_90a (kernels/attention*.cu)";
  py::class_<AttentionArgs> c(m, "AttentionArgs",
                              "Arguments of launch_attention (pointers as integer addresses).");
  c.def(py::init<>());
  bind_ptr(c, "q", &AttentionArgs::q);
  bind_ptr(c, "k", &AttentionArgs::k);
  bind_ptr(c, "v", &AttentionArgs::v);
  bind_ptr(c, "o", &AttentionArgs::o);
  bind_ptr(c, "lse", &AttentionArgs::lse);
  bind_ptr(c, "o_f32", &AttentionArgs::o_f32);
  c.def_readwrite("B", &AttentionArgs::B)
      .def_readwrite("S_q", &AttentionArgs::S_q)
      .def_readwrite("S_kv", &AttentionArgs::S_kv)
      .def_readwrite("Hq", &AttentionArgs::Hq)
      .def_readwrite("Hkv", &AttentionArgs::Hkv)
      .def_readwrite("D", &AttentionArgs::D)
      .def_readwrite("scale", &AttentionArgs::scale)
      .def_readwrite("causal", &AttentionArgs::causal)
      .def_readwrite("num_sms", &AttentionArgs::num_sms)
      .def_readwrite("variant", &AttentionArgs::variant);

  m.def(
      "launch_attention",
      [](const AttentionArgs& a, uintptr_t stream) {
        return launch_attention(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("args"), py::arg("stream"),
      "Attention forward on the given CUDA stream handle; returns an AttentionStatus (0 = ok).");
  m.def("attention_status_string", &attention_status_string, py::arg("status"));
  bind_backward(m);
}
