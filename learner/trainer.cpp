#include "learner/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/types.h>

#include "learner/batch.h"
#include "learner/checkpoint.h"
#include "learner/chunked_policy.h"
#include "learner/distributed.h"
#include "learner/policy_gradient.h"
#include "model/balancing.h"
#include "model/config.h"
#include "model/policy.h"
#include "model/policy_checkpoint.h"
#include "model/precision.h"
#include "model/weight_channel.h"
#include "replay/client.h"

namespace odyssey::learner {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

TrainerOptions trainer_options(const Config& c, int rank, bool resume) {
  TrainerOptions o;
  o.out_dir = c.get_string("run.out");
  o.model_config = c.get_string("policy.model");
  o.init = c.get_string("policy.init");
  o.device = c.get_string("policy.device");
  o.publish_dtype = c.get_string("policy.dtype");
  o.threads = static_cast<int>(c.get_int("policy.threads"));
  o.seed = static_cast<uint64_t>(c.get_int("job.seed"));
  o.replay_endpoint = c.get_string("replay.listen");
  o.rank = rank;
  o.ranks = static_cast<int>(c.get_int("learner.ranks"));
  o.backend = c.get_string("learner.backend");
  o.master = c.get_string("learner.master");
  o.groups_per_step = c.get_int("learner.groups_per_step");
  o.chunk_tokens = c.get_int("learner.chunk_tokens");
  o.recompute = c.get_bool("learner.recompute");
  o.kda_keep_chunk_states = c.get_bool("learner.kda_keep_chunk_states");
  o.float32_matmul_precision = c.get_string("learner.float32_matmul_precision");
  o.steps = c.get_int("learner.steps");
  o.adamw.lr = c.get_double("learner.lr");
  o.adamw.weight_decay = c.get_double("learner.weight_decay");
  o.adamw.beta1 = c.get_double("learner.beta1");
  o.adamw.beta2 = c.get_double("learner.beta2");
  o.schedule.warmup_steps = c.get_int("learner.warmup_steps");
  o.schedule.total_steps = o.steps;
  o.schedule.schedule = c.get_string("learner.schedule") == "cosine" ? LrSchedule::kCosine : LrSchedule::kConstant;
  o.max_grad_norm = c.get_double("learner.max_grad_norm");
  o.loss.clip_low = c.get_double("learner.clip_low");
  o.loss.clip_high = c.get_double("learner.clip_high");
  o.loss.tis_cap = c.get_double("learner.tis_cap");
  o.loss.mask_ratio_above = c.get_double("learner.mask_ratio_above");
  o.loss.kl_coef = c.get_double("learner.kl_coef");
  o.loss.entropy_coef = c.get_double("learner.entropy_coef");
  o.publish_every = c.get_int("learner.publish_every");
  o.checkpoint_every = c.get_int("learner.checkpoint_every");
  o.keep_checkpoints = static_cast<int>(c.get_int("learner.keep_checkpoints"));
  o.resume = resume;
  return o;
}

json StepMetrics::to_json() const {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  return json{{"role", "learner"},
              {"time", now},
              {"step", step},
              {"version", version},
              {"loss", loss},
              {"reward_mean", reward_mean},
              {"success_rate", success_rate},
              {"tokens", tokens},
              {"trained_tokens", trained_tokens},
              {"tokens_per_s", tokens_per_s},
              {"seconds", seconds},
              {"wait_seconds", wait_seconds},
              {"policy_lag_mean", policy_lag_mean},
              {"policy_lag_max", policy_lag_max},
              {"clip_fraction", clip_fraction},
              {"entropy", entropy},
              {"ratio_mean", ratio_mean},
              {"ratio_max", ratio_max},
              {"masked_fraction", masked_fraction},
              {"kl", kl},
              {"grad_norm", grad_norm},
              {"lr", lr},
              {"groups", groups},
              {"trajectories", trajectories}};
}

namespace {

// This rank's share of `total` (the first total % ranks ranks take one more).
int64_t share(int64_t total, int rank, int ranks) { return total / ranks + (rank < total % ranks ? 1 : 0); }

at::ScalarType publish_dtype(const std::string& name) { return name == "bf16" ? at::kBFloat16 : at::kFloat; }

}  // namespace

struct Trainer::Impl {
  TrainerOptions o;
  model::ModelConfig model_config;
  json config_json;
  model::CheckpointMeta init_meta;
  at::Device device = at::kCPU;
  model::Policy policy{nullptr};
  std::unique_ptr<ChunkedPolicy> runner;
  model::Policy reference{nullptr};
  std::unique_ptr<ChunkedPolicy> reference_runner;
  std::unique_ptr<AdamW> adamw;
  std::vector<std::pair<std::string, at::Tensor>> trainable;
  std::vector<std::unique_ptr<model::QuantileBalancer>> balancers;
  std::unique_ptr<DataParallel> dp;
  std::unique_ptr<replay::ReplaySampler> sampler;
  std::unique_ptr<model::WeightPublisher> publisher;
  std::ofstream metrics;

