#include "model/safetensors.h"

#include <stdlib.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;

// A fresh folder per test, removed afterwards.
class SafetensorsFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "safetensors_test_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string length_prefix(uint64_t n) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  return bytes;
}

// A file made by hand: length, `header` as given, then `data_bytes` bytes of 0x01.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return length_prefix(header.size()) + header + std::string(data_bytes, '\x01');
}

// Same dtype, shape and bytes.
::testing::AssertionResult BitIdentical(const at::Tensor& expected, const at::Tensor& actual) {
  if (expected.scalar_type() != actual.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype " << actual.scalar_type() << " != " << expected.scalar_type();
  }
  if (expected.sizes() != actual.sizes()) {
    return ::testing::AssertionFailure() << "shape " << actual.sizes() << " != " << expected.sizes();
  }
  at::Tensor a = expected.contiguous();
  at::Tensor b = actual.contiguous();
  if (a.numel() > 0 && std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) != 0) {
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// One tensor of every dtype, values chosen to exercise the bits (NaN, inf, -0, subnormals).
std::map<std::string, at::Tensor> every_dtype() {
  at::manual_seed(7);
  at::Tensor floats = at::randn({3, 5}, at::kDouble);
  floats[0][0] = std::numeric_limits<double>::quiet_NaN();
  floats[0][1] = std::numeric_limits<double>::infinity();
  floats[0][2] = -0.0;
  floats[0][3] = 1e-40;  // subnormal in fp32 and bf16
  at::Tensor ints = at::randint(-100, 100, {4, 3}, at::kLong);
  return {
      {"f64", floats},
      {"f32", floats.to(at::kFloat)},
      {"f16", floats.to(at::kHalf)},
      {"bf16", floats.to(at::kBFloat16)},
      {"i64", ints},
      {"i32", ints.to(at::kInt)},
      {"i16", ints.to(at::kShort)},
      {"i8", ints.to(at::kChar)},
      {"u8", at::randint(0, 256, {7}, at::kLong).to(at::kByte)},
      {"bool", at::randint(0, 2, {2, 3}, at::kLong).to(at::kBool)},
      {"scalar", at::scalar_tensor(3.5, at::kFloat)},
      {"empty", at::empty({0, 4}, at::kBFloat16)},
  };
}

TEST(Safetensors, ReadsTheReferenceGoldenFile) {
  const std::string golden = std::string(ODYSSEY_TESTDATA_DIR) + "/kda_golden.safetensors";
  auto file = read_safetensors(golden);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ(file->tensors.size(), 24u);
  EXPECT_NE(file->metadata.at("what").find("KDA"), std::string::npos);
  for (const std::string kase : {"random", "saturated", "no_decay"}) {
    for (const std::string part : {"q", "k", "v", "g", "beta", "initial_state", "expected_o",
                                   "expected_final_state"}) {
      ASSERT_TRUE(file->tensors.count(kase + "." + part)) << kase << "." << part;
    }
  }
  for (const auto& [name, tensor] : file->tensors) {
    EXPECT_EQ(tensor.scalar_type(), at::kDouble) << name;
    EXPECT_TRUE(tensor.is_contiguous()) << name;
    EXPECT_TRUE(tensor.isfinite().all().item<bool>()) << name;
  }
  const at::Tensor& q = file->tensors.at("random.q");
  EXPECT_EQ(q.sizes().vec(), (std::vector<int64_t>{50, 2, 16}));
  EXPECT_EQ(file->tensors.at("random.v").sizes().vec(), (std::vector<int64_t>{50, 2, 8}));
  EXPECT_EQ(file->tensors.at("random.beta").sizes().vec(), (std::vector<int64_t>{50, 2}));
  EXPECT_EQ(file->tensors.at("random.initial_state").sizes().vec(), (std::vector<int64_t>{2, 16, 8}));
  double worst = (q.norm(2, /*dim=*/{-1}) - 1.0).abs().max().item<double>();
  EXPECT_LT(worst, 1e-12) << "q rows are L2-normalised in the reference";

  auto header = read_safetensors_header(golden);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header->at("random.q").byte_size, 50u * 2 * 16 * 8);
  EXPECT_EQ(header->at("random.q").dtype, at::kDouble);
}

