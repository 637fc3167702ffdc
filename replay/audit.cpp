#include "replay/audit.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <iterator>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/codec.h"
#include "core/utf8.h"

namespace odyssey::replay {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr const char* kStatusNames[] = {"in_flight", "complete", "consumed", "withheld", "failed"};
constexpr const char* kRoleNames[] = {"system", "user", "assistant", "tool"};
constexpr const char* kToolStatusNames[] = {"ok",           "tool_error", "malformed_call", "unknown_tool",
                                            "bad_arguments", "timeout",    "crashed"};

template <size_t N>
std::string enum_name(const char* const (&names)[N], uint16_t value) {
  return value < N ? names[value] : fmt::format("unknown({})", value);
}

std::string_view view(capnp::Text::Reader text) { return std::string_view(text.cStr(), text.size()); }
std::string text_of(capnp::Text::Reader text) { return to_valid_utf8(view(text)); }

// Valid UTF-8 with control characters escaped, so stored bytes cannot move the cursor,
// clear the screen or retitle the terminal. Newline and tab stay unless `one_line`.
std::string printable(std::string_view bytes, bool one_line = false) {
  const std::string text = to_valid_utf8(bytes);
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n' && one_line) {
      out += "\\n";
    } else if (c == '\t' && one_line) {
      out += "\\t";
    } else if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
    } else if (c == 0xC2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9F) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned char>(text[i + 1]));  // C1 controls (CSI ...)
      ++i;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

// Every line of `text` behind `prefix`.
std::string indented(std::string_view text, std::string_view prefix) {
  std::string out(prefix);
  for (char c : text) {
    out.push_back(c);
    if (c == '\n') out.append(prefix);
  }
  return out;
}

// Cuts valid UTF-8 `text` to `max_bytes` (0 = no limit) at a character boundary.
bool truncate_utf8(std::string& text, size_t max_bytes) {
  if (max_bytes == 0 || text.size() <= max_bytes) return false;
  text.resize(utf8_prefix_length(text, max_bytes));
  return true;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(units)) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, units[u]);
}

std::string plural(uint64_t n, const char* one, const char* many) { return fmt::format("{} {}", n, n == 1 ? one : many); }

std::string format_age(int64_t nanos) {
  const int64_t s = std::max<int64_t>(nanos, 0) / 1000000000;
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m", s / 60);
  if (s < 86400) return fmt::format("{}h", s / 3600);
  return fmt::format("{}d", s / 86400);
}

std::string versions_range(uint32_t lo, uint32_t hi) {
  return lo == hi ? fmt::format("{}", lo) : fmt::format("{}..{}", lo, hi);
}

std::string image_summary(const AssembledImage& image) {
  return fmt::format("[image {}x{} {}, {} bytes, {} patch tokens]", image.width, image.height,
                     printable(image.media_type, /*one_line=*/true), image.size, image.num_patch_tokens);
}

const AssembledImage* image_at(const AssembledTurn& turn, uint64_t position) {
  for (const auto& image : turn.images)
    if (image.position == position) return &image;
  return nullptr;
}

// Index just past an image's patch tokens and its end token, from the token after its begin.
size_t skip_image_body(const Tokenizer& tokenizer, const std::vector<uint32_t>& ids, size_t i) {
  while (i < ids.size() && tokenizer.special_kind(ids[i]) == SpecialToken::kImagePatch) ++i;
  if (i < ids.size() && tokenizer.special_kind(ids[i]) == SpecialToken::kImageEnd) ++i;
  return i;
}

std::string base64(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(bytes[i])} << 16) |
                       (uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8) | static_cast<uint8_t>(bytes[i + 2]);
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], kAlphabet[v & 63]};
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint32_t{static_cast<uint8_t>(bytes[i])} << 16;
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(bytes[i])} << 16) | (uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8);
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

std::string dump(const ordered_json& j) { return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace); }

// Fits single-line `text` into `width` columns (code points), with "…" when cut.
std::string column(std::string_view text, size_t width, bool right = false) {
  std::string s = printable(text, /*one_line=*/true);
  size_t len = utf8_length(s);
  if (len > width) {
    size_t keep = 0, chars = 0;
    while (keep < s.size() && chars < width - 1) {
      ++keep;
      while (keep < s.size() && (static_cast<uint8_t>(s[keep]) & 0xC0) == 0x80) ++keep;
      ++chars;
    }
    s.resize(keep);
    s += "…";
    len = width;
  }
  const std::string pad(width - len, ' ');
  return right ? pad + s : s + pad;
}

}  // namespace

