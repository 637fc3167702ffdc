// The replay service as users run it: the real `odyssey replay serve` process, real ZeroMQ on
// loopback, a real RocksDB store, writers in their own processes, SIGKILL and SIGSTOP.
#include <signal.h>

#include <atomic>
#include <fstream>
#include <future>
#include <thread>

#include <capnp/message.h>
#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <zmq.hpp>

#include "core/transport.h"
#include "replay/client.h"
#include "replay/layout.h"
#include "replay/store.h"
#include "test_helpers.h"

namespace odyssey::replay {
namespace {

using namespace std::chrono_literals;
using testing::Process;
using testing::TempDir;

// `odyssey replay serve` on a fixed port and directory, restartable.
class ServiceProcess {
 public:
  ServiceProcess(const TempDir& tmp, int port, std::vector<std::string> extra = {})
      : tmp_(tmp), endpoint_("tcp://127.0.0.1:" + std::to_string(port)), extra_(std::move(extra)) {}
  // True once the service prints that it listens.
  [[nodiscard]] bool start() {
    std::vector<std::string> argv = {ODYSSEY_BINARY, "replay", "serve", "--dir", tmp_.str("store"),
                                     "--listen", endpoint_, "--log-level", "warn"};
    argv.insert(argv.end(), extra_.begin(), extra_.end());
    proc_ = std::make_unique<Process>(argv, tmp_.str("service.log"));
    ++starts_;
    if (proc_->wait_for_output("listening on " + endpoint_ + "\n", 30s)) return true;
    ADD_FAILURE() << "service did not start:\n" << proc_->output();
    return false;
  }
  void kill9() {
    proc_->kill(SIGKILL);
    EXPECT_EQ(proc_->wait(10s), 128 + SIGKILL);
    proc_.reset();
  }
  int stop() {
    proc_->kill(SIGTERM);
    int code = proc_->wait(30s);
    proc_.reset();
    return code;
  }
  Process& process() { return *proc_; }
  const std::string& endpoint() const { return endpoint_; }
  std::string store_dir() const { return tmp_.str("store"); }

 private:
  const TempDir& tmp_;
  std::string endpoint_;
  std::vector<std::string> extra_;
  std::unique_ptr<Process> proc_;
  int starts_ = 0;
};

ClientOptions client(const std::string& endpoint, int ack_timeout_ms = 1000) {
  ClientOptions o;
  o.endpoint = endpoint;
  o.name = "test";
  o.ack_timeout_ms = ack_timeout_ms;
  o.give_up_after_ms = 30000;
  return o;
}

TEST(ReplayCrash, FourWriterProcessesSurviveTwoSigkillsWithEveryAckedSegmentStoredOnce) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port());
  ASSERT_TRUE(service.start());
  constexpr int kWriters = 4, kPerWriter = 250, kSegments = 3, kTokens = 64;
  // Each writer holds its last trajectory until the gate opens after the second crash: however the
  // machine schedules them, no writer finishes before both crashes.
  const std::string gate = tmp.str("gate");
  std::vector<std::unique_ptr<Process>> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.push_back(std::make_unique<Process>(
        std::vector<std::string>{REPLAY_TEST_WRITER, service.endpoint(), std::to_string(w), std::to_string(kPerWriter),
                                 std::to_string(kSegments), std::to_string(kTokens), /*pace_ms=*/"2", gate},
        tmp.str("writer" + std::to_string(w) + ".log")));
  }
  // Kill the service twice while the writers stream: once a quarter and once 60% of the
  // trajectories have arrived.
  auto stored = [&]() -> uint64_t {
    auto sampler = ReplaySampler::connect(client(service.endpoint()));
    if (!sampler.ok()) return 0;
    auto stats = (*sampler)->stats();
    return stats.ok() ? stats->trajectories : 0;
  };
  for (uint64_t threshold : {kWriters * kPerWriter / 4, kWriters * kPerWriter * 6 / 10}) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (stored() < threshold && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
    int running = 0;
    for (auto& w : writers) running += w->running();
    EXPECT_EQ(running, kWriters) << "writers finished before the crash at " << threshold;
    service.kill9();
    std::this_thread::sleep_for(300ms);  // writers notice the silence and keep resending
    ASSERT_TRUE(service.start());
  }
  std::ofstream(gate).put('\n');
  uint64_t reconnects = 0;
  for (int w = 0; w < kWriters; ++w) {
    EXPECT_EQ(writers[w]->wait(120s), 0) << writers[w]->output();
    auto out = writers[w]->output();
    auto pos = out.find(" resends, ");
    if (pos != std::string::npos) reconnects += std::stoull(out.substr(pos + 10));
  }
  EXPECT_GT(reconnects, 0u) << "no writer had to reconnect: the crashes were not exercised";
  {
    auto sampler = ReplaySampler::connect(client(service.endpoint()));
    ASSERT_TRUE(sampler.ok());
    auto stats = (*sampler)->stats();
    ASSERT_TRUE(stats.ok()) << stats.status().to_string();
    EXPECT_EQ(stats->trajectories, uint64_t{kWriters * kPerWriter});
    EXPECT_EQ(stats->complete, uint64_t{kWriters * kPerWriter});
    EXPECT_EQ(stats->in_flight, 0u);
    EXPECT_EQ(stats->segments, uint64_t{kWriters * kPerWriter * kSegments});
  }
  EXPECT_EQ(service.stop(), 0);

  std::string out;
  EXPECT_EQ(testing::run_command({ODYSSEY_BINARY, "traj", "verify", "--dir", service.store_dir()}, &out), 0) << out;
  EXPECT_NE(out.find("sound: 1000 trajectories, 3000 segments"), std::string::npos) << out;

  // Exactly once: every trajectory holds exactly its 3 segments, in one unbroken chain.
  StoreOptions so;
  so.dir = service.store_dir();
  so.read_only = true;
  auto store = TrajectoryStore::open(so);
  ASSERT_TRUE(store.ok());
  for (int w = 0; w < kWriters; ++w) {
    for (int i = 0; i < kPerWriter; ++i) {
      const uint64_t id = (uint64_t(w + 1) << 32) | uint64_t(i + 1);
      auto segs = (*store)->read_segments(id, 0, 100, 1ull << 30);
      ASSERT_TRUE(segs.ok());
      ASSERT_EQ(segs->size(), size_t{kSegments}) << format_trajectory_id(id);
    }
  }
}

