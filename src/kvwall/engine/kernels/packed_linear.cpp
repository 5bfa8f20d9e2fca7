// PackedLinear's matmul (layers/packed.py): the kernel itself is packed.h, shared with decode_stack.cpp.
#include "packed.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x W^T, W packed int8/int4 with fp16 scale (and zero) per group",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("s"), pybind11::arg("z"), pybind11::arg("bits"),
        pybind11::arg("group"), pybind11::arg("gemm_rows") = -1, pybind11::arg("x8") = false,
        pybind11::arg("qt") = pybind11::none(), pybind11::arg("st") = pybind11::none(),
        pybind11::arg("zt") = pybind11::none());
  m.def("packed_dequantize", &packed_dequantize, "the packed (N, K) matrix as float32, exactly dequantize()'s");
  m.attr("GEMM_MIN_ROWS") = GEMM_MIN_ROWS;
#ifdef KVWALL_X8
  m.def("x8_fits", &x8_fits, "whether the integer kernel takes this shape (bits, K, group)");
  m.attr("X8_INTEGER") = true;  // int8 activations run the VNNI kernel over x8 tiles (else the float paths)
#else
  m.attr("X8_INTEGER") = false;
#endif
}
