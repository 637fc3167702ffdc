#include "bench/trajectory_bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "actors/actor.h"
#include "actors/transcript.h"
#include "core/codec.h"
#include "core/tokenizer.h"
#include "envs/plugin.h"
#include "model/config.h"
#include "model/policy.h"
#include "model/policy_checkpoint.h"
#include "model/weight_channel.h"
#include "replay/service.h"
#include "replay/verify.h"

namespace odyssey::bench {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_rss_mb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

double current_rss_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

uint64_t bytes_on_disk(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  return total;
}

// The work folder: the given one, or a fresh temporary one removed when this goes away.
class WorkDir {
 public:
  explicit WorkDir(const std::string& given) {
    if (!given.empty()) {
      path_ = given;
      return;
    }
    std::random_device rd;
    path_ = fs::temp_directory_path() / fmt::format("odyssey-bench-trajectory-{}-{:x}", ::getpid(), rd());
    owned_ = true;
  }
  ~WorkDir() {
    std::error_code ec;
    if (owned_) fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  bool owned_ = false;
};

// The stored trajectory against what it must be. Reads segment by segment (bounded memory).
Status verify_content(const replay::TrajectoryStore& store, uint64_t id, const actors::ActorOptions& ao,
                      uint64_t actor_tokens, TrajectoryBenchResult* result) {
  ODY_ASSIGN_OR_RETURN(std::string record_bytes, store.read_record(id));
  ODY_ASSIGN_OR_RETURN(auto record_message, decode_trajectory(record_bytes));
  auto record = record_message->getRoot<schema::Trajectory>().asReader();
  if (record.getStatus() != schema::TrajectoryStatus::COMPLETE)
    return Status(StatusCode::kCorrupt, "the trajectory is not complete");
  if (record.getNumTokens() != actor_tokens)
    return Status(StatusCode::kCorrupt, fmt::format("the record says {} tokens; the actor wrote {}",
                                                    record.getNumTokens(), actor_tokens));

  // The prompt, regenerated from the record's task and seed by a fresh environment.
  ODY_ASSIGN_OR_RETURN(std::string plugin_path, envs::find_plugin(ao.env_name));
  ODY_ASSIGN_OR_RETURN(auto plugin, envs::Plugin::load(plugin_path));
  ODY_ASSIGN_OR_RETURN(auto session, plugin->create(ao.env_config));
  ODY_ASSIGN_OR_RETURN(env::Observation first,
                       session->reset(json::parse(std::string(record.getTask().cStr())), record.getSeed()));
  const ByteTokenizer tokenizer;
  const actors::TranscriptPiece prompt =
      actors::prompt_piece(first, tokenizer, [](int64_t, int64_t) -> int64_t { return 0; });

  uint64_t position = 0, masked = 0, segments = 0;
  for (uint32_t seq = 0;; seq += 64) {
    ODY_ASSIGN_OR_RETURN(auto pieces, store.read_segments(id, seq, 64, uint64_t{256} << 20));
    if (pieces.empty()) break;
    for (const std::string& bytes : pieces) {
      MessageView view(bytes);
      ODY_RETURN_IF_ERROR(view.status());
      auto segment = view.root<schema::Segment>();
      if (segment.getTokenStart() != position)
        return Status(StatusCode::kCorrupt, fmt::format("segment {} starts at token {}, expected {}", segments,
                                                        segment.getTokenStart(), position));
      auto tokens = segment.getTokens();
      auto mask = segment.getLossMask();
      for (uint32_t i = 0; i < tokens.size(); ++i, ++position) {
        if (position < prompt.tokens.size()) {
          if (tokens[i] != prompt.tokens[position])
            return Status(StatusCode::kCorrupt, fmt::format("token {} is {}; the regenerated prompt has {}", position,
                                                            tokens[i], prompt.tokens[position]));
          if (mask[i] != 0) return Status(StatusCode::kCorrupt, fmt::format("prompt token {} is trained on", position));
        }
        masked += mask[i] != 0;
      }
      ++segments;
    }
  }
  if (position != actor_tokens)
    return Status(StatusCode::kCorrupt, fmt::format("the segments hold {} tokens; the actor wrote {}", position, actor_tokens));
  if (position <= prompt.tokens.size()) return Status(StatusCode::kCorrupt, "nothing after the prompt was stored");
  std::printf("verified: %llu tokens in %llu segments; the first %zu are the regenerated prompt; %llu model tokens "
              "(loss mask 1)\n",
              static_cast<unsigned long long>(position), static_cast<unsigned long long>(segments),
              prompt.tokens.size(), static_cast<unsigned long long>(masked));
  result->tokens = position;
  result->segments = segments;
  return Status::Ok();
}

}  // namespace

Result<TrajectoryBenchResult> run_trajectory_bench(const TrajectoryBenchOptions& o) {
  if (o.corpus_tokens < 20000)
    return invalid_argument("bench trajectory: --tokens must be at least 20000 (needle's smallest two-hop corpus)");
  if (o.answer_tokens < 1 || o.segment_tokens < 1 || o.snapshot_every < 0 || o.threads < 1)
    return invalid_argument("bench trajectory: --answer-tokens, --segment-tokens and --threads must be positive");
  WorkDir work(o.dir);
  std::error_code ec;
  fs::create_directories(work.path(), ec);
  if (ec) return Status(StatusCode::kIo, fmt::format("creating {}: {}", work.path().string(), ec.message()));
  if (fs::exists(work.path() / "replay"))
    return invalid_argument("bench trajectory: {} already holds a replay store; give an empty --dir", work.path().string());

  // Weights: version 1 of the policy, published the way the learner publishes.
  ODY_ASSIGN_OR_RETURN(auto config, model::load_model_config({o.model_config}));
  {
    at::manual_seed(0);
    model::Policy policy(config);
    if (!o.init.empty()) ODY_RETURN_IF_ERROR(model::load_policy(policy, o.init).status());
    model::WeightPublisher publisher((work.path() / "out" / "weights").string(), json{{"model", config.name}});
    ODY_RETURN_IF_ERROR(publisher.publish(policy, 1));
  }

  // The replay service, in this process, on a loopback port.
  replay::ServiceOptions so;
  so.store.dir = (work.path() / "replay").string();
  so.listen = "tcp://127.0.0.1:*";
  so.stats_every_seconds = 0;
  ODY_ASSIGN_OR_RETURN(auto service, replay::ReplayService::create(so));
  std::atomic<bool> stop_service{false};
  Status service_status;
  std::thread service_thread([&] { service_status = service->run(stop_service); });
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread& thread;
    ~Joiner() {
      stop = true;
      if (thread.joinable()) thread.join();
    }
  } joiner{stop_service, service_thread};

