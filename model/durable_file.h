// Files that survive a crash whole or not at all: the write path under checkpoints.
//
// write_file_durably writes `pieces` in order to `<path>.tmp`, fsyncs it, renames it over `path`
// and fsyncs the containing folder. After it returns OK the file is on disk with its full
// contents; if it fails or the process dies, `path` holds its previous contents (or does not
// exist) and the .tmp file is removed where possible. Errors are kIo and name the file and the
// system call. Two writers of the same path at once are not supported (they share the .tmp).
//
// Thread-safety: reentrant; no shared state.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/status.h"

namespace odyssey::model {

// A run of bytes owned by the caller, alive for the duration of the call.
struct ByteSpan {
  const void* data = nullptr;
  size_t size = 0;
};

Status write_file_durably(const std::string& path, const std::vector<ByteSpan>& pieces);
Status write_file_durably(const std::string& path, const std::string& contents);

// fsyncs a folder, so that entries created or renamed in it are durable.
Status sync_directory(const std::string& path);

}  // namespace odyssey::model
