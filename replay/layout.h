// The replay store's on-disk layout in RocksDB: column families and key encodings.
// Everything that reads a store (the service, `odyssey traj ...`, verify) goes through here.
//
//   segments      be64(trajectory id) be32(seq)        -> Segment message bytes (verbatim from the wire)
//   trajectories  be64(trajectory id)                  -> Trajectory record (self-hashed)
//   index         'r' be64(readySeq)                   -> be64(id)   order trajectories became sampleable
//                 'j' job 0x00 be64(id)                -> ""         by job
//                 'e' environment 0x00 be64(id)        -> ""         by environment name
//                 'v' be32(minPolicyVersion) be64(id)  -> ""         by policy version
//                 'w' ordered(rewardTotal) be64(id)    -> ""         by reward
//   state         "limiter" | "rng" | "counters" | "lease/" be64(delivery) | "format"
//
// Big-endian integers make RocksDB's byte order the numeric order.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace odyssey::replay {

inline constexpr const char* kSegmentsCf = "segments";
inline constexpr const char* kTrajectoriesCf = "trajectories";
inline constexpr const char* kIndexCf = "index";
inline constexpr const char* kStateCf = "state";
inline constexpr uint32_t kFormatVersion = 1;

inline void put_be64(std::string& out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_be32(std::string& out, uint32_t v) {
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t get_be64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
inline uint32_t get_be32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

inline std::string segment_key(uint64_t id, uint32_t seq) {
  std::string k;
  k.reserve(12);
  put_be64(k, id);
  put_be32(k, seq);
  return k;
}
inline std::string trajectory_key(uint64_t id) {
  std::string k;
  put_be64(k, id);
  return k;
}
// Splits a segments-CF key; false when it is not 12 bytes.
inline bool parse_segment_key(std::string_view key, uint64_t* id, uint32_t* seq) {
  if (key.size() != 12) return false;
  *id = get_be64(key.data());
  *seq = get_be32(key.data() + 8);
  return true;
}

inline std::string ready_index_key(uint64_t ready_seq) {
  std::string k("r");
  put_be64(k, ready_seq);
  return k;
}
inline std::string text_index_key(char kind, std::string_view text, uint64_t id) {
  std::string k(1, kind);
  k.append(text);
  k.push_back('\0');
  put_be64(k, id);
  return k;
}
inline std::string version_index_key(uint32_t min_version, uint64_t id) {
  std::string k("v");
  put_be32(k, min_version);
  put_be64(k, id);
  return k;
}
// Doubles map to unsigned integers whose order is the numeric order (NaN sorts last).
inline uint64_t ordered_double(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  return (bits & (uint64_t{1} << 63)) ? ~bits : bits | (uint64_t{1} << 63);
}
inline std::string reward_index_key(double reward, uint64_t id) {
  std::string k("w");
  put_be64(k, ordered_double(reward));
  put_be64(k, id);
  return k;
}
inline std::string lease_key(uint64_t delivery) {
  std::string k("lease/");
  put_be64(k, delivery);
  return k;
}

}  // namespace odyssey::replay