// --- names and formats ---

std::string trajectory_status_name(schema::TrajectoryStatus status) {
  return enum_name(kStatusNames, static_cast<uint16_t>(status));
}

Result<schema::TrajectoryStatus> parse_trajectory_status(std::string_view text) {
  std::string name(text);
  std::replace(name.begin(), name.end(), '-', '_');
  for (uint16_t i = 0; i < std::size(kStatusNames); ++i)
    if (name == kStatusNames[i]) return static_cast<schema::TrajectoryStatus>(i);
  return invalid_argument("'{}' is not a trajectory status (one of in_flight, complete, consumed, withheld, failed)",
                          printable(text, /*one_line=*/true));
}

std::string role_name(schema::Role role) { return enum_name(kRoleNames, static_cast<uint16_t>(role)); }

std::string tool_status_name(schema::ToolStatus status) {
  return enum_name(kToolStatusNames, static_cast<uint16_t>(status));
}

std::string format_duration(int64_t nanos) {
  if (nanos < 0) return "-" + format_duration(nanos == INT64_MIN ? INT64_MAX : -nanos);
  if (nanos < 1000) return fmt::format("{}ns", nanos);
  if (nanos < 1000000) return fmt::format("{:.1f}us", nanos / 1e3);
  if (nanos < 1000000000) return fmt::format("{:.2f}ms", nanos / 1e6);
  if (nanos < 60 * int64_t{1000000000}) return fmt::format("{:.2f}s", nanos / 1e9);
  const int64_t s = nanos / 1000000000;
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m{:02}s", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}d{:02}h{:02}m", s / 86400, s / 3600 % 24, s / 60 % 60);
}

std::string format_unix_nanos(int64_t unix_nanos) {
  if (unix_nanos == 0) return "-";
  int64_t seconds = unix_nanos / 1000000000, rem = unix_nanos % 1000000000;
  if (rem < 0) {
    rem += 1000000000;
    --seconds;
  }
  const std::time_t t = static_cast<std::time_t>(seconds);
  std::tm tm{};
  if (gmtime_r(&t, &tm) == nullptr) return fmt::format("{}ns since 1970", unix_nanos);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, rem / 1000000);
}

Status render_trajectory(TrajectoryRenderer& renderer, schema::Trajectory::Reader record,
                         const std::vector<schema::Segment::Reader>& segments) {
  ODY_RETURN_IF_ERROR(renderer.begin(record));
  for (auto segment : segments) ODY_RETURN_IF_ERROR(renderer.add(segment));
  return renderer.finish();
}

Status begin_stored_record(TrajectoryRenderer& renderer, std::string_view record_bytes) {
  ODY_ASSIGN_OR_RETURN(auto record, decode_trajectory(record_bytes));
  return renderer.begin(record->getRoot<schema::Trajectory>().asReader());
}

Status add_stored_segment(TrajectoryRenderer& renderer, std::string_view segment_bytes) {
  MessageView view(segment_bytes);
  if (!view.ok()) return view.status().with_context("segment");
  std::optional<schema::Segment::Reader> segment;
  ODY_RETURN_IF_ERROR(guarded("segment", [&]() -> Status {
    segment = view.root<schema::Segment>();
    return Status::Ok();
  }));
  return renderer.add(*segment);
}

// --- show ---

ShowRenderer::ShowRenderer(const Tokenizer& tokenizer, std::ostream& out, ShowOptions options)
    : tokenizer_(tokenizer), out_(out), options_(options), assembler_([&] {
        TurnAssemblyOptions a;
        // Every kept token shows as at least one byte, so this keeps enough for the text.
        if (options.max_turn_bytes != 0) a.max_turn_tokens = options.max_turn_bytes;
        if (options.max_result_bytes != 0) a.max_result_bytes = options.max_result_bytes;
        a.keep_token_details = options.show_token_ids;
        return a;
      }()) {}