TEST(ReplayService, AnswersMalformedInputWithErrorsAndKeepsServing) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port(), {"--set", "replay.max_message_bytes=65536"});
  ASSERT_TRUE(service.start());
  zmq::context_t ctx(1);
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.connect(service.endpoint());
  auto expect_error = [&](const std::vector<std::string>& frames, schema::ErrorCode code, const std::string& needle) {
    std::vector<std::string_view> views(frames.begin(), frames.end());
    ASSERT_TRUE(send_frames(raw, views).ok());
    auto reply = recv_frames(raw, 5000);
    ASSERT_TRUE(reply.ok() && reply->has_value()) << "no reply";
    MessageView view(view_of((**reply)[0]));
    ASSERT_TRUE(view.ok());
    auto r = view.root<schema::Response>();
    EXPECT_EQ(r.getError(), code) << r.getMessage().cStr();
    EXPECT_NE(std::string(r.getMessage().cStr()).find(needle), std::string::npos) << r.getMessage().cStr();
  };
  auto request = [](auto fill) {
    capnp::MallocMessageBuilder m;
    auto req = m.initRoot<schema::Request>();
    req.setId(7);
    fill(req);
    return flat_bytes(m);
  };
  // Garbage, truncated and misaligned bytes.
  expect_error({"definitely not capnp"}, schema::ErrorCode::BAD_REQUEST, "");
  std::string hello = request([](schema::Request::Builder r) { r.initHello().setProtocolVersion(1); });
  expect_error({hello.substr(0, hello.size() - 8)}, schema::ErrorCode::BAD_REQUEST, "");
  // An append without its segment frame, for an unknown trajectory, and an oversized one.
  std::string append = request([](schema::Request::Builder r) {
    auto a = r.initAppend();
    a.setTrajectoryId(42);
    a.setSeq(0);
  });
  expect_error({append}, schema::ErrorCode::BAD_REQUEST, "second frame");
  auto seg = encode_segment(SegmentPosition{42, 0, 0, {}}, testing::make_segment(8));
  ASSERT_TRUE(seg.ok());
  expect_error({append, seg->bytes}, schema::ErrorCode::UNKNOWN_TRAJECTORY, "begin()");
  auto big = encode_segment(SegmentPosition{42, 0, 0, {}}, testing::make_segment(20000));
  ASSERT_TRUE(big.ok());
  expect_error({append, big->bytes}, schema::ErrorCode::TOO_LARGE, "max_message_bytes");
  // A corrupted segment (one flipped bit) for a real trajectory.
  auto writer = TrajectoryWriter::connect(client(service.endpoint()));
  ASSERT_TRUE(writer.ok());
  TrajectoryMeta meta;
  meta.id = 42;
  meta.job = "j";
  ASSERT_TRUE((*writer)->begin(meta).ok());
  std::string flipped = seg->bytes;
  flipped[flipped.size() - 20] ^= 0x01;
  expect_error({append, flipped}, schema::ErrorCode::BAD_REQUEST, "does not match its content");
  // A segment that claims to be another (trajectory, seq) than the request says.
  auto other = encode_segment(SegmentPosition{43, 0, 0, {}}, testing::make_segment(8));
  expect_error({append, other->bytes}, schema::ErrorCode::BAD_REQUEST, "says it is");
  // An out-of-order segment.
  std::string append5 = request([](schema::Request::Builder r) {
    auto a = r.initAppend();
    a.setTrajectoryId(42);
    a.setSeq(5);
  });
  auto seg5 = encode_segment(SegmentPosition{42, 5, 0, {}}, testing::make_segment(8));
  expect_error({append5, seg5->bytes}, schema::ErrorCode::CONFLICT, "expects seq 0");

  // Still serving, and nothing partial was stored: the trajectory has no segments.
  ASSERT_TRUE((*writer)->append(42, testing::make_segment(8)).ok());
  ASSERT_TRUE((*writer)->end(42, Reward{1.0, {}}).ok());
  ASSERT_TRUE((*writer)->flush().ok());
  auto sampler = ReplaySampler::connect(client(service.endpoint()));
  auto stats = (*sampler)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->segments, 1u);
  EXPECT_EQ(stats->complete, 1u);
  EXPECT_TRUE(service.process().running());
}