TEST_F(SafetensorsFixture, RoundTripIsBitExactForEveryDtype) {
  auto tensors = every_dtype();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "ünïcode ok"}};
  ASSERT_TRUE(write_safetensors(path("all.safetensors"), tensors, metadata).ok());
  auto file = read_safetensors(path("all.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ(file->metadata, metadata);
  ASSERT_EQ(file->tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(BitIdentical(tensor, file->tensors.at(name))) << name;
    EXPECT_TRUE(file->tensors.at(name).is_contiguous()) << name;
  }
  EXPECT_FALSE(fs::exists(path("all.safetensors.tmp")));
}

TEST_F(SafetensorsFixture, NonContiguousInputsAreWrittenInLogicalOrder) {
  at::Tensor base = at::arange(60, at::kFloat).reshape({3, 4, 5});
  std::map<std::string, at::Tensor> tensors = {
      {"transposed", base.transpose(0, 2)},
      {"strided", base.slice(/*dim=*/2, /*start=*/0, /*end=*/5, /*step=*/2)},
      {"offset", base[1]},
      {"expanded", at::arange(3, at::kBFloat16).unsqueeze(0).expand({4, 3})},
      {"permuted_bf16", base.to(at::kBFloat16).permute({1, 0, 2})},
  };
  ASSERT_TRUE(write_safetensors(path("views.safetensors"), tensors).ok());
  auto file = read_safetensors(path("views.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(BitIdentical(tensor.contiguous(), file->tensors.at(name))) << name;
  }
}

TEST_F(SafetensorsFixture, HeaderIsSpacePaddedAndTensorsAreAligned) {
  ASSERT_TRUE(write_safetensors(path("a.safetensors"), every_dtype(), {{"k", "v"}}).ok());
  std::string bytes = read_bytes(path("a.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  std::string header = bytes.substr(8, n);
  size_t json_end = header.find_last_of('}') + 1;
  EXPECT_LT(header.size() - json_end, 8u);
  EXPECT_EQ(header.substr(json_end), std::string(header.size() - json_end, ' '));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"k\":\"v\"}", 0), 0u) << "metadata first, compact, as the reference";
  auto parsed = nlohmann::json::parse(header);
  EXPECT_EQ(parsed["f32"]["dtype"], "F32");

  auto infos = read_safetensors_header(path("a.safetensors"));
  ASSERT_TRUE(infos.ok()) << infos.status().to_string();
  for (const auto& [name, info] : *infos) {
    EXPECT_EQ(info.data_begin % c10::elementSize(info.dtype), 0u) << name << " is not aligned";
  }
  EXPECT_EQ(infos->at("bf16").shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(infos->at("bf16").byte_size, 30u);
  EXPECT_EQ(infos->at("scalar").shape, std::vector<int64_t>{});
}

TEST_F(SafetensorsFixture, WriterRejectsWhatTheFormatCannotHold) {
  EXPECT_EQ(write_safetensors(path("x"), {{"c", at::zeros({2}, at::kComplexFloat)}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(write_safetensors(path("x"), {{"__metadata__", at::zeros({2})}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(write_safetensors(path("x"), {{"u", at::Tensor()}}).code(), StatusCode::kInvalidArgument);
  Status bad_utf8 = write_safetensors(path("x"), {{"ok", at::zeros({1})}}, {{"k", std::string("\xff\xfe")}});
  EXPECT_EQ(bad_utf8.code(), StatusCode::kInvalidArgument) << bad_utf8.to_string();
  EXPECT_FALSE(fs::exists(path("x")));
  EXPECT_FALSE(fs::exists(path("x.tmp")));
}

TEST_F(SafetensorsFixture, MissingFileIsNotFound) {
  auto file = read_safetensors(path("absent.safetensors"));
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find("absent.safetensors"), std::string::npos);
}

// Each damaged file must give kCorrupt, naming the file and saying what is wrong.
struct Corruption {
  const char* name;
  std::string bytes;
  const char* says;
};

TEST_F(SafetensorsFixture, EveryCorruptionIsReportedWithTheFileAndTheFault) {
  const std::string a8 = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::vector<Corruption> cases = {
      {"short", "abc", "shorter than the 8-byte header length"},
      {"length_beyond_file", length_prefix(1000) + "{}", "header length 1000 runs past the end of the file"},
      {"bad_json", raw_file("{\"a\": [", 0), "not valid JSON"},
      {"not_object", raw_file("[1, 2]  ", 0), "not a JSON object"},
      {"unknown_dtype", raw_file(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2),
       "tensor 'a': unknown dtype 'F8_E4M3'"},
      {"size_mismatch", raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 12),
       "tensor 'a': shape [2, 2] of F32 needs 16 bytes but \"data_offsets\" [0, 12] hold 12"},
      {"negative_dim", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "tensor 'a': \"shape\""},
      {"bad_offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", 8),
       "tensor 'a': \"data_offsets\" missing"},
      {"unknown_field", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8),
       "tensor 'a': unknown field 'x'"},
      {"overlap",
       raw_file("{" + a8 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {"gap", raw_file("{" + a8 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})", 20),
       "gap: data bytes [8, 12) before tensor 'b'"},
      {"gap_at_start", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "gap: data bytes [0, 4) before tensor 'a'"},
      {"trailing", raw_file("{" + a8 + "}", 11), "3 trailing bytes after the last tensor ('a')"},
      {"truncated_data", raw_file("{" + a8 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 13),
       "truncated: tensor 'b' needs data bytes [8, 16) but the file holds only 13"},
      {"duplicate", raw_file("{" + a8 + "," + a8 + "}", 8), "header names 'a' twice"},
      {"metadata_not_strings", raw_file(R"({"__metadata__":{"n":3},)" + a8 + "}", 8),
       "\"__metadata__\" entry 'n' is number"},
      {"bool_byte", raw_file(R"({"a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", 2),
       "tensor 'a': BOOL element 0 holds byte 1"},
  };
  // raw_file fills with 0x01, a valid BOOL; make that case hold a 2.
  cases.back().bytes.back() = '\x02';
  cases.back().says = "tensor 'a': BOOL element 1 holds byte 2, not 0 or 1";
  for (const Corruption& c : cases) {
    const std::string file = path(std::string(c.name) + ".safetensors");
    write_bytes(file, c.bytes);
    auto result = read_safetensors(file);
    ASSERT_FALSE(result.ok()) << c.name;
    EXPECT_EQ(result.status().code(), StatusCode::kCorrupt) << c.name << ": " << result.status().to_string();
    EXPECT_NE(result.status().message().find(file), std::string::npos) << c.name << ": "
                                                                       << result.status().message();
    EXPECT_NE(result.status().message().find(c.says), std::string::npos)
        << c.name << ": got '" << result.status().message() << "', wanted '" << c.says << "'";
    if (std::string(c.name) != "bool_byte") {
      EXPECT_FALSE(read_safetensors_header(file).ok()) << c.name << ": the header reader must refuse it too";
    }
  }
}

TEST_F(SafetensorsFixture, TruncatingAWrittenFileNamesTheFirstTensorCut) {
  std::map<std::string, at::Tensor> tensors = {{"w1", at::ones({64}, at::kFloat)}, {"w2", at::ones({64}, at::kFloat)}};
  ASSERT_TRUE(write_safetensors(path("t.safetensors"), tensors).ok());
  std::string bytes = read_bytes(path("t.safetensors"));
  write_bytes(path("t.safetensors"), bytes.substr(0, bytes.size() - 300));
  auto result = read_safetensors(path("t.safetensors"));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("truncated: tensor 'w1'"), std::string::npos)
      << result.status().message();
}

TEST_F(SafetensorsFixture, PaddedHeaderWithSpacesAndEmptyFileAreAccepted) {
  write_bytes(path("empty.safetensors"), raw_file("{}      ", 0));
  auto empty = read_safetensors(path("empty.safetensors"));
  ASSERT_TRUE(empty.ok()) << empty.status().to_string();
  EXPECT_TRUE(empty->tensors.empty());
  ASSERT_TRUE(write_safetensors(path("none.safetensors"), {}).ok());
  EXPECT_TRUE(read_safetensors(path("none.safetensors")).ok());
}

TEST_F(SafetensorsFixture, RewritingReplacesTheFileWhole) {
  ASSERT_TRUE(write_safetensors(path("r.safetensors"), {{"a", at::zeros({1000})}}).ok());
  ASSERT_TRUE(write_safetensors(path("r.safetensors"), {{"b", at::ones({3})}}).ok());
  auto file = read_safetensors(path("r.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  ASSERT_EQ(file->tensors.size(), 1u);
  EXPECT_TRUE(BitIdentical(at::ones({3}), file->tensors.at("b")));
}

// The reference Python implementation reads our files and writes files we read. Needs python3
// with `safetensors`, `torch` and `numpy` (the GPU machine); opt in with
// ODYSSEY_PYTHON_SAFETENSORS=1.
class SafetensorsInterop : public SafetensorsFixture {
 protected:
  void SetUp() override {
    const char* enabled = std::getenv("ODYSSEY_PYTHON_SAFETENSORS");
    if (enabled == nullptr || std::string(enabled) != "1") {
      GTEST_SKIP() << "set ODYSSEY_PYTHON_SAFETENSORS=1 to check against Python safetensors (needs python3 with "
                      "safetensors, torch, numpy)";
    }
    SafetensorsFixture::SetUp();
  }

  // Runs the interop script; returns its stdout, fails the test on a non-zero exit.
  std::string run_script(const std::string& args) {
    const std::string script = std::string(ODYSSEY_SOURCE_DIR) + "/tests/model/safetensors_interop.py";
    const std::string command = "python3 " + script + " " + args + " 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    EXPECT_NE(pipe, nullptr);
    if (pipe == nullptr) return "";
    std::string output;
    std::array<char, 4096> buffer;
    size_t n;
    while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output.append(buffer.data(), n);
    int rc = ::pclose(pipe);
    EXPECT_EQ(rc, 0) << command << "\n" << output;
    return output;
  }
};

// The script prints "tensor <name> <dtype> <shape> <byte sum>" per tensor; so do we.
std::string describe(const std::string& name, const at::Tensor& tensor) {
  at::Tensor bytes = tensor.contiguous();
  uint64_t sum = 0;
  const unsigned char* data = static_cast<const unsigned char*>(bytes.data_ptr());
  for (int64_t i = 0; i < bytes.numel() * bytes.element_size(); ++i) sum += data[i];
  std::vector<int64_t> shape = tensor.sizes().vec();
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? "," : "") + std::to_string(shape[i]);
  return "tensor " + name + " " + *safetensors_dtype_name(tensor.scalar_type()) + " [" + dims + "] " +
         std::to_string(sum);
}

TEST_F(SafetensorsInterop, PythonReadsWhatWeWrite) {
  auto tensors = every_dtype();
  tensors.erase("empty");  // older safetensors releases refuse zero-sized torch views
  ASSERT_TRUE(write_safetensors(path("ours.safetensors"), tensors, {{"format", "pt"}, {"stage", "8K"}}).ok());
  std::string output = run_script("read " + path("ours.safetensors"));
  for (const auto& [name, tensor] : tensors) {
    EXPECT_NE(output.find(describe(name, tensor) + "\n"), std::string::npos) << describe(name, tensor) << "\n"
                                                                             << output;
  }
  EXPECT_NE(output.find("metadata stage=8K\n"), std::string::npos) << output;
  EXPECT_NE(output.find("numpy ok\n"), std::string::npos) << output;
}

TEST_F(SafetensorsInterop, WeReadWhatPythonWrites) {
  std::string output = run_script("write " + path("torch.safetensors") + " " + path("numpy.safetensors"));
  // The script's tensors: arange(24) reshaped [2, 3, 4], shifted and cast (see the script).
  at::Tensor base = at::arange(24, at::kDouble).reshape({2, 3, 4});
  std::map<std::string, at::Tensor> expected = {
      {"f64", (base - 7) * 0.5},
      {"f32", ((base - 7) * 0.5).to(at::kFloat)},
      {"f16", ((base - 7) * 0.5).to(at::kHalf)},
      {"bf16", ((base - 7) * 0.5).to(at::kBFloat16)},
      {"i64", (base - 7).to(at::kLong)},
      {"i32", (base - 7).to(at::kInt)},
      {"i16", (base - 7).to(at::kShort)},
      {"i8", (base - 7).to(at::kChar)},
      {"u8", base.to(at::kByte)},
      {"bool", base.to(at::kLong).remainder(3).eq(0)},
      {"transposed", ((base - 7) * 0.5).to(at::kFloat).transpose(0, 2).contiguous()},
  };
  for (const char* file : {"torch.safetensors", "numpy.safetensors"}) {
    auto read = read_safetensors(path(file));
    ASSERT_TRUE(read.ok()) << read.status().to_string() << "\n" << output;
    EXPECT_EQ(read->metadata.at("writer"), "python") << file;
    for (const auto& [name, tensor] : expected) {
      if (std::string(file) == "numpy.safetensors" && name == "bf16") {
        EXPECT_FALSE(read->tensors.count(name)) << "numpy has no bfloat16";
        continue;
      }
      ASSERT_TRUE(read->tensors.count(name)) << file << " lacks " << name;
      EXPECT_TRUE(BitIdentical(tensor, read->tensors.at(name))) << file << ": " << name;
    }
  }
}

}  // namespace
}  // namespace odyssey::model