  actors::ActorOptions ao;
  ao.out_dir = (work.path() / "out").string();
  ao.job = "bench-trajectory";
  ao.model_config = o.model_config;
  ao.device = o.device;
  ao.dtype = o.dtype;
  ao.threads = o.threads;
  ao.env_name = "needle";
  ao.env_config = {{"corpus_tokens", o.corpus_tokens}, {"inline_corpus", true}, {"max_turns", 1}};
  ao.slots = 1;
  ao.group_size = 1;
  ao.sampling.temperature = 1.0;
  ao.max_tokens = o.corpus_tokens + o.corpus_tokens / 5 + 8192;  // the prompt's headers and instructions fit
  ao.max_turn_tokens = o.answer_tokens;
  ao.segment_tokens = o.segment_tokens;
  ao.snapshot_every_tokens = o.snapshot_every;
  ao.replay_endpoint = service->endpoint();
  ao.max_episodes = 1;
  ao.metrics_every_s = 10.0;

  std::printf("model %s on %s (%s, %d thread(s)); needle corpus_tokens %lld inline; segments of %lld tokens, a KDA "
              "snapshot every %lld\n",
              config.name.c_str(), o.device.c_str(), o.dtype.c_str(), o.threads, static_cast<long long>(o.corpus_tokens),
              static_cast<long long>(o.segment_tokens), static_cast<long long>(o.snapshot_every));
  ODY_ASSIGN_OR_RETURN(auto actor, actors::Actor::create(ao));
  const double rss_before = current_rss_mb();
  const auto t0 = Clock::now();
  std::atomic<bool> stop_actor{false};
  ODY_RETURN_IF_ERROR(actor->run(stop_actor));
  const double generate_s = seconds_since(t0);
  const actors::ActorStats stats = actor->stats();
  if (stats.episodes != 1 || stats.failures != 0)
    return Status(StatusCode::kInternal, fmt::format("the episode failed ({} episodes, {} failures)", stats.episodes, stats.failures));
  stop_service = true;
  service_thread.join();
  ODY_RETURN_IF_ERROR(service_status);
  const double peak = peak_rss_mb();
  std::printf("generated and streamed: %llu tokens (%llu by the model) in %.1f s, %.0f tokens/s, %llu segments sent\n",
              static_cast<unsigned long long>(stats.trajectory_tokens), static_cast<unsigned long long>(stats.model_tokens),
              generate_s, static_cast<double>(stats.trajectory_tokens) / generate_s,
              static_cast<unsigned long long>(stats.segments));