TEST(ReplayService, WriterBlocksWhenItsCreditsAreUsedUpAndResumesWithoutLoss) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port(), {"--set", "replay.credits=4"});
  ASSERT_TRUE(service.start());
  auto writer = TrajectoryWriter::connect(client(service.endpoint(), /*ack_timeout_ms=*/5000));
  ASSERT_TRUE(writer.ok());
  TrajectoryMeta meta;
  meta.job = "j";
  auto id = (*writer)->begin(meta);
  ASSERT_TRUE(id.ok());
  service.process().kill(SIGSTOP);  // the service stops acknowledging
  std::atomic<int> appended{0};
  auto done = std::async(std::launch::async, [&] {
    for (int i = 0; i < 10; ++i) {
      if (!(*writer)->append(*id, testing::make_segment(16)).ok()) return false;
      ++appended;
    }
    return (*writer)->flush().ok();
  });
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(appended.load(), 4) << "the writer must stop at its credits, not drop or buffer without bound";
  service.process().kill(SIGCONT);
  ASSERT_EQ(done.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(done.get());
  EXPECT_EQ(appended.load(), 10);
  auto sampler = ReplaySampler::connect(client(service.endpoint()));
  auto stats = (*sampler)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->segments, 10u);
}

// A writer held back by the rate limiter (nobody samples) leaves begin() as soon as its stop flag
// is set, instead of waiting out give_up_after_ms: an actor asked to stop exits promptly.
TEST(ReplayService, AStopFlagEndsABeginHeldBackByTheRateLimiter) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port(),
                         {"--set", "replay.rate_limiter.samples_per_insert=1.0", "--set",
                          "replay.rate_limiter.error_buffer=2.0"});
  ASSERT_TRUE(service.start());
  std::atomic<bool> stop{false};
  ClientOptions options = client(service.endpoint());
  options.stop = &stop;
  auto writer = TrajectoryWriter::connect(options);
  ASSERT_TRUE(writer.ok());
  std::atomic<int> admitted{0};
  auto done = std::async(std::launch::async, [&]() -> Status {
    for (int i = 0; i < 50; ++i) {
      TrajectoryMeta meta;
      meta.job = "j";
      Result<uint64_t> id = (*writer)->begin(meta);
      if (!id.ok()) return id.status();
      ++admitted;
      ODY_RETURN_IF_ERROR((*writer)->end(*id, Reward{}));
    }
    return Status::Ok();
  });
  EXPECT_EQ(done.wait_for(1500ms), std::future_status::timeout) << "nothing samples, so inserts must be held back";
  EXPECT_LT(admitted.load(), 50);
  const int before = admitted.load();
  stop = true;
  ASSERT_EQ(done.wait_for(5s), std::future_status::ready) << "begin() kept waiting after the stop flag was set";
  const Status st = done.get();
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("stopped"), std::string::npos) << st.to_string();
  EXPECT_EQ(admitted.load(), before);
}

