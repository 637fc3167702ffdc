/* odyssey environment plugin ABI, version 1.
 *
 * A tool environment is a shared library that exports one C function,
 *
 *     const ody_env_plugin* ody_env_plugin_v1(uint32_t host_abi_version);
 *
 * returning a table of functions (static storage, valid until the library is unloaded), or
 * NULL when it cannot serve a host of that ABI version. odyssey loads the library, checks the
 * table (abi_version, struct_size, required functions, the tools' JSON schemas) and refuses it
 * with a message naming what is wrong. C++ authors do not write this by hand: derive from
 * odyssey::env::Environment in <odyssey/env_sdk.hpp> and register with ODY_ENV_PLUGIN.
 *
 * Life of an instance (one episode at a time; an instance is used by one thread at a time):
 *
 *     create(config_json)            -> instance
 *     reset(instance, task, seed)    -> first observation (the task prompt)
 *     step(instance, action)         -> observation, reward parts, done      (repeated)
 *     score(instance)                -> final grade: reward, success, parts  (after done, or
 *                                       whenever the host stops the episode, e.g. out of tokens)
 *     snapshot(instance) / restore   -> optional, at turn boundaries: fork = create + restore
 *     destroy(instance)
 *
 * The framework owns tokenization: the model's tool calls arrive parsed (a name the plugin
 * declared, arguments that are a JSON object valid against the tool's input schema). Calls the
 * framework cannot parse or validate never reach the plugin; they become error observations.
 * A plugin reports a failing tool call (bad argument value, a command that failed) as a tool
 * result with is_error = 1, not as an ODY_ENV_ERR_* status: statuses are for the instance
 * itself being unusable (bad config, internal fault).
 *
 * Memory: everything the host passes in is owned by the host and valid only during the call.
 * Everything a plugin returns through an out-parameter (observation, score, snapshot) is owned
 * by the plugin until the host hands it back to the matching free function (init/free pairs:
 * the host zero-initializes an out struct, the plugin fills it, the host frees it with
 * free_observation / free_score / free_buffer). Strings are UTF-8 with explicit sizes and need
 * not be NUL-terminated. The table's own strings (name, version, tools_json, ...) are static.
 *
 * Errors: functions that can fail return ody_env_status and, on failure, write a NUL-terminated
 * message into the caller's ody_env_error (truncated to fit). No C++ exception may cross this
 * boundary.
 *
 * Evolution: fields are only ever appended to the structs; struct_size tells the host which
 * fields a plugin knows. A change that is not an append gets a new entry point name
 * (ody_env_plugin_v2) and a new ODY_ENV_ABI_VERSION.
 */
#ifndef ODYSSEY_ENV_H_
#define ODYSSEY_ENV_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ODY_ENV_ABI_VERSION 1u
#define ODY_ENV_ENTRY_POINT "ody_env_plugin_v1"
#define ODY_ENV_ERROR_CAPACITY 1024

#if defined(_WIN32)
#define ODY_ENV_EXPORT __declspec(dllexport)
#else
#define ODY_ENV_EXPORT __attribute__((visibility("default")))
#endif

typedef enum ody_env_status {
  ODY_ENV_OK = 0,
  ODY_ENV_ERR_INVALID_CONFIG = 1,   /* create: the config JSON is wrong (message names the key) */
  ODY_ENV_ERR_INVALID_TASK = 2,     /* reset: the task JSON is wrong */
  ODY_ENV_ERR_INVALID_ACTION = 3,   /* step: an action the plugin cannot take (e.g. after done) */
  ODY_ENV_ERR_UNSUPPORTED = 4,      /* e.g. restore of a snapshot from another version */
  ODY_ENV_ERR_INTERNAL = 5          /* anything else; the instance should be destroyed */
} ody_env_status;

typedef enum ody_env_image_format {
  ODY_ENV_IMAGE_RGB8 = 0, /* width * height * 3 bytes, row-major, top row first */
  ODY_ENV_IMAGE_PNG = 1   /* a PNG file's bytes; width and height as in its header */
} ody_env_image_format;

/* Capability bits of ody_env_plugin.capabilities. */
#define ODY_ENV_CAP_SNAPSHOT (1ull << 0) /* snapshot and restore are provided */
#define ODY_ENV_CAP_IMAGES (1ull << 1)   /* observations may carry images */

typedef struct ody_env_string {
  const char* data;
  uint64_t size;
} ody_env_string;

typedef struct ody_env_buffer {
  uint8_t* data;
  uint64_t size;
} ody_env_buffer;

typedef struct ody_env_error {
  char message[ODY_ENV_ERROR_CAPACITY];
} ody_env_error;

