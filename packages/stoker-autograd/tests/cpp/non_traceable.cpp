// A C++ autograd::Function whose backward may not be traced (is_traceable is false,
// the default for torch::autograd::Function), as third-party C++ extensions write
// them. test_autograd_torch_tests.py builds it with torch.utils.cpp_extension.load.
// Only light headers: the build takes seconds, not the minute torch/extension.h costs.
#include <ATen/ops/mul.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

struct NonTraceableScale : public torch::autograd::Function<NonTraceableScale> {
  // y = x * w * 2; the gradient flows to x only (w is a constant of the op)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({w});
    return at::mul(at::mul(x, w), 2);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto w = ctx->get_saved_variables()[0];
    return {at::mul(at::mul(grad_out[0], w), 2), at::Tensor()};
  }
};

at::Tensor non_traceable_scale(const at::Tensor& x, const at::Tensor& w) {
  return NonTraceableScale::apply(x, w);
}

TORCH_LIBRARY(stoker_test_cpp, m) { m.def("non_traceable_scale(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(stoker_test_cpp, CompositeImplicitAutograd, m) {
  m.impl("non_traceable_scale", non_traceable_scale);
}
