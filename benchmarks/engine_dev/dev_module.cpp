// dev_module.cpp: stand-alone module for the GEMM engine's dev harness (the package's own module is
// kernels/binding.cpp, owned elsewhere).
#include <pybind11/pybind11.h>

void register_gemm(pybind11::module_& m);

PYBIND11_MODULE(mk_gemm_dev, m) { register_gemm(m); }
