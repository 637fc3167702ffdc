// How many parts a walk along the tokens is cut into, for the KDA layer's kernels whose backward
// threads each walk one part of a column (the short convolution, kda_conv.cu; the decay gate,
// kda_gate.cu) and sum their parameter gradients over it, the parts added in order afterwards.
//
// Parts of `per_part` units (positions or tokens), at most `max_parts`; where those would leave
// the GPU short of threads (a learner chunk: one sequence of 2048 tokens and 1024 channels made 66
// CTAs of 64-step walks), more and shorter parts, down to `min_per_part` units, until
// `kWalkFillThreads` threads are in flight. A function of the shape alone, never of the GPU, so a
// gradient's order of sums is the same every run and on every card.
#pragma once

#include <algorithm>
#include <cstdint>

namespace odyssey::kernels {

inline constexpr int64_t kWalkFillThreads = int64_t{1} << 17;  // ~a GPU's worth of threads in flight

// `units` along the walk; `threads_per_part` the threads one part of the walk takes (the columns'
// pieces, times the batch where each sequence walks apart).
inline int64_t walk_parts(int64_t units, int64_t threads_per_part, int64_t per_part, int64_t min_per_part,
                          int64_t max_parts) {
  const int64_t by_length = (units + per_part - 1) / per_part;
  const int64_t threads = std::max<int64_t>(1, threads_per_part);
  const int64_t to_fill = (kWalkFillThreads + threads - 1) / threads;
  const int64_t most = std::min(max_parts, (units + min_per_part - 1) / min_per_part);
  return std::clamp<int64_t>(std::max(by_length, to_fill), 1, std::max<int64_t>(1, most));
}

}  // namespace odyssey::kernels