typedef struct ody_env_image {
  ody_env_image_format format;
  uint32_t width;
  uint32_t height;
  const uint8_t* data;
  uint64_t size;
} ody_env_image;

/* One tool call of the model, parsed and validated by the framework. */
typedef struct ody_env_tool_call {
  ody_env_string id;             /* unique within the episode, e.g. "call_3" */
  ody_env_string name;           /* one of the plugin's tools */
  ody_env_string arguments_json; /* a JSON object, valid against the tool's input_schema */
} ody_env_tool_call;

/* The model's turn. */
typedef struct ody_env_action {
  ody_env_string text; /* the turn's text without its tool-call spans (e.g. a final answer) */
  const ody_env_tool_call* tool_calls;
  uint32_t tool_call_count;
} ody_env_action;

typedef struct ody_env_tool_result {
  ody_env_string call_id; /* the ody_env_tool_call.id it answers */
  ody_env_string content; /* what the model sees */
  int32_t is_error;       /* 1: the call failed (bad value, command error); content says why */
} ody_env_tool_result;

typedef struct ody_env_reward_part {
  ody_env_string name; /* e.g. "format", "correct", "hop_1" */
  double value;
} ody_env_reward_part;

/* What the environment returns from reset and step. */
typedef struct ody_env_observation {
  ody_env_string text; /* text for the model (after reset: the task prompt) */
  const ody_env_tool_result* tool_results;
  uint32_t tool_result_count; /* one per tool call of the action, in order */
  const ody_env_image* images;
  uint32_t image_count;
  const ody_env_reward_part* rewards; /* reward earned by this step, by component */
  uint32_t reward_count;
  int32_t done;             /* 1: the episode is over; call score */
  ody_env_string info_json; /* optional JSON object for logs and audits; may be empty */
  void* plugin_data;        /* the plugin's own bookkeeping for free_observation */
} ody_env_observation;

/* The episode's final grade. */
typedef struct ody_env_score {
  double reward;  /* the total the learner optimizes */
  int32_t success; /* 1: the task was solved (what success rates count) */
  const ody_env_reward_part* parts;
  uint32_t part_count;
  ody_env_string info_json; /* optional JSON object, e.g. the expected answer */
  void* plugin_data;
} ody_env_score;

typedef struct ody_env ody_env; /* an instance; the plugin defines it */

typedef struct ody_env_plugin {
  uint32_t abi_version; /* ODY_ENV_ABI_VERSION the plugin was built against */
  uint32_t struct_size; /* sizeof(ody_env_plugin) the plugin was built with */
  const char* name;        /* [a-z0-9_-]+, e.g. "arith" */
  const char* version;     /* the plugin's own version, e.g. "1.2.0" */
  const char* description; /* one line */
  /* JSON array of tools, each {"name", "description", "input_schema"} (MCP's shape; OpenAI's
   * "parameters" is accepted as a synonym of "input_schema"). input_schema is a JSON Schema
   * whose type is "object". */
  const char* tools_json;
  uint64_t capabilities; /* ODY_ENV_CAP_* bits */

  ody_env_status (*create)(ody_env_string config_json, ody_env** out, ody_env_error* err);
  void (*destroy)(ody_env* env);
  /* task_json: a JSON object the plugin documents (e.g. {"split": "eval", "index": 3}); "{}"
   * means: draw a task from seed. The same (task, seed) gives the same episode. */
  ody_env_status (*reset)(ody_env* env, ody_env_string task_json, uint64_t seed, ody_env_observation* out,
                          ody_env_error* err);
  ody_env_status (*step)(ody_env* env, const ody_env_action* action, ody_env_observation* out,
                         ody_env_error* err);
  ody_env_status (*score)(ody_env* env, ody_env_score* out, ody_env_error* err);
  void (*free_observation)(ody_env* env, ody_env_observation* observation);
  void (*free_score)(ody_env* env, ody_env_score* score);
  /* Optional (NULL unless ODY_ENV_CAP_SNAPSHOT): the episode's state at a turn boundary as
   * bytes, and an instance (from the same plugin and config) put back into that state. */
  ody_env_status (*snapshot)(ody_env* env, ody_env_buffer* out, ody_env_error* err);
  ody_env_status (*restore)(ody_env* env, ody_env_string snapshot, ody_env_error* err);
  void (*free_buffer)(ody_env* env, ody_env_buffer* buffer);
} ody_env_plugin;

typedef const ody_env_plugin* (*ody_env_entry_point)(uint32_t host_abi_version);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ODYSSEY_ENV_H_ */
