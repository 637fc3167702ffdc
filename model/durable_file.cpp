#include "model/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace odyssey::model {
namespace {

Status io_error(const std::string& what, const std::string& path) {
  return make_status(StatusCode::kIo, "{} {}: {}", what, path, std::strerror(errno));
}

Status write_all(int fd, const std::string& path, const ByteSpan& piece) {
  const char* bytes = static_cast<const char*>(piece.data);
  size_t left = piece.size;
  while (left > 0) {
    ssize_t n = ::write(fd, bytes, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("writing", path);
    }
    bytes += n;
    left -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status write_and_sync(const std::string& path, const std::vector<ByteSpan>& pieces) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("creating", path);
  Status status;
  for (const ByteSpan& piece : pieces) {
    status = write_all(fd, path, piece);
    if (!status.ok()) break;
  }
  if (status.ok() && ::fsync(fd) != 0) status = io_error("fsync of", path);
  if (::close(fd) != 0 && status.ok()) status = io_error("closing", path);
  return status;
}

}  // namespace

Status sync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("opening folder", path);
  Status status;
  if (::fsync(fd) != 0) status = io_error("fsync of folder", path);
  ::close(fd);
  return status;
}

Status write_file_durably(const std::string& path, const std::vector<ByteSpan>& pieces) {
  const std::string tmp = path + ".tmp";
  Status status = write_and_sync(tmp, pieces);
  if (status.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    status = make_status(StatusCode::kIo, "renaming {} to {}: {}", tmp, path, std::strerror(errno));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  std::string folder = std::filesystem::path(path).parent_path().string();
  return sync_directory(folder.empty() ? "." : folder);
}

Status write_file_durably(const std::string& path, const std::string& contents) {
  return write_file_durably(path, std::vector<ByteSpan>{{contents.data(), contents.size()}});
}

}  // namespace odyssey::model
