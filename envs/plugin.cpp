// Loading environment plugins and running them in this process (envs/plugin.h).
#include "envs/plugin.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "envs/json_schema.h"

namespace odyssey::envs {
namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "libody_env_";
constexpr const char* kSuffix = ".so";

bool valid_plugin_name(const char* name) {
  if (name == nullptr || *name == '\0') return false;
  for (const char* p = name; *p; ++p) {
    const char c = *p;
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
  }
  return true;
}

// MCP's rule for tool names: 1-128 of [A-Za-z0-9_.-] (OpenAI's is the same without '.').
bool valid_tool_name(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
  });
}

Result<std::string> hash_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_status(StatusCode::kIo, "plugin {}: cannot read the file to hash it", path);
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  char buffer[1 << 16];
  while (in) {
    in.read(buffer, sizeof(buffer));
    XXH3_128bits_update(&state, buffer, static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) return make_status(StatusCode::kIo, "plugin {}: error while reading the file to hash it", path);
  const XXH128_hash_t h = XXH3_128bits_digest(&state);
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);  // XXH128's canonical (big-endian) form
}

// ---- Copying the plugin's C values into SDK types --------------------------------------------

// The plugin's strings are (data, size); a null pointer with a size is a plugin bug.
Status copy_string(ody_env_string s, const char* what, std::string* out) {
  if (s.size == 0) {
    out->clear();
    return Status::Ok();
  }
  if (s.data == nullptr) return Status(StatusCode::kInternal, fmt::format("{} has size {} but no data", what, s.size));
  out->assign(s.data, s.size);
  return Status::Ok();
}

template <class T>
Status check_array(const T* data, uint32_t count, const char* what) {
  if (count > 0 && data == nullptr)
    return Status(StatusCode::kInternal, fmt::format("{} count is {} but the array is null", what, count));
  return Status::Ok();
}

Status copy_info(ody_env_string s, const char* what, nlohmann::json* out) {
  std::string text;
  ODY_RETURN_IF_ERROR(copy_string(s, what, &text));
  if (text.empty()) {
    *out = nlohmann::json::object();
    return Status::Ok();
  }
  *out = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded() || !out->is_object())
    return Status(StatusCode::kInternal, fmt::format("{} is not a JSON object", what));
  return Status::Ok();
}

Status copy_parts(const ody_env_reward_part* parts, uint32_t count, const char* what,
                  std::vector<env::RewardPart>* out) {
  ODY_RETURN_IF_ERROR(check_array(parts, count, what));
  out->clear();
  for (uint32_t i = 0; i < count; ++i) {
    env::RewardPart part;
    ODY_RETURN_IF_ERROR(copy_string(parts[i].name, what, &part.name));
    part.value = parts[i].value;
    out->push_back(std::move(part));
  }
  return Status::Ok();
}

Status copy_observation(const ody_env_observation& in, env::Observation* out) {
  ODY_RETURN_IF_ERROR(copy_string(in.text, "observation text", &out->text));
  ODY_RETURN_IF_ERROR(check_array(in.tool_results, in.tool_result_count, "tool_result"));
  for (uint32_t i = 0; i < in.tool_result_count; ++i) {
    env::ToolResult r;
    ODY_RETURN_IF_ERROR(copy_string(in.tool_results[i].call_id, "tool result call_id", &r.call_id));
    ODY_RETURN_IF_ERROR(copy_string(in.tool_results[i].content, "tool result content", &r.content));
    r.is_error = in.tool_results[i].is_error != 0;
    out->tool_results.push_back(std::move(r));
  }
  ODY_RETURN_IF_ERROR(check_array(in.images, in.image_count, "image"));
  for (uint32_t i = 0; i < in.image_count; ++i) {
    const ody_env_image& im = in.images[i];
    if (im.format != ODY_ENV_IMAGE_RGB8 && im.format != ODY_ENV_IMAGE_PNG)
      return Status(StatusCode::kInternal, fmt::format("image {} has unknown format {}", i, int(im.format)));
    if (im.format == ODY_ENV_IMAGE_RGB8 && im.size != uint64_t(im.width) * im.height * 3)
      return Status(StatusCode::kInternal, fmt::format("RGB8 image {} is {}x{} but has {} bytes (expected {})", i,
                                                       im.width, im.height, im.size, uint64_t(im.width) * im.height * 3));
    if (im.size > 0 && im.data == nullptr)
      return Status(StatusCode::kInternal, fmt::format("image {} has size {} but no data", i, im.size));
    env::Image image;
    image.format = im.format;
    image.width = im.width;
    image.height = im.height;
    image.data.assign(im.data, im.data + im.size);
    out->images.push_back(std::move(image));
  }
  ODY_RETURN_IF_ERROR(copy_parts(in.rewards, in.reward_count, "reward part", &out->rewards));
  out->done = in.done != 0;
  return copy_info(in.info_json, "observation info_json", &out->info);
}

