#include "actors/actor.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "actors/ragged_decoder.h"
#include "actors/transcript.h"
#include "core/tokenizer.h"
#include "envs/env_host.h"
#include "envs/episode.h"
#include "envs/mcp.h"
#include "envs/plugin.h"
#include "model/config.h"
#include "model/weight_channel.h"
#include "replay/client.h"

namespace odyssey::actors {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kPrefillChunk = 4096;

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t mix(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x6f647973736579ull;  // "odyssey"
  for (uint64_t p : parts) h = mix64(h ^ p);
  return h;
}
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Appends one JSON line to `path` (creating its folder).
void append_json_line(const fs::path& path, const json& line) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::ofstream out(path, std::ios::app);
  out << line.dump() << '\n';
  if (!out) spdlog::warn("metrics: cannot append to {}", path.string());
}

// Writes `text` to `path` atomically (temporary file, then rename).
Status write_file_atomically(const fs::path& path, const std::string& text) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return make_status(StatusCode::kIo, "cannot write {}", tmp.string());
  }
  fs::rename(tmp, path, ec);
  if (ec) return make_status(StatusCode::kIo, "cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message());
  return Status::Ok();
}

// Threads that run environment calls; each job names its slot, and completed() hands the slots
// whose jobs finished back to the actor loop (the queue's mutex orders the job's writes before
// the loop's reads).
class EnvWorkers {
 public:
  explicit EnvWorkers(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~EnvWorkers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void submit(size_t slot, std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({slot, std::move(job)});
      ++busy_;
    }
    work_cv_.notify_one();
  }
  std::vector<size_t> completed(std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lock(mu_);
    if (done_.empty() && wait.count() > 0 && busy_ > 0) done_cv_.wait_for(lock, wait, [&] { return !done_.empty(); });
    std::vector<size_t> out(done_.begin(), done_.end());
    done_.clear();
    busy_ -= out.size();
    return out;
  }
  size_t busy() {
    std::lock_guard<std::mutex> lock(mu_);
    return busy_;
  }

 private:
  struct Job {
    size_t slot;
    std::function<void()> fn;
  };
  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job.fn();
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back(job.slot);
      }
      done_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> jobs_;
  std::vector<size_t> done_;
  size_t busy_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

struct EpisodeSpec {
  json task;
  uint64_t env_seed = 0;
  uint64_t sequence = 0;  // the sampling sequence id (counter-based randomness)
  uint64_t group_id = 0;
  uint32_t group_size = 0;
  uint64_t episode = 0;
  bool record = true;     // stream to replay
};

struct Outcome {
  double reward = 0;
  bool success = false;
  bool failed = false;
};

// Where episodes come from, and where their outcomes go.
class EpisodeSource {
 public:
  virtual ~EpisodeSource() = default;
  // The next episode to start; nullopt once no more will come.
  virtual std::optional<EpisodeSpec> next() = 0;
  virtual void finished(const EpisodeSpec&, const Outcome&) {}
};

// Training episodes in GRPO groups (see actor.h).
class RolloutSource final : public EpisodeSource {
 public:
  RolloutSource(const ActorOptions& o, fs::path state_file) : o_(o), state_file_(std::move(state_file)) {}

  Status load() {
    std::ifstream in(state_file_);
    if (!in) return Status::Ok();  // a fresh actor
    const json state = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!state.is_object() || !state.contains("next_group") || !state["next_group"].is_number_unsigned())
      return invalid_argument("actor state {}: expected {{\"next_group\": N}}", state_file_.string());
    next_group_ = state["next_group"].get<uint64_t>();
    return Status::Ok();
  }
  Status status() const { return status_; }

  std::optional<EpisodeSpec> next() override {
    if (o_.max_episodes > 0 && issued_ >= static_cast<uint64_t>(o_.max_episodes)) return std::nullopt;
    if (!status_.ok()) return std::nullopt;
    if (!group_ || member_ == static_cast<uint64_t>(o_.group_size)) {
      group_ = next_group_++;
      member_ = 0;
      // Persist first: a restart after this point moves on to the next group.
      status_ = write_file_atomically(state_file_, json{{"next_group", next_group_}}.dump() + "\n");
      if (!status_.ok()) return std::nullopt;
    }
    const uint64_t g = *group_;
    const uint64_t job = fnv1a(o_.job);
    EpisodeSpec spec;
    spec.task = {{"split", "train"},
                 {"index", o_.seed * 1000000 + g * static_cast<uint64_t>(o_.actor_count) + static_cast<uint64_t>(o_.index)}};
    spec.env_seed = mix({job, o_.seed, static_cast<uint64_t>(o_.index), g, 1});
    spec.group_id = mix({job, o_.seed, static_cast<uint64_t>(o_.index), g, 2}) | 1;
    spec.group_size = static_cast<uint32_t>(o_.group_size);
    spec.episode = g * static_cast<uint64_t>(o_.group_size) + member_;
    spec.sequence = mix({job, o_.seed, static_cast<uint64_t>(o_.index), spec.episode, 3});
    spec.record = true;
    ++member_;
    ++issued_;
    return spec;
  }

 private:
  const ActorOptions& o_;
  fs::path state_file_;
  uint64_t next_group_ = 0;
  std::optional<uint64_t> group_;
  uint64_t member_ = 0;
  uint64_t issued_ = 0;
  Status status_;
};

