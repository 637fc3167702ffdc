// Rng: the replay service's deterministic random stream for samplers.
//
// Counter-based: draw i (1-based) is SplitMix64's finaliser applied to seed + i * gamma,
// which is exactly the i-th output of a SplitMix64 generator seeded with `seed`. The whole
// state is (seed, counter), two integers the store persists with each sampling operation,
// so a restarted service draws the same numbers the old one would have drawn next.
//
// Not thread-safe: one sampler owns one Rng.
#pragma once

#include <cstdint>

namespace odyssey::replay {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0, uint64_t counter = 0) : seed_(seed), counter_(counter) {}

  uint64_t seed() const { return seed_; }
  uint64_t counter() const { return counter_; }  // draws taken so far

  uint64_t next_u64() {
    ++counter_;
    uint64_t z = seed_ + counter_ * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, 1), 53 random bits.
  double uniform_double() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

  // Uniform in [0, n) without modulo bias (rejects the 2^64 mod n lowest draws); 0 when n <= 1.
  uint64_t uniform_int(uint64_t n) {
    if (n <= 1) return 0;
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = next_u64();
      if (r >= threshold) return r % n;
    }
  }

 private:
  uint64_t seed_;
  uint64_t counter_;
};

}  // namespace odyssey::replay
