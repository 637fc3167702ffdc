#include "learner/pretrain.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <memory>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/types.h>

#include "envs/episode.h"
#include "envs/plugin.h"
#include "envs/turn.h"
#include "learner/chunked_policy.h"
#include "learner/optimizer.h"
#include "model/balancing.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/policy_checkpoint.h"
#include "model/precision.h"

namespace odyssey::learner {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

at::Tensor to_tensor(const std::vector<uint32_t>& tokens) {
  std::vector<int64_t> ids(tokens.begin(), tokens.end());
  return at::tensor(ids, at::kLong);
}

// The balancing bias buffers of the policy, in moe_layers() order.
std::vector<at::Tensor> expert_biases(model::Policy& policy) {
  std::vector<at::Tensor> out;
  const auto buffers = policy->named_buffers();
  for (int64_t layer : policy->moe_layers()) {
    const std::string name = fmt::format("layers.{}.moe.router.bias", layer);
    const at::Tensor* b = buffers.find(name);
    out.push_back(b ? b->detach().to(at::kCPU, at::kFloat).clone() : at::Tensor());
  }
  return out;
}

}  // namespace

// ---- Stages ----

Result<int64_t> stage_tokens(const std::string& stage) {
  ODY_RETURN_IF_ERROR(model::validate_stage(stage));
  const int64_t count = std::stoll(stage.substr(0, stage.size() - 1));
  return count * (stage.back() == 'K' ? int64_t{1024} : int64_t{1024} * 1024);
}

Result<std::vector<PretrainStage>> parse_stages(const std::vector<std::string>& names, const std::string& where) {
  if (names.empty()) return invalid_argument("{}: no stages; list at least one, e.g. [\"1K\", \"4K\"]", where);
  std::vector<PretrainStage> stages;
  for (const std::string& name : names) {
    Result<int64_t> tokens = stage_tokens(name);
    if (!tokens.ok()) {
      return invalid_argument("{}: stage '{}' is not a context length like 1K, 4K, 16K, 64K or 1M", where, name);
    }
    if (!stages.empty() && *tokens <= stages.back().context) {
      return invalid_argument("{}: stages must grow, but '{}' ({} tokens) follows '{}' ({} tokens)", where, name, *tokens,
                              stages.back().name, stages.back().context);
    }
    stages.push_back({name, *tokens});
  }
  return stages;
}

// ---- Options from the config ----

Result<PretrainOptions> pretrain_options(const Config& config) {
  const auto where = [&](const char* key) { return fmt::format("config {}: key '{}'", config.source(key), key); };
  PretrainOptions o;
  o.out_dir = config.get_string("pretrain.out");
  if (o.out_dir.empty()) return invalid_argument("{}: empty; name the directory of the stage checkpoints", where("pretrain.out"));
  ODY_ASSIGN_OR_RETURN(o.stages, parse_stages(config.get_strings("pretrain.stages"), where("pretrain.stages")));
  o.steps_per_stage = config.get_int("pretrain.steps_per_stage");
  o.batch_tokens = config.get_int("pretrain.batch_tokens");
  o.lr = config.get_double("pretrain.lr");
  Result<DataKind> kind = parse_data_kind(config.get_string("pretrain.data"));
  if (!kind.ok()) return invalid_argument("{}: {}", where("pretrain.data"), kind.status().message());
  o.data.kind = *kind;
  o.seed = static_cast<uint64_t>(config.get_int("job.seed"));
  o.data.seed = o.seed;
  o.job = config.get_string("job.name");
  o.model_config = config.get_string("policy.model");
  o.save_dtype = config.get_string("policy.dtype");
  o.device = config.get_string("policy.device");
  o.threads = static_cast<int>(config.get_int("pretrain.threads"));
  if (o.threads == 0) o.threads = static_cast<int>(config.get_int("policy.threads"));
  o.chunk_tokens = config.get_int("learner.chunk_tokens");
  o.recompute = config.get_bool("learner.recompute");
  o.kda_keep_chunk_states = config.get_bool("learner.kda_keep_chunk_states");
  o.float32_matmul_precision = config.get_string("learner.float32_matmul_precision");
  o.eval.env = config.get_string("env.name");
  o.eval.env_config = json::parse(config.get_string("env.config"), nullptr, /*allow_exceptions=*/false);
  if (!o.eval.env_config.is_object()) {
    return invalid_argument("{}: '{}' is not a JSON object", where("env.config"), config.get_string("env.config"));
  }
  o.eval.max_tokens = config.get_int("actor.max_tokens");
  o.eval.max_turn_tokens = config.get_int("actor.max_turn_tokens");
  return o;
}

