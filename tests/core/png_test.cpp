#include "core/png.h"

#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace odyssey {
namespace {

uint32_t be32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) | (uint32_t(uint8_t(s[at + 2])) << 8) |
         uint32_t(uint8_t(s[at + 3]));
}

TEST(Png, EncodesSignatureHeaderAndChunksWithValidCrcs) {
  Canvas c(7, 3, {10, 20, 30});
  c.set(2, 1, {255, 0, 0});
  auto png = encode_png(c.rgb(), c.width(), c.height());
  ASSERT_TRUE(png.ok()) << png.status().to_string();
  const std::string& s = *png;
  ASSERT_EQ(s.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(s.substr(12, 4), "IHDR");
  EXPECT_EQ(be32(s, 16), 7u);
  EXPECT_EQ(be32(s, 20), 3u);
  EXPECT_EQ(s.substr(s.size() - 8, 4), "IEND");
  // The IEND chunk's CRC is a known constant.
  EXPECT_EQ(be32(s, s.size() - 4), 0xAE426082u);
}

TEST(Png, PythonsDecoderReadsThePixelsBack) {
  // A second, independent decoder: Python's zlib + struct (always present with python3).
  Canvas c(5, 4, {255, 255, 255});
  c.line(0, 0, 4, 3, {0, 0, 255});
  c.set(4, 0, {1, 2, 3});
  const std::string path = ::testing::TempDir() + "/png_test_" + std::to_string(::getpid()) + ".png";
  ASSERT_TRUE(write_png(path, c).ok());
  const std::string script =
      "import zlib,struct,sys\n"
      "d=open(sys.argv[1],'rb').read(); p=8; idat=b''\n"
      "while p<len(d):\n"
      "  n=struct.unpack('>I',d[p:p+4])[0]; t=d[p+4:p+8]; body=d[p+8:p+8+n]\n"
      "  assert zlib.crc32(t+body)&0xffffffff==struct.unpack('>I',d[p+8+n:p+12+n])[0]\n"
      "  idat+=body if t==b'IDAT' else b''; p+=12+n\n"
      "raw=zlib.decompress(idat); w=5\n"
      "row=lambda y: raw[y*(w*3+1)+1:(y+1)*(w*3+1)]\n"
      "print(list(row(0)[0:3]), list(row(0)[12:15]), list(row(3)[12:15]), list(row(1)[0:3]))\n";
  const std::string script_path = path + ".py";
  std::ofstream(script_path) << script;
  FILE* p = ::popen(("python3 " + script_path + " " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, p);
  ::pclose(p);
  EXPECT_EQ(std::string(buf, n), "[0, 0, 255] [1, 2, 3] [0, 0, 255] [255, 255, 255]\n");
  std::filesystem::remove(path);
  std::filesystem::remove(script_path);
}

TEST(Png, TextDrawsGlyphPixelsAndRejectsMismatchedBuffers) {
  Canvas c(40, 10);
  const int w = c.text(1, 1, "A1", {0, 0, 0});
  EXPECT_EQ(w, 12);
  int dark = 0;
  for (int y = 0; y < 10; ++y)
    for (int x = 0; x < 40; ++x) dark += c.get(x, y).r == 0;
  EXPECT_GT(dark, 10);
  auto bad = encode_png(std::vector<uint8_t>(5), 2, 2);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("2x2"), std::string::npos);
}

}  // namespace
}  // namespace odyssey
