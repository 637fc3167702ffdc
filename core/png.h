// PNG images: an RGB canvas with the few drawing operations plots need (lines, rectangles,
// 5x7 bitmap text), and a PNG encoder (zlib deflate, CRC-32) that any viewer reads.
//
// Coordinates are pixels, (0, 0) top left; drawing outside the canvas is clipped. Text knows
// ASCII letters (drawn as capitals), digits and common punctuation; other characters draw as
// a box. Not thread-safe; a canvas belongs to one thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace odyssey {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = {255, 255, 255});
  int width() const { return width_; }
  int height() const { return height_; }
  const std::vector<uint8_t>& rgb() const { return pixels_; }  // width * height * 3, row-major

  void set(int x, int y, Rgb c);
  Rgb get(int x, int y) const;
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1);
  void rect(int x0, int y0, int x1, int y1, Rgb c);         // outline
  void fill(int x0, int y0, int x1, int y1, Rgb c);         // filled, inclusive corners
  // Text with its top-left corner at (x, y); `scale` multiplies the 5x7 glyphs. Returns the width drawn.
  int text(int x, int y, std::string_view s, Rgb c, int scale = 1);
  static int text_width(std::string_view s, int scale = 1) { return static_cast<int>(s.size()) * 6 * scale; }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;
};

// The PNG file bytes of an 8-bit RGB image (width * height * 3 bytes).
Result<std::string> encode_png(const std::vector<uint8_t>& rgb, int width, int height);
// encode_png, written to `path` (temp file + rename).
Status write_png(const std::string& path, const Canvas& canvas);

}  // namespace odyssey