// ---- Greedy evaluation ----

json EvalResult::to_json() const {
  return json{{"episodes", episodes},          {"successes", successes},
              {"success_rate", success_rate},  {"mean_reward", mean_reward},
              {"generated_tokens", generated_tokens}, {"seconds", seconds}};
}

Result<EvalResult> evaluate_greedy(model::Policy& policy, const Tokenizer& tokenizer, const GreedyEvalOptions& o) {
  const auto start = Clock::now();
  ODY_ASSIGN_OR_RETURN(const std::string path, envs::find_plugin(o.env));
  ODY_ASSIGN_OR_RETURN(std::shared_ptr<envs::Plugin> plugin, envs::Plugin::load(path));
  Result<std::unique_ptr<envs::EnvSession>> created = plugin->create(o.env_config);
  if (!created.ok()) return created.status().with_context(fmt::format("evaluation: plugin {} with config {}", path, o.env_config.dump()));
  envs::EnvSession& session = **created;

  const uint32_t end_turn = tokenizer.special_id(SpecialToken::kEndTurn);
  const uint32_t eos = tokenizer.special_id(SpecialToken::kEos);
  const at::NoGradGuard no_grad;
  // Eval mode for the rollouts, the caller's mode back whatever happens.
  struct ModeGuard {
    model::Policy& policy;
    bool was_training;
    ~ModeGuard() { policy->train(was_training); }
  } mode{policy, policy->is_training()};
  policy->eval();
  const at::Device device = policy->lm_head->weight.device();

  EvalResult result;
  double reward = 0;
  try {
    for (int64_t i = 0; i < o.episodes; ++i) {
      envs::Episode episode(session, tokenizer);
      const json task{{"split", o.split}, {"index", o.first_index + static_cast<uint64_t>(i)}};
      const env::Observation first = episode.start(task, static_cast<uint64_t>(i));
      if (episode.failed()) {
        return make_status(StatusCode::kInvalidArgument, "evaluation: {} refused task {}: {}", path, task.dump(),
                           episode.failure());
      }
      std::vector<uint32_t> transcript{tokenizer.special_id(SpecialToken::kBos)};
      const std::vector<uint32_t> user = envs::render_observation(first, tokenizer, SpecialToken::kUser).tokens;
      transcript.insert(transcript.end(), user.begin(), user.end());
      transcript.push_back(tokenizer.special_id(SpecialToken::kAssistant));

      model::PolicyState state = policy->initial_state(1, o.max_tokens);
      // Feeds `tokens` and returns the next token the policy picks.
      const auto feed = [&](const std::vector<uint32_t>& tokens) {
        const at::Tensor logits = policy->forward_chunk(to_tensor(tokens).unsqueeze(0).to(device), state);
        return static_cast<uint32_t>(logits.select(1, logits.size(1) - 1).argmax(-1).item<int64_t>());
      };
      uint32_t next = feed(transcript);
      while (!episode.done()) {
        std::vector<uint32_t> turn;
        bool cut = false;
        for (;;) {
          if (static_cast<int64_t>(transcript.size()) >= o.max_tokens) {
            cut = true;
            break;
          }
          turn.push_back(next);
          transcript.push_back(next);
          ++result.generated_tokens;
          if (next == end_turn || next == eos || static_cast<int64_t>(turn.size()) >= o.max_turn_tokens) break;
          next = static_cast<uint32_t>(
              policy->step(at::full({1}, static_cast<int64_t>(next), at::kLong).to(device), state).argmax(-1).item<int64_t>());
        }
        if (cut) break;  // out of tokens mid-turn: scored as it stands
        const env::Observation obs = episode.take_turn(turn);
        std::vector<uint32_t> more = envs::render_observation(obs, tokenizer, SpecialToken::kTool).tokens;
        if (static_cast<int64_t>(transcript.size() + more.size()) + 2 > o.max_tokens) break;
        transcript.insert(transcript.end(), more.begin(), more.end());
        if (episode.done() || turn.back() == eos) break;
        transcript.push_back(tokenizer.special_id(SpecialToken::kAssistant));
        more.insert(more.begin(), turn.back());  // the turn's last token is not fed yet
        more.push_back(tokenizer.special_id(SpecialToken::kAssistant));
        next = feed(more);
      }
      transcript.push_back(eos);
      const envs::EpisodeScore grade = episode.finish();
      ++result.episodes;
      if (grade.score.success) ++result.successes;
      reward += grade.score.reward;
      if (i < o.keep_transcripts) result.transcripts.push_back(tokenizer.decode(transcript));
    }
  } catch (const std::exception& e) {
    return make_status(StatusCode::kInternal, "evaluation: {}", e.what());
  }
  result.success_rate = result.episodes ? static_cast<double>(result.successes) / static_cast<double>(result.episodes) : 0;
  result.mean_reward = result.episodes ? reward / static_cast<double>(result.episodes) : 0;
  result.seconds = seconds_since(start);
  return result;
}

