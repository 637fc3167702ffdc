// safetensors files: the tensor container the policy's checkpoints are made of, read and written
// exactly as the format's reference implementation (Hugging Face `safetensors`) does.
//
// Format (https://github.com/huggingface/safetensors):
//   8 bytes   N, the header length, little-endian uint64
//   N bytes   UTF-8 JSON: {"__metadata__": {str: str}, name: {"dtype": D, "shape": [...],
//             "data_offsets": [begin, end]}, ...}; D is one of F64 F32 F16 BF16 I64 I32 I16 I8
//             U8 BOOL. Trailing spaces pad the header so that the data starts 8-byte aligned.
//   the rest  the data buffer: each tensor's bytes, row-major, little-endian, at
//             [begin, end) relative to the buffer start. Together the ranges cover the buffer
//             exactly: contiguous from 0, no overlap, no gap, nothing after the last one.
//
// Reading validates all of it before touching the data, and every error names the file and the
// tensor or field at fault (status kCorrupt for a damaged or malformed file, kNotFound / kIo
// for one that cannot be opened or read): a file shorter than 8 bytes, a header length beyond
// the file, a header that is not JSON or not an object, an unknown dtype, a bad shape or
// data_offsets field, a byte range whose size disagrees with shape x dtype, overlapping or
// gapped ranges, bytes after the last tensor, a duplicate name (the JSON allows it; we do not),
// a BOOL byte other than 0 or 1. A truncated file names the first tensor whose bytes are
// missing. Reading never crashes on bad input and never allocates more than the file holds.
//
// Writing lays tensors out like the reference (larger element sizes first, so every tensor
// starts aligned to its element size; ties by name), pads the header with spaces to 8 bytes,
// writes `<path>.tmp`, fsyncs it, renames it over `<path>` and fsyncs the folder: a reader sees
// the old file or the new one, never a torn one. Two writers of the same path at once are not
// supported (they share the .tmp name).
//
// Thread-safety: every function is reentrant; concurrent calls on different paths are safe.
// Assumes a little-endian host (checked at compile time).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "core/status.h"

namespace odyssey::model {

// The contents of one file. Tensors are CPU, contiguous, and own their memory.
struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> metadata;  // the header's "__metadata__"
};

// One header entry, as stored (nothing read from the data buffer).
struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // byte offset in the data buffer
  uint64_t byte_size = 0;   // end - begin = numel x element size
};

// "F32" for at::kFloat, ...; nullopt for a dtype safetensors files cannot hold here.
std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype);
// at::kFloat for "F32", ...; nullopt for a name outside the list above.
std::optional<at::ScalarType> safetensors_dtype_from_name(const std::string& name);

// Reads and validates the whole file (see above).
Result<SafetensorsFile> read_safetensors(const std::string& path);

// Reads and validates the header only, including that the data buffer has exactly the size the
// header describes; the tensor bytes are not read (BOOL values are not checked).
Result<std::map<std::string, TensorInfo>> read_safetensors_header(const std::string& path);

// Writes `tensors` (any device, any strides; copied to contiguous CPU bytes) and `metadata`.
// kInvalidArgument for an undefined tensor, an unsupported dtype, an empty name or the reserved
// name "__metadata__", or a name or metadata string that is not UTF-8; kIo when the file
// system fails (the .tmp file is removed, `path` is left as it was).
Status write_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace odyssey::model