StatusCode status_code_for(ody_env_status s) {
  switch (s) {
    case ODY_ENV_ERR_INVALID_CONFIG:
    case ODY_ENV_ERR_INVALID_TASK:
    case ODY_ENV_ERR_INVALID_ACTION:
      return StatusCode::kInvalidArgument;
    case ODY_ENV_ERR_UNSUPPORTED:
      return StatusCode::kFailedPrecondition;
    default:
      return StatusCode::kInternal;
  }
}

const char* status_name(ody_env_status s) {
  switch (s) {
    case ODY_ENV_OK: return "ok";
    case ODY_ENV_ERR_INVALID_CONFIG: return "invalid config";
    case ODY_ENV_ERR_INVALID_TASK: return "invalid task";
    case ODY_ENV_ERR_INVALID_ACTION: return "invalid action";
    case ODY_ENV_ERR_UNSUPPORTED: return "unsupported";
    case ODY_ENV_ERR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

// The plugin's message, which it may have left unterminated or empty.
std::string error_text(const ody_env_error& err) {
  const char* end = static_cast<const char*>(std::memchr(err.message, '\0', sizeof(err.message)));
  std::string text(err.message, end == nullptr ? sizeof(err.message) : size_t(end - err.message));
  return text.empty() ? "(no message)" : text;
}

// ---- The in-process session -------------------------------------------------------------------

class InProcessSession final : public EnvSession {
 public:
  InProcessSession(std::shared_ptr<Plugin> plugin, std::string config, ody_env* instance)
      : plugin_(std::move(plugin)), table_(plugin_->table()), config_(std::move(config)), instance_(instance) {}
  ~InProcessSession() override {
    if (instance_ != nullptr) table_.destroy(instance_);
  }

  const EnvInfo& info() const override { return plugin_->info(); }

  Result<env::Observation> reset(const nlohmann::json& task, uint64_t seed) override {
    if (!task.is_object()) return invalid_argument("plugin '{}' reset: the task must be a JSON object", name());
    // An instance that failed with an internal error is replaced before it is used again.
    if (instance_ == nullptr) ODY_RETURN_IF_ERROR(recreate());
    const std::string text = task.dump();
    ody_env_observation obs{};
    ody_env_error err{};
    const ody_env_status s = table_.reset(instance_, {text.data(), text.size()}, seed, &obs, &err);
    return take_observation(s, obs, err, "reset", nullptr);
  }

  Result<env::Observation> step(const env::Action& action) override {
    ODY_RETURN_IF_ERROR(usable("step"));
    std::vector<std::string> arguments;
    arguments.reserve(action.tool_calls.size());
    std::vector<ody_env_tool_call> calls;
    for (const env::ToolCall& call : action.tool_calls) {
      if (!call.arguments.is_object())
        return invalid_argument("plugin '{}' step: arguments of call '{}' ({}) must be a JSON object", name(), call.id,
                                call.name);
      arguments.push_back(call.arguments.dump());
      calls.push_back({{call.id.data(), call.id.size()},
                       {call.name.data(), call.name.size()},
                       {arguments.back().data(), arguments.back().size()}});
    }
    ody_env_action a{};
    a.text = {action.text.data(), action.text.size()};
    a.tool_calls = calls.data();
    a.tool_call_count = static_cast<uint32_t>(calls.size());
    ody_env_observation obs{};
    ody_env_error err{};
    const ody_env_status s = table_.step(instance_, &a, &obs, &err);
    return take_observation(s, obs, err, "step", &action);
  }

  Result<env::Score> score() override {
    ODY_RETURN_IF_ERROR(usable("score"));
    ody_env_score sc{};
    ody_env_error err{};
    const ody_env_status s = table_.score(instance_, &sc, &err);
    if (s != ODY_ENV_OK) return failure(s, err, "score");
    env::Score out;
    out.reward = sc.reward;
    out.success = sc.success != 0;
    Status copied = copy_parts(sc.parts, sc.part_count, "score part", &out.parts);
    if (copied.ok()) copied = copy_info(sc.info_json, "score info_json", &out.info);
    table_.free_score(instance_, &sc);
    if (!copied.ok()) return broken(copied, "score");
    return out;
  }

  Result<std::string> snapshot() override {
    if (!info().snapshots)
      return make_status(StatusCode::kFailedPrecondition, "plugin '{}' does not offer snapshots", name());
    ODY_RETURN_IF_ERROR(usable("snapshot"));
    ody_env_buffer buffer{};
    ody_env_error err{};
    const ody_env_status s = table_.snapshot(instance_, &buffer, &err);
    if (s != ODY_ENV_OK) return failure(s, err, "snapshot");
    if (buffer.size > 0 && buffer.data == nullptr) {
      table_.free_buffer(instance_, &buffer);
      return broken(Status(StatusCode::kInternal, fmt::format("snapshot has size {} but no data", buffer.size)),
                    "snapshot");
    }
    std::string bytes(reinterpret_cast<const char*>(buffer.data), buffer.size);
    table_.free_buffer(instance_, &buffer);
    return bytes;
  }

  Status restore(std::string_view bytes) override {
    if (!info().snapshots)
      return make_status(StatusCode::kFailedPrecondition, "plugin '{}' does not offer snapshots", name());
    if (instance_ == nullptr) ODY_RETURN_IF_ERROR(recreate());
    ody_env_error err{};
    const ody_env_status s = table_.restore(instance_, {bytes.data(), bytes.size()}, &err);
    if (s != ODY_ENV_OK) return failure(s, err, "restore");
    return Status::Ok();
  }

 private:
  const std::string& name() const { return plugin_->info().name; }

  Status usable(const char* call) const {
    if (instance_ == nullptr)
      return make_status(StatusCode::kFailedPrecondition,
                         "plugin '{}' {}: the instance failed with an internal error; reset it first", name(), call);
    return Status::Ok();
  }

  Status recreate() {
    ody_env* fresh = nullptr;
    ody_env_error err{};
    const ody_env_status s = table_.create({config_.data(), config_.size()}, &fresh, &err);
    if (s != ODY_ENV_OK) return failure(s, err, "create");
    if (fresh == nullptr)
      return make_status(StatusCode::kInternal, "plugin '{}' create: returned OK but no instance", name());
    instance_ = fresh;
    return Status::Ok();
  }

  // A failed call: the plugin's status and message, naming the plugin and the call. After an
  // internal error the instance is destroyed (env.h: "the instance should be destroyed").
  Status failure(ody_env_status s, const ody_env_error& err, const char* call) {
    Status status(status_code_for(s),
                  fmt::format("plugin '{}' {}: {}: {}", name(), call, status_name(s), error_text(err)));
    if (status.code() == StatusCode::kInternal) drop_instance();
    return status;
  }
  // The plugin returned OK with values that break the ABI's rules.
  Status broken(const Status& what, const char* call) {
    drop_instance();
    return Status(StatusCode::kInternal, fmt::format("plugin '{}' {}: {}", name(), call, what.message()));
  }
  void drop_instance() {
    if (instance_ != nullptr) table_.destroy(instance_);
    instance_ = nullptr;
  }

  Result<env::Observation> take_observation(ody_env_status s, ody_env_observation& obs, const ody_env_error& err,
                                            const char* call, const env::Action* action) {
    if (s != ODY_ENV_OK) return failure(s, err, call);
    env::Observation out;
    Status copied = copy_observation(obs, &out);
    table_.free_observation(instance_, &obs);
    if (copied.ok() && action != nullptr) copied = check_answers(*action, out);
    if (!copied.ok()) return broken(copied, call);
    return out;
  }

  // One tool result per call, in the order of the calls (env.h).
  static Status check_answers(const env::Action& action, const env::Observation& obs) {
    if (obs.tool_results.size() != action.tool_calls.size())
      return Status(StatusCode::kInternal, fmt::format("returned {} tool results for {} tool calls",
                                                       obs.tool_results.size(), action.tool_calls.size()));
    for (size_t i = 0; i < obs.tool_results.size(); ++i) {
      if (obs.tool_results[i].call_id != action.tool_calls[i].id)
        return Status(StatusCode::kInternal, fmt::format("tool result {} answers call '{}', expected '{}'", i,
                                                         obs.tool_results[i].call_id, action.tool_calls[i].id));
    }
    return Status::Ok();
  }

  std::shared_ptr<Plugin> plugin_;
  const ody_env_plugin& table_;
  std::string config_;
  ody_env* instance_;
};

// ---- Discovery ---------------------------------------------------------------------------------

std::string executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

std::vector<std::string> search_dirs(const std::vector<std::string>& extra_dirs) {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("ODYSSEY_ENV_PATH")) {
    std::stringstream ss(env);
    std::string dir;
    while (std::getline(ss, dir, ':'))
      if (!dir.empty()) dirs.push_back(dir);
  }
  dirs.insert(dirs.end(), extra_dirs.begin(), extra_dirs.end());
  const std::string exe_dir = executable_dir();
  if (!exe_dir.empty()) dirs.push_back((fs::path(exe_dir) / ".." / "envs" / "plugins").lexically_normal().string());
#ifdef ODYSSEY_PLUGIN_DIR
  dirs.push_back(ODYSSEY_PLUGIN_DIR);
#endif
  // The same directory named twice is searched once.
  std::vector<std::string> unique;
  std::set<std::string> seen;
  for (const std::string& dir : dirs) {
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(dir, ec);
    if (seen.insert(ec ? dir : canonical.string()).second) unique.push_back(dir);
  }
  return unique;
}

bool is_plain_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

// ---- Plugin ------------------------------------------------------------------------------------

Result<std::vector<ToolSpec>> parse_tools(const nlohmann::json& tools, const std::string& where) {
  if (!tools.is_array()) return invalid_argument("{}: tools must be a JSON array, got {}", where, tools.type_name());
  std::vector<ToolSpec> specs;
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const nlohmann::json& t = tools[i];
    if (!t.is_object()) return invalid_argument("{}: tool {} must be a JSON object, got {}", where, i, t.type_name());
    auto name = t.find("name");
    if (name == t.end() || !name->is_string())
      return invalid_argument("{}: tool {} needs a \"name\" string", where, i);
    ToolSpec spec;
    spec.name = name->get<std::string>();
    if (!valid_tool_name(spec.name))
      return invalid_argument("{}: tool {} has name '{}'; a tool name is 1-128 of [A-Za-z0-9_.-]", where, i, spec.name);
    const std::string tool_where = fmt::format("{}: tool '{}'", where, spec.name);
    if (!names.insert(spec.name).second) return invalid_argument("{}: the name is used by two tools", tool_where);
    if (auto d = t.find("description"); d != t.end()) {
      if (!d->is_string()) return invalid_argument("{}: \"description\" must be a string", tool_where);
      spec.description = d->get<std::string>();
    }
    auto schema = t.find("input_schema");
    const char* schema_key = "input_schema";
    if (schema == t.end()) {
      schema = t.find("parameters");  // OpenAI's name for it
      schema_key = "parameters";
    }
    if (schema == t.end()) return invalid_argument("{}: needs an \"input_schema\" (a JSON Schema object)", tool_where);
    if (!schema->is_object())
      return invalid_argument("{}: \"{}\" must be a JSON Schema object, got {}", tool_where, schema_key,
                              schema->type_name());
    auto type = schema->find("type");
    if (type == schema->end() || *type != "object")
      return invalid_argument("{}: \"{}\" must have \"type\": \"object\" (tool arguments are a JSON object)",
                              tool_where, schema_key);
    auto compiled = JsonSchema::compile(*schema, fmt::format("{}: \"{}\"", tool_where, schema_key));
    if (!compiled.ok()) return compiled.status();
    spec.input_schema = *schema;
    specs.push_back(std::move(spec));
  }
  return specs;
}