// ---- Pretraining ----

namespace {

struct StepResult {
  double loss = 0;
  int64_t loss_tokens = 0;
};

class StageTrainer {
 public:
  StageTrainer(const PretrainOptions& o, model::Policy& policy, std::vector<std::unique_ptr<model::QuantileBalancer>>& balancers,
               at::Device device)
      : o_(o), policy_(policy), balancers_(balancers), device_(device), runner_(policy) {}

  // One optimizer step on the batch `tokens`/`mask` (int64 / uint8 [B, L], CPU).
  StepResult step(const at::Tensor& tokens, const at::Tensor& mask, AdamW& adamw, double lr, double* grad_norm,
                  uint32_t pad) {
    const int64_t B = tokens.size(0), T = tokens.size(1) - 1;
    const at::Tensor inputs = tokens.narrow(1, 0, T).to(device_);
    const at::Tensor targets = tokens.narrow(1, 1, T).to(device_);
    const at::Tensor weights = mask.narrow(1, 1, T).to(device_, at::kFloat);
    const at::Tensor valid = inputs.ne(static_cast<int64_t>(pad));
    const int64_t count = mask.narrow(1, 1, T).sum().item<int64_t>();
    StepResult r;
    r.loss_tokens = count;
    policy_->zero_grad(/*set_to_none=*/true);
    histograms_.assign(balancers_.size(), at::Tensor());

    // Masked next-token cross-entropy of a chunk of positions [s, s + n), summed.
    const auto loss_sum = [&](const at::Tensor& logits, int64_t s, int64_t n) {
      const at::Tensor logp = at::log_softmax(logits.to(at::kFloat), -1);
      const at::Tensor picked = logp.gather(2, targets.narrow(1, s, n).unsqueeze(2)).squeeze(2);
      return -(picked * weights.narrow(1, s, n)).sum();
    };
    const double denom = static_cast<double>(std::max<int64_t>(count, 1));
    if (T <= o_.chunk_tokens) {
      const at::Tensor loss = loss_sum(policy_->forward(inputs), 0, T) / denom;
      loss.backward();
      r.loss = loss.item<double>();
      const auto& routing = policy_->last_routing();
      std::vector<at::Tensor> scores;
      for (int64_t layer : policy_->moe_layers()) scores.push_back(routing[static_cast<size_t>(layer)].scores);
      observe_routing(scores, valid.reshape({-1}));
    } else {
      double total = 0;
      ChunkCallbacks cb;
      cb.tokens = [&](int64_t s, int64_t n) { return inputs.narrow(1, s, n); };
      cb.observe = [&](const ChunkView& v) {
        observe_routing(v.output->routing, valid.narrow(1, v.start, v.length).reshape({-1}));
      };
      cb.loss = [&](const ChunkView& v) -> at::Tensor {
        if (weights.narrow(1, v.start, v.length).sum().item<double>() == 0) return at::Tensor();
        const at::Tensor loss = loss_sum(v.output->logits, v.start, v.length) / denom;
        total += loss.item<double>();
        return loss;
      };
      chunked_backward(runner_, B, T, ChunkedBackwardOptions{o_.chunk_tokens, o_.recompute, o_.kda_keep_chunk_states}, cb);
      r.loss = total;
    }
    *grad_norm = clip_grad_norm(params(adamw), o_.max_grad_norm);
    adamw.step(lr);
    update_balancers();
    return r;
  }

