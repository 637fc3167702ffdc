#include "model/precision.h"

#include <atomic>

#include <ATen/Context.h>

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

}  // namespace odyssey::model
