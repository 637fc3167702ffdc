// odyssey traj ls | show | export | verify: replay and audit stored trajectories.
// They open the store as a RocksDB secondary, so they work while a service is writing it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>

#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "core/tokenizer.h"
#include "replay/audit.h"
#include "replay/layout.h"
#include "replay/store.h"
#include "replay/verify.h"

namespace odyssey::cli {

namespace {

struct TrajArgs {
  std::string dir;
  size_t max_problems = 20;
  replay::TrajectoryFilterArgs filter;
  size_t limit = 0;
  std::string id;
  size_t max_turn_bytes = 4000, max_result_bytes = 1000;
  bool token_ids = false;
  std::string format = "jsonl", out;
  bool no_tokens = false, inline_images = false;
};

Result<std::unique_ptr<replay::TrajectoryStore>> open_for_audit(const std::string& dir) {
  replay::StoreOptions o;
  o.dir = dir;
  o.read_only = true;
  return replay::TrajectoryStore::open(o);
}

// Records matching `filter`, oldest first (by start time). Uses the job or environment index
// when the filter names one, so a filtered listing of a big store reads only what matches.
Result<std::vector<std::unique_ptr<capnp::MallocMessageBuilder>>> select(const replay::TrajectoryStore& store,
                                                                         const replay::TrajectoryFilter& filter) {
  std::vector<std::unique_ptr<capnp::MallocMessageBuilder>> out;
  auto consider = [&](std::string_view value) -> Status {
    auto rec = decode_trajectory(value);
    if (!rec.ok()) {
      spdlog::warn("skipping an unreadable trajectory record: {} (run `odyssey traj verify`)", rec.status().message());
      return Status::Ok();
    }
    if (filter.matches((*rec)->getRoot<schema::Trajectory>().asReader())) out.push_back(std::move(*rec));
    return Status::Ok();
  };
  std::optional<std::string> prefix;
  if (filter.job) prefix = std::string("j") + *filter.job + '\0';
  else if (filter.environment) prefix = std::string("e") + *filter.environment + '\0';
  if (prefix) {
    std::unique_ptr<rocksdb::Iterator> it(store.db()->NewIterator(rocksdb::ReadOptions(), store.index_cf()));
    for (it->Seek(*prefix); it->Valid() && it->key().starts_with(*prefix); it->Next()) {
      if (it->key().size() != prefix->size() + 8) continue;
      auto record = store.read_record(replay::get_be64(it->key().data() + prefix->size()));
      if (record.ok()) ODY_RETURN_IF_ERROR(consider(*record));
    }
    if (!it->status().ok()) return Status(StatusCode::kIo, it->status().ToString());
  } else {
    std::unique_ptr<rocksdb::Iterator> it(store.db()->NewIterator(rocksdb::ReadOptions(), store.trajectories_cf()));
    for (it->SeekToFirst(); it->Valid(); it->Next())
      ODY_RETURN_IF_ERROR(consider(std::string_view(it->value().data(), it->value().size())));
    if (!it->status().ok()) return Status(StatusCode::kIo, it->status().ToString());
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a->template getRoot<schema::Trajectory>().getStartedUnixNanos() <
           b->template getRoot<schema::Trajectory>().getStartedUnixNanos();
  });
  return out;
}

// Streams one trajectory's segments through `renderer`, a few at a time.
Status render(const replay::TrajectoryStore& store, schema::Trajectory::Reader record,
              replay::TrajectoryRenderer& renderer) {
  ODY_RETURN_IF_ERROR(renderer.begin(record));
  uint32_t seq = 0;
  for (;;) {
    ODY_ASSIGN_OR_RETURN(auto segs, store.read_segments(record.getId(), seq, 8, 32ull << 20));
    if (segs.empty()) break;
    for (const auto& bytes : segs) {
      MessageView view(bytes);
      if (!view.ok()) return view.status().with_context(fmt::format("segment {}", seq));
      ODY_RETURN_IF_ERROR(guarded("segment", [&] { return renderer.add(view.root<schema::Segment>()); }));
      ++seq;
    }
  }
  return renderer.finish();
}

Result<std::unique_ptr<Tokenizer>> tokenizer_for(schema::Trajectory::Reader record) {
  std::string name = record.getTokenizer();
  return make_tokenizer(name.empty() ? "byte-v1" : name);
}

int fail(const char* cmd, const Status& st) {
  std::fprintf(stderr, "traj %s: %s\n", cmd, st.to_string().c_str());
  return st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kNotFound ? 2 : 1;
}

int ls(const TrajArgs& a) {
  auto filter = replay::parse_filter(a.filter);
  if (!filter.ok()) return fail("ls", filter.status());
  auto store = open_for_audit(a.dir);
  if (!store.ok()) return fail("ls", store.status());
  auto records = select(**store, *filter);
  if (!records.ok()) return fail("ls", records.status());
  const int64_t now = unix_nanos_now();
  std::printf("%s\n", replay::format_ls_header().c_str());
  size_t shown = 0;
  for (const auto& r : *records) {
    if (a.limit && shown >= a.limit) break;
    std::printf("%s\n", replay::format_ls_row(r->getRoot<schema::Trajectory>().asReader(), now).c_str());
    ++shown;
  }
  std::printf("%zu of %zu matching trajectories shown\n", shown, records->size());
  return 0;
}

int show(const TrajArgs& a) {
  auto id = parse_trajectory_id(a.id);
  if (!id.ok()) return fail("show", id.status());
  auto store = open_for_audit(a.dir);
  if (!store.ok()) return fail("show", store.status());
  auto bytes = (*store)->read_record(*id);
  if (!bytes.ok()) return fail("show", bytes.status());
  auto rec = decode_trajectory(*bytes);
  if (!rec.ok()) return fail("show", rec.status());
  auto record = (*rec)->getRoot<schema::Trajectory>().asReader();
  auto tokenizer = tokenizer_for(record);
  if (!tokenizer.ok()) return fail("show", tokenizer.status());
  replay::ShowOptions so;
  so.max_turn_bytes = a.max_turn_bytes;
  so.max_result_bytes = a.max_result_bytes;
  so.show_token_ids = a.token_ids;
  replay::ShowRenderer renderer(**tokenizer, std::cout, so);
  Status st = render(**store, record, renderer);
  std::cout.flush();
  return st.ok() ? 0 : fail("show", st);
}

int export_jsonl(const TrajArgs& a) {
  if (a.format != "jsonl")
    return fail("export", invalid_argument("--format {} is not supported; use --format jsonl", a.format));
  auto filter = replay::parse_filter(a.filter);
  if (!filter.ok()) return fail("export", filter.status());
  auto store = open_for_audit(a.dir);
  if (!store.ok()) return fail("export", store.status());
  auto records = select(**store, *filter);
  if (!records.ok()) return fail("export", records.status());
  std::ofstream file;
  if (!a.out.empty()) {
    file.open(a.out, std::ios::out | std::ios::trunc);
    if (!file) return fail("export", Status(StatusCode::kIo, "cannot write " + a.out));
  }
  std::ostream& out = a.out.empty() ? std::cout : file;
  replay::ExportOptions eo;
  eo.include_tokens = !a.no_tokens;
  eo.inline_images = a.inline_images;
  size_t written = 0, skipped = 0;
  for (const auto& r : *records) {
    if (a.limit && written >= a.limit) break;
    auto record = r->getRoot<schema::Trajectory>().asReader();
    auto tokenizer = tokenizer_for(record);
    if (!tokenizer.ok()) return fail("export", tokenizer.status());
    replay::ChatJsonlRenderer renderer(**tokenizer, out, eo);
    Status st = render(**store, record, renderer);
    if (!st.ok()) {
      spdlog::warn("skipping trajectory {}: {}", format_trajectory_id(record.getId()), st.to_string());
      ++skipped;
      continue;
    }
    ++written;
  }
  out.flush();
  std::fprintf(stderr, "exported %zu trajectories%s\n", written,
               skipped ? fmt::format(" ({} skipped: run `odyssey traj verify`)", skipped).c_str() : "");
  return skipped ? 1 : 0;
}

int verify(const TrajArgs& a) {
  auto store = open_for_audit(a.dir);
  if (!store.ok()) {
    std::fprintf(stderr, "traj verify: %s\n", store.status().to_string().c_str());
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  replay::VerifyOptions vo;
  vo.max_problems = a.max_problems;
  auto report = replay::verify_store(**store, vo);
  if (!report.ok()) {
    std::fprintf(stderr, "traj verify: %s\n", report.status().to_string().c_str());
    return 2;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& p : report->problems) std::printf("BAD %s\n", p.to_string().c_str());
  std::printf("%s: %lu trajectories, %lu segments, %lu tokens, %.1f MB checked in %.2f s (%.1fM tokens/s)%s\n",
              report->sound() ? "sound" : "NOT SOUND", report->trajectories, report->segments, report->tokens,
              report->bytes / 1e6, secs, report->tokens / std::max(secs, 1e-9) / 1e6,
              report->sound() ? "" : fmt::format("; first problem: {}", report->problems.front().to_string()).c_str());
  return report->sound() ? 0 : 1;
}

}  // namespace

void add_traj_commands(CLI::App& app, Action& action) {
  static TrajArgs args;
  auto* traj = app.add_subcommand("traj", "replay and audit stored trajectories");
  traj->require_subcommand(1);

  auto* v = traj->add_subcommand("verify",
                                 "check hash chains, completeness and schema validity; exit 0 only when all is sound");
  v->add_option("--dir", args.dir, "replay store directory")->required();
  v->add_option("--max-problems", args.max_problems, "stop after listing this many problems")->capture_default_str();
  v->callback([&action] { action = [] { return verify(args); }; });

  auto add_filters = [](CLI::App* c) {
    c->add_option("--job", args.filter.job, "only this job");
    c->add_option("--env", args.filter.environment, "only this environment (name)");
    c->add_option("--status", args.filter.status,
                  "only these statuses, comma-separated: in_flight, complete, consumed, withheld, failed");
    c->add_option("--reward-min", args.filter.reward_min, "total reward at least this");
    c->add_option("--reward-max", args.filter.reward_max, "total reward at most this");
    c->add_option("--version-min", args.filter.version_min, "every token from policy version >= this");
    c->add_option("--version-max", args.filter.version_max, "every token from policy version <= this");
    c->add_option("--limit", args.limit, "at most this many (0 = all)");
  };
  auto* l = traj->add_subcommand("ls", "list trajectories, oldest first, with filters");
  l->add_option("--dir", args.dir, "replay store directory")->required();
  add_filters(l);
  l->callback([&action] { action = [] { return ls(args); }; });

  auto* sh = traj->add_subcommand("show", "one trajectory for people: turns, tool calls, rewards, versions, timings");
  sh->add_option("--dir", args.dir, "replay store directory")->required();
  sh->add_option("id", args.id, "trajectory id (16 hex digits, as `traj ls` prints)")->required();
  sh->add_option("--max-turn-bytes", args.max_turn_bytes, "text shown per turn (0 = all)")->capture_default_str();
  sh->add_option("--max-result-bytes", args.max_result_bytes, "tool result text shown per call (0 = all)")
      ->capture_default_str();
  sh->add_flag("--token-ids", args.token_ids, "also list every token: id, text, logprob, policy version, loss mask");
  sh->callback([&action] { action = [] { return show(args); }; });

  auto* ex = traj->add_subcommand("export", "trajectories as OpenAI chat JSONL with tool_calls and token-level fields");
  ex->add_option("--dir", args.dir, "replay store directory")->required();
  ex->add_option("--format", args.format, "output format (jsonl)")->capture_default_str();
  ex->add_option("--out", args.out, "write here instead of stdout");
  ex->add_flag("--no-tokens", args.no_tokens, "leave out the token-level fields");
  ex->add_flag("--inline-images", args.inline_images, "images as base64 data: URLs instead of placeholders");
  add_filters(ex);
  ex->callback([&action] { action = [] { return export_jsonl(args); }; });
}

}  // namespace odyssey::cli
