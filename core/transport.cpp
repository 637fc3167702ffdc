#include "core/transport.h"

#include <cerrno>

#include <capnp/serialize.h>

namespace odyssey {

std::string flat_bytes(capnp::MessageBuilder& message) {
  auto flat = capnp::messageToFlatArray(message);
  return std::string(reinterpret_cast<const char*>(flat.begin()), flat.size() * sizeof(capnp::word));
}

Status send_frames(zmq::socket_t& socket, const std::vector<std::string_view>& frames, bool dont_wait) {
  try {
    for (size_t i = 0; i < frames.size(); ++i) {
      auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      if (dont_wait) flags = flags | zmq::send_flags::dontwait;
      auto sent = socket.send(zmq::const_buffer(frames[i].data(), frames[i].size()), flags);
      if (!sent) return Status(StatusCode::kUnavailable, "socket would block");
    }
  } catch (const zmq::error_t& e) {
    return Status(StatusCode::kUnavailable, fmt::format("zmq send: {}", e.what()));
  }
  return Status::Ok();
}

Result<std::optional<std::vector<zmq::message_t>>> recv_frames(zmq::socket_t& socket, int timeout_ms) {
  try {
    zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) == 0) return std::optional<std::vector<zmq::message_t>>();
    std::vector<zmq::message_t> frames;
    for (;;) {
      zmq::message_t m;
      auto got = socket.recv(m, zmq::recv_flags::dontwait);
      if (!got) break;
      bool more = m.more();
      frames.push_back(std::move(m));
      if (!more) break;
    }
    if (frames.empty()) return std::optional<std::vector<zmq::message_t>>();
    return std::optional<std::vector<zmq::message_t>>(std::move(frames));
  } catch (const zmq::error_t& e) {
    // A signal (SIGTERM asking for a clean stop) interrupted the wait: report "nothing yet" so the
    // caller's loop gets to look at its stop flag instead of failing the whole process.
    if (e.num() == EINTR) return std::optional<std::vector<zmq::message_t>>();
    return Status(StatusCode::kUnavailable, fmt::format("zmq recv: {}", e.what()));
  }
}

Status check_endpoint(const std::string& endpoint) {
  static const char* kSchemes[] = {"tcp://", "ipc://", "inproc://"};
  for (const char* s : kSchemes) {
    if (endpoint.rfind(s, 0) == 0 && endpoint.size() > std::string_view(s).size()) return Status::Ok();
  }
  return invalid_argument("endpoint '{}' is not a ZeroMQ address (tcp://127.0.0.1:5555, ipc:///tmp/x, inproc://x)",
                          endpoint);
}

}  // namespace odyssey