// The held-out tasks of one evaluation.
class EvalSource final : public EpisodeSource {
 public:
  explicit EvalSource(int tasks) : tasks_(tasks) {}
  std::optional<EpisodeSpec> next() override {
    if (next_ >= tasks_) return std::nullopt;
    EpisodeSpec spec;
    spec.task = {{"split", "eval"}, {"index", next_}};
    spec.env_seed = static_cast<uint64_t>(next_);
    spec.sequence = static_cast<uint64_t>(next_);
    spec.episode = static_cast<uint64_t>(next_);
    spec.record = false;
    ++next_;
    return spec;
  }
  void finished(const EpisodeSpec&, const Outcome& o) override {
    ++done_;
    reward_ += o.reward;
    successes_ += o.success;
  }
  int done() const { return done_; }
  double success_rate() const { return done_ ? static_cast<double>(successes_) / done_ : 0.0; }
  double reward_mean() const { return done_ ? reward_ / done_ : 0.0; }

 private:
  int tasks_;
  int next_ = 0;
  int done_ = 0;
  int successes_ = 0;
  double reward_ = 0;
};

enum class Phase { kIdle, kStarting, kModel, kEnv, kFinishing };

struct Slot {
  Phase phase = Phase::kIdle;
  EpisodeSpec spec;
  std::unique_ptr<envs::EnvSession> session;  // kept across episodes
  std::unique_ptr<envs::Episode> episode;
  model::PolicyState state;
  std::unique_ptr<SegmentBuilder> builder;
  uint64_t trajectory_id = 0;  // 0: not recorded (or not begun)

  // Model side: tokens to feed before the next sample, with image patch rows.
  std::vector<uint32_t> feed;
  std::vector<uint8_t> feed_mask;
  at::Tensor feed_images;
  at::Tensor logits;  // after the last fed token: the next token is sampled from it
  std::vector<uint32_t> turn;
  uint64_t turn_model_start = 0;  // absolute position of the turn's first model token
  uint32_t unfed = 0;             // the turn's last token, sampled but not yet fed
  bool model_eos = false;
  size_t calls_seen = 0;

  // Written by the worker job, read by the loop after completion.
  Status job_status;
  env::Observation observation;
  envs::EpisodeScore score;

  std::string forced_failure;  // the actor's own reason to fail the episode
};

}  // namespace

// ---------------------------------------------------------------------------------------------

Result<ActorOptions> actor_options_from_config(const Config& c, int index) {
  ActorOptions o;
  o.index = index;
  o.actor_count = static_cast<int>(c.get_int("actor.count"));
  if (index < 0) return invalid_argument("actor: --index must be >= 0, got {}", index);
  o.out_dir = c.get_string("run.out");
  o.job = c.get_string("job.name");
  o.seed = static_cast<uint64_t>(c.get_int("job.seed"));
  o.model_config = c.get_string("policy.model");
  o.dtype = c.get_string("policy.dtype");
  o.device = c.get_string("policy.device");
  o.threads = static_cast<int>(c.get_int("policy.threads"));
  o.env_name = c.get_string("env.name");
  o.env_config = json::parse(c.get_string("env.config"), nullptr, /*allow_exceptions=*/false);
  if (!o.env_config.is_object())
    return invalid_argument("config {}: key 'env.config' must be a JSON object (as text), got {}", c.source("env.config"),
                            c.get_string("env.config"));
  o.env_hosted = c.get_bool("env.hosted");
  o.env_call_timeout_ms = static_cast<int>(c.get_int("env.call_timeout_ms"));
  o.env_memory_mb = static_cast<int>(c.get_int("env.memory_mb"));
  o.slots = static_cast<int>(c.get_int("actor.slots"));
  o.group_size = static_cast<int>(c.get_int("actor.group_size"));
  o.sampling.temperature = c.get_double("actor.temperature");
  o.sampling.top_p = c.get_double("actor.top_p");
  o.sampling.top_k = c.get_int("actor.top_k");
  ODY_RETURN_IF_ERROR(validate(o.sampling));
  o.max_tokens = c.get_int("actor.max_tokens");
  o.max_turn_tokens = c.get_int("actor.max_turn_tokens");
  o.segment_tokens = c.get_int("actor.segment_tokens");
  o.snapshot_every_tokens = c.get_int("actor.snapshot_every_tokens");
  o.weights_poll_ms = static_cast<int>(c.get_int("actor.weights_poll_ms"));
  o.replay_endpoint = c.get_string("replay.listen");
  o.eval_every = static_cast<int>(c.get_int("run.eval_every"));
  o.eval_tasks = static_cast<int>(c.get_int("run.eval_tasks"));
  return o;
}

