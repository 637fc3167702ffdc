#include "learner_test_helpers.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "replay/client.h"

namespace odyssey::testing {

std::string tiny_model_config() { return std::string(ODYSSEY_SOURCE_DIR) + "/configs/model/tiny.toml"; }

InProcessReplay::InProcessReplay(const std::string& dir) {
  replay::ServiceOptions o;
  o.store.dir = dir;
  o.store.sync = false;
  o.store.sampler = "group_complete";
  o.listen = "tcp://127.0.0.1:*";
  o.stats_every_seconds = 0;
  auto service = replay::ReplayService::create(o);
  EXPECT_TRUE(service.ok()) << service.status().to_string();
  if (!service.ok()) return;
  service_ = std::move(service).value();
  endpoint_ = service_->endpoint();
  thread_ = std::thread([this] {
    const Status st = service_->run(stop_);
    EXPECT_TRUE(st.ok()) << st.to_string();
  });
}

InProcessReplay::~InProcessReplay() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::vector<SyntheticGroup> sample_groups_from(model::Policy& policy, int groups, int size, int prompt, int generated,
                                               uint64_t seed, uint64_t id_base) {
  const at::NoGradGuard no_grad;
  at::manual_seed(seed);
  std::vector<SyntheticGroup> out;
  for (int g = 0; g < groups; ++g) {
    SyntheticGroup group;
    group.group_id = id_base + static_cast<uint64_t>(g);
    const at::Tensor prompt_tokens = at::randint(0, 256, {prompt}, at::kLong);
    model::PolicyState state = policy->initial_state(size);
    at::Tensor logits = policy->forward_chunk(prompt_tokens.unsqueeze(0).expand({size, prompt}).contiguous(), state)
                            .select(1, prompt - 1);
    std::vector<SyntheticTrajectory> members(static_cast<size_t>(size));
    for (int m = 0; m < size; ++m) {
      members[static_cast<size_t>(m)].id = ((id_base + static_cast<uint64_t>(g)) << 8) | static_cast<uint64_t>(m + 1);
      for (int p = 0; p < prompt; ++p) {
        members[static_cast<size_t>(m)].tokens.push_back(static_cast<uint32_t>(prompt_tokens[p].item<int64_t>()));
        members[static_cast<size_t>(m)].logprobs.push_back(0.0f);
        members[static_cast<size_t>(m)].loss_mask.push_back(0);
      }
    }
    for (int t = 0; t < generated; ++t) {
      const at::Tensor logp = at::log_softmax(logits.to(at::kFloat), -1);  // [size, V]
      const at::Tensor next = at::multinomial(logp.exp(), 1).squeeze(1);  // [size]
      const at::Tensor chosen = logp.gather(1, next.unsqueeze(1)).squeeze(1);
      for (int m = 0; m < size; ++m) {
        auto& tr = members[static_cast<size_t>(m)];
        tr.tokens.push_back(static_cast<uint32_t>(next[m].item<int64_t>()));
        tr.logprobs.push_back(chosen[m].item<float>());
        tr.loss_mask.push_back(1);
      }
      logits = policy->step(next, state);
    }
    for (auto& tr : members) {
      int low = 0;
      for (int t = prompt; t < prompt + generated; ++t) low += tr.tokens[static_cast<size_t>(t)] < 128;
      tr.reward = static_cast<double>(low) / generated;
    }
    group.members = std::move(members);
    out.push_back(std::move(group));
  }
  return out;
}

Status write_groups(const std::string& endpoint, const std::vector<SyntheticGroup>& groups, uint32_t segment_tokens) {
  replay::ClientOptions o;
  o.endpoint = endpoint;
  o.name = "test-writer";
  o.ack_timeout_ms = 2000;
  o.give_up_after_ms = 60000;
  ODY_ASSIGN_OR_RETURN(auto writer, replay::TrajectoryWriter::connect(o));
  for (const auto& g : groups) {
    for (const auto& tr : g.members) {
      replay::TrajectoryMeta meta;
      meta.id = tr.id;
      meta.job = "learner-test";
      meta.environment = "synthetic";
      meta.task = "group-" + std::to_string(g.group_id);
      meta.group_id = g.group_id;
      meta.group_size = static_cast<uint32_t>(g.members.size());
      ODY_ASSIGN_OR_RETURN(uint64_t id, writer->begin(meta));
      for (size_t s = 0; s < tr.tokens.size(); s += segment_tokens) {
        const size_t e = std::min(tr.tokens.size(), s + segment_tokens);
        SegmentData d;
        d.tokens.assign(tr.tokens.begin() + static_cast<long>(s), tr.tokens.begin() + static_cast<long>(e));
        d.logprobs.assign(tr.logprobs.begin() + static_cast<long>(s), tr.logprobs.begin() + static_cast<long>(e));
        d.loss_mask.assign(tr.loss_mask.begin() + static_cast<long>(s), tr.loss_mask.begin() + static_cast<long>(e));
        d.policy_versions.assign(e - s, 1);
        ODY_RETURN_IF_ERROR(writer->append(id, d));
      }
      ODY_RETURN_IF_ERROR(writer->end(id, replay::Reward{tr.reward, {{"correct", tr.reward > 0.5 ? 1.0 : 0.0}}}));
    }
  }
  return writer->flush();
}

std::string save_init_checkpoint(const std::string& dir, uint64_t seed) {
  auto config = model::load_model_config({tiny_model_config()});
  EXPECT_TRUE(config.ok()) << config.status().message();
  at::manual_seed(seed);
  model::Policy policy(*config);
  model::SaveOptions so;
  so.dtype = at::kFloat;
  const Status st = model::save_policy(policy, dir, nlohmann::json{{"name", "tiny"}}, model::CheckpointMeta{"1K", nullptr}, so);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return dir;
}

learner::TrainerOptions small_trainer_options(const std::string& out_dir, const std::string& endpoint,
                                              const std::string& init) {
  learner::TrainerOptions o;
  o.out_dir = out_dir;
  o.model_config = tiny_model_config();
  o.init = init;
  o.replay_endpoint = endpoint;
  o.groups_per_step = 2;
  o.chunk_tokens = 64;
  o.steps = 4;
  o.adamw.lr = 1e-3;
  o.schedule.warmup_steps = 0;
  o.schedule.total_steps = 4;
  o.checkpoint_every = 100;
  o.sample_wait_ms = 200;
  o.replay_timeout_ms = 20000;
  o.threads = 1;
  return o;
}

}  // namespace odyssey::testing
