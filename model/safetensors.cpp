#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/durable_file.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian bytes; this reader copies them as they are");

namespace odyssey::model {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr uint64_t kHeaderLengthBytes = 8;

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

Status corrupt(const std::string& path, const std::string& what) {
  return make_status(StatusCode::kCorrupt, "safetensors file {}: {}", path, what);
}

// An open file descriptor, closed on scope exit.
class ReadOnlyFile {
 public:
  ~ReadOnlyFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      StatusCode code = errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIo;
      return make_status(code, "opening safetensors file {}: {}", path, std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      return make_status(StatusCode::kIo, "stat of {}: {}", path, std::strerror(errno));
    }
    size_ = static_cast<uint64_t>(st.st_size);
    return Status::Ok();
  }
  uint64_t size() const { return size_; }
  // Reads exactly `size` bytes at `offset`; `what` names them in the truncation error.
  Status read_at(void* out, uint64_t size, uint64_t offset, const std::string& what) const {
    char* bytes = static_cast<char*>(out);
    while (size > 0) {
      ssize_t n = ::pread(fd_, bytes, size, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return make_status(StatusCode::kIo, "reading {} of {}: {}", what, path_, std::strerror(errno));
      }
      if (n == 0) return corrupt(path_, fmt::format("truncated while reading {}", what));
      bytes += n;
      size -= static_cast<uint64_t>(n);
      offset += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

 private:
  int fd_ = -1;
  std::string path_;
  uint64_t size_ = 0;
};

struct Header {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;            // file offset of the data buffer
  std::vector<std::string> by_offset;  // tensor names in data_begin order
};

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Parses the JSON, refusing duplicate keys in any object (nlohmann keeps the last silently).
Result<json> parse_header_json(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto on_event = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys_per_object.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys_per_object.empty()) keys_per_object.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys_per_object.empty() && !keys_per_object.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, on_event);
  } catch (const json::exception& e) {
    return corrupt(path, fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!duplicate.empty()) {
    return corrupt(path, fmt::format("header names '{}' twice", duplicate));
  }
  if (!header.is_object()) return corrupt(path, "header is not a JSON object");
  return header;
}

Result<std::map<std::string, std::string>> parse_metadata(const std::string& path, const json& value) {
  std::map<std::string, std::string> metadata;
  if (value.is_null()) return metadata;
  if (!value.is_object()) return corrupt(path, "\"__metadata__\" is not an object of strings");
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return corrupt(path, fmt::format("\"__metadata__\" entry '{}' is {}, not a string", key, item.type_name()));
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

Result<TensorInfo> parse_tensor_entry(const std::string& path, const std::string& name, const json& entry) {
  auto bad = [&](const std::string& what) { return corrupt(path, fmt::format("tensor '{}': {}", name, what)); };
  if (!entry.is_object()) return bad("entry is not an object");
  for (const auto& [key, unused] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return bad(fmt::format("unknown field '{}' (expected dtype, shape, data_offsets)", key));
    }
  }
  TensorInfo info;
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return bad("\"dtype\" missing or not a string");
  std::optional<at::ScalarType> dtype = safetensors_dtype_from_name(dtype_it->get<std::string>());
  if (!dtype) {
    return bad(fmt::format("unknown dtype '{}' (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)",
                           dtype_it->get<std::string>()));
  }
  info.dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) return bad("\"shape\" missing or not an array");
  uint64_t numel = 1;
  for (const json& dim : *shape_it) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return bad(fmt::format("\"shape\" {} holds {}, not a non-negative integer", shape_it->dump(), dim.dump()));
    }
    uint64_t size = dim.get<uint64_t>();
    info.shape.push_back(static_cast<int64_t>(size));
    if (__builtin_mul_overflow(numel, size, &numel)) return bad(fmt::format("\"shape\" {} overflows", shape_it->dump()));
  }
  uint64_t expected_bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(info.dtype)), &expected_bytes)) {
    return bad(fmt::format("\"shape\" {} overflows", shape_it->dump()));
  }

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    return bad("\"data_offsets\" missing or not [begin, end] of non-negative integers");
  }
  uint64_t begin = (*offsets_it)[0].get<uint64_t>();
  uint64_t end = (*offsets_it)[1].get<uint64_t>();
  if (end < begin) return bad(fmt::format("\"data_offsets\" [{}, {}] end before begin", begin, end));
  info.data_begin = begin;
  info.byte_size = end - begin;
  if (info.byte_size != expected_bytes) {
    return bad(fmt::format("shape {} of {} needs {} bytes but \"data_offsets\" [{}, {}] hold {}",
                           shape_string(info.shape), dtype_it->get<std::string>(), expected_bytes, begin, end,
                           info.byte_size));
  }
  return info;
}