class Actor::Impl {
 public:
  explicit Impl(const ActorOptions& o)
      : o_(o),
        sampler_(o.sampling, o.seed),
        greedy_({/*temperature=*/0.0, 0, 1.0}, o.seed),
        subscriber_((fs::path(o.out_dir) / "weights").string(), std::chrono::milliseconds(o.weights_poll_ms)),
        workers_(o.env_workers > 0 ? o.env_workers : std::min(o.slots, 8)),
        slots_(static_cast<size_t>(o.slots)) {}

  Status init();
  Status run(const std::atomic<bool>& stop);
  Status run_eval(const std::atomic<bool>& stop);
  const ActorStats& stats() const { return stats_; }

 private:
  // Runs episodes from `source` until it has no more and every slot is idle, or `stop`.
  Status drive(EpisodeSource& source, const TokenSampler& sampler, const std::atomic<bool>& stop, bool rollout);
  Status wait_for_weights(const std::atomic<bool>& stop, bool* stopped);
  void refresh_weights();

  void start(size_t i, EpisodeSpec spec);
  Status on_started(size_t i);
  Status on_env_answered(size_t i);
  Status on_finished(size_t i, EpisodeSource& source);
  Status model_work(const TokenSampler& sampler);
  void prefill(Slot& s);
  void handle_token(size_t i, const SampledToken& sampled);
  void finish(size_t i);
  Status abort_all(EpisodeSource& source);

  Status flush(Slot& s, bool everything);
  void maybe_snapshot(Slot& s);
  at::Tensor piece_images(const TranscriptPiece& piece, std::vector<uint8_t>& mask);
  // Opens the assistant turn and queues for the model `first` (the token before the piece that
  // the model has not read: BOS, or the last sampled token), the piece's tokens and the
  // assistant marker, with the piece's image patches; the slot then waits for the model.
  void open_assistant_turn(Slot& s, uint32_t first, const TranscriptPiece& piece);
  Result<std::unique_ptr<envs::EnvSession>> make_session();
  void metrics_line(bool force);
  bool any_model_work() const;

  ActorOptions o_;
  ByteTokenizer tokenizer_;
  uint32_t bos_ = 0, eos_ = 0, end_turn_ = 0, assistant_ = 0;
  model::ModelConfig model_config_;
  std::unique_ptr<RaggedDecoder> decoder_;
  TokenSampler sampler_, greedy_;
  model::WeightSubscriber subscriber_;
  uint32_t version_ = 0;
  std::unique_ptr<replay::TrajectoryWriter> writer_;
  std::shared_ptr<envs::Plugin> plugin_;  // in-process plugins
  std::string plugin_path_;
  Clock::time_point last_refresh_warning_{};

  ActorStats stats_;
  // Metrics window.
  Clock::time_point window_start_ = Clock::now();
  uint64_t window_tokens_ = 0, window_episodes_ = 0, window_successes_ = 0;
  double window_reward_ = 0;

  // Declared before the slots: slots (and their environment sessions) go first, then the
  // threads that started hosted sessions.
  EnvWorkers workers_;
  std::vector<Slot> slots_;
};

