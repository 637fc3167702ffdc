// files: a small software task in a temporary directory (project.h), solved with the tools
// list, read, write and run_check, and graded by running the task's check (exit 0 = success).
//
// Config (all optional):
//   root              $TMPDIR or /tmp   where task directories (ody-files-XXXXXX) are made
//   max_turns         30                turns before the episode ends
//   check_timeout_s   10                wall-clock limit of one check run (CPU limit: 1 s more)
//   check_memory_mb   512               address-space limit of the check's processes
//   output_bytes      8192              most bytes of check output and of read shown to the model
//   max_file_bytes    65536             largest file write accepts
//   max_files         64                most regular files the directory may hold after a write
//   max_total_bytes   1048576           most bytes the directory may hold after a write; also
//                                       the snapshot limit
// Tasks: {"split": "train"|"eval", "index": N} is task N of that split; {} with seed S is train
// task S; "family" (python_fix, python_implement, shell_fix, config) restricts either form to
// one family. A project's split is decided by its content: it is an eval project when
// splitmix64(FNV-1a-64 of its family, variant and every file's path and content) % 10 == 0, so
// no project is in both splits. Task N of a split is the first project, over attempts a = 0, 1,
// ..., generated from seed splitmix64(splitmix64(N) + a) that is in the split (generation is
// pure and cheap; only the accepted project is written). A split task ignores the seed.
// Episode: the model calls tools; a turn without tool calls, or max_turns, ends it. check.sh
// and tests/ belong to the check: write refuses them, and they are restored (tests/ wiped and
// rewritten) before every check run, so the grade is always the original check's.
// score(): runs the check (cached until the next step); reward 1 and success when it exits 0.
// Snapshots (JSON): task, seed, turn and every regular file outside check.sh and tests/ (UTF-8
// as text, anything else base64), at most max_total_bytes; symlinks and special files are not
// kept. The directory is removed on destroy and on the next reset.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "odyssey/env_sdk.hpp"
#include "odyssey/env_util.hpp"
#include "project.h"
#include "sandbox.h"

namespace odyssey::files {
namespace {

namespace fs = std::filesystem;
using env::EnvError;
using env::ToolError;
using nlohmann::json;

constexpr int kSnapshotVersion = 1;
constexpr uint64_t kMaxReadBytes = 8ull << 20;
constexpr size_t kMaxListed = 200;
constexpr size_t kMaxWalked = 20000;
constexpr uint64_t kMaxAttempts = 1000;

// The split of a project is a function of its content alone (every file, paths included).
bool in_eval(const Project& p) {
  uint64_t h = env::fnv1a64(p.family + "\n" + p.variant);
  for (const ProjectFile& f : p.files) h = env::fnv1a64(f.content, env::fnv1a64(f.path + "\n", h));
  return env::splitmix64(h) % 10 == 0;
}

// Well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF), which is what JSON
// serialization accepts.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
    if (c < 0x80) n = 0;
    else if (c >= 0xc2 && c <= 0xdf) n = 1;
    else if (c >= 0xe0 && c <= 0xef) n = 2, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    else if (c >= 0xf0 && c <= 0xf4) n = 3, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    else return false;
    if (n > s.size() - i - 1) return false;
    for (size_t k = 1; k <= n; ++k) {
      const unsigned char b = static_cast<unsigned char>(s[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b >> 6) != 0x2) return false;
    }
    i += n + 1;
  }
  return true;
}

// `s` with every byte of a malformed UTF-8 text past ASCII shown as '?'.
std::string printable(std::string s) {
  if (valid_utf8(s)) return s;
  for (char& c : s)
    if (static_cast<unsigned char>(c) >= 0x80) c = '?';
  return s;
}

const char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& in) {
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (const unsigned char c : in) {
    bits = (bits << 8) | c;
    count += 8;
    while (count >= 6) out += kBase64[(bits >> (count -= 6)) & 63];
  }
  if (count > 0) out += kBase64[(bits << (6 - count)) & 63];
  while (out.size() % 4) out += '=';
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (const char c : in) {
    if (c == '=') break;
    const char* at = std::strchr(kBase64, c);
    if (at == nullptr || c == '\0') throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "files snapshot: bad base64");
    bits = (bits << 6) | static_cast<uint32_t>(at - kBase64);
    count += 6;
    if (count >= 8) out += static_cast<char>((bits >> (count -= 8)) & 0xff);
  }
  return out;
}

