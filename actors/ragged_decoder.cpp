#include "actors/ragged_decoder.h"

#include <cstring>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "model/attn_res.h"
#include "model/vision.h"

namespace odyssey::actors {

namespace {

// The KDA state of layer `layer` of every sequence, stacked into one batch.
model::KdaState stack_kda(const std::vector<model::PolicyState*>& states, size_t layer) {
  if (states.size() == 1) return states[0]->kda[layer];
  std::vector<at::Tensor> recurrent, q, k, v;
  for (const model::PolicyState* s : states) {
    const model::KdaState& k_state = s->kda[layer];
    recurrent.push_back(k_state.recurrent);
    q.push_back(k_state.q_conv_inputs);
    k.push_back(k_state.k_conv_inputs);
    v.push_back(k_state.v_conv_inputs);
  }
  return {at::cat(recurrent, 0), at::cat(q, 0), at::cat(k, 0), at::cat(v, 0)};
}

// Gives each sequence its row of the stepped batch state back.
void unstack_kda(const model::KdaState& stacked, const std::vector<model::PolicyState*>& states, size_t layer) {
  if (states.size() == 1) {
    states[0]->kda[layer] = stacked;
    return;
  }
  for (size_t b = 0; b < states.size(); ++b) {
    const auto row = static_cast<int64_t>(b);
    model::KdaState& s = states[b]->kda[layer];
    s.recurrent = stacked.recurrent.narrow(0, row, 1);
    s.q_conv_inputs = stacked.q_conv_inputs.narrow(0, row, 1);
    s.k_conv_inputs = stacked.k_conv_inputs.narrow(0, row, 1);
    s.v_conv_inputs = stacked.v_conv_inputs.narrow(0, row, 1);
  }
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  bool u32(uint32_t& v) { return uint(v, 4); }
  bool u64(uint64_t& v) { return uint(v, 8); }
  bool take(uint64_t n, std::string_view& out) {
    if (n > bytes_.size() - at_) return false;
    out = bytes_.substr(at_, n);
    at_ += n;
    return true;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  template <typename T>
  bool uint(T& v, size_t n) {
    if (n > bytes_.size() - at_) return false;
    v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<T>(static_cast<uint8_t>(bytes_[at_ + i])) << (8 * i);
    at_ += n;
    return true;
  }
  std::string_view bytes_;
  size_t at_ = 0;
};

constexpr char kMagic[4] = {'O', 'D', 'K', 'S'};
constexpr uint32_t kSnapshotVersion = 1;

}  // namespace

RaggedDecoder::RaggedDecoder(model::Policy policy) : policy_(std::move(policy)) {}

model::PolicyState RaggedDecoder::start(int64_t reserve_tokens) const {
  return policy_->initial_state(/*batch=*/1, reserve_tokens);
}

at::Tensor RaggedDecoder::forward_chunk(model::PolicyState& state, const std::vector<uint32_t>& tokens,
                                        const std::vector<uint8_t>& image_mask, const at::Tensor& image_embeddings) {
  TORCH_CHECK(!tokens.empty(), "RaggedDecoder::forward_chunk: no tokens");
  TORCH_CHECK(image_mask.empty() || image_mask.size() == tokens.size(), "RaggedDecoder::forward_chunk: image mask of ",
              image_mask.size(), " entries for ", tokens.size(), " tokens");
  c10::NoGradGuard no_grad;
  const at::Device device = policy_->embed->weight.device();
  const auto t = static_cast<int64_t>(tokens.size());
  const at::Tensor ids =
      at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong).view({1, t}).to(device);
  at::Tensor mask, embeddings;
  size_t patches = 0;
  for (uint8_t m : image_mask) patches += m != 0;
  if (patches > 0) {
    TORCH_CHECK(image_embeddings.defined() && image_embeddings.size(0) == static_cast<int64_t>(patches),
                "RaggedDecoder::forward_chunk: ", patches, " image patch positions but ",
                image_embeddings.defined() ? image_embeddings.size(0) : 0, " embeddings");
    std::vector<uint8_t> m(image_mask.begin(), image_mask.end());
    mask = at::tensor(at::ArrayRef<uint8_t>(m), at::kByte).to(at::kBool).view({1, t}).to(device);
    embeddings = image_embeddings;
  }
  const at::Tensor logits = policy_->forward_chunk(ids, state, embeddings, mask);
  return logits.select(0, 0).select(0, t - 1);
}

at::Tensor RaggedDecoder::step(const std::vector<model::PolicyState*>& states, const std::vector<uint32_t>& tokens) {
  TORCH_CHECK(!states.empty() && states.size() == tokens.size(), "RaggedDecoder::step: ", states.size(),
              " states for ", tokens.size(), " tokens");
  for (const model::PolicyState* s : states)
    TORCH_CHECK(s != nullptr && s->batch == 1, "RaggedDecoder::step: every state must be a batch-1 sequence state");
  c10::NoGradGuard no_grad;
  model::PolicyImpl& p = *policy_;
  const model::ModelConfig& config = p.config();
  const at::Device device = p.embed->weight.device();
  const auto B = static_cast<int64_t>(states.size());
  const at::Tensor ids = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong).to(device);