Result<std::shared_ptr<Plugin>> Plugin::load(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return make_status(StatusCode::kNotFound, "plugin {}: no such file", path);
  if (!is_plain_file(path)) return invalid_argument("plugin {}: not a regular file", path);
  // dlopen searches the library path for a bare name; a plugin is always a file we name.
  const std::string open_path = path.find('/') == std::string::npos ? "./" + path : path;

  std::shared_ptr<Plugin> plugin(new Plugin());
  plugin->path_ = path;
  dlerror();
  plugin->handle_ = dlopen(open_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (plugin->handle_ == nullptr) {
    const char* e = dlerror();
    return invalid_argument("plugin {}: cannot load it: {}", path, e ? e : "unknown dlopen error");
  }
  dlerror();
  void* symbol = dlsym(plugin->handle_, ODY_ENV_ENTRY_POINT);
  if (symbol == nullptr)
    return invalid_argument("plugin {}: missing entry point {} (is it an odyssey environment plugin built with "
                            "ODY_ENV_PLUGIN?)",
                            path, ODY_ENV_ENTRY_POINT);
  auto entry = reinterpret_cast<ody_env_entry_point>(symbol);
  const ody_env_plugin* table = entry(ODY_ENV_ABI_VERSION);
  if (table == nullptr)
    return invalid_argument("plugin {}: {} returned no table for host ABI version {} (built for another ABI "
                            "version?)",
                            path, ODY_ENV_ENTRY_POINT, ODY_ENV_ABI_VERSION);
  if (table->abi_version != ODY_ENV_ABI_VERSION)
    return invalid_argument("plugin {}: built for ABI version {}, this odyssey speaks ABI version {}; rebuild it "
                            "against this odyssey's odyssey/env.h",
                            path, table->abi_version, ODY_ENV_ABI_VERSION);
  if (table->struct_size < sizeof(ody_env_plugin))
    return invalid_argument("plugin {}: table struct_size is {}, smaller than this ABI's {} bytes", path,
                            table->struct_size, sizeof(ody_env_plugin));
  if (!valid_plugin_name(table->name))
    return invalid_argument("plugin {}: name '{}' is not [a-z0-9_-]+", path, table->name ? table->name : "(null)");
  const std::string name = table->name;
  std::vector<std::string> missing;
  auto require = [&](bool present, const char* field) {
    if (!present) missing.push_back(field);
  };
  require(table->version != nullptr, "version");
  require(table->description != nullptr, "description");
  require(table->tools_json != nullptr, "tools_json");
  require(table->create != nullptr, "create");
  require(table->destroy != nullptr, "destroy");
  require(table->reset != nullptr, "reset");
  require(table->step != nullptr, "step");
  require(table->score != nullptr, "score");
  require(table->free_observation != nullptr, "free_observation");
  require(table->free_score != nullptr, "free_score");
  const bool snapshots = (table->capabilities & ODY_ENV_CAP_SNAPSHOT) != 0;
  const size_t before_snapshot = missing.size();
  if (snapshots) {
    require(table->snapshot != nullptr, "snapshot");
    require(table->restore != nullptr, "restore");
    require(table->free_buffer != nullptr, "free_buffer");
  }
  if (!missing.empty())
    return invalid_argument("plugin {} ('{}'): missing required {}: {}{}", path, name,
                            missing.size() == 1 ? "entry" : "entries", fmt::join(missing, ", "),
                            missing.size() > before_snapshot
                                ? " (capabilities has ODY_ENV_CAP_SNAPSHOT, which needs snapshot, restore and free_buffer)"
                                : "");

  const nlohmann::json tools = nlohmann::json::parse(table->tools_json, nullptr, /*allow_exceptions=*/false);
  if (tools.is_discarded()) return invalid_argument("plugin {} ('{}'): tools_json is not valid JSON", path, name);
  ODY_ASSIGN_OR_RETURN(plugin->info_.tools, parse_tools(tools, fmt::format("plugin {} ('{}')", path, name)));
  ODY_ASSIGN_OR_RETURN(plugin->info_.source_hash, hash_file(path));

  plugin->table_ = table;
  plugin->info_.name = name;
  plugin->info_.version = table->version;
  plugin->info_.description = table->description;
  plugin->info_.snapshots = snapshots;
  plugin->info_.images = (table->capabilities & ODY_ENV_CAP_IMAGES) != 0;
  plugin->info_.source = fs::absolute(path, ec).lexically_normal().string();
  if (ec) plugin->info_.source = path;
  return plugin;
}

Plugin::~Plugin() {
  if (handle_ != nullptr) dlclose(handle_);
}

Result<std::unique_ptr<EnvSession>> Plugin::create(const nlohmann::json& config) {
  if (!config.is_object())
    return invalid_argument("plugin '{}' create: the config must be a JSON object, got {}", info_.name,
                            config.type_name());
  std::string text = config.dump();
  ody_env* instance = nullptr;
  ody_env_error err{};
  const ody_env_status s = table_->create({text.data(), text.size()}, &instance, &err);
  if (s != ODY_ENV_OK)
    return Status(status_code_for(s),
                  fmt::format("plugin '{}' create: {}: {}", info_.name, status_name(s), error_text(err)));
  if (instance == nullptr)
    return make_status(StatusCode::kInternal, "plugin '{}' create: returned OK but no instance", info_.name);
  return std::unique_ptr<EnvSession>(new InProcessSession(shared_from_this(), std::move(text), instance));
}

Result<std::string> find_plugin(const std::string& name_or_path, const std::vector<std::string>& extra_dirs) {
  if (name_or_path.find('/') != std::string::npos) {
    if (is_plain_file(name_or_path)) return name_or_path;
    return make_status(StatusCode::kNotFound, "plugin {}: no such file", name_or_path);
  }
  const std::vector<std::string> dirs = search_dirs(extra_dirs);
  const std::string file = kPrefix + name_or_path + kSuffix;
  for (const std::string& dir : dirs) {
    const fs::path candidate = fs::path(dir) / file;
    if (is_plain_file(candidate)) return candidate.string();
  }
  return make_status(StatusCode::kNotFound,
                     "no environment plugin '{}': looked for {} in {} (add directories with $ODYSSEY_ENV_PATH, or "
                     "pass a path containing '/')",
                     name_or_path, file, dirs.empty() ? std::string("no directories") : fmt::format("{}", fmt::join(dirs, ", ")));
}

std::vector<std::string> discover_plugins(const std::vector<std::string>& extra_dirs) {
  std::vector<std::string> found;
  std::set<std::string> seen;
  const std::string prefix = kPrefix, suffix = kSuffix;
  for (const std::string& dir : search_dirs(extra_dirs)) {
    std::error_code ec;
    std::vector<std::string> here;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string file = it->path().filename().string();
      if (file.size() <= prefix.size() + suffix.size() || file.compare(0, prefix.size(), prefix) != 0 ||
          file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      if (!is_plain_file(it->path())) continue;
      here.push_back(it->path().string());
    }
    std::sort(here.begin(), here.end());
    for (std::string& path : here) {
      std::error_code cec;
      const fs::path canonical = fs::weakly_canonical(path, cec);
      if (seen.insert(cec ? path : canonical.string()).second) found.push_back(std::move(path));
    }
  }
  return found;
}

}  // namespace odyssey::envs