  // Verify what was stored: the store's audit, then the content.
  TrajectoryBenchResult result;
  const auto t1 = Clock::now();
  ODY_ASSIGN_OR_RETURN(auto report, replay::verify_store(service->store()));
  for (const auto& p : report.problems) std::printf("store problem: %s\n", p.to_string().c_str());
  if (!report.sound() || report.trajectories != 1)
    return Status(StatusCode::kCorrupt, fmt::format("the store audit failed: {} problem(s), {} trajectories",
                                                    report.problems.size(), report.trajectories));
  std::unique_ptr<rocksdb::Iterator> it(
      service->store().db()->NewIterator(rocksdb::ReadOptions(), service->store().trajectories_cf()));
  it->SeekToFirst();
  if (!it->Valid()) return Status(StatusCode::kCorrupt, "no trajectory record in the store");
  ODY_ASSIGN_OR_RETURN(auto first_record, decode_trajectory(std::string_view(it->value().data(), it->value().size())));
  const uint64_t id = first_record->getRoot<schema::Trajectory>().getId();
  it.reset();
  ODY_RETURN_IF_ERROR(verify_content(service->store(), id, ao, stats.trajectory_tokens, &result));
  result.verified = true;
  std::printf("store audit: %llu trajectory, %llu segments, %llu tokens, sound; verification took %.1f s\n",
              static_cast<unsigned long long>(report.trajectories), static_cast<unsigned long long>(report.segments),
              static_cast<unsigned long long>(report.tokens), seconds_since(t1));
  std::printf("on disk: %.1f MB (RocksDB, compressed)\n", static_cast<double>(bytes_on_disk(work.path() / "replay")) / 1e6);

  // Memory: what had to grow (the MLA latent caches) against what did.
  const double bytes_per_value = o.dtype == "fp32" ? 4.0 : 2.0;
  const double mla_cache_mb = static_cast<double>(config.num_mla_layers()) * static_cast<double>(result.tokens) *
                              static_cast<double>(config.mla.cache_width()) * bytes_per_value / (1024.0 * 1024.0);
  result.peak_rss_mb = peak;
  std::printf("memory: resident %.0f MB before the episode, peak %.0f MB; the MLA latent caches at the end: %.0f MB "
              "(%lld layers x %llu tokens x %lld numbers)\n",
              rss_before, peak, mla_cache_mb, static_cast<long long>(config.num_mla_layers()),
              static_cast<unsigned long long>(result.tokens), static_cast<long long>(config.mla.cache_width()));
  std::printf("peak growth / MLA cache: %.2f\n", (peak - rss_before) / std::max(mla_cache_mb, 1e-9));
  std::printf("trajectory_peak_rss_mb: %.0f\n", peak);
  return result;
}

}  // namespace odyssey::bench