// Reads and validates the header against the file's size (see safetensors.h).
Result<Header> read_header(const ReadOnlyFile& file, const std::string& path) {
  if (file.size() < kHeaderLengthBytes) {
    return corrupt(path, fmt::format("truncated: {} bytes, shorter than the 8-byte header length", file.size()));
  }
  unsigned char length_bytes[kHeaderLengthBytes];
  ODY_RETURN_IF_ERROR(file.read_at(length_bytes, kHeaderLengthBytes, 0, "the header length"));
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  if (header_length > file.size() - kHeaderLengthBytes) {
    return corrupt(path, fmt::format("header length {} runs past the end of the file ({} bytes)", header_length,
                                     file.size()));
  }
  if (header_length > kMaxHeaderBytes) {
    return corrupt(path, fmt::format("header length {} exceeds the {}-byte limit", header_length, kMaxHeaderBytes));
  }
  std::string text(header_length, '\0');
  ODY_RETURN_IF_ERROR(file.read_at(text.data(), header_length, kHeaderLengthBytes, "the header"));
  ODY_ASSIGN_OR_RETURN(json document, parse_header_json(path, text));

  Header header;
  header.data_start = kHeaderLengthBytes + header_length;
  for (const auto& [name, entry] : document.items()) {
    if (name == "__metadata__") {
      ODY_ASSIGN_OR_RETURN(header.metadata, parse_metadata(path, entry));
      continue;
    }
    if (name.empty()) return corrupt(path, "a tensor has an empty name");
    ODY_ASSIGN_OR_RETURN(TensorInfo info, parse_tensor_entry(path, name, entry));
    header.tensors.emplace(name, std::move(info));
  }

  // The byte ranges must tile the data buffer: sorted by begin, each starts where the last ended.
  for (const auto& [name, info] : header.tensors) header.by_offset.push_back(name);
  auto range = [&](const std::string& name) {
    const TensorInfo& info = header.tensors.at(name);
    return std::make_pair(info.data_begin, info.data_begin + info.byte_size);
  };
  std::stable_sort(header.by_offset.begin(), header.by_offset.end(),
                   [&](const std::string& a, const std::string& b) { return range(a) < range(b); });
  uint64_t covered = 0;
  const std::string* previous = nullptr;
  for (const std::string& name : header.by_offset) {
    auto [begin, end] = range(name);
    if (begin > covered) {
      return corrupt(path, fmt::format("gap: data bytes [{}, {}) before tensor '{}' belong to no tensor", covered,
                                       begin, name));
    }
    if (begin < covered) {
      auto [previous_begin, previous_end] = range(*previous);
      return corrupt(path, fmt::format("tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", name, begin,
                                       end, *previous, previous_begin, previous_end));
    }
    covered = end;
    previous = &name;
  }
  const uint64_t buffer_size = file.size() - header.data_start;
  if (covered < buffer_size) {
    return corrupt(path, fmt::format("{} trailing bytes after the last tensor{} belong to no tensor "
                                     "(file {} bytes, header describes {})",
                                     buffer_size - covered, previous ? fmt::format(" ('{}')", *previous) : "",
                                     file.size(), header.data_start + covered));
  }
  if (covered > buffer_size) {
    for (const std::string& name : header.by_offset) {
      auto [begin, end] = range(name);
      if (end > buffer_size) {
        return corrupt(path, fmt::format("truncated: tensor '{}' needs data bytes [{}, {}) but the file holds only "
                                         "{} data bytes (file {} bytes, header describes {})",
                                         name, begin, end, buffer_size, file.size(), header.data_start + covered));
      }
    }
  }
  return header;
}