Status ShowRenderer::begin(schema::Trajectory::Reader record) {
  std::string header;
  Status st = guarded("trajectory record", [&]() -> Status {
    trajectory_id_ = record.getId();
    record_segments_ = record.getNumSegments();
    record_tokens_ = record.getNumTokens();
    record_in_flight_ = record.getStatus() == schema::TrajectoryStatus::IN_FLIGHT;
    auto line = [&](const char* label, const std::string& value) {
      header += fmt::format("  {:<12} {}\n", label, value.empty() ? "-" : value);
    };
    header += fmt::format("trajectory {}\n", format_trajectory_id(record.getId()));
    line("job", printable(text_of(record.getJob()), true));
    auto env = record.getEnvironment();
    std::string env_text = printable(text_of(env.getName()), true);
    if (env.getVersion().size() > 0) env_text += " " + printable(text_of(env.getVersion()), true);
    if (env.getPluginHash().size() > 0) env_text += fmt::format(" (plugin {})", printable(text_of(env.getPluginHash()), true));
    line("environment", env_text);
    line("task", printable(text_of(record.getTask()), true));
    line("seed", fmt::format("{}", record.getSeed()));
    line("group", record.getGroupSize() > 1 ? fmt::format("{} (size {})", format_trajectory_id(record.getGroupId()),
                                                          record.getGroupSize())
                                            : std::string("none"));
    line("tokenizer", printable(text_of(record.getTokenizer()), true));
    line("writer", printable(text_of(record.getWriter()), true));
    line("status", trajectory_status_name(record.getStatus()));
    if (record.getError().size() > 0) line("error", printable(text_of(record.getError()), true));
    std::string reward = record_in_flight_ ? std::string("- (in flight)") : fmt::format("{:g}", record.getRewardTotal());
    auto parts = record.getRewardParts();
    if (parts.size() > 0) {
      std::vector<std::string> named;
      for (auto p : parts) named.push_back(fmt::format("{} {:g}", printable(text_of(p.getName()), true), p.getValue()));
      reward += fmt::format(" ({})", fmt::join(named, ", "));
    }
    line("reward", reward);
    line("tokens", fmt::format("{} in {}, {} stored", record.getNumTokens(),
                               plural(record.getNumSegments(), "segment", "segments"), format_bytes(record.getNumBytes())));
    line("policy", "versions " + versions_range(record.getMinPolicyVersion(), record.getMaxPolicyVersion()));
    const int64_t started = record.getStartedUnixNanos(), ended = record.getEndedUnixNanos();
    line("started", format_unix_nanos(started));
    if (ended != 0) {
      line("ended", fmt::format("{} (took {})", format_unix_nanos(ended), format_duration(ended - started)));
    } else if (started != 0) {
      const int64_t now = options_.now_unix_nanos != 0 ? options_.now_unix_nanos : unix_nanos_now();
      line("ended", fmt::format("- (running for {})", format_duration(now - started)));
    }
    line("sampled", fmt::format("{}, priority {:g}{}", plural(record.getTimesSampled(), "time", "times"),
                                record.getPriority(),
                                record.getReadySeq() != 0 ? fmt::format(", ready #{}", record.getReadySeq()) : ""));
    return Status::Ok();
  });
  ODY_RETURN_IF_ERROR(st);
  assembler_.reset(trajectory_id_);
  turns_ = calls_ = failed_calls_ = images_ = 0;
  experts_ = ExpertStats{};
  snapshots_ = SnapshotStats{};
  out_ << header;
  return Status::Ok();
}

Status ShowRenderer::add(schema::Segment::Reader segment) {
  ODY_RETURN_IF_ERROR(assembler_.add(segment, [this](AssembledTurn&& turn) { write_turn(std::move(turn)); }));
  // The segment passed validation inside the assembler; these reads stay in bounds.
  return guarded("segment", [&]() -> Status {
    if (segment.hasRoutedExperts()) {
      auto re = segment.getRoutedExperts();
      const uint64_t per_token = uint64_t{re.getNumLayers()} * re.getTopK();
      if (experts_.segments == 0) {
        experts_.num_layers = re.getNumLayers();
        experts_.top_k = re.getTopK();
      } else if (experts_.num_layers != re.getNumLayers() || experts_.top_k != re.getTopK()) {
        experts_.shapes_differ = true;
      }
      ++experts_.segments;
      if (per_token != 0) experts_.tokens += re.getExperts().size() / per_token;
      for (uint16_t e : re.getExperts()) ++experts_.uses[e];
      experts_.total_uses += re.getExperts().size();
    }
    for (auto snap : segment.getStateSnapshots()) {
      SnapshotStats& s = snapshots_;
      if (s.count == 0) {
        s.first_position = s.last_position = snap.getTokenPosition();
        s.min_version = s.max_version = snap.getPolicyVersion();
      }
      ++s.count;
      s.bytes += snap.getData().size();
      s.first_position = std::min<uint64_t>(s.first_position, snap.getTokenPosition());
      s.last_position = std::max<uint64_t>(s.last_position, snap.getTokenPosition());
      s.min_version = std::min(s.min_version, snap.getPolicyVersion());
      s.max_version = std::max(s.max_version, snap.getPolicyVersion());
      std::string format = printable(text_of(snap.getFormat()), true);
      if (std::find(s.formats.begin(), s.formats.end(), format) == s.formats.end() && s.formats.size() < 8)
        s.formats.push_back(std::move(format));
    }
    return Status::Ok();
  });
}

