// The CUDA autograd of the forward ops (apex_norm::layer_norm_fwd, apex_norm::rms_norm_fwd) in
// C++: AutogradCUDA kernels that take precedence over the ops' Python autograd (ops.py,
// register_autograd) on CUDA tensors once this library is loaded. The math is the same; what goes
// is the host time of a Python autograd.Function per call (about 30 us a forward+backward on the
// H200's host), which at small rows was longer than the kernels.
//
// The statistics outputs get no gradient (as in the Python autograd), and theirs are not
// materialised: zeros for them cost an allocation and a fill kernel per backward (about 40 us of a
// 184 us forward+backward on the H200's host at small rows). They are not marked
// non-differentiable: the Python autograd does not mark them either, and compiled autograd
// (CppNode::compiled_args) refuses a C++ Function that marks any.
//
// A forward call that records nothing for backward (grad mode off, or no input that needs a
// gradient) skips the Function: the op runs below autograd at once (records_nothing).
//
// Forward and backward call the ops themselves below autograd through the dispatcher, so the CUDA
// kernels run for real tensors and the fakes for FakeTensors (torch.compile, opcheck). Under
// create_graph=True (grad mode on in backward) the gradients come, as in ops.grads_with_graph,
// from autograd through the plain-torch forward recomputed from the saved input, so they are
// differentiable again; memory_efficient (the output saved, not the input) refuses that.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace apex_norm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using LnFwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    at::IntArrayRef, double, bool, std::optional<at::ScalarType>);
using LnBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    at::IntArrayRef, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
    bool, std::optional<at::ScalarType>);
using RmsFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                  const std::optional<at::Tensor>&,
                                                  at::IntArrayRef, double, bool,
                                                  std::optional<at::ScalarType>);
using RmsBwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, at::IntArrayRef,
                                                  const std::optional<at::Tensor>&, double, bool,
                                                  std::optional<at::ScalarType>);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t.contiguous()) : std::nullopt;
}

at::ScalarType dtype_of(const AutogradContext* ctx, const char* key) {
  return static_cast<at::ScalarType>(ctx->saved_data.at(key).toInt());
}

// The plain-torch forward (reference.py's math, float32 statistics; float64 for float64 input)
// for the differentiable gradients of create_graph=True.
at::Tensor reference_forward(bool rms, const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias, at::IntArrayRef shape, double eps,
                             at::ScalarType out_dtype) {
  const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t cols = c10::multiply_integers(shape);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  at::Tensor x = input.reshape({rows, cols}).to(acc);
  at::Tensor y;
  if (rms) {
    y = x * at::rsqrt((x * x).mean({1}, /*keepdim=*/true) + eps);
  } else {
    const at::Tensor c = x - x.mean({1}, /*keepdim=*/true);
    y = c * at::rsqrt((c * c).mean({1}, /*keepdim=*/true) + eps);
  }
  if (weight.defined()) y = y * weight.reshape({1, cols}).to(acc);
  if (bias.defined()) y = y + bias.reshape({1, cols}).to(acc);
  return y.to(out_dtype).reshape(input.sizes());
}

// (grad_input, grad_weight, grad_bias) as differentiable functions of the saved tensors and g;
// undefined for a tensor that needs no gradient.
variable_list grads_with_graph(AutogradContext* ctx, bool rms, const at::Tensor& g,
                               const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  TORCH_CHECK(!ctx->saved_data.at("me").toBool(),
              "apex.normalization: memory_efficient=True keeps the norm's output instead of its "
              "input, so its gradient cannot be differentiated again (backward with "
              "create_graph=True, torch.autograd.grad(..., create_graph=True)); use "
              "memory_efficient=False for double backward");
  const std::vector<int64_t> shape = ctx->saved_data.at("shape").toIntVector();
  variable_list need;
  std::vector<int> slot;
  const at::Tensor* ins[3] = {&x, &w, &b};
  for (int i = 0; i < 3; ++i) {
    if (ins[i]->defined() && ins[i]->requires_grad()) {
      need.push_back(*ins[i]);
      slot.push_back(i);
    }
  }
  variable_list out(3);
  if (need.empty()) return out;
  const at::Tensor y = reference_forward(rms, x, w, b, shape, ctx->saved_data.at("eps").toDouble(),
                                         dtype_of(ctx, "out_dtype"));
  const variable_list got = torch::autograd::grad({y}, need, {g}, /*retain_graph=*/true,
                                                  /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < slot.size(); ++k) out[slot[k]] = got[k];
  return out;
}

