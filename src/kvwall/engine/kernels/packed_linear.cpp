// PackedLinear's matmul (layers/packed.py): the kernel itself is packed.h, shared with decode_stack.cpp.
#include "packed.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x W^T, W packed int8/int4 with fp16 scale (and zero) per group");
}