Status Actor::Impl::init() {
  if (o_.slots < 1 || o_.group_size < 1) return invalid_argument("actor: actor.slots and actor.group_size must be >= 1");
  ODY_RETURN_IF_ERROR(validate(o_.sampling));
  bos_ = tokenizer_.special_id(SpecialToken::kBos);
  eos_ = tokenizer_.special_id(SpecialToken::kEos);
  end_turn_ = tokenizer_.special_id(SpecialToken::kEndTurn);
  assistant_ = tokenizer_.special_id(SpecialToken::kAssistant);

  auto config = model::load_model_config({o_.model_config});
  if (!config.ok()) return config.status().with_context("policy.model");
  model_config_ = *config;
  if (static_cast<uint64_t>(model_config_.vocab_size) < tokenizer_.vocab_size())
    return invalid_argument("policy.model {}: vocab_size {} is smaller than the tokenizer's {}", o_.model_config,
                            model_config_.vocab_size, tokenizer_.vocab_size());
  at::set_num_threads(o_.threads);
  try {
    model::Policy policy(model_config_);
    if (o_.device != "cpu") policy->to(at::Device(o_.device));
    if (o_.dtype == "bf16") {
      policy->to(at::kBFloat16);
      for (int64_t layer : policy->moe_layers()) policy->layer(layer)->moe->router->to(at::kFloat);
    } else if (o_.dtype != "fp32") {
      return invalid_argument("policy.dtype: '{}' (expected fp32 or bf16)", o_.dtype);
    }
    policy->eval();
    decoder_ = std::make_unique<RaggedDecoder>(policy);
  } catch (const c10::Error& e) {
    return Status(StatusCode::kInvalidArgument, fmt::format("policy: {}", e.what_without_backtrace()));
  }

  if (o_.env_name != "mcp") {
    ODY_ASSIGN_OR_RETURN(plugin_path_, envs::find_plugin(o_.env_name));
    if (!o_.env_hosted) {
      ODY_ASSIGN_OR_RETURN(plugin_, envs::Plugin::load(plugin_path_));
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<envs::EnvSession>> Actor::Impl::make_session() {
  if (o_.env_name == "mcp") return envs::make_mcp_session(o_.env_config);
  if (o_.env_hosted) {
    envs::HostOptions host;
    host.odyssey_binary = o_.odyssey_binary;
    host.call_timeout = std::chrono::milliseconds(o_.env_call_timeout_ms);
    host.memory_bytes = static_cast<uint64_t>(o_.env_memory_mb) << 20;
    ODY_ASSIGN_OR_RETURN(auto session, envs::HostedSession::start(plugin_path_, o_.env_config, host));
    return std::unique_ptr<envs::EnvSession>(std::move(session));
  }
  return plugin_->create(o_.env_config);
}

Status Actor::Impl::wait_for_weights(const std::atomic<bool>& stop, bool* stopped) {
  *stopped = false;
  const std::string dir = (fs::path(o_.out_dir) / "weights").string();
  bool logged = false;
  for (;;) {
    if (stop.load()) {
      *stopped = true;
      return Status::Ok();
    }
    if (auto latest = subscriber_.latest(/*force=*/true)) {
      Status st = subscriber_.load(decoder_->policy(), *latest);
      if (st.ok()) {
        version_ = *latest;
        stats_.version = version_;
        spdlog::info("actor {}: weights version {} from {}", o_.index, version_, dir);
        return Status::Ok();
      }
      if (st.code() != StatusCode::kNotFound) return st;
    } else if (!logged) {
      spdlog::info("waiting for weights in {}", dir);
      logged = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o_.weights_poll_ms));
  }
}

void Actor::Impl::refresh_weights() {
  auto r = subscriber_.refresh(decoder_->policy(), version_);
  if (!r.ok()) {
    if (Clock::now() - last_refresh_warning_ > std::chrono::seconds(10)) {
      spdlog::warn("actor {}: keeping weights version {}: {}", o_.index, version_, r.status().to_string());
      last_refresh_warning_ = Clock::now();
    }
    return;
  }
  if (*r != version_) {
    spdlog::info("actor {}: weights version {} -> {}", o_.index, version_, *r);
    version_ = *r;
    stats_.version = version_;
  }
}

bool Actor::Impl::any_model_work() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.phase == Phase::kModel; });
}

Status Actor::Impl::drive(EpisodeSource& source, const TokenSampler& sampler, const std::atomic<bool>& stop,
                          bool rollout) {
  bool draining = false;
  for (;;) {
    if (stop.load()) return abort_all(source);
    if (rollout) refresh_weights();
    if (!draining) {
      for (size_t i = 0; i < slots_.size() && !draining; ++i) {
        if (slots_[i].phase != Phase::kIdle) continue;
        std::optional<EpisodeSpec> spec = source.next();
        if (!spec) {
          draining = true;
          break;
        }
        start(i, std::move(*spec));
      }
    }
    const auto wait = any_model_work() ? std::chrono::milliseconds(0) : std::chrono::milliseconds(20);
    for (size_t i : workers_.completed(wait)) {
      switch (slots_[i].phase) {
        case Phase::kStarting: {
          const Status started = on_started(i);
          // Stopped while the rate limiter held the episode's trajectory back: a clean stop.
          if (!started.ok() && stop.load()) return abort_all(source);
          ODY_RETURN_IF_ERROR(started);
          break;
        }
        case Phase::kEnv: ODY_RETURN_IF_ERROR(on_env_answered(i)); break;
        case Phase::kFinishing: ODY_RETURN_IF_ERROR(on_finished(i, source)); break;
        default: break;
      }
    }
    ODY_RETURN_IF_ERROR(model_work(sampler));
    if (rollout) metrics_line(/*force=*/false);
    const bool idle =
        std::all_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.phase == Phase::kIdle; });
    if (draining && idle) break;
  }
  if (writer_) ODY_RETURN_IF_ERROR(writer_->flush());
  return Status::Ok();
}

void Actor::Impl::start(size_t i, EpisodeSpec spec) {
  Slot& s = slots_[i];
  s.phase = Phase::kStarting;
  s.spec = std::move(spec);
  s.forced_failure.clear();
  workers_.submit(i, [this, &s] {
    s.job_status = Status::Ok();
    if (!s.session) {
      auto session = make_session();
      if (!session.ok()) {
        s.job_status = session.status();
        return;
      }
      s.session = std::move(session).value();
    }
    s.episode = std::make_unique<envs::Episode>(*s.session, tokenizer_);
    s.observation = s.episode->start(s.spec.task, s.spec.env_seed);
  });
}