void save_args(AutogradContext* ctx, at::IntArrayRef shape, double eps, bool me,
               const at::Tensor& input, const at::Tensor& out) {
  ctx->saved_data["shape"] = shape.vec();
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["me"] = me;
  ctx->saved_data["in_dtype"] = static_cast<int64_t>(input.scalar_type());
  ctx->saved_data["out_dtype"] = static_cast<int64_t>(out.scalar_type());
}

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef shape,
                               double eps, bool me, std::optional<at::ScalarType> out_dtype) {
    static const auto fwd = op<LnFwd>("apex_norm::layer_norm_fwd");
    at::Tensor out, mean, invvar;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, mean, invvar) = fwd.call(input, weight, bias, shape, eps, me, out_dtype);
    }
    save_args(ctx, shape, eps, me, input, out);
    // As ops._ln_setup: the output (and no mean) for memory_efficient, else the input as given.
    ctx->save_for_backward({me ? out : input, me ? at::Tensor() : mean, invvar,
                            weight.value_or(at::Tensor()), bias.value_or(at::Tensor())});
    ctx->set_materialize_grads(false);  // no zeros for mean's and invvar's gradients (see above)
    return {out, mean, invvar};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<LnBwd>("apex_norm::layer_norm_bwd");
    const variable_list s = ctx->get_saved_variables();  // x or y, mean, invvar, weight, bias
    variable_list g3(3);
    if (!grads[0].defined()) {
      // The output took no part in what is differentiated: no gradients.
    } else if (at::GradMode::is_enabled()) {
      g3 = grads_with_graph(ctx, false, grads[0], s[0], s[3], s[4]);
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      const std::vector<int64_t> shape = ctx->saved_data.at("shape").toIntVector();
      auto [gi, gw, gb] =
          bwd.call(grads[0].contiguous(), s[1].defined() ? std::optional<at::Tensor>(s[1]) : std::nullopt,
                   s[2], s[0].contiguous(), shape, opt(s[3]), opt(s[4]),
                   ctx->saved_data.at("eps").toDouble(), ctx->saved_data.at("me").toBool(),
                   dtype_of(ctx, "in_dtype"));
      g3 = {gi, s[3].defined() ? gw : at::Tensor(), s[4].defined() ? gb : at::Tensor()};
    }
    return {g3[0], g3[1], g3[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const std::optional<at::Tensor>& weight, at::IntArrayRef shape,
                               double eps, bool me, std::optional<at::ScalarType> out_dtype) {
    static const auto fwd = op<RmsFwd>("apex_norm::rms_norm_fwd");
    at::Tensor out, invvar;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, invvar) = fwd.call(input, weight, shape, eps, me, out_dtype);
    }
    save_args(ctx, shape, eps, me, input, out);
    ctx->save_for_backward({me ? out : input, invvar, weight.value_or(at::Tensor())});
    ctx->set_materialize_grads(false);
    return {out, invvar};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<RmsBwd>("apex_norm::rms_norm_bwd");
    const variable_list s = ctx->get_saved_variables();  // x or y, invvar, weight
    variable_list g3(3);
    if (!grads[0].defined()) {
      // The output took no part in what is differentiated: no gradients.
    } else if (at::GradMode::is_enabled()) {
      g3 = grads_with_graph(ctx, true, grads[0], s[0], s[2], at::Tensor());
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      const std::vector<int64_t> shape = ctx->saved_data.at("shape").toIntVector();
      auto [gi, gw] = bwd.call(grads[0].contiguous(), s[1], s[0].contiguous(), shape, opt(s[2]),
                               ctx->saved_data.at("eps").toDouble(),
                               ctx->saved_data.at("me").toBool(), dtype_of(ctx, "in_dtype"));
      g3 = {gi, s[2].defined() ? gw : at::Tensor(), at::Tensor()};
    }
    return {g3[0], g3[1], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Whether a forward call records nothing for backward: grad mode off (torch.no_grad, eval
// loops), or no input that needs a gradient or carries a forward-mode tangent. Then the op runs
// straight below autograd: no Function node, saved tensors or saved_data for a backward that
// cannot come (host time per inference call). A forward-mode tangent keeps Function::apply, which
// refuses it (no jvp here) rather than dropping it silently.
bool records_nothing(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias) {
  const at::Tensor* ts[3] = {&input, weight ? &*weight : nullptr, bias ? &*bias : nullptr};
  for (const at::Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->_fw_grad(/*level=*/0).defined()) return false;
  }
  if (!at::GradMode::is_enabled()) return true;
  for (const at::Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->requires_grad()) return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef normalized_shape, double eps,
    bool memory_efficient, std::optional<at::ScalarType> out_dtype) {
  if (records_nothing(input, weight, bias)) {
    static const auto fwd = op<LnFwd>("apex_norm::layer_norm_fwd");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(input, weight, bias, normalized_shape, eps, memory_efficient, out_dtype);
  }
  const variable_list r = LayerNormFn::apply(input, weight, bias, normalized_shape, eps,
                                             memory_efficient, out_dtype);
  return {r[0], r[1], r[2]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_autograd(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight,
                                                         at::IntArrayRef normalized_shape,
                                                         double eps, bool memory_efficient,
                                                         std::optional<at::ScalarType> out_dtype) {
  if (records_nothing(input, weight, std::nullopt)) {
    static const auto fwd = op<RmsFwd>("apex_norm::rms_norm_fwd");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(input, weight, normalized_shape, eps, memory_efficient, out_dtype);
  }
  const variable_list r =
      RmsNormFn::apply(input, weight, normalized_shape, eps, memory_efficient, out_dtype);
  return {r[0], r[1]};
}

}  // namespace
}  // namespace apex_norm

TORCH_LIBRARY_IMPL(apex_norm, AutogradCUDA, m) {
  m.impl("layer_norm_fwd", &apex_norm::layer_norm_fwd_autograd);
  m.impl("rms_norm_fwd", &apex_norm::rms_norm_fwd_autograd);
}
