// fsdp::torch as a CMake user links it: <fsdp/torch/...> and libtorch's headers (<ATen/...>,
// and <torch/torch.h> from torch/csrc/api/include) are found through the target alone, the
// file compiles with libtorch's ABI flag and definitions (Torch::Torch,
// cmake/fsdpDependencies.cmake), and libtorch links and loads. A file of its own, built only
// where fsdp::torch loaded, so that the other programs do not compile libtorch's headers.
// It includes what it uses: at::zeros from its own operator header, not <torch/torch.h>
// (the whole C++ frontend, about 14 s of CPU at -O0, against 2 s for ATen's tensor alone),
// so that it costs no more than fsdp/torch/tensor_traits.hpp itself includes. Prints one
// line, then "torch_check: ok"; exits non-zero on a wrong answer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <ATen/ops/zeros.h>
#include <fsdp/core/dtype.hpp>
#include <fsdp/torch/tensor_traits.hpp>

namespace {
// A libtorch tensor's fsdp dtype, its element size in fsdp's table against libtorch's, and its
// shape, through fsdp::tensor_traits<at::Tensor>.
bool round_trips(const at::Tensor& t, fsdp::DType want) {
  using traits = fsdp::tensor_traits<at::Tensor>;
  const fsdp::DType got = traits::dtype(t);
  const auto shape = traits::shape(t);
  return got == want && fsdp::size_of(got) == static_cast<std::size_t>(t.element_size()) &&
         shape.size() == 1 && shape[0] == 2;
}
}  // namespace

int main() {
  const bool ok = round_trips(at::zeros({2}), fsdp::DType::f32) &&
                  round_trips(at::zeros({2}, at::kBFloat16), fsdp::DType::bf16) &&
                  round_trips(at::zeros({2}, at::kLong), fsdp::DType::i64);
  std::printf("fsdp::torch (tensor_traits<at::Tensor>: f32, bf16, i64 of at::zeros({2})): %s\n",
              ok ? "ok" : "WRONG");
  if (!ok) return EXIT_FAILURE;
  std::printf("torch_check: ok\n");
  return EXIT_SUCCESS;
}
