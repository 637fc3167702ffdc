// KDA against independent fp64 golden values (tests/data/kda_golden.safetensors, see the README
// there): recurrent and chunked must both reproduce them.
#include <cmath>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "model/kda.h"
#include "model/safetensors.h"

namespace odyssey::model {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(Kda, RecurrentAndChunkedMatchGoldenValuesInFp64) {
  const std::string path = std::string(ODYSSEY_TESTDATA_DIR) + "/kda_golden.safetensors";
  auto file = read_safetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  for (const std::string name : {"random", "saturated", "no_decay"}) {
    // The file holds one sequence per case, [T, H, *] and states [H, K, V]: add the batch axis.
    auto get = [&](const std::string& field) {
      auto it = file->tensors.find(name + "." + field);
      EXPECT_NE(it, file->tensors.end()) << name << "." << field;
      if (it == file->tensors.end()) return at::Tensor();
      EXPECT_EQ(it->second.scalar_type(), at::kDouble) << name << "." << field;
      return it->second.unsqueeze(0);
    };
    const at::Tensor q = get("q"), k = get("k"), v = get("v"), g = get("g"), beta = get("beta"),
                     initial_state = get("initial_state"), expected_o = get("expected_o"),
                     expected_state = get("expected_final_state");
    ASSERT_TRUE(expected_state.defined());
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto rec = kda::recurrent(q, k, v, g, beta, initial_state, scale);
    const auto chk = kda::chunked(q, k, v, g, beta, initial_state, scale, /*chunk=*/16);
    const double diffs[] = {max_abs_diff(rec.o, expected_o),
                            max_abs_diff(rec.final_state, expected_state),
                            max_abs_diff(chk.o, expected_o),
                            max_abs_diff(chk.final_state, expected_state)};
    std::printf("  golden %-10s T=%-3lld max |diff| recurrent o %.3e state %.3e, "
                "chunked o %.3e state %.3e\n",
                name.c_str(), static_cast<long long>(q.size(1)), diffs[0], diffs[1], diffs[2],
                diffs[3]);
    for (double diff : diffs) EXPECT_LT(diff, 1e-10) << name;
  }
}

}  // namespace
}  // namespace odyssey::model