at::Tensor Actor::Impl::piece_images(const TranscriptPiece& piece, std::vector<uint8_t>& mask) {
  std::vector<at::Tensor> rows;
  for (const TranscriptImage& im : piece.images) {
    at::Tensor embedded;
    const env::Image& img = im.image;
    const bool raw = img.format == ODY_ENV_IMAGE_RGB8 &&
                     img.data.size() == static_cast<size_t>(img.width) * img.height * 3 && img.width > 0 && img.height > 0;
    if (raw && decoder_->has_vision()) {
      const at::Tensor pixels =
          at::from_blob(const_cast<uint8_t*>(img.data.data()), {img.height, img.width, 3}, at::kByte)
              .permute({2, 0, 1})
              .to(at::kFloat)
              .div(255.0);
      embedded = decoder_->image_embeddings(pixels);
    }
    if (embedded.defined() && embedded.size(0) == static_cast<int64_t>(im.patches)) {
      rows.push_back(embedded);
    } else {
      // No pixels the encoder can read (PNG, no vision encoder): the patch tokens stay plain.
      for (uint32_t j = 0; j < im.patches; ++j) mask[im.offset + 1 + j] = 0;
    }
  }
  if (std::none_of(mask.begin(), mask.end(), [](uint8_t m) { return m != 0; })) mask.clear();
  return rows.empty() ? at::Tensor() : at::cat(rows, 0);
}

Status Actor::Impl::on_started(size_t i) {
  Slot& s = slots_[i];
  if (!s.job_status.ok())
    return s.job_status.with_context(fmt::format("actor {}: creating environment '{}'", o_.index, o_.env_name));
  s.builder = std::make_unique<SegmentBuilder>(static_cast<size_t>(o_.segment_tokens));
  s.state = decoder_->start();
  s.calls_seen = 0;
  s.model_eos = false;
  s.turn.clear();
  s.logits = at::Tensor();
  s.trajectory_id = 0;
  if (s.spec.record && writer_) {
    replay::TrajectoryMeta meta;
    const envs::EnvInfo& info = s.session->info();
    meta.job = o_.job;
    meta.environment = info.name;
    meta.environment_version = info.version;
    meta.plugin_hash = info.source_hash;
    meta.task = s.spec.task.dump();
    meta.tokenizer = tokenizer_.name();
    meta.seed = s.spec.env_seed;
    meta.group_id = s.spec.group_id;
    meta.group_size = s.spec.group_size;
    ODY_ASSIGN_OR_RETURN(s.trajectory_id, writer_->begin(meta));
  }
  const PatchCounter patches = [this](int64_t h, int64_t w) { return decoder_->image_patches(h, w); };
  const TranscriptPiece user = render_with_images(s.observation, tokenizer_, SpecialToken::kUser, patches);
  SegmentBuilder& b = *s.builder;
  b.append(bos_, 0, version_, false);
  b.begin_turn(schema::Role::USER);
  b.append(user, version_);
  b.end_turn();
  stats_.trajectory_tokens += 1 + user.tokens.size();
  if (s.episode->failed() || s.observation.done) {
    b.append(eos_, 0, version_, false);
    ++stats_.trajectory_tokens;
    finish(i);
    return Status::Ok();
  }
  if (static_cast<int64_t>(b.position()) + 3 > o_.max_tokens) {
    s.forced_failure = fmt::format("the prompt ({} tokens) does not fit actor.max_tokens = {}", b.position(), o_.max_tokens);
    b.append(eos_, 0, version_, false);
    ++stats_.trajectory_tokens;
    finish(i);
    return Status::Ok();
  }
  open_assistant_turn(s, bos_, user);
  return flush(s, /*everything=*/false);
}

void Actor::Impl::maybe_snapshot(Slot& s) {
  const int64_t k = o_.snapshot_every_tokens;
  if (k <= 0 || s.state.tokens == 0 || s.state.tokens % k != 0) return;
  StateSnapshotData snap;
  snap.token_position = static_cast<uint64_t>(s.state.tokens);
  snap.policy_version = version_;
  snap.format = kKdaSnapshotFormat;
  snap.data = kda_state_snapshot(s.state);
  s.builder->add_snapshot(std::move(snap));
}

void Actor::Impl::prefill(Slot& s) {
  size_t at = 0;
  int64_t row = 0;
  while (at < s.feed.size()) {
    int64_t n = std::min<int64_t>(static_cast<int64_t>(s.feed.size() - at), kPrefillChunk);
    if (o_.snapshot_every_tokens > 0)
      n = std::min<int64_t>(n, o_.snapshot_every_tokens - s.state.tokens % o_.snapshot_every_tokens);
    const auto begin = s.feed.begin() + static_cast<std::ptrdiff_t>(at);
    const std::vector<uint32_t> chunk(begin, begin + n);
    std::vector<uint8_t> mask;
    at::Tensor rows;
    if (!s.feed_mask.empty()) {
      const auto mbegin = s.feed_mask.begin() + static_cast<std::ptrdiff_t>(at);
      mask.assign(mbegin, mbegin + n);
      const auto patches = static_cast<int64_t>(std::count(mask.begin(), mask.end(), uint8_t{1}));
      if (patches > 0) rows = s.feed_images.narrow(0, row, patches);
      else mask.clear();
      row += patches;
    }
    s.logits = decoder_->forward_chunk(s.state, chunk, mask, rows);
    at += static_cast<size_t>(n);
    maybe_snapshot(s);
  }
  s.feed.clear();
  s.feed_mask.clear();
  s.feed_images = at::Tensor();
}