 private:
  static std::vector<at::Tensor> params(const AdamW& adamw) {
    std::vector<at::Tensor> out;
    for (const auto& p : adamw.params()) out.push_back(p.second);
    return out;
  }

  void observe_routing(const std::vector<at::Tensor>& scores, const at::Tensor& valid) {
    const at::NoGradGuard no_grad;
    const at::Tensor rows = valid.nonzero().squeeze(1);
    for (size_t j = 0; j < scores.size() && j < balancers_.size(); ++j) {
      if (!scores[j].defined() || rows.numel() == 0) continue;
      const at::Tensor s = scores[j].detach().to(at::kFloat).index_select(0, rows.to(scores[j].device()));
      const at::Tensor h = balancers_[j]->local_histogram(s).to(at::kCPU);
      histograms_[j] = histograms_[j].defined() ? histograms_[j] + h : h;
    }
  }

  void update_balancers() {
    if (balancers_.empty()) return;
    std::vector<at::Tensor> biases;
    for (size_t j = 0; j < balancers_.size(); ++j) {
      if (!histograms_[j].defined() || histograms_[j].sum().item<int64_t>() == 0) {
        biases.push_back(balancers_[j]->bias());
        continue;
      }
      biases.push_back(balancers_[j]->update_from_histogram(histograms_[j].to(balancers_[j]->bias().device())));
    }
    const at::NoGradGuard no_grad;
    policy_->set_expert_biases(biases);
  }

