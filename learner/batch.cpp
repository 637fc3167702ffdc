#include "learner/batch.h"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/codec.h"

namespace odyssey::learner {

int64_t TrajectoryTokens::trained_tokens() const {
  int64_t n = 0;
  for (size_t i = 1; i < loss_mask.size(); ++i) n += loss_mask[i] != 0;
  return n;
}

bool trajectory_success(schema::Trajectory::Reader record) {
  for (auto part : record.getRewardParts()) {
    if (std::string_view(part.getName().cStr()) == "correct") return part.getValue() > 0;
  }
  return record.getRewardTotal() >= 1.0;
}

Result<uint32_t> sample_more(replay::ReplaySampler& sampler, uint32_t count, uint32_t wait_ms, TrainingBatch* batch,
                             std::vector<replay::TrajectoryInfo>* records) {
  if (count == 0) return 0u;
  auto sampled = sampler.sample(count, wait_ms);
  if (!sampled.ok()) {
    if (sampled.status().code() == StatusCode::kTimeout) {
      spdlog::debug("learner: waiting for groups: {}", sampled.status().message());
      return 0u;
    }
    return sampled.status().with_context("sampling groups from the replay service");
  }
  if (sampled->items.empty()) return 0u;
  batch->cursor = std::max(batch->cursor, sampled->cursor);
  std::vector<uint32_t> starts = sampled->group_starts;
  if (starts.empty()) starts.push_back(0);  // one unit
  uint32_t got = 0;
  for (size_t g = 0; g < starts.size(); ++g) {
    const size_t begin = starts[g];
    const size_t end = g + 1 < starts.size() ? starts[g + 1] : sampled->items.size();
    if (begin >= end) continue;
    batch->group_starts.push_back(records->size());
    for (size_t i = begin; i < end; ++i) records->push_back(sampled->items[i]);
    ++got;
  }
  return got;
}

Status read_trajectory(replay::ReplaySampler& sampler, uint32_t version_now, const ReadLimits& limits,
                       TrajectoryTokens* out) {
  const std::string name = format_trajectory_id(out->id);
  uint32_t seq = 0;
  for (;;) {
    auto pieces = sampler.read(out->id, seq, limits.max_segments, limits.max_bytes);
    if (!pieces.ok()) return pieces.status().with_context(fmt::format("reading trajectory {}", name));
    if (pieces->empty()) break;
    for (const std::string& bytes : *pieces) {
      MessageView view(bytes);
      if (!view.ok()) return view.status().with_context(fmt::format("trajectory {} segment {}", name, seq));
      Status st = guarded("segment", [&]() -> Status {
        auto s = view.root<schema::Segment>();
        ODY_RETURN_IF_ERROR(validate_segment(s));
        if (s.getSeq() != seq || s.getTokenStart() != out->tokens.size())
          return Status(StatusCode::kCorrupt, fmt::format("segment seq {} at token {} where seq {} at token {} was expected",
                                                          s.getSeq(), s.getTokenStart(), seq, out->tokens.size()));
        auto tokens = s.getTokens();
        auto logprobs = s.getLogprobs();
        auto versions = s.getPolicyVersions();
        auto mask = s.getLossMask();
        for (uint32_t i = 0; i < tokens.size(); ++i) {
          const uint32_t t = tokens[i];
          if (t > static_cast<uint32_t>(INT32_MAX)) return invalid_argument("token {} out of range", t);
          out->tokens.push_back(static_cast<int32_t>(t));
          out->logprobs.push_back(logprobs[i]);
          const uint8_t m = mask[i];
          out->loss_mask.push_back(m);
          if (m) {
            const uint32_t v = versions[i];
            const uint32_t lag = version_now > v ? version_now - v : 0;
            out->lag_sum += lag;
            out->lag_tokens += 1;
            out->lag_max = std::max(out->lag_max, lag);
          }
        }
        return Status::Ok();
      });
      if (!st.ok()) return st.with_context(fmt::format("trajectory {} segment {}", name, seq));
      ++seq;
    }
  }
  return Status::Ok();
}

Status read_batch(replay::ReplaySampler& sampler, const std::vector<replay::TrajectoryInfo>& records,
                  uint32_t version_now, const ReadLimits& limits, TrainingBatch* batch) {
  batch->trajectories.resize(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    TrajectoryTokens& t = batch->trajectories[i];
    Status st = guarded("trajectory record", [&]() -> Status {
      auto r = records[i].record();
      t.id = r.getId();
      t.group_id = r.getGroupId();
      t.reward = r.getRewardTotal();
      t.success = trajectory_success(r);
      return Status::Ok();
    });
    ODY_RETURN_IF_ERROR(st);
    ODY_RETURN_IF_ERROR(read_trajectory(sampler, version_now, limits, &t));
  }
  return Status::Ok();
}

Result<TrainingBatch> load_batch(replay::ReplaySampler& sampler, uint32_t groups, uint32_t version_now,
                                 const ReadLimits& limits, uint32_t wait_ms, const std::atomic<bool>* stop) {
  TrainingBatch batch;
  std::vector<replay::TrajectoryInfo> records;
  uint32_t have = 0;
  while (have < groups) {
    if (stop && stop->load()) {
      batch.interrupted = true;
      return batch;
    }
    ODY_ASSIGN_OR_RETURN(uint32_t got, sample_more(sampler, groups - have, wait_ms, &batch, &records));
    have += got;
  }
  ODY_RETURN_IF_ERROR(read_batch(sampler, records, version_now, limits, &batch));
  return batch;
}

}  // namespace odyssey::learner
