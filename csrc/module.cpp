// The Python module quamba._C. It holds no bindings: importing it loads this library, whose
// kernel families each register their ops with TORCH_LIBRARY_FRAGMENT(quamba, ...) in their own
// files; they are called as torch.ops.quamba.<name>.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "quamba CUDA kernels, registered as torch.ops.quamba.*";
}