std::string ShowRenderer::turn_text(const AssembledTurn& turn) const {
  const auto& ids = turn.ids;
  std::string text;
  size_t run = 0, i = 0;
  auto flush = [&](size_t end) {
    if (end > run) text += tokenizer_.decode(ids.data() + run, end - run);
  };
  while (i < ids.size()) {
    const auto kind = tokenizer_.special_kind(ids[i]);
    if (kind != SpecialToken::kImage && kind != SpecialToken::kImagePatch) {
      ++i;
      continue;
    }
    flush(i);
    if (kind == SpecialToken::kImage) {
      const AssembledImage* image = image_at(turn, turn.start + i);
      if (image != nullptr) {
        text += image_summary(*image);
        i = skip_image_body(tokenizer_, ids, i + 1);
      } else {
        text += tokenizer_.token_text(ids[i]);
        ++i;
      }
    } else {  // a run of patch tokens, shown once with its length
      size_t j = i;
      while (j < ids.size() && tokenizer_.special_kind(ids[j]) == SpecialToken::kImagePatch) ++j;
      text += tokenizer_.token_text(ids[i]);
      if (j - i > 1) text += fmt::format(" x {}", j - i);
      i = j;
    }
    run = i;
  }
  flush(ids.size());
  return text;
}

void ShowRenderer::write_call(const AssembledToolCall& call) {
  ++calls_;
  if (call.status != schema::ToolStatus::OK) ++failed_calls_;
  std::string out = fmt::format("    tool call {} {}: {}, {}\n", printable(call.call_id, true),
                                printable(call.name, true), tool_status_name(call.status),
                                format_duration(call.wall_time_nanos));
  std::string arguments = to_valid_utf8(call.arguments);
  const bool cut_arguments = truncate_utf8(arguments, options_.max_result_bytes);
  out += fmt::format("      arguments: {}{}\n", printable(arguments, true),
                     cut_arguments ? fmt::format(" ... [{} bytes in all]", call.arguments.size()) : "");
  if (!call.error.empty()) out += fmt::format("      error: {}\n", printable(call.error, true));
  std::string result = to_valid_utf8(call.result);
  const bool cut_result = truncate_utf8(result, options_.max_result_bytes) || call.result.size() < call.result_size;
  const std::string size = cut_result ? fmt::format("{} bytes, first {} shown", call.result_size, result.size())
                                      : plural(call.result_size, "byte", "bytes");
  if (result.find('\n') == std::string::npos && result.size() <= 100)
    out += fmt::format("      result ({}): {}\n", size, printable(result));
  else
    out += fmt::format("      result ({}):\n{}\n", size, indented(printable(result), "        "));
  out_ << out;
}

void ShowRenderer::write_turn(AssembledTurn&& turn) {
  const uint64_t index = turns_++;
  const std::string seqs = turn.first_seq == turn.last_seq ? fmt::format("seq {}", turn.first_seq)
                                                           : fmt::format("seq {}-{}", turn.first_seq, turn.last_seq);
  if (turn.synthetic) {
    out_ << fmt::format("\n[{}] tool calls outside any assistant turn, at token {} ({})\n", index, turn.start, seqs);
  } else {
    images_ += turn.images.size();
    out_ << fmt::format("\n[{}] {}  tokens {}..{} ({}, {})\n", index, role_name(turn.role), turn.start,
                        turn.start + turn.num_tokens, turn.num_tokens, seqs);
    std::string text = turn_text(turn);
    const bool cut = truncate_utf8(text, options_.max_turn_bytes);
    out_ << indented(printable(text), "    ") << "\n";
    if (cut || turn.ids.size() < turn.num_tokens)
      out_ << fmt::format("    ... [cut at {} bytes; the turn has {}]\n", options_.max_turn_bytes,
                          plural(turn.num_tokens, "token", "tokens"));
    if (options_.show_token_ids) {
      for (size_t i = 0; i < turn.ids.size(); ++i) {
        out_ << fmt::format("      {:>8}  {:>6}  {:<18} lp {:>9.4f}  v{}  mask {}\n", turn.start + i, turn.ids[i],
                            printable(tokenizer_.token_text(turn.ids[i]), true), turn.logprobs[i],
                            turn.policy_versions[i], int(turn.loss_mask[i]));
      }
    }
  }
  for (const auto& call : turn.calls) write_call(call);
}

