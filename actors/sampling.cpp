#include "actors/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

namespace odyssey::actors {

namespace {

// SplitMix64's finaliser: a bijection on 64-bit words with full avalanche.
uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool usable(double z) { return !std::isnan(z) && z != -std::numeric_limits<double>::infinity(); }

}  // namespace

Status validate(const SamplingOptions& o) {
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    return invalid_argument("sampling: temperature must be a finite number >= 0, got {}", o.temperature);
  if (o.top_k < 0) return invalid_argument("sampling: top_k must be >= 0 (0 = every token), got {}", o.top_k);
  if (!(o.top_p > 0 && o.top_p <= 1)) return invalid_argument("sampling: top_p must be in (0, 1], got {}", o.top_p);
  return Status::Ok();
}

double counter_uniform(uint64_t seed, uint64_t sequence, uint64_t position) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ sequence);
  h = mix64(h ^ (position * 0xd1b54a32d192ed03ull));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

TokenSampler::TokenSampler(SamplingOptions options, uint64_t seed) : options_(options), seed_(seed) {}

Result<TokenSampler::Kept> TokenSampler::kept(const double* logits, size_t vocab) const {
  Kept out;
  if (options_.temperature == 0) {
    size_t best = vocab;
    for (size_t i = 0; i < vocab; ++i) {
      if (!usable(logits[i])) continue;
      if (best == vocab || logits[i] > logits[best]) best = i;
    }
    if (best == vocab) return invalid_argument("sampling: no finite logit among {} values", vocab);
    out.ids = {static_cast<uint32_t>(best)};
    out.weights = {1.0};
    out.total = 1.0;
    return out;
  }
  const double inv_t = 1.0 / options_.temperature;
  double z_max = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < vocab; ++i) {
    if (!usable(logits[i])) continue;
    out.ids.push_back(static_cast<uint32_t>(i));
    z_max = std::max(z_max, logits[i] * inv_t);
  }
  if (out.ids.empty()) return invalid_argument("sampling: no finite logit among {} values", vocab);
  auto z = [&](uint32_t id) { return logits[id] * inv_t; };
  auto weight = [&](uint32_t id) {
    // +inf logits: an even split among them (exp(inf - inf) is undefined).
    if (std::isinf(z_max)) return z(id) == z_max ? 1.0 : 0.0;
    return std::exp(z(id) - z_max);
  };
  auto before = [&](uint32_t a, uint32_t b) { return z(a) > z(b) || (z(a) == z(b) && a < b); };

  const bool truncate_k = options_.top_k > 0 && static_cast<size_t>(options_.top_k) < out.ids.size();
  const bool truncate_p = options_.top_p < 1;
  if (truncate_p) {
    std::sort(out.ids.begin(), out.ids.end(), before);
    if (truncate_k) out.ids.resize(static_cast<size_t>(options_.top_k));
  } else if (truncate_k) {
    const auto k = static_cast<std::ptrdiff_t>(options_.top_k);
    std::partial_sort(out.ids.begin(), out.ids.begin() + k, out.ids.end(), before);
    out.ids.resize(static_cast<size_t>(k));
  }
  out.weights.resize(out.ids.size());
  for (size_t j = 0; j < out.ids.size(); ++j) out.weights[j] = weight(out.ids[j]);
  out.total = std::accumulate(out.weights.begin(), out.weights.end(), 0.0);
  if (truncate_p) {
    const double target = options_.top_p * out.total;
    double cum = 0;
    size_t keep = 0;
    while (keep < out.ids.size()) {
      cum += out.weights[keep++];
      if (cum >= target) break;
    }
    out.ids.resize(keep);
    out.weights.resize(keep);
    out.total = std::accumulate(out.weights.begin(), out.weights.end(), 0.0);
  }
  return out;
}

Result<SampledToken> TokenSampler::sample(const double* logits, size_t vocab, DrawKey key) const {
  ODY_ASSIGN_OR_RETURN(Kept k, kept(logits, vocab));
  size_t chosen = k.ids.size() - 1;
  if (k.ids.size() > 1) {
    const double target = counter_uniform(seed_, key.sequence, key.position) * k.total;
    double cum = 0;
    for (size_t j = 0; j < k.ids.size(); ++j) {
      cum += k.weights[j];
      if (cum > target && k.weights[j] > 0) {
        chosen = j;
        break;
      }
    }
    // A weight that underflowed to 0 is never drawn, not even through rounding at the end.
    while (k.weights[chosen] == 0 && chosen > 0) --chosen;
  }
  SampledToken out;
  out.token = k.ids[chosen];
  out.logprob = static_cast<float>(std::log(k.weights[chosen] / k.total));
  return out;
}

Result<std::vector<SampledToken>> TokenSampler::sample(const at::Tensor& logits,
                                                       const std::vector<DrawKey>& keys) const {
  if (logits.dim() != 2 || logits.size(0) != static_cast<int64_t>(keys.size()))
    return invalid_argument("sampling: logits must be [B, V] with B = {} keys, got {} dimensions of sizes [{}]",
                            keys.size(), logits.dim(), fmt::join(logits.sizes().vec(), ", "));
  const at::Tensor rows = logits.detach().to(at::kCPU, at::kDouble).contiguous();
  const auto vocab = static_cast<size_t>(rows.size(1));
  const double* data = rows.data_ptr<double>();
  std::vector<SampledToken> out;
  out.reserve(keys.size());
  for (size_t b = 0; b < keys.size(); ++b) {
    auto token = sample(data + b * vocab, vocab, keys[b]);
    if (!token.ok()) return token.status().with_context(fmt::format("row {}", b));
    out.push_back(*token);
  }
  return out;
}

Result<std::vector<double>> TokenSampler::distribution(const double* logits, size_t vocab) const {
  ODY_ASSIGN_OR_RETURN(Kept k, kept(logits, vocab));
  std::vector<double> q(vocab, 0.0);
  for (size_t j = 0; j < k.ids.size(); ++j) q[k.ids[j]] = k.weights[j] / k.total;
  return q;
}

}  // namespace odyssey::actors