  const PretrainOptions& o_;
  model::Policy& policy_;
  std::vector<std::unique_ptr<model::QuantileBalancer>>& balancers_;
  at::Device device_;
  ChunkedPolicy runner_;
  std::vector<at::Tensor> histograms_;
};

Status check_options(const PretrainOptions& o) {
  if (o.stages.empty()) return invalid_argument("pretrain: no stages");
  if (o.steps_per_stage < 1) return invalid_argument("pretrain: steps_per_stage {} must be at least 1", o.steps_per_stage);
  if (o.batch_tokens < 1) return invalid_argument("pretrain: batch_tokens {} must be at least 1", o.batch_tokens);
  if (!(o.lr >= 0)) return invalid_argument("pretrain: lr {} must not be negative", o.lr);
  if (o.chunk_tokens < 1) return invalid_argument("pretrain: chunk_tokens {} must be at least 1", o.chunk_tokens);
  if (o.save_dtype != "fp32" && o.save_dtype != "bf16")
    return invalid_argument("pretrain: save dtype '{}' is not fp32 or bf16", o.save_dtype);
  for (const PretrainStage& s : o.stages)
    if (s.context < 2) return invalid_argument("pretrain: stage {} has a context of {} tokens; at least 2", s.name, s.context);
  return Status::Ok();
}

Result<PretrainSummary> pretrain_impl(const PretrainOptions& o) {
  const auto run_start = Clock::now();
  ODY_RETURN_IF_ERROR(check_options(o));
  if (o.threads > 0) at::set_num_threads(o.threads);
  ODY_ASSIGN_OR_RETURN(const model::ModelConfig mc, model::load_model_config({o.model_config}));
  const ByteTokenizer tokenizer;
  if (mc.vocab_size < static_cast<int64_t>(tokenizer.vocab_size())) {
    return invalid_argument("pretrain: model {} has a vocabulary of {} but the byte tokenizer needs {}", o.model_config,
                            mc.vocab_size, tokenizer.vocab_size());
  }
  const at::Device device(o.device);
  ODY_RETURN_IF_ERROR(model::set_float32_matmul_precision(o.float32_matmul_precision, "learner.float32_matmul_precision"));
  at::manual_seed(o.seed);
  model::Policy policy(mc);
  policy->to(device);
  policy->train();
  const json config_json{{"model_config", o.model_config}, {"name", mc.name}};

  std::vector<std::unique_ptr<model::QuantileBalancer>> balancers;
  for (size_t i = 0; i < policy->moe_layers().size(); ++i) {
    model::QuantileBalancerOptions bo;
    bo.num_experts = mc.moe.routed_experts;
    bo.top_k = mc.moe.top_k;
    bo.ema_decay = mc.moe.balancing.ema;
    bo.histogram_bins = mc.moe.balancing.histogram_bins;
    balancers.push_back(std::make_unique<model::QuantileBalancer>(bo));
  }
  const auto sync_balancers = [&]() -> Status {
    const std::vector<at::Tensor> biases = expert_biases(policy);
    for (size_t i = 0; i < balancers.size(); ++i) {
      if (!biases[i].defined()) continue;
      ODY_RETURN_IF_ERROR(balancers[i]->restore(model::BalancerState{biases[i], 0}));
    }
    return Status::Ok();
  };
  ODY_RETURN_IF_ERROR(sync_balancers());

  ODY_ASSIGN_OR_RETURN(std::unique_ptr<DocumentStream> stream, DocumentStream::create(tokenizer, o.data));
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return make_status(StatusCode::kIo, "pretrain: cannot create {}: {}", o.out_dir, ec.message());

  std::vector<std::pair<std::string, at::Tensor>> trainable;
  for (const auto& item : policy->named_parameters())
    if (item.value().requires_grad()) trainable.emplace_back(item.key(), item.value());
  const uint32_t pad = tokenizer.special_id(SpecialToken::kPad);

  PretrainSummary summary;
  std::string parent;
  for (const PretrainStage& stage : o.stages) {
    StageSummary st;
    st.stage = stage;
    st.dir = (fs::path(o.out_dir) / ("stage-" + stage.name)).string();
    if (fs::exists(st.dir)) {
      if (o.resume && fs::exists(fs::path(st.dir) / model::kCheckpointCompleteFile)) {
        Result<model::CheckpointMeta> meta = model::load_policy(policy, st.dir);
        if (!meta.ok()) return meta.status().with_context("pretrain --resume: loading " + st.dir);
        ODY_RETURN_IF_ERROR(sync_balancers());
        st.resumed = true;
        if (meta->provenance.is_object()) {
          st.steps = meta->provenance.value("steps", int64_t{0});
          st.tokens = meta->provenance.value("tokens", int64_t{0});
          st.final_loss = meta->provenance.value("final_loss", 0.0);
        }
        // The last stage, already complete, is still evaluated when asked: `--resume --eval-tasks N`
        // evaluates existing stage checkpoints without training.
        if (o.eval.episodes > 0 && &stage == &o.stages.back()) {
          ODY_ASSIGN_OR_RETURN(EvalResult eval, evaluate_greedy(policy, tokenizer, o.eval));
          st.eval = std::move(eval);
        }
        summary.stages.push_back(st);
        parent = stage.name;
        continue;
      }
      if (!o.overwrite) {
        return make_status(StatusCode::kAlreadyExists,
                           "pretrain: {} already exists (from an earlier run); --resume continues after its complete "
                           "stages, --overwrite replaces them, or set pretrain.out to a new directory",
                           st.dir);
      }
    }
    if (o.on_stage_begin) o.on_stage_begin(st, policy);

    const auto stage_start = Clock::now();
    const int64_t rows = std::max<int64_t>(1, o.batch_tokens / stage.context);
    SequencePacker packer(*stream, tokenizer, stage.context);
    AdamW adamw(trainable, AdamWOptions{o.lr, 0.9, 0.95, 1e-8, o.weight_decay});
    ScheduleOptions schedule{std::max<int64_t>(1, o.steps_per_stage / 10), o.steps_per_stage, LrSchedule::kCosine};
    StageTrainer trainer(o, policy, balancers, device);
    const int64_t log_every = o.log_every > 0 ? o.log_every : std::max<int64_t>(1, o.steps_per_stage / 10);

    // final_loss: the mean of the last tenth of the stage's steps (1 to 10 of them).
    const int64_t tail_steps = std::clamp<int64_t>(o.steps_per_stage / 10, 1, 10);
    std::deque<double> recent;
    double window_loss = 0, window_tokens = 0;
    int64_t window_steps = 0;
    auto window_start = Clock::now();
    for (int64_t step = 0; step < o.steps_per_stage; ++step) {
      at::Tensor tokens = at::empty({rows, stage.context}, at::kLong);
      at::Tensor mask = at::empty({rows, stage.context}, at::kByte);
      for (int64_t r = 0; r < rows; ++r) {
        ODY_ASSIGN_OR_RETURN(const PackedRow row, packer.next_row());
        std::vector<int64_t> ids(row.tokens.begin(), row.tokens.end());
        tokens[r].copy_(at::tensor(ids, at::kLong));
        mask[r].copy_(at::tensor(std::vector<uint8_t>(row.loss_mask), at::kByte));
      }
      const double lr = learning_rate(o.lr, schedule, step);
      double grad_norm = 0;
      const StepResult r = trainer.step(tokens, mask, adamw, lr, &grad_norm, pad);
      if (step == 0) st.first_loss = r.loss;
      recent.push_back(r.loss);
      if (static_cast<int64_t>(recent.size()) > tail_steps) recent.pop_front();
      const int64_t positions = rows * (stage.context - 1);
      st.tokens += positions;
      st.loss_tokens += r.loss_tokens;
      ++st.steps;
      window_loss += r.loss;
      window_tokens += static_cast<double>(positions);
      ++window_steps;
      if (o.on_progress && ((step + 1) % log_every == 0 || step + 1 == o.steps_per_stage)) {
        PretrainProgress p;
        p.stage = stage.name;
        p.step = step + 1;
        p.steps = o.steps_per_stage;
        p.loss = window_loss / static_cast<double>(window_steps);
        p.lr = lr;
        p.grad_norm = grad_norm;
        p.tokens_per_s = window_tokens / std::max(1e-9, seconds_since(window_start));
        p.seconds = seconds_since(run_start);
        o.on_progress(p);
        window_loss = window_tokens = 0;
        window_steps = 0;
        window_start = Clock::now();
      }
    }
    double tail = 0;
    for (double l : recent) tail += l;
    st.final_loss = tail / static_cast<double>(recent.size());
    st.seconds = seconds_since(stage_start);

    json provenance{{"steps", st.steps},
                    {"tokens", st.tokens},
                    {"loss_tokens", st.loss_tokens},
                    {"data", data_kind_name(o.data.kind)},
                    {"first_loss", st.first_loss},
                    {"final_loss", st.final_loss},
                    {"seed", o.seed},
                    {"parent_stage", parent.empty() ? json() : json(parent)},
                    {"context", stage.context},
                    {"rows_per_step", rows},
                    {"batch_tokens", o.batch_tokens},
                    {"lr", o.lr},
                    {"job", o.job},
                    {"seconds", st.seconds}};
    if (o.eval.episodes > 0) {
      ODY_ASSIGN_OR_RETURN(EvalResult eval, evaluate_greedy(policy, tokenizer, o.eval));
      json e = eval.to_json();
      e["env"] = o.eval.env;
      e["env_config"] = o.eval.env_config;
      e["split"] = o.eval.split;
      provenance["eval"] = std::move(e);
      st.eval = std::move(eval);
    }
    if (o.on_stage_end) o.on_stage_end(st, policy);

    model::SaveOptions so;
    so.dtype = o.save_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    so.overwrite = o.overwrite;
    ODY_RETURN_IF_ERROR(model::save_policy(policy, st.dir, config_json, model::CheckpointMeta{stage.name, provenance}, so));
    summary.tokens += st.tokens;
    summary.stages.push_back(std::move(st));
    parent = stage.name;
  }
  summary.seconds = seconds_since(run_start);
  return summary;
}

}  // namespace

Result<PretrainSummary> run_pretrain(const PretrainOptions& options) {
  try {
    return pretrain_impl(options);
  } catch (const std::exception& e) {  // c10::Error from LibTorch, bad_alloc
    return make_status(StatusCode::kInternal, "pretrain: {}", e.what());
  }
}

}  // namespace odyssey::learner