Status ShowRenderer::finish() {
  assembler_.finish([this](AssembledTurn&& turn) { write_turn(std::move(turn)); });
  std::string out = "\n";
  out += fmt::format("summary: {}, {} ({} not ok), {}, {} outside any turn\n", plural(turns_, "turn", "turns"),
                     plural(calls_, "tool call", "tool calls"), failed_calls_, plural(images_, "image", "images"),
                     plural(assembler_.tokens_outside_turns(), "token", "tokens"));
  if (snapshots_.count > 0) {
    out += fmt::format("state snapshots: {}, {}, at tokens {}..{}, policy versions {}, format {}\n", snapshots_.count,
                       format_bytes(snapshots_.bytes), snapshots_.first_position, snapshots_.last_position,
                       versions_range(snapshots_.min_version, snapshots_.max_version),
                       fmt::join(snapshots_.formats, ", "));
  } else {
    out += "state snapshots: none\n";
  }
  if (experts_.segments > 0) {
    std::vector<std::pair<uint16_t, uint64_t>> ranked(experts_.uses.begin(), experts_.uses.end());
    std::sort(ranked.begin(), ranked.end(),
              [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
    std::vector<std::string> top;
    for (size_t i = 0; i < std::min<size_t>(3, ranked.size()); ++i)
      top.push_back(fmt::format("{} ({:.1f}%)", ranked[i].first, 100.0 * ranked[i].second / experts_.total_uses));
    out += fmt::format("routed experts: {} of {} tokens, {} layers x top-{}{}, {} distinct experts{}{}\n", experts_.tokens,
                       assembler_.tokens_read(), experts_.num_layers, experts_.top_k,
                       experts_.shapes_differ ? " (shapes differ between segments)" : "", ranked.size(),
                       top.empty() ? "" : "; most used: ", fmt::join(top, ", "));
  } else {
    out += "routed experts: not recorded\n";
  }
  if (!record_in_flight_ &&
      (assembler_.segments_read() != record_segments_ || assembler_.tokens_read() != record_tokens_)) {
    out += fmt::format("note: the record counts {} segments and {} tokens; {} segments and {} tokens were read\n",
                       record_segments_, record_tokens_, assembler_.segments_read(), assembler_.tokens_read());
  }
  for (const auto& note : assembler_.notes()) out += fmt::format("note: {}\n", note);
  out_ << out;
  out_.flush();
  return out_ ? Status::Ok() : Status(StatusCode::kIo, "writing the trajectory view failed");
}

// --- export ---

namespace {

// The OpenAI content of a turn: its text without layout tokens and tool-call spans; a
// string, or an array of text and image parts when images are inlined.
ordered_json message_content(const Tokenizer& tokenizer, const AssembledTurn& turn, bool inline_images) {
  const auto& ids = turn.ids;
  std::string text;
  ordered_json parts = ordered_json::array();
  size_t run = 0, i = 0;
  auto flush = [&](size_t end) {
    if (end > run) text += tokenizer.decode(ids.data() + run, end - run);
  };
  while (i < ids.size()) {
    const auto kind = tokenizer.special_kind(ids[i]);
    if (!kind) {
      ++i;
      continue;
    }
    flush(i);
    ++i;
    if (*kind == SpecialToken::kToolCall) {
      while (i < ids.size() && tokenizer.special_kind(ids[i]) != SpecialToken::kToolCallEnd) ++i;
      if (i < ids.size()) ++i;
    } else if (*kind == SpecialToken::kImage) {
      const AssembledImage* image = image_at(turn, turn.start + i - 1);
      if (image != nullptr && inline_images && !image->data.empty()) {
        if (!text.empty()) parts.push_back({{"type", "text"}, {"text", std::move(text)}});
        text.clear();
        parts.push_back({{"type", "image_url"},
                         {"image_url", {{"url", fmt::format("data:{};base64,{}", to_valid_utf8(image->media_type),
                                                            base64(image->data))}}}});
      } else {
        text += image != nullptr ? image_summary(*image) : std::string("[image]");
      }
      i = skip_image_body(tokenizer, ids, i);
    }
    // Every other framework token is layout (role headers, turn ends, brackets): dropped.
    run = i;
  }
  flush(ids.size());
  if (parts.empty()) return text;
  if (!text.empty()) parts.push_back({{"type", "text"}, {"text", std::move(text)}});
  return parts;
}

template <typename T, typename Write>
void write_array(std::string& out, const char* name, const std::vector<T>& values, Write write) {
  out += fmt::format("\"{}\":[", name);
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out.push_back(',');
    write(out, values[i]);
  }
  out.push_back(']');
}

}  // namespace

ChatJsonlRenderer::ChatJsonlRenderer(const Tokenizer& tokenizer, std::ostream& out, ExportOptions options)
    : tokenizer_(tokenizer), out_(out), options_(options), assembler_([&] {
        TurnAssemblyOptions a;
        a.keep_image_data = options.inline_images;
        return a;
      }()) {}

Status ChatJsonlRenderer::begin(schema::Trajectory::Reader record) {
  begun_ = false;
  turns_.clear();
  ids_.clear();
  logprobs_.clear();
  policy_versions_.clear();
  loss_mask_.clear();
  ordered_json head;
  uint64_t id = 0;
  ODY_RETURN_IF_ERROR(guarded("trajectory record", [&]() -> Status {
    id = record.getId();
    head["id"] = format_trajectory_id(id);
    head["job"] = text_of(record.getJob());
    auto env = record.getEnvironment();
    head["environment"] = {{"name", text_of(env.getName())},
                           {"version", text_of(env.getVersion())},
                           {"plugin_hash", text_of(env.getPluginHash())}};
    head["task"] = text_of(record.getTask());
    head["seed"] = record.getSeed();
    head["group_id"] = format_trajectory_id(record.getGroupId());
    head["group_size"] = record.getGroupSize();
    head["tokenizer"] = text_of(record.getTokenizer());
    head["writer"] = text_of(record.getWriter());
    head["status"] = trajectory_status_name(record.getStatus());
    head["reward"] = record.getRewardTotal();
    ordered_json parts = ordered_json::object();
    for (auto p : record.getRewardParts()) parts[text_of(p.getName())] = p.getValue();
    head["reward_parts"] = std::move(parts);
    if (record.getError().size() > 0) head["error"] = text_of(record.getError());
    return Status::Ok();
  }));
  head_ = dump(head);
  assembler_.reset(id);
  begun_ = true;
  return Status::Ok();
}

Status ChatJsonlRenderer::add(schema::Segment::Reader segment) {
  if (!begun_) return Status(StatusCode::kFailedPrecondition, "export: add() before a successful begin()");
  Status added = assembler_.add(segment, [this](AssembledTurn&& turn) { turns_.push_back(std::move(turn)); });
  if (!added.ok()) {
    begun_ = false;  // this trajectory's line is never written
    return added;
  }
  if (!options_.include_tokens) return Status::Ok();
  // Validated by the assembler: the per-token lists have the same length.
  return guarded("segment", [&]() -> Status {
    for (uint32_t t : segment.getTokens()) ids_.push_back(t);
    for (float lp : segment.getLogprobs()) logprobs_.push_back(lp);
    for (uint32_t v : segment.getPolicyVersions()) policy_versions_.push_back(v);
    auto mask = segment.getLossMask();
    loss_mask_.insert(loss_mask_.end(), mask.begin(), mask.end());
    return Status::Ok();
  });
}

Status ChatJsonlRenderer::finish() {
  if (!begun_) return Status(StatusCode::kFailedPrecondition, "export: finish() before a successful begin()");
  begun_ = false;
  assembler_.finish([this](AssembledTurn&& turn) { turns_.push_back(std::move(turn)); });

  // Number the calls, and find the tool turn that holds each call's result.
  struct CallRef {
    const AssembledToolCall* call;
    std::string id;
  };
  std::vector<std::vector<CallRef>> results_in(turns_.size()), results_after(turns_.size());
  std::vector<size_t> tool_turns;  // indexes of tool turns, in token order
  for (size_t t = 0; t < turns_.size(); ++t)
    if (!turns_[t].synthetic && turns_[t].role == schema::Role::TOOL) tool_turns.push_back(t);
  std::vector<std::vector<std::string>> call_ids(turns_.size());
  size_t numbered = 0;
  for (size_t t = 0; t < turns_.size(); ++t) {
    for (const auto& call : turns_[t].calls) {
      std::string id = call.call_id.empty() ? fmt::format("call_{}", numbered) : to_valid_utf8(call.call_id);
      ++numbered;
      call_ids[t].push_back(id);
      auto after = std::upper_bound(tool_turns.begin(), tool_turns.end(), call.result_position,
                                    [&](uint64_t pos, size_t k) { return pos < turns_[k].start; });
      const bool in_tool_turn = after != tool_turns.begin() && *(after - 1) > t &&
                                call.result_position < turns_[*(after - 1)].start + turns_[*(after - 1)].num_tokens;
      (in_tool_turn ? results_in[*(after - 1)] : results_after[t]).push_back({&call, std::move(id)});
    }
  }

  auto tool_message = [](const CallRef& ref) {
    ordered_json m = {{"role", "tool"},
                      {"tool_call_id", ref.id},
                      {"name", to_valid_utf8(ref.call->name)},
                      {"content", to_valid_utf8(ref.call->result)},
                      {"status", tool_status_name(ref.call->status)}};
    if (!ref.call->error.empty()) m["error"] = to_valid_utf8(ref.call->error);
    return m;
  };
  ordered_json messages = ordered_json::array();
  for (size_t t = 0; t < turns_.size(); ++t) {
    const AssembledTurn& turn = turns_[t];
    if (turn.role == schema::Role::TOOL && !turn.synthetic && !results_in[t].empty()) {
      for (const auto& ref : results_in[t]) messages.push_back(tool_message(ref));
      continue;
    }
    ordered_json m = {{"role", role_name(turn.role)},
                      {"content", message_content(tokenizer_, turn, options_.inline_images)}};
    if (!turn.calls.empty()) {
      ordered_json calls = ordered_json::array();
      for (size_t c = 0; c < turn.calls.size(); ++c) {
        calls.push_back({{"id", call_ids[t][c]},
                         {"type", "function"},
                         {"function", {{"name", to_valid_utf8(turn.calls[c].name)},
                                       {"arguments", to_valid_utf8(turn.calls[c].arguments)}}}});
      }
      m["tool_calls"] = std::move(calls);
    }
    messages.push_back(std::move(m));
    for (const auto& ref : results_after[t]) messages.push_back(tool_message(ref));
  }

  std::string line = head_;
  line.pop_back();  // the head's closing brace
  line += ",\"messages\":";
  line += dump(messages);
  if (options_.include_tokens) {
    line += ",\"tokens\":{";
    auto integer = [](std::string& out, auto v) { fmt::format_to(std::back_inserter(out), "{}", +v); };
    write_array(line, "ids", ids_, integer);
    line.push_back(',');
    write_array(line, "logprobs", logprobs_, [](std::string& out, float v) {
      if (std::isfinite(v)) fmt::format_to(std::back_inserter(out), "{}", v);
      else out += "null";
    });
    line.push_back(',');
    write_array(line, "policy_versions", policy_versions_, integer);
    line.push_back(',');
    write_array(line, "loss_mask", loss_mask_, integer);
    line.push_back('}');
  }
  line += "}\n";
  turns_.clear();
  out_.write(line.data(), static_cast<std::streamsize>(line.size()));
  out_.flush();
  return out_ ? Status::Ok() : Status(StatusCode::kIo, "writing the exported trajectory failed");
}

// --- ls ---

bool TrajectoryFilter::matches(schema::Trajectory::Reader record) const {
  bool match = false;
  Status st = guarded("trajectory record", [&]() -> Status {
    if (job && view(record.getJob()) != *job) return Status::Ok();
    if (environment && view(record.getEnvironment().getName()) != *environment) return Status::Ok();
    if (!statuses.empty() && std::find(statuses.begin(), statuses.end(), record.getStatus()) == statuses.end())
      return Status::Ok();
    if (reward_min || reward_max) {
      if (record.getStatus() == schema::TrajectoryStatus::IN_FLIGHT) return Status::Ok();
      if (reward_min && !(record.getRewardTotal() >= *reward_min)) return Status::Ok();
      if (reward_max && !(record.getRewardTotal() <= *reward_max)) return Status::Ok();
    }
    if (version_min && record.getMinPolicyVersion() < *version_min) return Status::Ok();
    if (version_max && record.getMaxPolicyVersion() > *version_max) return Status::Ok();
    match = true;
    return Status::Ok();
  });
  return st.ok() && match;
}

namespace {

Result<double> parse_bound(const char* option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    return invalid_argument("{} '{}' is not a number (e.g. 0.5, -1, 1e-3)", option, printable(text, true));
  return v;
}

Result<uint32_t> parse_version(const char* option, const std::string& text) {
  uint64_t v = 0;
  bool ok = !text.empty() && text.size() <= 10;
  for (char c : text) {
    if (c < '0' || c > '9') ok = false;
    else v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (!ok || v > UINT32_MAX)
    return invalid_argument("{} '{}' is not a policy version (a whole number from 0 to {})", option,
                            printable(text, true), UINT32_MAX);
  return static_cast<uint32_t>(v);
}

}  // namespace

Result<TrajectoryFilter> parse_filter(const TrajectoryFilterArgs& args) {
  TrajectoryFilter f;
  if (!args.job.empty()) f.job = args.job;
  if (!args.environment.empty()) f.environment = args.environment;
  if (!args.status.empty()) {
    size_t from = 0;
    while (from <= args.status.size()) {
      const size_t comma = std::min(args.status.find(',', from), args.status.size());
      auto status = parse_trajectory_status(std::string_view(args.status).substr(from, comma - from));
      if (!status.ok()) return status.status().with_context("--status");
      f.statuses.push_back(*status);
      from = comma + 1;
    }
  }
  if (!args.reward_min.empty()) {
    ODY_ASSIGN_OR_RETURN(f.reward_min, parse_bound("--reward-min", args.reward_min));
  }
  if (!args.reward_max.empty()) {
    ODY_ASSIGN_OR_RETURN(f.reward_max, parse_bound("--reward-max", args.reward_max));
  }
  if (f.reward_min && f.reward_max && *f.reward_min > *f.reward_max)
    return invalid_argument("--reward-min {:g} is above --reward-max {:g}", *f.reward_min, *f.reward_max);
  if (!args.version_min.empty()) {
    ODY_ASSIGN_OR_RETURN(f.version_min, parse_version("--version-min", args.version_min));
  }
  if (!args.version_max.empty()) {
    ODY_ASSIGN_OR_RETURN(f.version_max, parse_version("--version-max", args.version_max));
  }
  if (f.version_min && f.version_max && *f.version_min > *f.version_max)
    return invalid_argument("--version-min {} is above --version-max {}", *f.version_min, *f.version_max);
  return f;
}

namespace {

// Column widths of `ls`, shared by the header and the rows.
constexpr size_t kIdWidth = 16, kStatusWidth = 9, kEnvWidth = 20, kTaskWidth = 24, kRewardWidth = 8,
                 kTokensWidth = 9, kSegmentsWidth = 5, kVersionsWidth = 9, kAgeWidth = 5;

std::string ls_line(std::string_view id, std::string_view status, std::string_view env, std::string_view task,
                    std::string_view reward, std::string_view tokens, std::string_view segments,
                    std::string_view versions, std::string_view age) {
  return fmt::format("{}  {}  {}  {}  {}  {}  {}  {}  {}", column(id, kIdWidth), column(status, kStatusWidth),
                     column(env, kEnvWidth), column(task, kTaskWidth), column(reward, kRewardWidth, true),
                     column(tokens, kTokensWidth, true), column(segments, kSegmentsWidth, true),
                     column(versions, kVersionsWidth), column(age, kAgeWidth, true));
}

}  // namespace

std::string format_ls_header() {
  return ls_line("ID", "STATUS", "ENV", "TASK", "REWARD", "TOKENS", "SEGS", "VERSIONS", "AGE");
}

std::string format_ls_row(schema::Trajectory::Reader record, int64_t now_unix_nanos) {
  std::string row;
  uint64_t id = 0;
  Status st = guarded("trajectory record", [&]() -> Status {
    id = record.getId();
    auto env = record.getEnvironment();
    std::string env_text = text_of(env.getName());
    if (env.getVersion().size() > 0) env_text += "@" + text_of(env.getVersion());
    const bool in_flight = record.getStatus() == schema::TrajectoryStatus::IN_FLIGHT;
    const int64_t started = record.getStartedUnixNanos();
    row = ls_line(format_trajectory_id(id), trajectory_status_name(record.getStatus()), env_text,
                  text_of(record.getTask()), in_flight ? std::string("-") : fmt::format("{:.4g}", record.getRewardTotal()),
                  fmt::format("{}", record.getNumTokens()), fmt::format("{}", record.getNumSegments()),
                  versions_range(record.getMinPolicyVersion(), record.getMaxPolicyVersion()),
                  started != 0 ? format_age(now_unix_nanos - started) : std::string("-"));
    return Status::Ok();
  });
  if (!st.ok()) return fmt::format("{}  malformed record: {}", format_trajectory_id(id), st.message());
  return row;
}

}  // namespace odyssey::replay