  // The layer order of PolicyImpl::run in its step form (model/policy.cpp), with each
  // layer's attention state gathered per kind.
  model::AttnResStream stream(p.embed_tokens(ids), config.attn_res_block_size, config.rms_norm_eps);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    model::PolicyLayerImpl& layer = *p.layer(i);
    const auto li = static_cast<size_t>(i);
    stream.begin_layer(i);
    const at::Tensor a_in = layer.attn_norm->forward(stream.mix(layer.attn_mix));
    at::Tensor a;
    if (layer.attention_kind() == model::AttentionKind::kKda) {
      model::KdaState stacked = stack_kda(states, li);
      a = layer.kda->step(a_in, stacked);
      unstack_kda(stacked, states, li);
    } else {
      std::vector<at::Tensor> rows;
      rows.reserve(states.size());
      for (int64_t b = 0; b < B; ++b)
        rows.push_back(layer.mla->step(a_in.narrow(0, b, 1), states[static_cast<size_t>(b)]->mla[li]));
      a = B == 1 ? rows[0] : at::cat(rows, 0);
    }
    stream.add(a);
    const at::Tensor f_in = layer.ffn_norm->forward(stream.mix(layer.ffn_mix));
    if (layer.ffn_kind() == model::FfnKind::kDense) {
      stream.add(layer.ffn->forward(f_in));
    } else {
      stream.add(layer.moe->forward(f_in).y);
    }
  }
  at::Tensor logits = p.lm_head->forward(p.norm->forward(stream.mix(p.out_mix)));
  for (model::PolicyState* s : states) s->tokens += 1;
  return logits;
}

bool RaggedDecoder::has_vision() const { return !policy_->vision.is_empty(); }

at::Tensor RaggedDecoder::image_embeddings(const at::Tensor& pixels) {
  if (!has_vision()) return {};
  TORCH_CHECK(pixels.dim() == 3, "RaggedDecoder::image_embeddings: pixels must be [C, H, W], got ", pixels.sizes());
  c10::NoGradGuard no_grad;
  const at::Tensor w = policy_->embed->weight;
  const at::Tensor out = policy_->vision->encode(pixels.unsqueeze(0).to(w.device(), w.scalar_type()));
  return out.select(0, 0);
}

int64_t RaggedDecoder::image_patches(int64_t height, int64_t width) const {
  const int64_t patch = has_vision() && policy_->config().vision.patch_size > 0 ? policy_->config().vision.patch_size : 16;
  return model::vision_num_patches(patch, height, width);
}

// Layout (little-endian): "ODKS", u32 version = 1, u32 count, then per KDA layer in ascending
// order: u32 layer index, u64 size, KdaState::to_bytes() (model/kda.h: self-describing tensors).
std::string kda_state_snapshot(const model::PolicyState& state) {
  std::string out(kMagic, sizeof(kMagic));
  put_u32(out, kSnapshotVersion);
  uint32_t count = 0;
  for (const model::KdaState& s : state.kda) count += s.recurrent.defined();
  put_u32(out, count);
  for (size_t i = 0; i < state.kda.size(); ++i) {
    if (!state.kda[i].recurrent.defined()) continue;
    const std::string bytes = state.kda[i].to_bytes();
    put_u32(out, static_cast<uint32_t>(i));
    put_u64(out, bytes.size());
    out += bytes;
  }
  return out;
}

Result<std::map<int64_t, model::KdaState>> parse_kda_state_snapshot(std::string_view bytes) {
  auto corrupt = [](const std::string& what) {
    return Status(StatusCode::kCorrupt, std::string(kKdaSnapshotFormat) + " snapshot: " + what);
  };
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return corrupt("does not start with ODKS");
  Reader r(bytes.substr(sizeof(kMagic)));
  uint32_t version = 0, count = 0;
  if (!r.u32(version) || !r.u32(count)) return corrupt("truncated header");
  if (version != kSnapshotVersion) return corrupt(fmt::format("version {} (this build reads {})", version, kSnapshotVersion));
  std::map<int64_t, model::KdaState> out;
  for (uint32_t j = 0; j < count; ++j) {
    uint32_t layer = 0;
    uint64_t size = 0;
    std::string_view body;
    if (!r.u32(layer) || !r.u64(size) || !r.take(size, body)) return corrupt(fmt::format("entry {} is truncated", j));
    auto state = model::KdaState::from_bytes(std::string(body));
    if (!state.ok()) return state.status().with_context(fmt::format("{} snapshot, layer {}", kKdaSnapshotFormat, layer));
    if (!out.emplace(layer, std::move(state).value()).second) return corrupt(fmt::format("layer {} appears twice", layer));
  }
  if (!r.done()) return corrupt("trailing bytes after the last entry");
  return out;
}

}  // namespace odyssey::actors