Status Actor::Impl::model_work(const TokenSampler& sampler) {
  // Prefill (alone), then one batched decode step for every slot with a single token to feed.
  std::vector<size_t> decoding;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.phase != Phase::kModel || s.feed.empty()) continue;
    if (s.feed.size() == 1 && s.feed_mask.empty()) {
      decoding.push_back(i);
    } else {
      prefill(s);
    }
  }
  if (!decoding.empty()) {
    std::vector<model::PolicyState*> states;
    std::vector<uint32_t> tokens;
    for (size_t i : decoding) {
      states.push_back(&slots_[i].state);
      tokens.push_back(slots_[i].feed[0]);
    }
    const at::Tensor logits = decoder_->step(states, tokens);
    for (size_t j = 0; j < decoding.size(); ++j) {
      Slot& s = slots_[decoding[j]];
      s.logits = logits.select(0, static_cast<int64_t>(j));
      s.feed.clear();
      maybe_snapshot(s);
    }
  }
  // Every slot with logits samples its next token.
  std::vector<size_t> sampling;
  std::vector<at::Tensor> rows;
  std::vector<DrawKey> keys;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.phase != Phase::kModel || !s.logits.defined()) continue;
    sampling.push_back(i);
    rows.push_back(s.logits);
    keys.push_back({s.spec.sequence, s.builder->position()});
  }
  if (sampling.empty()) return Status::Ok();
  ODY_ASSIGN_OR_RETURN(std::vector<SampledToken> sampled, sampler.sample(at::stack(rows), keys));
  for (size_t j = 0; j < sampling.size(); ++j) {
    slots_[sampling[j]].logits = at::Tensor();
    handle_token(sampling[j], sampled[j]);
  }
  for (size_t i : sampling) ODY_RETURN_IF_ERROR(flush(slots_[i], /*everything=*/false));
  return Status::Ok();
}

void Actor::Impl::handle_token(size_t i, const SampledToken& sampled) {
  Slot& s = slots_[i];
  SegmentBuilder& b = *s.builder;
  const uint32_t token = sampled.token;
  b.append(token, sampled.logprob, version_, /*model_written=*/true);
  s.turn.push_back(token);
  ++stats_.model_tokens;
  ++stats_.trajectory_tokens;
  ++window_tokens_;
  if (token == eos_) s.model_eos = true;
  const bool turn_over = token == end_turn_ || token == eos_ ||
                         static_cast<int64_t>(s.turn.size()) >= o_.max_turn_tokens;
  const bool out_of_tokens = static_cast<int64_t>(b.position()) + 1 >= o_.max_tokens;
  if (!turn_over && out_of_tokens) {
    // The budget cuts the turn: it is not sent to the environment.
    b.end_turn();
    b.append(eos_, 0, version_, false);
    ++stats_.trajectory_tokens;
    finish(i);
    return;
  }
  if (!turn_over) {
    s.feed.assign(1, token);
    return;
  }
  b.end_turn();
  s.unfed = token;
  s.phase = Phase::kEnv;
  workers_.submit(i, [&s] { s.observation = s.episode->take_turn(s.turn); });
}

Status Actor::Impl::on_env_answered(size_t i) {
  Slot& s = slots_[i];
  SegmentBuilder& b = *s.builder;
  const PatchCounter patches = [this](int64_t h, int64_t w) { return decoder_->image_patches(h, w); };
  const TranscriptPiece piece = render_with_images(s.observation, tokenizer_, SpecialToken::kTool, patches);
  const bool done = s.observation.done || s.model_eos || s.episode->done();
  const int64_t need = static_cast<int64_t>(piece.tokens.size()) + 1 + (done ? 0 : 2);
  const bool fits = static_cast<int64_t>(b.position()) + need <= o_.max_tokens;
  const uint64_t result_position = b.position();
  const auto& calls = s.episode->calls();
  for (size_t c = s.calls_seen; c < calls.size(); ++c) {
    const envs::ToolCallRecord& r = calls[c];
    ToolCallData data;
    data.call_id = r.call_id;
    data.name = r.name;
    data.arguments = r.arguments;
    data.result = r.result;
    data.error = r.error;
    data.status = static_cast<schema::ToolStatus>(static_cast<uint16_t>(r.status));
    data.wall_time_nanos = r.wall_time_nanos;
    b.add_tool_call(std::move(data), s.turn_model_start + r.token_offset, result_position);
  }
  s.calls_seen = calls.size();
  if (fits) {
    b.begin_turn(schema::Role::TOOL);
    b.append(piece, version_);
    b.end_turn();
    stats_.trajectory_tokens += piece.tokens.size();
  }
  if (done || !fits) {
    b.append(eos_, 0, version_, false);
    ++stats_.trajectory_tokens;
    finish(i);
    return Status::Ok();
  }
  // The round is over: send it, then open the next assistant turn.
  ODY_RETURN_IF_ERROR(flush(s, /*everything=*/true));
  s.turn.clear();
  open_assistant_turn(s, s.unfed, piece);
  return Status::Ok();
}