TEST(ReplayService, CheckpointsWhileWritersKeepWritingAndTheCheckpointServes) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port());
  ASSERT_TRUE(service.start());
  std::atomic<bool> stop{false};
  std::atomic<int> ended{0};
  std::thread streaming([&] {
    auto writer = TrajectoryWriter::connect(client(service.endpoint()));
    ASSERT_TRUE(writer.ok());
    while (!stop) {
      TrajectoryMeta meta;
      meta.job = "j";
      auto id = (*writer)->begin(meta);
      ASSERT_TRUE(id.ok());
      for (int s = 0; s < 4; ++s) ASSERT_TRUE((*writer)->append(*id, testing::make_segment(256)).ok());
      ASSERT_TRUE((*writer)->end(*id, Reward{0.5, {}}).ok());
      ++ended;
    }
    ASSERT_TRUE((*writer)->flush().ok());
  });
  while (ended < 5) std::this_thread::sleep_for(10ms);
  std::string out;
  ASSERT_EQ(testing::run_command({ODYSSEY_BINARY, "replay", "checkpoint", "--connect", service.endpoint(),
                                  tmp.str("ckpt")},
                                 &out),
            0)
      << out;
  const int at_checkpoint = ended.load();
  while (ended < at_checkpoint + 5) std::this_thread::sleep_for(10ms);  // writers kept going
  stop = true;
  streaming.join();
  EXPECT_EQ(testing::run_command({ODYSSEY_BINARY, "traj", "verify", "--dir", tmp.str("ckpt")}, &out), 0) << out;
  EXPECT_EQ(testing::run_command({ODYSSEY_BINARY, "traj", "verify", "--dir", service.store_dir()}, &out), 0) << out;
  // The checkpoint is a store of its own: a service can serve it.
  Process second({ODYSSEY_BINARY, "replay", "serve", "--dir", tmp.str("ckpt"), "--listen",
                  "tcp://127.0.0.1:" + std::to_string(testing::free_port())},
                 tmp.str("second.log"));
  EXPECT_TRUE(second.wait_for_output("listening on", 30s)) << second.output();
}

TEST(TrajVerify, CatchesOneFlippedByteInAStoredSegmentAndNamesIt) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port());
  ASSERT_TRUE(service.start());
  uint64_t victim = 0;
  {
    auto writer = TrajectoryWriter::connect(client(service.endpoint()));
    ASSERT_TRUE(writer.ok());
    for (int t = 0; t < 3; ++t) {
      TrajectoryMeta meta;
      meta.id = 100 + t;
      meta.job = "j";
      ASSERT_TRUE((*writer)->begin(meta).ok());
      for (int s = 0; s < 3; ++s) ASSERT_TRUE((*writer)->append(100 + t, testing::make_segment(64)).ok());
      ASSERT_TRUE((*writer)->end(100 + t, Reward{1, {}}).ok());
    }
    ASSERT_TRUE((*writer)->flush().ok());
    victim = 101;
  }
  ASSERT_EQ(service.stop(), 0);
  std::string out;
  ASSERT_EQ(testing::run_command({ODYSSEY_BINARY, "traj", "verify", "--dir", service.store_dir()}, &out), 0) << out;

  // Flip one byte of segment 1 of trajectory 101, behind the service's back.
  {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const char* n : {rocksdb::kDefaultColumnFamilyName.c_str(), kSegmentsCf, kTrajectoriesCf, kIndexCf, kStateCf})
      cfs.emplace_back(n, n == std::string(kSegmentsCf) ? TrajectoryStore::segment_cf_options()
                                                         : rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::DBOptions(), service.store_dir(), cfs, &handles, &raw).ok());
    std::string value;
    ASSERT_TRUE(raw->Get(rocksdb::ReadOptions(), handles[1], segment_key(victim, 1), &value).ok());
    value[value.size() / 2] ^= 0x04;
    ASSERT_TRUE(raw->Put(rocksdb::WriteOptions(), handles[1], segment_key(victim, 1), value).ok());
    for (auto* h : handles) raw->DestroyColumnFamilyHandle(h);
    delete raw;
  }
  EXPECT_EQ(testing::run_command({ODYSSEY_BINARY, "traj", "verify", "--dir", service.store_dir()}, &out), 1) << out;
  EXPECT_NE(out.find("first problem: trajectory 0000000000000065 segment 1: hash mismatch"), std::string::npos) << out;

  // A service over the damaged store refuses to hand out the bad segment, says which it is,
  // and keeps serving the rest.
  ASSERT_TRUE(service.start());
  auto sampler = ReplaySampler::connect(client(service.endpoint()));
  ASSERT_TRUE(sampler.ok());
  auto bad = (*sampler)->read(victim, 0, 8);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(bad.status().message().find("segment 0000000000000065/1"), std::string::npos) << bad.status().message();
  auto good = (*sampler)->read(100, 0, 8);
  ASSERT_TRUE(good.ok()) << good.status().to_string();
  EXPECT_EQ(good->size(), 3u);
  EXPECT_TRUE(service.process().running());
}

}  // namespace
}  // namespace odyssey::replay