  int64_t step = 0;
  uint32_t version = 0;
  uint64_t trained_cursor = 0;
  uint64_t committed_cursor = 0;
  int64_t last_checkpoint_step = -1;
  uint64_t trajectories_trained = 0, trajectory_id_sum = 0, tokens_trained = 0;

  std::string checkpoint_root() const { return o.out_dir + "/checkpoints"; }
  std::string weights_dir() const { return o.out_dir + "/weights"; }

  Status init();
  Result<StepMetrics> step_once(const std::atomic<bool>* stop);
  Status publish_next();
  Status save_checkpoint();
  void update_balancers(const std::vector<at::Tensor>& histograms);
  bool any_rank(bool flag);
};

bool Trainer::Impl::any_rank(bool flag) {
  at::Tensor t = at::full({1}, flag ? 1.0f : 0.0f);
  dp->all_reduce_max(t);
  return t.item<float>() > 0;
}

Status Trainer::Impl::init() {
  at::set_num_threads(std::max(1, o.threads));
  if (o.device != "cpu" && o.device.rfind("cuda", 0) != 0)
    return invalid_argument("policy.device '{}': cpu or cuda", o.device);
  device = at::Device(o.device);
  ODY_RETURN_IF_ERROR(model::set_float32_matmul_precision(o.float32_matmul_precision, "learner.float32_matmul_precision"));
  ODY_ASSIGN_OR_RETURN(model_config, model::load_model_config({o.model_config}));
  config_json = json{{"model_config", o.model_config}, {"name", model_config.name}};

  DataParallelOptions dpo;
  dpo.rank = o.rank;
  dpo.ranks = o.ranks;
  dpo.backend = o.backend;
  dpo.master = o.master;
  ODY_ASSIGN_OR_RETURN(dp, DataParallel::create(dpo));

  // The policy: random init from the job seed (identical on every rank), then init or resume.
  at::manual_seed(o.seed);
  policy = model::Policy(model_config);
  init_meta.stage = "1K";
  init_meta.provenance = json{{"init", o.init.empty() ? "random" : o.init}};
  auto load_init = [&](model::Policy& target) -> Status {
    if (o.init.empty()) return Status::Ok();
    auto meta = model::load_policy(target, o.init);
    if (!meta.ok()) return meta.status().with_context("policy.init");
    init_meta.stage = meta->stage;
    return Status::Ok();
  };
  if (o.init.empty()) {
    spdlog::warn("learner: policy.init is empty: training starts from random weights (seed {})", o.seed);
  }
  if (o.loss.kl_coef > 0) {
    // The reference is the job's starting policy (before any learner step), however often the
    // learner has been resumed since.
    at::manual_seed(o.seed);
    reference = model::Policy(model_config);
    ODY_RETURN_IF_ERROR(load_init(reference));
    reference->to(device);
    reference->eval();
    for (auto& p : reference->parameters()) p.requires_grad_(false);
    reference_runner = std::make_unique<ChunkedPolicy>(reference);
  }
  policy->to(device);
  runner = std::make_unique<ChunkedPolicy>(policy);
  for (const auto& p : policy->named_parameters())
    if (p.value().requires_grad()) trainable.emplace_back(p.key(), p.value());
  adamw = std::make_unique<AdamW>(trainable, o.adamw);
  for (size_t i = 0; i < policy->moe_layers().size(); ++i) {
    model::QuantileBalancerOptions bo;
    bo.num_experts = model_config.moe.routed_experts;
    bo.top_k = model_config.moe.top_k;
    bo.ema_decay = model_config.moe.balancing.ema;
    bo.histogram_bins = model_config.moe.balancing.histogram_bins;
    balancers.push_back(std::make_unique<model::QuantileBalancer>(bo));
  }

  std::optional<std::string> resume_from;
  if (o.resume) {
    resume_from = latest_checkpoint(checkpoint_root());
    if (!resume_from) spdlog::warn("learner: --resume, but {} holds no complete checkpoint; starting fresh", checkpoint_root());
  }
  if (resume_from) {
    ODY_ASSIGN_OR_RETURN(LearnerState s, load_learner_checkpoint(*resume_from, policy));
    ODY_RETURN_IF_ERROR(adamw->restore(s.optimizer, s.optimizer_steps));
    if (s.balancer_biases.size() != balancers.size())
      return make_status(StatusCode::kCorrupt, "learner checkpoint {}: {} balancer biases for {} MoE layers",
                         *resume_from, s.balancer_biases.size(), balancers.size());
    for (size_t i = 0; i < balancers.size(); ++i) {
      ODY_RETURN_IF_ERROR(balancers[i]->restore(model::BalancerState{s.balancer_biases[i], s.balancer_steps[i]}));
    }
    if (s.rng_state.defined()) {
      at::Generator cpu = at::detail::getDefaultCPUGenerator();
      cpu.set_state(s.rng_state);
    }
    step = s.step;
    version = s.version;
    trained_cursor = committed_cursor = s.replay_cursor;
    trajectories_trained = s.trajectories_trained;
    trajectory_id_sum = s.trajectory_id_sum;
    tokens_trained = s.tokens_trained;
    last_checkpoint_step = s.step;
    if (s.provenance.contains("stage")) init_meta.stage = s.provenance["stage"].get<std::string>();
    spdlog::info("learner: resumed from {} (step {}, version {}, replay cursor {})", *resume_from, step, version,
                 trained_cursor);
  } else {
    ODY_RETURN_IF_ERROR(load_init(policy));
  }
  {
    // Every rank starts from rank 0's weights and balancing biases.
    const at::NoGradGuard no_grad;
    for (auto& p : policy->parameters()) dp->broadcast(p);
    for (auto& b : policy->buffers()) dp->broadcast(b);
  }
  if (!resume_from) {
    // The balancers continue from the biases the starting weights route with (a stage
    // checkpoint carries them); on resume their state came from the checkpoint.
    for (size_t i = 0; i < balancers.size(); ++i) {
      const at::Tensor bias = policy->layer(policy->moe_layers()[i])->moe->router->bias.detach().to(at::kFloat).cpu();
      ODY_RETURN_IF_ERROR(balancers[i]->restore(model::BalancerState{bias.clone(), 0}));
    }
  }
  policy->train();

  replay::ClientOptions co;
  co.endpoint = o.replay_endpoint;
  co.name = fmt::format("learner-{}", o.rank);
  co.give_up_after_ms = o.replay_timeout_ms;
  ODY_ASSIGN_OR_RETURN(sampler, replay::ReplaySampler::connect(co));
  if (dp->is_root()) {
    // Deliveries after the checkpoint were never trained on by surviving weights: offer them again.
    ODY_RETURN_IF_ERROR(sampler->resume(trained_cursor).with_context("replay resume"));
    auto stats = sampler->stats();
    if (stats.ok() && stats->sampler != "group_complete") {
      spdlog::warn("learner: the replay service samples with '{}', not group_complete: every trajectory is a group "
                   "of one and gets advantage 0 (set replay.sampler = \"group_complete\")",
                   stats->sampler);
    }
  }
  dp->barrier();  // nobody samples before the resume above

  if (dp->is_root() && o.publish) {
    publisher = std::make_unique<model::WeightPublisher>(weights_dir(), config_json, publish_dtype(o.publish_dtype),
                                                         /*keep=*/3);
  }
  // Versions only grow: continue after whatever a crashed predecessor published.
  {
    model::WeightSubscriber latest(weights_dir());
    at::Tensor v = at::full({1}, static_cast<double>(std::max<uint32_t>(version, latest.latest(true).value_or(0))),
                            at::kDouble);
    dp->all_reduce_max(v);
    version = static_cast<uint32_t>(v.item<double>());
  }
  ODY_RETURN_IF_ERROR(publish_next());

  if (dp->is_root() && o.write_metrics) {
    std::error_code ec;
    fs::create_directories(o.out_dir + "/metrics", ec);
    metrics.open(o.out_dir + "/metrics/learner.jsonl", std::ios::app);
    if (!metrics) return make_status(StatusCode::kIo, "learner: cannot open {}/metrics/learner.jsonl", o.out_dir);
  }
  return Status::Ok();
}

Status Trainer::Impl::publish_next() {
  ++version;
  if (!dp->is_root()) return Status::Ok();
  if (publisher) {
    ODY_RETURN_IF_ERROR(publisher->publish(policy, version, json{{"step", step}}));
  }
  return sampler->set_policy_version(version).with_context("replay set_policy_version");
}

void Trainer::Impl::update_balancers(const std::vector<at::Tensor>& histograms) {
  if (balancers.empty()) return;
  std::vector<at::Tensor> biases;
  for (size_t j = 0; j < balancers.size(); ++j) {
    at::Tensor h = j < histograms.size() && histograms[j].defined()
                       ? histograms[j].clone()
                       : at::zeros({balancers[j]->num_experts(), balancers[j]->options().histogram_bins}, at::kLong);
    dp->all_reduce_sum(h);
    if (h.sum().item<int64_t>() == 0) {
      biases.push_back(balancers[j]->bias().defined() ? balancers[j]->bias() : at::zeros({balancers[j]->num_experts()}));
      continue;
    }
    biases.push_back(balancers[j]->update_from_histogram(h.to(balancers[j]->bias().device())));
  }
  const at::NoGradGuard no_grad;
  policy->set_expert_biases(biases);
}

Result<StepMetrics> Trainer::Impl::step_once(const std::atomic<bool>* stop) {
  const auto t0 = Clock::now();
  if (any_rank(stop && stop->load())) return Status(StatusCode::kTimeout, "learner: stop requested");

  // 1. This rank's groups. Requests wait at most sample_wait_ms; between them the ranks agree
  // (one small all-reduce) whether everyone has its groups or someone was asked to stop, so no
  // collective ever waits long on a rank that is waiting for data.
  const uint32_t groups_here = static_cast<uint32_t>(share(o.groups_per_step, o.rank, o.ranks));
  TrainingBatch batch;
  std::vector<replay::TrajectoryInfo> records;
  uint32_t have = 0;
  double wait_seconds = 0;
  for (;;) {
    const bool stopping = stop && stop->load();
    if (have < groups_here && !stopping) {
      const auto w0 = Clock::now();
      ODY_ASSIGN_OR_RETURN(uint32_t got, sample_more(*sampler, groups_here - have, o.sample_wait_ms, &batch, &records));
      have += got;
      wait_seconds += std::chrono::duration<double>(Clock::now() - w0).count();
    }
    at::Tensor flags = at::tensor({have < groups_here ? 1.0f : 0.0f, stopping ? 1.0f : 0.0f});
    dp->all_reduce_max(flags);
    // The partial batch is abandoned: its deliveries stay leased and come back at the next resume.
    if (flags[1].item<float>() > 0) return Status(StatusCode::kTimeout, "learner: stop requested while waiting for data");
    if (flags[0].item<float>() == 0) break;
  }
  ODY_RETURN_IF_ERROR(read_batch(*sampler, records, version, ReadLimits{}, &batch));

  // 2. Group-relative advantages.
  for (size_t g = 0; g < batch.group_starts.size(); ++g) {
    const size_t begin = batch.group_starts[g];
    const size_t end = g + 1 < batch.group_starts.size() ? batch.group_starts[g + 1] : batch.trajectories.size();
    std::vector<double> rewards;
    for (size_t i = begin; i < end; ++i) rewards.push_back(batch.trajectories[i].reward);
    const std::vector<double> adv = group_advantages(rewards);
    for (size_t i = begin; i < end; ++i) batch.trajectories[i].advantage = adv[i - begin];
  }

  // 3. Global loss-token count (the denominator of the token mean on every rank).
  double local_tokens = 0, local_all_tokens = 0;
  for (const auto& t : batch.trajectories) {
    local_tokens += static_cast<double>(t.trained_tokens());
    local_all_tokens += static_cast<double>(t.length());
  }
  at::Tensor count = at::tensor({local_tokens}, at::kDouble);
  dp->all_reduce_sum(count);
  const double tokens_global = count.item<double>();

  // 4. Forward/backward (learner/policy_gradient.h).
  for (auto& p : trainable) p.second.mutable_grad() = at::Tensor();
  PolicyGradientOptions pgo;
  pgo.chunk_tokens = o.chunk_tokens;
  pgo.recompute = o.recompute;
  pgo.kda_keep_chunk_states = o.kda_keep_chunk_states;
  pgo.loss = o.loss;
  pgo.tokens_global = tokens_global;
  pgo.device = device;
  std::vector<model::QuantileBalancer*> balancer_ptrs;
  for (auto& b : balancers) balancer_ptrs.push_back(b.get());
  const PolicyGradientResult pg =
      accumulate_policy_gradient(*runner, reference_runner.get(), batch.trajectories, balancer_ptrs, pgo);
  const LossSums& sums = pg.sums;

  // 5. Gradients summed over ranks (each already divided by the global token count), clipped.
  {
    const at::NoGradGuard no_grad;
    std::vector<at::Tensor> flat;
    std::vector<float> has(trainable.size(), 0.0f);
    for (size_t i = 0; i < trainable.size(); ++i) {
      const at::Tensor& p = trainable[i].second;
      has[i] = p.grad().defined() ? 1.0f : 0.0f;
      flat.push_back(p.grad().defined() ? p.grad().reshape({-1}).to(at::kFloat)
                                        : at::zeros({p.numel()}, p.options().dtype(at::kFloat)));
    }
    if (dp->ranks() > 1) {
      at::Tensor buffer = at::cat(flat);
      at::Tensor flags = at::tensor(has, at::kFloat);
      dp->all_reduce_sum(buffer);
      dp->all_reduce_max(flags);
      int64_t offset = 0;
      for (size_t i = 0; i < trainable.size(); ++i) {
        at::Tensor& p = trainable[i].second;
        const int64_t n = p.numel();
        if (flags[static_cast<int64_t>(i)].item<float>() > 0) {
          p.mutable_grad() = buffer.narrow(0, offset, n).view(p.sizes()).to(p.scalar_type()).clone();
        } else {
          p.mutable_grad() = at::Tensor();
        }
        offset += n;
      }
    }
  }
  std::vector<at::Tensor> params;
  for (auto& p : trainable) params.push_back(p.second);
  const double grad_norm = clip_grad_norm(params, o.max_grad_norm);
  const double lr = learning_rate(o.adamw.lr, o.schedule, step);
  if (std::isfinite(grad_norm)) {
    adamw->step(lr);
  } else {
    spdlog::warn("learner: step {}: gradient norm is {}; update skipped", step + 1, grad_norm);
  }
  update_balancers(pg.histograms);

  // 6. The step's figures over all ranks.
  double reward_sum = 0, success = 0, lag_sum = 0, lag_tokens = 0, lag_max = 0;
  int64_t id_lo = 0, id_hi = 0;
  for (const auto& t : batch.trajectories) {
    reward_sum += t.reward;
    success += t.success ? 1 : 0;
    lag_sum += t.lag_sum;
    lag_tokens += static_cast<double>(t.lag_tokens);
    lag_max = std::max(lag_max, static_cast<double>(t.lag_max));
    id_lo += static_cast<int64_t>(t.id & 0xffffffffu);
    id_hi += static_cast<int64_t>(t.id >> 32);
  }
  at::Tensor sum = at::tensor({sums.loss_value, sums.tokens, sums.kept, sums.clipped, sums.ratio_sum, sums.entropy_sum,
                               sums.kl_sum, reward_sum, success, static_cast<double>(batch.trajectories.size()),
                               static_cast<double>(batch.group_starts.size()), lag_sum, lag_tokens, local_all_tokens},
                              at::kDouble);
  at::Tensor mx = at::tensor({sums.ratio_max, lag_max}, at::kDouble);
  at::Tensor ids = at::tensor(std::vector<int64_t>{id_lo, id_hi}, at::kLong);
  at::Tensor cursor = at::tensor(std::vector<int64_t>{static_cast<int64_t>(batch.cursor)}, at::kLong);
  dp->all_reduce_sum(sum);
  dp->all_reduce_max(mx);
  dp->all_reduce_sum(ids);
  dp->all_reduce_max(cursor);
  auto S = [&](int64_t i) { return sum[i].item<double>(); };

  LossSums global;
  global.loss_value = S(0);
  global.tokens = S(1);
  global.kept = S(2);
  global.clipped = S(3);
  global.ratio_sum = S(4);
  global.entropy_sum = S(5);
  global.kl_sum = S(6);
  global.ratio_max = mx[0].item<double>();
  const LossMetrics lm = loss_metrics(global);
  const double trajectories = S(9);

  ++step;
  trained_cursor = std::max<uint64_t>(trained_cursor, static_cast<uint64_t>(cursor[0].item<int64_t>()));
  trajectories_trained += static_cast<uint64_t>(trajectories);
  trajectory_id_sum += static_cast<uint64_t>(ids[0].item<int64_t>()) + (static_cast<uint64_t>(ids[1].item<int64_t>()) << 32);
  tokens_trained += static_cast<uint64_t>(global.tokens);

  StepMetrics m;
  m.step = step;
  m.loss = lm.loss;
  m.reward_mean = trajectories > 0 ? S(7) / trajectories : 0;
  m.success_rate = trajectories > 0 ? S(8) / trajectories : 0;
  m.trajectories = static_cast<int64_t>(trajectories);
  m.groups = static_cast<int64_t>(S(10));
  m.policy_lag_mean = S(12) > 0 ? S(11) / S(12) : 0;
  m.policy_lag_max = mx[1].item<double>();
  m.tokens = S(13);
  m.trained_tokens = global.tokens;
  m.clip_fraction = lm.clip_fraction;
  m.entropy = lm.entropy;
  m.ratio_mean = lm.ratio_mean;
  m.ratio_max = lm.ratio_max;
  m.masked_fraction = lm.masked_fraction;
  m.kl = lm.kl;
  m.grad_norm = grad_norm;
  m.lr = lr;

  // 7. Publish, report, checkpoint.
  if (step % o.publish_every == 0) ODY_RETURN_IF_ERROR(publish_next());
  m.version = version;
  m.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  m.wait_seconds = wait_seconds;
  m.tokens_per_s = m.seconds - wait_seconds > 0 ? m.tokens / (m.seconds - wait_seconds) : 0;
  if (metrics.is_open()) {
    metrics << m.to_json().dump() << "\n";
    metrics.flush();
  }
  if (step % o.checkpoint_every == 0) ODY_RETURN_IF_ERROR(save_checkpoint());
  return m;
}

Status Trainer::Impl::save_checkpoint() {
  if (!dp->is_root() || last_checkpoint_step == step) return Status::Ok();
  LearnerState s;
  s.step = step;
  s.version = version;
  s.replay_cursor = trained_cursor;
  s.optimizer_steps = adamw->steps();
  s.optimizer = adamw->state();
  for (auto& b : balancers) {
    const model::BalancerState bs = b->state();
    s.balancer_biases.push_back(bs.bias.defined() ? bs.bias : at::zeros({b->num_experts()}));
    s.balancer_steps.push_back(bs.step);
  }
  s.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  s.trajectories_trained = trajectories_trained;
  s.trajectory_id_sum = trajectory_id_sum;
  s.tokens_trained = tokens_trained;
  s.provenance = json{{"init", o.init}, {"stage", init_meta.stage}, {"model_config", o.model_config}};
  ODY_RETURN_IF_ERROR(save_learner_checkpoint(checkpoint_root(), policy, s, config_json, init_meta, o.keep_checkpoints));
  last_checkpoint_step = step;
  // Only now, with the checkpoint durable, may the service mark these deliveries consumed.
  if (trained_cursor > committed_cursor) {
    ODY_RETURN_IF_ERROR(sampler->commit(trained_cursor).with_context("replay commit"));
    committed_cursor = trained_cursor;
  }
  spdlog::info("learner: checkpoint at step {} (version {}, replay cursor {})", step, version, trained_cursor);
  return Status::Ok();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->o = options;
  Status st;
  try {
    st = impl->init();
  } catch (const std::exception& e) {
    st = Status(StatusCode::kInternal, fmt::format("learner start: {}", e.what()));
  }
  if (!st.ok()) return st;
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step(const std::atomic<bool>* stop) {
  try {
    return impl_->step_once(stop);
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, fmt::format("learner step {}: {}", impl_->step + 1, e.what()));
  }
}

Status Trainer::checkpoint() {
  try {
    return impl_->save_checkpoint();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, fmt::format("learner checkpoint: {}", e.what()));
  }
}

Status Trainer::run(const std::atomic<bool>& stop) {
  while (impl_->step < impl_->o.steps) {
    auto m = step(&stop);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kTimeout) break;  // stop requested
      return m.status();
    }
    spdlog::info("learner: step {} loss {:.4f} reward {:.3f} success {:.3f} tokens/s {:.0f} lag {:.2f} grad_norm {:.3f}",
                 m->step, m->loss, m->reward_mean, m->success_rate, m->tokens_per_s, m->policy_lag_mean, m->grad_norm);
  }
  return checkpoint();
}

int64_t Trainer::step_count() const { return impl_->step; }
uint32_t Trainer::version() const { return impl_->version; }
uint64_t Trainer::trained_cursor() const { return impl_->trained_cursor; }
const TrainerOptions& Trainer::options() const { return impl_->o; }
std::vector<std::pair<std::string, at::Tensor>> Trainer::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : impl_->policy->named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace odyssey::learner