void Actor::Impl::open_assistant_turn(Slot& s, uint32_t first, const TranscriptPiece& piece) {
  SegmentBuilder& b = *s.builder;
  b.begin_turn(schema::Role::ASSISTANT);
  b.append(assistant_, 0, version_, false);
  ++stats_.trajectory_tokens;
  s.turn_model_start = b.position();
  s.feed.clear();
  s.feed.push_back(first);
  s.feed.insert(s.feed.end(), piece.tokens.begin(), piece.tokens.end());
  s.feed.push_back(assistant_);
  std::vector<uint8_t> mask = piece.patch_mask();
  at::Tensor images = piece_images(piece, mask);
  s.feed_mask.clear();
  if (!mask.empty()) {
    s.feed_mask.push_back(0);
    s.feed_mask.insert(s.feed_mask.end(), mask.begin(), mask.end());
    s.feed_mask.push_back(0);
  }
  s.feed_images = images;
  s.phase = Phase::kModel;
}

void Actor::Impl::finish(size_t i) {
  Slot& s = slots_[i];
  s.phase = Phase::kFinishing;
  s.feed.clear();
  s.logits = at::Tensor();
  workers_.submit(i, [&s] { s.score = s.episode->finish(); });
}

Status Actor::Impl::flush(Slot& s, bool everything) {
  SegmentBuilder& b = *s.builder;
  auto send = [&](SegmentData seg) -> Status {
    if (s.trajectory_id == 0) return Status::Ok();  // not recorded
    ++stats_.segments;
    return writer_->append(s.trajectory_id, seg);
  };
  while (b.has_full()) ODY_RETURN_IF_ERROR(send(b.take_full()));
  if (everything && !b.empty()) ODY_RETURN_IF_ERROR(send(b.take_all()));
  return Status::Ok();
}

Status Actor::Impl::on_finished(size_t i, EpisodeSource& source) {
  Slot& s = slots_[i];
  ODY_RETURN_IF_ERROR(flush(s, /*everything=*/true));
  const envs::EpisodeScore& score = s.score;
  const bool failed = score.failed || !s.forced_failure.empty();
  const std::string why = !s.forced_failure.empty() ? s.forced_failure : score.failure;
  if (s.trajectory_id != 0) {
    replay::Reward reward;
    reward.total = score.score.reward;
    for (const env::RewardPart& p : score.score.parts) reward.parts.emplace_back(p.name, p.value);
    ODY_RETURN_IF_ERROR(writer_->end(s.trajectory_id, reward, failed, why));
  }
  ++stats_.episodes;
  stats_.failures += failed;
  ++window_episodes_;
  window_successes_ += score.score.success;
  window_reward_ += score.score.reward;
  source.finished(s.spec, {score.score.reward, score.score.success, failed});
  if (failed) spdlog::debug("actor {}: episode {} failed: {}", o_.index, s.spec.episode, why);
  // Free the slot: the model state and the episode go, the environment session stays.
  s.phase = Phase::kIdle;
  s.state = model::PolicyState();
  s.builder.reset();
  s.episode.reset();
  s.trajectory_id = 0;
  s.turn.clear();
  return Status::Ok();
}

Status Actor::Impl::abort_all(EpisodeSource& source) {
  // Let running environment calls come back (they are bounded by their own timeouts).
  while (workers_.busy() > 0) {
    for (size_t i : workers_.completed(std::chrono::milliseconds(50))) {
      if (slots_[i].phase == Phase::kFinishing) ODY_RETURN_IF_ERROR(on_finished(i, source));
    }
  }
  for (Slot& s : slots_) {
    if (s.phase == Phase::kIdle) continue;
    if (s.trajectory_id != 0 && s.builder) {
      ODY_RETURN_IF_ERROR(flush(s, /*everything=*/true));
      ODY_RETURN_IF_ERROR(writer_->end(s.trajectory_id, {}, /*failed=*/true, "actor stopped before the episode ended"));
    }
    s.phase = Phase::kIdle;
    s.state = model::PolicyState();
    s.builder.reset();
    s.episode.reset();
    s.trajectory_id = 0;
  }
  if (writer_) ODY_RETURN_IF_ERROR(writer_->flush());
  return Status::Ok();
}

