#include "replay/rate_limiter.h"

#include <algorithm>
#include <cmath>

namespace odyssey::replay {
namespace {

constexpr uint8_t kStateVersion = 1;
constexpr size_t kStateBytes = 1 + 8 + 8 + 8 + 4;

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

}  // namespace

Status RateLimiterOptions::validate() const {
  if (min_size_to_sample < 1) {
    return invalid_argument("rate limiter: min_size_to_sample must be >= 1, got {}",
                            min_size_to_sample);
  }
  if (!std::isfinite(samples_per_insert) || samples_per_insert < 0.0) {
    return invalid_argument(
        "rate limiter: samples_per_insert must be a finite number >= 0 (0 = no ratio), got {}",
        samples_per_insert);
  }
  if (!std::isfinite(error_buffer) || error_buffer < 0.0) {
    return invalid_argument("rate limiter: error_buffer must be a finite number >= 0, got {}",
                            error_buffer);
  }
  if (samples_per_insert > 0.0 && error_buffer < std::max(1.0, samples_per_insert)) {
    return invalid_argument(
        "rate limiter: error_buffer={} is below max(1, samples_per_insert={}), which can block "
        "inserts and samples forever; raise error_buffer to at least {}",
        error_buffer, samples_per_insert, std::max(1.0, samples_per_insert));
  }
  if (max_policy_lag < 0) {
    return invalid_argument("rate limiter: max_policy_lag must be >= 0 (0 = unbounded), got {}",
                            max_policy_lag);
  }
  return Status::Ok();
}

Result<RateLimiter> RateLimiter::create(const RateLimiterOptions& options,
                                        const RateLimiterState& state) {
  ODY_RETURN_IF_ERROR(options.validate());
  if (state.deletes > state.inserts) {
    return invalid_argument("rate limiter: state has {} deletes but only {} inserts",
                            state.deletes, state.inserts);
  }
  return RateLimiter(options, state);
}

double RateLimiter::min_diff() const {
  return static_cast<double>(options_.min_size_to_sample) * options_.samples_per_insert -
         options_.error_buffer;
}

double RateLimiter::max_diff() const {
  return static_cast<double>(options_.min_size_to_sample) * options_.samples_per_insert +
         options_.error_buffer;
}

bool RateLimiter::can_insert(uint64_t n) const {
  return insert_blocked_reason(n).empty();
}

bool RateLimiter::can_sample(uint64_t n) const {
  return sample_blocked_reason(n).empty();
}

std::string RateLimiter::insert_blocked_reason(uint64_t n) const {
  const double spi = options_.samples_per_insert;
  if (spi == 0.0 || present() + n <= static_cast<uint64_t>(options_.min_size_to_sample)) return "";
  const double diff = static_cast<double>(state_.inserts + n) * spi -
                      static_cast<double>(state_.samples);
  if (diff <= max_diff()) return "";
  return fmt::format(
      "inserting blocked: {} samples allow at most {} inserts and {} would make {} "
      "(samples_per_insert={}, error_buffer={}); waiting for samples",
      state_.samples, std::floor((max_diff() + static_cast<double>(state_.samples)) / spi), n,
      state_.inserts + n, spi, options_.error_buffer);
}

std::string RateLimiter::sample_blocked_reason(uint64_t n) const {
  const uint64_t min_size = static_cast<uint64_t>(options_.min_size_to_sample);
  if (present() < min_size) {
    if (state_.deletes == 0) {
      return fmt::format("sampling blocked: {} of min_size_to_sample={} inserted", present(),
                         min_size);
    }
    return fmt::format("sampling blocked: {} of min_size_to_sample={} present ({} inserted, {} "
                       "deleted)",
                       present(), min_size, state_.inserts, state_.deletes);
  }
  const double spi = options_.samples_per_insert;
  if (spi == 0.0) return "";
  const double diff = static_cast<double>(state_.inserts) * spi -
                      static_cast<double>(state_.samples + n);
  if (diff >= min_diff()) return "";
  return fmt::format(
      "sampling blocked: {} inserts allow at most {} samples and {} would make {} "
      "(samples_per_insert={}, error_buffer={}); waiting for inserts",
      state_.inserts, std::floor(static_cast<double>(state_.inserts) * spi - min_diff()), n,
      state_.samples + n, spi, options_.error_buffer);
}

void RateLimiter::on_delete(uint64_t n) {
  state_.deletes += std::min(n, present());
}

bool RateLimiter::is_stale(uint32_t min_policy_version) const {
  return options_.max_policy_lag > 0 && state_.policy_version > min_policy_version &&
         state_.policy_version - min_policy_version >
             static_cast<uint64_t>(options_.max_policy_lag);
}

std::string RateLimiter::describe() const {
  std::string line = fmt::format("inserts={} samples={} deletes={} policy_version={}",
                                 state_.inserts, state_.samples, state_.deletes,
                                 state_.policy_version);
  if (options_.max_policy_lag > 0) {
    line += fmt::format(" max_policy_lag={}", options_.max_policy_lag);
  }
  std::string blocked = sample_blocked_reason();
  const std::string insert = insert_blocked_reason();
  if (!insert.empty()) blocked += (blocked.empty() ? "" : "; ") + insert;
  return line + ": " + (blocked.empty() ? "sampling and inserting allowed" : blocked);
}

std::string RateLimiter::encode() const {
  std::string out;
  out.reserve(kStateBytes);
  out.push_back(static_cast<char>(kStateVersion));
  put_le(out, state_.inserts, 8);
  put_le(out, state_.samples, 8);
  put_le(out, state_.deletes, 8);
  put_le(out, state_.policy_version, 4);
  return out;
}

Result<RateLimiterState> RateLimiter::decode(std::string_view bytes) {
  if (bytes.empty()) {
    return make_status(StatusCode::kCorrupt, "rate limiter state: empty (no version byte)");
  }
  const uint8_t version = static_cast<uint8_t>(bytes[0]);
  if (version != kStateVersion) {
    return make_status(StatusCode::kCorrupt,
                       "rate limiter state: unknown version {} (this build reads version {})",
                       version, kStateVersion);
  }
  if (bytes.size() != kStateBytes) {
    return make_status(StatusCode::kCorrupt,
                       "rate limiter state: version {} is {} bytes, got {}", version,
                       kStateBytes, bytes.size());
  }
  RateLimiterState state;
  state.inserts = get_le(bytes.data() + 1, 8);
  state.samples = get_le(bytes.data() + 9, 8);
  state.deletes = get_le(bytes.data() + 17, 8);
  state.policy_version = static_cast<uint32_t>(get_le(bytes.data() + 25, 4));
  if (state.deletes > state.inserts) {
    return make_status(StatusCode::kCorrupt,
                       "rate limiter state: {} deletes exceed {} inserts", state.deletes,
                       state.inserts);
  }
  return state;
}

}  // namespace odyssey::replay