// Entries below `dir` (no symlinks followed), sorted, as paths relative to `root`.
struct Entry {
  std::string path;
  struct stat st;
};
void walk(const fs::path& root, const fs::path& dir, std::vector<Entry>& out, int depth) {
  if (depth > 32 || out.size() >= kMaxWalked) return;
  std::error_code ec;
  std::vector<fs::path> children;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end && children.size() < kMaxWalked; it.increment(ec))
    children.push_back(it->path());
  std::sort(children.begin(), children.end());
  for (const fs::path& child : children) {
    Entry e;
    if (::lstat(child.c_str(), &e.st) != 0) continue;
    e.path = child.lexically_relative(root).generic_string();
    out.push_back(e);
    if (S_ISDIR(e.st.st_mode)) walk(root, child, out, depth + 1);
    if (out.size() >= kMaxWalked) return;
  }
}

// check.sh and tests/ belong to the check.
bool belongs_to_check(const std::string& relative) {
  const std::string p = fs::path(relative).lexically_normal().generic_string();
  return p == "check.sh" || p == "tests" || p == "tests/" || p.rfind("tests/", 0) == 0;
}

void write_file(const fs::path& path, const std::string& content) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) throw ToolError("cannot create the directory for it: " + ec.message());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == ELOOP) throw ToolError("it is a symlink; write the file it points to instead");
    if (errno == EISDIR) throw ToolError("it is a directory");
    throw ToolError(std::strerror(errno));
  }
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string message = std::strerror(errno);
      ::close(fd);
      throw ToolError("write failed: " + message);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

struct Config {
  std::string root;
  uint32_t max_turns = 30;
  double check_timeout_s = 10;
  uint64_t check_memory_mb = 512;
  uint64_t output_bytes = 8192;
  uint64_t max_file_bytes = 65536;
  uint64_t max_files = 64;
  uint64_t max_total_bytes = 1 << 20;
};

Config parse_config(const json& c) {
  const std::string what = "files config";
  const auto bad = ODY_ENV_ERR_INVALID_CONFIG;
  env::check_keys(c, {"root", "max_turns", "check_timeout_s", "check_memory_mb", "output_bytes", "max_file_bytes", "max_files",
                 "max_total_bytes"},
             what, bad);
  Config config;
  if (c.contains("root")) {
    if (!c["root"].is_string() || c["root"].get<std::string>().empty())
      throw EnvError(bad, what + ": 'root' must be a directory path, got " + c["root"].dump());
    config.root = c["root"].get<std::string>();
    std::error_code ec;
    if (!fs::is_directory(config.root, ec))
      throw EnvError(bad, what + ": 'root' " + c["root"].dump() + " is not an existing directory");
  }
  config.max_turns = static_cast<uint32_t>(env::integer_field(c, "max_turns", 30, 1, 10000, what, bad));
  if (c.contains("check_timeout_s")) {
    const json& v = c["check_timeout_s"];
    if (!v.is_number() || v.get<double>() <= 0 || v.get<double>() > 600)
      throw EnvError(bad, what + ": 'check_timeout_s' must be a number in (0, 600], got " + v.dump());
    config.check_timeout_s = v.get<double>();
  }
  config.check_memory_mb = env::integer_field(c, "check_memory_mb", 512, 64, 1 << 20, what, bad);
  config.output_bytes = env::integer_field(c, "output_bytes", 8192, 256, 1 << 20, what, bad);
  config.max_file_bytes = env::integer_field(c, "max_file_bytes", 65536, 1024, 64ull << 20, what, bad);
  config.max_files = env::integer_field(c, "max_files", 64, 8, 100000, what, bad);
  config.max_total_bytes = env::integer_field(c, "max_total_bytes", 1 << 20, 4096, 1ull << 30, what, bad);
  return config;
}

const json& string_argument(const json& args, const char* key) {
  if (!args.is_object() || !args.contains(key) || !args[key].is_string())
    throw ToolError(std::string("argument '") + key + "' must be a string");
  return args[key];
}

