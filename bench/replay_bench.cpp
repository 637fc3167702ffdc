#include "bench/replay_bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <mutex>
#include <thread>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "core/codec.h"
#include "replay/client.h"
#include "replay/layout.h"
#include "replay/service.h"
#include "replay/verify.h"

namespace odyssey::bench {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A model-like segment: random token ids, log-probs, one policy version, mostly model tokens.
SegmentData make_segment(uint32_t tokens, uint64_t seed) {
  std::mt19937_64 gen(seed);
  SegmentData d;
  d.tokens.resize(tokens);
  d.logprobs.resize(tokens);
  d.policy_versions.assign(tokens, 1);
  d.loss_mask.resize(tokens);
  for (uint32_t i = 0; i < tokens; ++i) {
    d.tokens[i] = static_cast<uint32_t>(gen() % 163840);
    d.logprobs[i] = -static_cast<float>(gen() % 1000) / 100.0f;
    d.loss_mask[i] = (i % 8) != 0;
  }
  d.turns.push_back({schema::Role::ASSISTANT, 0, tokens, false});
  return d;
}

Result<double> raw_rocksdb(const ReplayBenchOptions& o, const std::string& dir,
                           const std::vector<std::vector<std::string>>& values) {
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.max_background_jobs = 2;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, rocksdb::ColumnFamilyOptions()},
      {replay::kSegmentsCf, replay::TrajectoryStore::segment_cf_options()}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  auto s = rocksdb::DB::Open(dbo, dir, cfs, &handles, &raw);
  if (!s.ok()) return Status(StatusCode::kIo, "raw rocksdb: " + s.ToString());
  std::unique_ptr<rocksdb::DB> db(raw);
  std::atomic<bool> failed{false};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < o.writers; ++w) {
    threads.emplace_back([&, w] {
      rocksdb::WriteOptions wo;
      wo.sync = o.sync;
      // Each writer makes durable as many segments at a time as it may have in flight to
      // the service (its credits): the same batching the service's group commit can reach.
      uint64_t n = 0;
      rocksdb::WriteBatch batch;
      for (const auto& v : values[w]) {
        batch.Put(handles[1], replay::segment_key(w + 1, static_cast<uint32_t>(n++)), v);
        if (batch.Count() >= o.credits || n == values[w].size()) {
          if (!db->Write(wo, &batch).ok()) failed = true;
          batch.Clear();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = seconds_since(start);
  for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
  db->Close().PermitUncheckedError();
  if (failed) return Status(StatusCode::kIo, "raw rocksdb write failed");
  return secs;
}

}  // namespace

Result<ReplayBenchResult> run_replay_bench(const ReplayBenchOptions& o) {
  const fs::path work = o.work_dir.empty()
                            ? fs::temp_directory_path() / fmt::format("odyssey-bench-replay-{}", ::getpid())
                            : fs::path(o.work_dir);
  fs::remove_all(work);
  fs::create_directories(work);
  ReplayBenchResult r;
  const uint64_t per_writer = (o.trajectories + o.writers - 1) / o.writers;
  const uint64_t total_tokens = per_writer * o.writers * o.segments_per_trajectory * uint64_t{o.tokens_per_segment};
  std::printf("bench replay: %u writers x %lu trajectories x %u segments x %u tokens = %.2fM tokens, sync=%d\n",
              o.writers, per_writer, o.segments_per_trajectory, o.tokens_per_segment, total_tokens / 1e6, o.sync);

  // The segments each writer streams, built up front so neither side pays for generating them.
  std::vector<SegmentData> segment_data;
  for (uint32_t i = 0; i < 8; ++i) segment_data.push_back(make_segment(o.tokens_per_segment, i));

  // Baseline: the exact bytes the service stores, written straight to RocksDB.
  std::vector<std::vector<std::string>> values(o.writers);
  uint64_t bytes = 0;
  for (uint32_t w = 0; w < o.writers; ++w) {
    for (uint64_t t = 0; t < per_writer; ++t) {
      Hash128 prev;
      uint64_t start = 0;
      for (uint32_t s = 0; s < o.segments_per_trajectory; ++s) {
        ODY_ASSIGN_OR_RETURN(auto enc, encode_segment(SegmentPosition{w * 100000 + t + 1, s, start, prev},
                                                      segment_data[s % segment_data.size()]));
        prev = enc.hash;
        start += o.tokens_per_segment;
        bytes += enc.bytes.size();
        values[w].push_back(std::move(enc.bytes));
      }
    }
  }
  ODY_ASSIGN_OR_RETURN(double raw_s, raw_rocksdb(o, (work / "raw").string(), values));
  values.clear();
  r.raw_tokens_per_s = total_tokens / raw_s;
  std::printf("raw rocksdb writebatch: %.3f s, %.2fM tokens/s, %.1f MB/s\n", raw_s, r.raw_tokens_per_s / 1e6,
              bytes / raw_s / 1e6);

  // End to end: a service on loopback, writers that encode, hash, send and wait for acks.
  replay::ServiceOptions so;
  so.store.dir = (work / "replay").string();
  so.store.sync = o.sync;
  so.listen = "tcp://127.0.0.1:*";
  so.credits = o.credits;
  so.stats_every_seconds = 0;
  ODY_ASSIGN_OR_RETURN(auto service, replay::ReplayService::create(so));
  std::atomic<bool> stop{false};
  Status service_status;
  std::thread service_thread([&] { service_status = service->run(stop); });
  const std::string endpoint = service->endpoint();

  std::atomic<bool> failed{false};
  std::string failure;
  std::mutex failure_mu;
  auto fail = [&](const Status& st) {
    std::lock_guard<std::mutex> lock(failure_mu);
    if (!failed.exchange(true)) failure = st.to_string();
  };
  const auto start = Clock::now();
  std::vector<std::thread> writers;
  for (uint32_t w = 0; w < o.writers; ++w) {
    writers.emplace_back([&, w] {
      replay::ClientOptions co;
      co.endpoint = endpoint;
      co.name = fmt::format("bench-writer-{}", w);
      auto writer = replay::TrajectoryWriter::connect(co);
      if (!writer.ok()) return fail(writer.status());
      for (uint64_t t = 0; t < per_writer; ++t) {
        replay::TrajectoryMeta meta;
        meta.job = "bench";
        meta.environment = "synthetic";
        meta.task = fmt::format("task-{}", t);
        auto id = (*writer)->begin(meta);
        if (!id.ok()) return fail(id.status());
        for (uint32_t s = 0; s < o.segments_per_trajectory; ++s) {
          Status st = (*writer)->append(*id, segment_data[s % segment_data.size()]);
          if (!st.ok()) return fail(st);
        }
        Status st = (*writer)->end(*id, replay::Reward{1.0, {}});
        if (!st.ok()) return fail(st);
      }
      Status st = (*writer)->flush();
      if (!st.ok()) fail(st);
    });
  }
  for (auto& t : writers) t.join();
  const double e2e_s = seconds_since(start);
  if (failed) {
    stop = true;
    service_thread.join();
    return Status(StatusCode::kInternal, "end-to-end writers failed: " + failure);
  }
  r.e2e_tokens_per_s = total_tokens / e2e_s;
  auto counters = service->store().counters();
  std::printf("end to end (zeromq + durable ack): %.3f s, %.2fM tokens/s, %.1f MB/s, %lu group commits\n", e2e_s,
              r.e2e_tokens_per_s / 1e6, counters.bytes / e2e_s / 1e6, counters.commits);

  if (o.million_token) {
    // One trajectory of 2^20 tokens, streamed as 256 segments of 4096 while "generated".
    replay::ClientOptions co;
    co.endpoint = endpoint;
    co.name = "bench-million";
    ODY_ASSIGN_OR_RETURN(auto writer, replay::TrajectoryWriter::connect(co));
    replay::TrajectoryMeta meta;
    meta.job = "bench";
    meta.environment = "synthetic";
    meta.task = "million-token";
    const auto t0 = Clock::now();
    ODY_ASSIGN_OR_RETURN(uint64_t id, writer->begin(meta));
    constexpr uint32_t kSegmentTokens = 4096;
    for (uint32_t s = 0; s < (1u << 20) / kSegmentTokens; ++s) {
      ODY_RETURN_IF_ERROR(writer->append(id, segment_data[s % segment_data.size()].tokens.size() == kSegmentTokens
                                                 ? segment_data[s % segment_data.size()]
                                                 : make_segment(kSegmentTokens, s)));
    }
    ODY_RETURN_IF_ERROR(writer->end(id, replay::Reward{0.0, {}}));
    ODY_RETURN_IF_ERROR(writer->flush());
    r.million_stream_s = seconds_since(t0);
    const auto t1 = Clock::now();
    replay::VerifyReport report;
    ODY_RETURN_IF_ERROR(replay::verify_trajectory(service->store(), id, report));
    r.million_verify_s = seconds_since(t1);
    if (!report.sound()) return Status(StatusCode::kCorrupt, report.problems.front().to_string());
    std::printf("million-token trajectory: streamed in %.3f s (%.2fM tokens/s), verified in %.3f s "
                "(%lu segments, %lu tokens, %.1f MB)\n",
                r.million_stream_s, (1 << 20) / r.million_stream_s / 1e6, r.million_verify_s, report.segments,
                report.tokens, report.bytes / 1e6);
  }
  stop = true;
  service_thread.join();
  ODY_RETURN_IF_ERROR(service_status);
  service.reset();
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  r.peak_rss_kb = ru.ru_maxrss;
  std::printf("peak rss: %.1f MB (whole process: baseline data, service, writers)\n", r.peak_rss_kb / 1024.0);
  fs::remove_all(work);
  r.ratio = r.e2e_tokens_per_s / r.raw_tokens_per_s;
  std::printf("replay_ingest_ratio: %.3f\n", r.ratio);
  std::fflush(stdout);
  return r;
}

}  // namespace odyssey::bench