namespace odyssey::replay {
namespace {

TEST(ReplaySampler, SamplesGroupsReadsAMillionTokenTrajectoryInChunksAndCommits) {
  TempDir tmp;
  ServiceProcess service(tmp, testing::free_port(), {"--set", "replay.sampler=group_complete"});
  ASSERT_TRUE(service.start());
  auto writer = TrajectoryWriter::connect(client(service.endpoint()));
  ASSERT_TRUE(writer.ok());
  // A group of two: one short trajectory and one of 2^20 tokens streamed in 4096-token segments.
  TrajectoryMeta meta;
  meta.job = "j";
  meta.group_id = 99;
  meta.group_size = 2;
  auto short_id = (*writer)->begin(meta);
  auto long_id = (*writer)->begin(meta);
  ASSERT_TRUE(short_id.ok() && long_id.ok());
  ASSERT_TRUE((*writer)->append(*short_id, testing::make_segment(100)).ok());
  ASSERT_TRUE((*writer)->end(*short_id, Reward{0.0, {{"correct", 0.0}}}).ok());
  const auto seg = testing::make_segment(4096, /*version=*/3);
  for (int s = 0; s < 256; ++s) ASSERT_TRUE((*writer)->append(*long_id, seg).ok());
  ASSERT_TRUE((*writer)->end(*long_id, Reward{1.0, {{"correct", 1.0}}}).ok());
  ASSERT_TRUE((*writer)->flush().ok());

  auto sampler = ReplaySampler::connect(client(service.endpoint()));
  ASSERT_TRUE(sampler.ok());
  auto batch = (*sampler)->sample(1, 1000);
  ASSERT_TRUE(batch.ok()) << batch.status().to_string();
  ASSERT_EQ(batch->items.size(), 2u);
  EXPECT_EQ(batch->group_starts, (std::vector<uint32_t>{0}));
  const auto& big = batch->items[0].id() == *long_id ? batch->items[0] : batch->items[1];
  EXPECT_EQ(big.record().getNumTokens(), uint64_t{1} << 20);
  EXPECT_EQ(big.record().getRewardTotal(), 1.0);
  EXPECT_EQ(big.record().getMinPolicyVersion(), 3u);

  // Read it back eight segments per request: never the whole trajectory in one message.
  SegmentStream stream(**sampler, *long_id, /*chunk=*/8);
  uint64_t tokens = 0, segments = 0;
  Hash128 prev;
  for (;;) {
    auto next = stream.next();
    ASSERT_TRUE(next.ok()) << next.status().to_string();
    if (!next->has_value()) break;
    MessageView v(**next);
    auto s = v.root<schema::Segment>();
    EXPECT_EQ(s.getSeq(), segments);
    EXPECT_EQ((Hash128{s.getPrevHashLo(), s.getPrevHashHi()}), prev);
    prev = *compute_self_hash(**next);
    tokens += s.getTokens().size();
    ++segments;
  }
  EXPECT_EQ(tokens, uint64_t{1} << 20);
  EXPECT_EQ(segments, 256u);

  // Nothing more to sample until the learner commits; then both are consumed.
  auto none = (*sampler)->sample(1, 50);
  EXPECT_EQ(none.status().code(), StatusCode::kTimeout) << "a waited-out sample says why";
  ASSERT_TRUE((*sampler)->commit(batch->cursor).ok());
  auto stats = (*sampler)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->consumed, 2u);
  EXPECT_EQ(stats->sampler, "group_complete");
}

TEST(ReplayService, ServeDryRunPrintsTheResolvedConfigAndBadConfigsNameTheKey) {
  std::string out;
  EXPECT_EQ(testing::run_command({ODYSSEY_BINARY, "replay", "serve", "--config",
                                  std::string(ODYSSEY_SOURCE_DIR) + "/configs/replay.toml", "--set",
                                  "replay.credits=32", "--dry-run"},
                                 &out),
            0)
      << out;
  EXPECT_NE(out.find("credits = 32"), std::string::npos) << out;
  EXPECT_NE(out.find("sampler = \"group_complete\""), std::string::npos) << out;
  EXPECT_NE(testing::run_command({ODYSSEY_BINARY, "replay", "serve", "--set", "replay.credts=3"}, &out), 0);
  EXPECT_NE(out.find("unknown key 'replay.credts' (did you mean 'replay.credits'?)"), std::string::npos) << out;
}

}  // namespace
}  // namespace odyssey::replay
