#include "model/precision.h"

#include <atomic>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/custom_function.h>

namespace odyssey::model {

namespace {
std::atomic<Float32MatmulPrecision> g_precision{Float32MatmulPrecision::kHighest};
}  // namespace

Result<Float32MatmulPrecision> parse_float32_matmul_precision(const std::string& name) {
  if (name == "highest") return Float32MatmulPrecision::kHighest;
  if (name == "high") return Float32MatmulPrecision::kHigh;
  if (name == "medium") return Float32MatmulPrecision::kMedium;
  return invalid_argument("float32 matmul precision '{}' is not one of highest, high, medium", name);
}

const char* float32_matmul_precision_name(Float32MatmulPrecision precision) {
  switch (precision) {
    case Float32MatmulPrecision::kHighest: return "highest";
    case Float32MatmulPrecision::kHigh: return "high";
    case Float32MatmulPrecision::kMedium: return "medium";
  }
  return "highest";
}

void set_float32_matmul_precision(Float32MatmulPrecision precision) {
  g_precision.store(precision);
  at::globalContext().setAllowTF32CuBLAS(precision != Float32MatmulPrecision::kHighest);
}

Status set_float32_matmul_precision(const std::string& name, const std::string& key) {
  const Result<Float32MatmulPrecision> precision = parse_float32_matmul_precision(name);
  if (!precision.ok()) return invalid_argument("{}: {}", key, precision.status().message());
  set_float32_matmul_precision(*precision);
  return Status::Ok();
}

Float32MatmulPrecision float32_matmul_precision() { return g_precision.load(); }

Float32MatmulPrecisionScope::Float32MatmulPrecisionScope(Float32MatmulPrecision precision)
    : previous_(float32_matmul_precision()) {
  set_float32_matmul_precision(precision);
}

Float32MatmulPrecisionScope::~Float32MatmulPrecisionScope() { set_float32_matmul_precision(previous_); }

namespace {

// source -> its bf16 copy, the copy made beforehand; the backward is source.to(kBFloat16)'s.
struct ShadowCast : torch::autograd::Function<ShadowCast> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& source, const at::Tensor& copy) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(source.scalar_type());
    return copy.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grads[0].to(dtype), at::Tensor()};
  }
};

}  // namespace

Bf16Shadow& Bf16Shadow::operator=(const Bf16Shadow&) {
  clear();
  return *this;
}

at::Tensor Bf16Shadow::get(const at::Tensor& source) {
  const at::Tensor copy = value(source);
  if (at::GradMode::is_enabled() && source.requires_grad()) return ShadowCast::apply(source, copy);
  return copy;
}

at::Tensor Bf16Shadow::value(const at::Tensor& source) {
  at::Tensor copy;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    const void* impl = source.unsafeGetTensorImpl();
    if (!copy_.defined() || impl_ != impl || data_ != source.data_ptr() || version_ != source._version() ||
        copy_.sizes() != source.sizes()) {
      const at::NoGradGuard no_grad;
      copy_ = source.detach().to(at::kBFloat16);
      impl_ = impl;
      data_ = source.data_ptr();
      version_ = source._version();
      ++casts_;
    }
    copy = copy_;
  }
  return copy.detach();
}

void Bf16Shadow::clear() {
  const std::lock_guard<std::mutex> lock(mu_);
  copy_ = at::Tensor();
  impl_ = data_ = nullptr;
  version_ = -1;
}

int64_t Bf16Shadow::casts() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return casts_;
}

}  // namespace odyssey::model