void Actor::Impl::metrics_line(bool force) {
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - window_start_).count();
  if (!force && elapsed < o_.metrics_every_s) return;
  json line = {{"role", fmt::format("actor-{}", o_.index)},
               {"time", unix_seconds()},
               {"index", o_.index},
               {"episodes", stats_.episodes},
               {"failures", stats_.failures},
               {"tokens", stats_.model_tokens},
               {"trajectory_tokens", stats_.trajectory_tokens},
               {"tokens_per_s", elapsed > 0 ? static_cast<double>(window_tokens_) / elapsed : 0.0},
               {"version", version_},
               {"window_episodes", window_episodes_}};
  if (window_episodes_ > 0) {
    line["reward_mean"] = window_reward_ / static_cast<double>(window_episodes_);
    line["success_rate"] = static_cast<double>(window_successes_) / static_cast<double>(window_episodes_);
  }
  append_json_line(fs::path(o_.out_dir) / "metrics" / fmt::format("actor-{}.jsonl", o_.index), line);
  window_start_ = now;
  window_tokens_ = window_episodes_ = window_successes_ = 0;
  window_reward_ = 0;
}

Status Actor::Impl::run(const std::atomic<bool>& stop) {
  bool stopped = false;
  ODY_RETURN_IF_ERROR(wait_for_weights(stop, &stopped));
  if (stopped) return Status::Ok();
  replay::ClientOptions client;
  client.endpoint = o_.replay_endpoint;
  client.name = fmt::format("actor-{}", o_.index);
  client.give_up_after_ms = o_.replay_give_up_ms;
  client.stop = &stop;  // a stop request ends a wait for the rate limiter
  ODY_ASSIGN_OR_RETURN(writer_, replay::TrajectoryWriter::connect(client));
  RolloutSource source(o_, fs::path(o_.out_dir) / "actors" / fmt::format("actor-{}.json", o_.index));
  ODY_RETURN_IF_ERROR(source.load());
  const auto t0 = Clock::now();
  Status st = drive(source, sampler_, stop, /*rollout=*/true);
  metrics_line(/*force=*/true);
  if (st.ok()) st = source.status();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  spdlog::info("actor {}: {} episodes ({} failed), {} model tokens in {:.1f} s ({:.1f} tokens/s), {} segments, "
               "weights version {}",
               o_.index, stats_.episodes, stats_.failures, stats_.model_tokens, s,
               s > 0 ? static_cast<double>(stats_.model_tokens) / s : 0.0, stats_.segments, version_);
  return st;
}

Status Actor::Impl::run_eval(const std::atomic<bool>& stop) {
  bool stopped = false;
  ODY_RETURN_IF_ERROR(wait_for_weights(stop, &stopped));
  if (stopped) return Status::Ok();
  uint32_t last = 0;
  bool first = true;
  while (!stop.load() && (o_.max_evals == 0 || stats_.evals < static_cast<uint64_t>(o_.max_evals))) {
    uint32_t target = 0;
    if (first) {
      target = version_;  // loaded by wait_for_weights
    } else if (auto latest = subscriber_.latest(/*force=*/true); latest && o_.eval_every > 0) {
      for (uint32_t v = last + 1; v <= *latest; ++v) {
        if ((v - 1) % static_cast<uint32_t>(o_.eval_every) == 0) {
          target = v;
          break;
        }
      }
    }
    if (target == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.weights_poll_ms));
      continue;
    }
    if (!first) {
      Status st = subscriber_.load(decoder_->policy(), target);
      if (st.code() == StatusCode::kNotFound) {
        spdlog::warn("eval: version {} was pruned before it could be evaluated; skipping it", target);
        last = target;
        continue;
      }
      ODY_RETURN_IF_ERROR(st);
      version_ = target;
      stats_.version = target;
    }
    first = false;
    EvalSource source(o_.eval_tasks);
    const auto t0 = Clock::now();
    ODY_RETURN_IF_ERROR(drive(source, greedy_, stop, /*rollout=*/false));
    if (stop.load() && source.done() < o_.eval_tasks) break;
    last = target;
    ++stats_.evals;
    append_json_line(fs::path(o_.out_dir) / "metrics" / "eval.jsonl",
                     {{"role", "eval"},
                      {"time", unix_seconds()},
                      {"version", target},
                      {"eval_success", source.success_rate()},
                      {"eval_reward", source.reward_mean()},
                      {"tasks", source.done()}});
    spdlog::info("eval: version {}: success {:.3f}, reward {:.3f} over {} tasks in {:.1f} s", target,
                 source.success_rate(), source.reward_mean(), source.done(),
                 std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

Actor::Actor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Actor::~Actor() = default;

Result<std::unique_ptr<Actor>> Actor::create(const ActorOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  ODY_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<Actor>(new Actor(std::move(impl)));
}

namespace {
// The boundary where LibTorch's exceptions become a Status.
template <typename F>
Status guarded_run(F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    return Status(StatusCode::kInternal, fmt::format("actor: {}", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, fmt::format("actor: {}", e.what()));
  }
}
}  // namespace

Status Actor::run(const std::atomic<bool>& stop) {
  return guarded_run([&] { return impl_->run(stop); });
}
Status Actor::run_eval(const std::atomic<bool>& stop) {
  return guarded_run([&] { return impl_->run_eval(stop); });
}
const ActorStats& Actor::stats() const { return impl_->stats(); }

}  // namespace odyssey::actors