Result<SafetensorsFile> read_file(const std::string& path) {
  ReadOnlyFile file;
  ODY_RETURN_IF_ERROR(file.open(path));
  ODY_ASSIGN_OR_RETURN(Header header, read_header(file, path));
  SafetensorsFile result;
  result.metadata = std::move(header.metadata);
  // One pass in file order, each tensor's bytes read straight into its own storage.
  for (const std::string& name : header.by_offset) {
    const TensorInfo& info = header.tensors.at(name);
    at::Tensor tensor = at::empty(info.shape, at::TensorOptions().dtype(info.dtype));
    if (info.byte_size > 0) {
      ODY_RETURN_IF_ERROR(file.read_at(tensor.data_ptr(), info.byte_size, header.data_start + info.data_begin,
                                       fmt::format("tensor '{}'", name)));
    }
    if (info.dtype == at::kBool) {
      const unsigned char* bytes = static_cast<const unsigned char*>(tensor.data_ptr());
      for (uint64_t i = 0; i < info.byte_size; ++i) {
        if (bytes[i] > 1) {
          return corrupt(path, fmt::format("tensor '{}': BOOL element {} holds byte {}, not 0 or 1", name, i,
                                           static_cast<int>(bytes[i])));
        }
      }
    }
    result.tensors.emplace(name, std::move(tensor));
  }
  return result;
}

Status write_file(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  struct Entry {
    std::string name;
    at::Tensor bytes;  // contiguous, CPU
  };
  std::vector<Entry> entries;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty() || name == "__metadata__") {
      return invalid_argument("writing safetensors file {}: tensor name '{}' is reserved or empty", path, name);
    }
    if (!tensor.defined()) {
      return invalid_argument("writing safetensors file {}: tensor '{}' is undefined", path, name);
    }
    std::optional<std::string> dtype_name = safetensors_dtype_name(tensor.scalar_type());
    if (!dtype_name) {
      return invalid_argument("writing safetensors file {}: tensor '{}' has dtype {}, which safetensors files here "
                              "cannot hold (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)",
                              path, name, c10::toString(tensor.scalar_type()));
    }
    at::Tensor bytes = tensor.detach().to(at::kCPU).contiguous();
    entries.push_back({name, std::move(bytes)});
  }
  // The reference layout: larger elements first, then by name, so every tensor is aligned.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.bytes.element_size() > b.bytes.element_size();
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Entry& entry : entries) {
    uint64_t size = static_cast<uint64_t>(entry.bytes.numel()) * entry.bytes.element_size();
    header[entry.name] = {{"dtype", *safetensors_dtype_name(entry.bytes.scalar_type())},
                          {"shape", entry.bytes.sizes().vec()},
                          {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("writing safetensors file {}: a tensor name or metadata string is not UTF-8: {}", path,
                            e.what());
  }
  text.append((kHeaderLengthBytes - text.size() % kHeaderLengthBytes) % kHeaderLengthBytes, ' ');
  unsigned char length_bytes[kHeaderLengthBytes];
  for (size_t i = 0; i < kHeaderLengthBytes; ++i) length_bytes[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  std::vector<ByteSpan> pieces = {{length_bytes, kHeaderLengthBytes}, {text.data(), text.size()}};
  for (const Entry& entry : entries) {
    size_t size = static_cast<size_t>(entry.bytes.numel()) * entry.bytes.element_size();
    if (size > 0) pieces.push_back({entry.bytes.data_ptr(), size});
  }
  return write_file_durably(path, pieces);
}

}  // namespace

std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype) {
  for (const DtypeName& entry : kDtypes) {
    if (entry.dtype == dtype) return std::string(entry.name);
  }
  return std::nullopt;
}

std::optional<at::ScalarType> safetensors_dtype_from_name(const std::string& name) {
  for (const DtypeName& entry : kDtypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

Result<SafetensorsFile> read_safetensors(const std::string& path) {
  try {
    return read_file(path);
  } catch (const std::exception& e) {  // allocation failure, or a LibTorch error
    return make_status(StatusCode::kInternal, "reading safetensors file {}: {}", path, e.what());
  }
}

Result<std::map<std::string, TensorInfo>> read_safetensors_header(const std::string& path) {
  ReadOnlyFile file;
  ODY_RETURN_IF_ERROR(file.open(path));
  ODY_ASSIGN_OR_RETURN(Header header, read_header(file, path));
  return std::move(header.tensors);
}

Status write_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  try {
    return write_file(path, tensors, metadata);
  } catch (const std::exception& e) {  // a device copy or allocation failed
    return make_status(StatusCode::kInternal, "writing safetensors file {}: {}", path, e.what());
  }
}

}  // namespace odyssey::model
