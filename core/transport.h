// ZeroMQ + Cap'n Proto plumbing shared by every role that talks over sockets.
// Messages are flat Cap'n Proto arrays in zmq frames; multipart messages are vectors of
// frames. Nothing here retries: callers own their retry and timeout policy.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <zmq.hpp>

#include "core/status.h"

namespace odyssey {

// The flat bytes of a builder (one contiguous array, with its segment table).
std::string flat_bytes(capnp::MessageBuilder& message);

// Sends `frames` as one multipart message. Returns kUnavailable when the socket would block.
Status send_frames(zmq::socket_t& socket, const std::vector<std::string_view>& frames, bool dont_wait = false);
// Receives one multipart message; std::nullopt on timeout (timeout_ms < 0 blocks).
Result<std::optional<std::vector<zmq::message_t>>> recv_frames(zmq::socket_t& socket, int timeout_ms);

inline std::string_view view_of(const zmq::message_t& m) {
  return std::string_view(static_cast<const char*>(m.data()), m.size());
}

// Validates a ZeroMQ endpoint string ("tcp://host:port", "ipc://path", "inproc://name").
Status check_endpoint(const std::string& endpoint);

}  // namespace odyssey