class Files : public env::Environment {
 public:
  explicit Files(const json& config) : config_(parse_config(config)) {
    const json path = {{"type", "string"}, {"description", "relative to the task directory, e.g. src/app.py"}};
    add_tool({"list", "Lists the files under a directory of the task (recursively) with their sizes.",
              {{"type", "object"},
               {"properties", {{"path", {{"type", "string"}, {"description", "a directory; default \".\""}}}}}}},
             [this](const json& args) { return list(args); });
    add_tool({"read", "Returns a text file's content, or lines start_line..end_line of it (1-based, inclusive).",
              {{"type", "object"},
               {"properties",
                {{"path", path},
                 {"start_line", {{"type", "integer"}, {"minimum", 1}}},
                 {"end_line", {{"type", "integer"}, {"minimum", 1}}}}},
               {"required", {"path"}}}},
             [this](const json& args) { return read(args); });
    add_tool({"write", "Creates or replaces a file with the given content (parent directories are created).",
              {{"type", "object"},
               {"properties", {{"path", path}, {"content", {{"type", "string"}, {"description", "the whole new content"}}}}},
               {"required", {"path", "content"}}}},
             [this](const json& args) { return write(args); });
    add_tool({"run_check", "Runs the task's check (sh check.sh) and returns its exit code and output.",
              {{"type", "object"}, {"properties", json::object()}}},
             [this](const json&) { return run_check(); });
  }

  ~Files() override { discard_directory(); }

  env::Observation reset(const json& task, uint64_t seed) override {
    env::check_keys(task, {"split", "index", "family"}, "files task", ODY_ENV_ERR_INVALID_TASK);
    std::string family;
    if (task.contains("family")) {
      const json& f = task["family"];
      const auto& known = families();
      if (!f.is_string() || std::find(known.begin(), known.end(), f.get<std::string>()) == known.end()) {
        std::string names;
        for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "files task: 'family' must be one of " + names + ", got " + f.dump());
      }
      family = f.get<std::string>();
    }
    bool eval = false;
    uint64_t index = seed;
    if (task.contains("split") || task.contains("index")) {
      if (!task.contains("split") || !task.contains("index"))
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "files task: give both 'split' and 'index', or neither");
      const json& split = task["split"];
      if (!split.is_string() || (split != "train" && split != "eval"))
        throw EnvError(ODY_ENV_ERR_INVALID_TASK, "files task: 'split' must be \"train\" or \"eval\", got " + split.dump());
      eval = split == "eval";
      index = env::integer_field(task, "index", 0, 0, UINT64_MAX, "files task", ODY_ENV_ERR_INVALID_TASK);
    }
    std::optional<Project> project;
    for (uint64_t attempt = 0; attempt < kMaxAttempts && !project; ++attempt) {
      try {
        Project candidate = make_project(family, env::splitmix64(env::splitmix64(index) + attempt));
        if (in_eval(candidate) == eval) project = std::move(candidate);
      } catch (const std::exception& e) {
        throw EnvError(ODY_ENV_ERR_INTERNAL, std::string("files: ") + e.what());
      }
    }
    if (!project)
      throw EnvError(ODY_ENV_ERR_INVALID_TASK, "files task: no project of that split in " + std::to_string(kMaxAttempts) +
                                                   " attempts");
    discard_directory();
    project_ = std::move(*project);
    make_directory();
    for (const ProjectFile& f : project_.files) write_file(root_ / f.path, f.content);
    task_ = task;
    seed_ = seed;
    started_ = true;
    done_ = false;
    turn_ = 0;
    graded_.reset();

    env::Observation obs;
    obs.text = "You are working in a small project directory.\n\n" + project_.statement + "\n\nFiles:\n" + listing(root_) +
               "\nTools: list {\"path\"} lists files; read {\"path\", \"start_line\", \"end_line\"} shows a file; "
               "write {\"path\", \"content\"} replaces a whole file; run_check {} runs `sh check.sh` and shows its exit "
               "code and output. check.sh and tests/ are read-only. Paths are relative to the project directory. "
               "When you are done, reply without a tool call. You have " +
               std::to_string(config_.max_turns) + " turns.";
    obs.info = {{"family", project_.family}, {"variant", project_.variant}, {"directory", root_.string()}};
    return obs;
  }

  env::Observation step(const env::Action& action) override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "files: step before reset");
    if (done_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "files: the episode is over; call score or reset");
    graded_.reset();
    return Environment::step(action);
  }

  env::Score score() override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "files: score before reset");
    if (!graded_) graded_ = check();
    const RunResult& r = *graded_;
    const bool passed = r.error.empty() && !r.timed_out && r.exit_code == 0;
    env::Score s;
    s.reward = passed ? 1.0 : 0.0;
    s.success = passed;
    s.parts.push_back({"passed", s.reward});
    json solution = json::object();
    for (const ProjectFile& f : project_.solution) solution[f.path] = f.content;
    s.info = {{"family", project_.family},
              {"variant", project_.variant},
              {"exit_code", r.exit_code},
              {"timed_out", r.timed_out},
              {"check_output", printable(r.output)},
              {"turns", turn_},
              {"solution", solution}};
    if (!r.error.empty()) s.info["error"] = r.error;
    return s;
  }

  std::string snapshot() override {
    if (!started_) throw EnvError(ODY_ENV_ERR_INVALID_ACTION, "files: snapshot before reset");
    std::vector<Entry> entries;
    walk(root_, root_, entries, 0);
    json files = json::array();
    uint64_t total = 0;
    for (const Entry& e : entries) {
      if (!S_ISREG(e.st.st_mode) || belongs_to_check(e.path)) continue;
      total += static_cast<uint64_t>(e.st.st_size);
      if (total > config_.max_total_bytes || files.size() >= config_.max_files * 4)
        throw EnvError(ODY_ENV_ERR_UNSUPPORTED, "files snapshot: the task directory holds more than max_total_bytes (" +
                                                    std::to_string(config_.max_total_bytes) + ") or too many files");
      const std::string content = read_whole(root_ / e.path, config_.max_total_bytes);
      json f = {{"path", e.path}};
      if (valid_utf8(content)) f["content"] = content;
      else f["base64"] = base64(content);
      files.push_back(std::move(f));
    }
    return json{{"env", "files"}, {"version", kSnapshotVersion}, {"task", task_}, {"seed", seed_},
                {"turn", turn_},  {"done", done_},                {"files", files}}
        .dump();
  }

  void restore(std::string_view bytes) override {
    const json s = env::parse_snapshot(bytes, "files", kSnapshotVersion);
    reset(s.at("task"), s.at("seed").get<uint64_t>());
    // The project as snapshotted: everything but the check's own files comes from the snapshot.
    std::error_code ec;
    for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name != "check.sh" && name != "tests") remove_tree(it->path());
    }
    for (const json& f : s.at("files")) {
      const std::string path = f.at("path").get<std::string>();
      if (belongs_to_check(path)) continue;
      fs::path target;
      try {
        target = confine(root_, path);
      } catch (const PathError& e) {
        throw EnvError(ODY_ENV_ERR_UNSUPPORTED, std::string("files snapshot: ") + e.what());
      }
      const std::string content = f.contains("base64") ? unbase64(f["base64"].get<std::string>()) : f.at("content").get<std::string>();
      try {
        write_file(target, content);
      } catch (const ToolError& e) {
        throw EnvError(ODY_ENV_ERR_INTERNAL, "files snapshot: cannot write " + path + ": " + e.what());
      }
    }
    turn_ = s.at("turn").get<uint32_t>();
    done_ = s.at("done").get<bool>();
  }

 protected:
  void on_turn(const env::Action& action, env::Observation& obs) override {
    ++turn_;
    if (action.tool_calls.empty()) {
      done_ = true;
    } else if (turn_ >= config_.max_turns) {
      done_ = true;
      obs.text = "Turn limit (" + std::to_string(config_.max_turns) + ") reached.";
    }
    obs.done = done_;
  }

 private:
  void make_directory() {
    std::string parent = config_.root;
    if (parent.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::string pattern = (fs::path(parent) / "ody-files-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr)
      throw EnvError(ODY_ENV_ERR_INTERNAL, "files: cannot create a task directory under " + parent + ": " + std::strerror(errno));
    std::error_code ec;
    root_ = fs::canonical(pattern, ec);
    if (ec) {
      remove_tree(pattern);
      throw EnvError(ODY_ENV_ERR_INTERNAL, "files: cannot resolve " + pattern + ": " + ec.message());
    }
  }

  void discard_directory() noexcept {
    if (!root_.empty()) remove_tree(root_);
    root_.clear();
  }

  fs::path resolve(const std::string& relative) const {
    try {
      return confine(root_, relative);
    } catch (const PathError& e) {
      throw ToolError(e.what());
    }
  }

  std::string listing(const fs::path& dir) const {
    std::vector<Entry> entries;
    walk(root_, dir, entries, 0);
    std::string out;
    size_t shown = 0;
    for (const Entry& e : entries) {
      if (shown == kMaxListed) {
        out += "... and " + std::to_string(entries.size() - shown) + " more entries\n";
        break;
      }
      ++shown;
      if (S_ISDIR(e.st.st_mode)) {
        out += "  " + e.path + "/\n";
      } else if (S_ISLNK(e.st.st_mode)) {
        std::error_code ec;
        out += "  " + e.path + " -> " + fs::read_symlink(root_ / e.path, ec).string() + "\n";
      } else if (S_ISREG(e.st.st_mode)) {
        out += "  " + e.path + "  (" + std::to_string(e.st.st_size) + " bytes)\n";
      } else {
        out += "  " + e.path + "  (special file)\n";
      }
    }
    return out.empty() ? "  (empty)\n" : printable(out);
  }

  static std::string read_whole(const fs::path& path, uint64_t limit) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw ToolError(errno == ELOOP ? "it is a symlink" : std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw ToolError(S_ISDIR(st.st_mode) ? "it is a directory; use list" : "not a regular file");
    }
    if (static_cast<uint64_t>(st.st_size) > limit) {
      ::close(fd);
      throw ToolError("the file has " + std::to_string(st.st_size) + " bytes; the limit is " + std::to_string(limit));
    }
    std::string content;
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      content.append(buffer, static_cast<size_t>(n));
      if (content.size() > limit) break;
    }
    ::close(fd);
    return content;
  }

  std::string list(const json& args) {
    const std::string relative = args.contains("path") ? string_argument(args, "path").get<std::string>() : ".";
    const fs::path dir = resolve(relative);
    struct stat st;
    if (::lstat(dir.c_str(), &st) != 0) throw ToolError("'" + relative + "' does not exist");
    if (!S_ISDIR(st.st_mode)) return "  " + relative + "  (" + std::to_string(st.st_size) + " bytes)\n";
    return listing(dir);
  }

  std::string read(const json& args) {
    const std::string relative = string_argument(args, "path").get<std::string>();
    const fs::path path = resolve(relative);
    std::string content;
    try {
      content = read_whole(path, kMaxReadBytes);
    } catch (const ToolError& e) {
      throw ToolError("cannot read '" + relative + "': " + e.what());
    }
    if (!valid_utf8(content)) throw ToolError("'" + relative + "' is not UTF-8 text (" + std::to_string(content.size()) + " bytes)");
    const auto line_arg = [&](const char* key) -> uint64_t {
      if (!args.contains(key)) return 0;
      const json& v = args[key];
      if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 1))
        throw ToolError(std::string("argument '") + key + "' must be an integer >= 1, got " + v.dump());
      return v.get<uint64_t>();
    };
    const uint64_t first = line_arg("start_line"), last = line_arg("end_line");
    if (first != 0 || last != 0) {
      const uint64_t from = first == 0 ? 1 : first;
      const uint64_t to = last == 0 ? UINT64_MAX : last;
      if (to < from) throw ToolError("end_line is before start_line");
      std::string out;
      uint64_t line = 1;
      size_t at = 0;
      while (at < content.size() && line <= to) {
        size_t end = content.find('\n', at);
        end = end == std::string::npos ? content.size() : end + 1;
        if (line >= from) out.append(content, at, end - at);
        at = end;
        ++line;
      }
      if (from >= line && !(content.empty() && from == 1))
        throw ToolError("'" + relative + "' has " + std::to_string(line - 1) + " lines");
      content = std::move(out);
    }
    if (content.size() > config_.output_bytes) {
      size_t cut = config_.output_bytes;
      while (cut > 0 && (static_cast<unsigned char>(content[cut]) >> 6) == 0x2) --cut;  // whole UTF-8 characters
      const size_t total = content.size();
      content.resize(cut);
      content += "\n[truncated: showing " + std::to_string(cut) + " of " + std::to_string(total) +
                 " bytes; read a line range for the rest]";
    }
    return content;
  }

  std::string write(const json& args) {
    const std::string relative = string_argument(args, "path").get<std::string>();
    const std::string& content = string_argument(args, "content").get_ref<const std::string&>();
    if (belongs_to_check(relative))
      throw ToolError("'" + relative + "' belongs to the check (check.sh and tests/ are read-only)");
    const fs::path path = resolve(relative);
    if (path == root_) throw ToolError("'" + relative + "' is the task directory itself");
    if (belongs_to_check(path.lexically_relative(root_).generic_string()))
      throw ToolError("'" + relative + "' belongs to the check (check.sh and tests/ are read-only)");
    if (content.size() > config_.max_file_bytes)
      throw ToolError("the content has " + std::to_string(content.size()) + " bytes; the limit is " +
                      std::to_string(config_.max_file_bytes));
    std::vector<Entry> entries;
    walk(root_, root_, entries, 0);
    uint64_t files = 1, total = content.size();
    const std::string self = path.lexically_relative(root_).generic_string();
    for (const Entry& e : entries) {
      if (!S_ISREG(e.st.st_mode) || e.path == self) continue;
      ++files;
      total += static_cast<uint64_t>(e.st.st_size);
    }
    if (files > config_.max_files)
      throw ToolError("the directory would hold " + std::to_string(files) + " files; the limit is " + std::to_string(config_.max_files));
    if (total > config_.max_total_bytes)
      throw ToolError("the directory would hold " + std::to_string(total) + " bytes; the limit is " +
                      std::to_string(config_.max_total_bytes));
    try {
      write_file(path, content);
    } catch (const ToolError& e) {
      throw ToolError("cannot write '" + relative + "': " + e.what());
    }
    return "wrote " + std::to_string(content.size()) + " bytes to " + self;
  }

  // Puts the check's pristine files back: check.sh, and tests/ wiped and rewritten.
  void restore_check_files() {
    remove_tree(root_ / "check.sh");
    remove_tree(root_ / "tests");
    for (const ProjectFile& f : project_.files) {
      if (!belongs_to_check(f.path)) continue;
      try {
        write_file(root_ / f.path, f.content);
      } catch (const ToolError& e) {
        throw EnvError(ODY_ENV_ERR_INTERNAL, "files: cannot restore " + f.path + ": " + e.what());
      }
    }
  }

  RunResult check() {
    restore_check_files();
    RunLimits limits;
    limits.timeout_s = config_.check_timeout_s;
    limits.cpu_s = static_cast<uint64_t>(config_.check_timeout_s) + 1;
    limits.memory_bytes = config_.check_memory_mb << 20;
    limits.output_bytes = config_.output_bytes;
    const std::string home = root_.string();
    return run_limited({"/bin/sh", "check.sh"}, home,
                       {"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + home, "TMPDIR=" + home, "LC_ALL=C.UTF-8",
                        "PYTHONDONTWRITEBYTECODE=1", "PYTHONHASHSEED=0", "PYTHONNOUSERSITE=1"},
                       limits);
  }

  std::string run_check() {
    const RunResult r = check();
    if (!r.error.empty()) throw ToolError("the check could not be started: " + r.error);
    std::string out;
    if (r.timed_out) {
      out = "timed out after " + std::to_string(static_cast<int>(config_.check_timeout_s + 0.5)) +
            " s; the check was killed (an infinite loop?)\n";
    } else if (r.signal != 0) {
      out = "killed by signal " + std::to_string(r.signal) + " (" + strsignal(r.signal) + ")\n";
    } else {
      out = "exit code: " + std::to_string(r.exit_code) + (r.exit_code == 0 ? " (passed)\n" : " (failed)\n");
    }
    out += "--- output ---\n" + printable(r.output);
    if (r.dropped > 0) out += "\n[truncated: " + std::to_string(r.dropped) + " more bytes]";
    return out;
  }

  Config config_;
  fs::path root_;
  Project project_;
  json task_ = json::object();
  uint64_t seed_ = 0;
  bool started_ = false;
  bool done_ = false;
  uint32_t turn_ = 0;
  std::optional<RunResult> graded_;
};

}  // namespace
}  // namespace odyssey::files

ODY_ENV_PLUGIN_WITH_SNAPSHOT(odyssey::files::Files, "files", "1.0.0",
                             "A small software task in a temporary directory, graded by its check script")
