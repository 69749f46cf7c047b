// DecoderStack: every decoder layer of a Llama-family model in one call from Python.
//
// Why: at one row a step's work is ~10 small ops per layer, 30 layers. Each op is a few microseconds of
// compiled work, but reaching it from Python -- the module's forward, the wrapper's checks, pybind, the
// dispatcher -- costs about as much again: measured on the default model (gguf, 2 threads, one decode at
// 330 tokens of context), the layers took 12.5 ms through the nn.Modules, 10.9 ms calling the same
// torch.ops from a bare Python loop, and 8.4 ms in the GEMMs and attention alone. Here the same ops run
// in the same order on the same tensors, called through the dispatcher from C++, so the result is the
// per-module path's to the bit (tests/test_decoder_stack.py compares the two); only the Python goes.
//
// It covers the common configuration only: panel-packed linears without bias, no q/k norm, the compiled
// attention kernel, one process (no tensor parallelism). The model keeps its modules and falls back to
// them for anything else (pagedkv/model/decoder_stack.py decides).
//
// The ops live in two libraries (the GEMM's needs AVX2), so they are found by name through the dispatcher
// when the first step runs, not linked: this file builds wherever the portable library does.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops a layer runs, looked up once, by the C++ signatures their files register them with.
using Tensor = at::Tensor;
using RmsNorm = Tensor(const Tensor&, const Tensor&, double, const std::optional<Tensor>&);
using PanelLinear = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t);
using Rope = Tensor&(Tensor&, const Tensor&, const Tensor&);
using WriteKv = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using PagedAttention = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              double);
using SiluMul = Tensor(const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("pagedkv::rms_norm");
  c10::TypedOperatorHandle<PanelLinear> panel_linear = find_op<PanelLinear>("pagedkv::panel_linear");
  c10::TypedOperatorHandle<Rope> rope_ = find_op<Rope>("pagedkv::rope_");
  c10::TypedOperatorHandle<WriteKv> write_kv = find_op<WriteKv>("pagedkv::write_kv");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = find_op<PagedAttention>("pagedkv::paged_attention");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find_op<SiluMul>("pagedkv::silu_mul");
};

// A packed weight and what panel_linear needs to read it.
struct Panel {
  Tensor packed;
  int64_t n, k, format;
  Tensor operator()(const Ops& ops, const Tensor& x) const { return ops.panel_linear.call(x, packed, n, k, format); }
};

struct Layer {
  Tensor input_norm, post_norm;
  Panel qkv, o, gate_up, down;
};

constexpr int64_t kPanelsPerLayer = 4;  // qkv, o, gate_up, down

class DecoderStack : public torch::CustomClassHolder {
 public:
  // norms: [input_layernorm, post_attention_layernorm] per layer; packed: [qkv, o, gate_up, down] per layer,
  // and dims (n, k, format) for each of them in the same order.
  DecoderStack(const std::vector<Tensor>& norms, const std::vector<Tensor>& packed,
               const std::vector<int64_t>& dims, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    const size_t layers = norms.size() / 2;
    TORCH_CHECK_VALUE(norms.size() == 2 * layers && packed.size() == kPanelsPerLayer * layers &&
                          dims.size() == 3 * packed.size(),
                      "DecoderStack: need 2 norms, 4 packed weights and 12 dims per layer");
    TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                      "DecoderStack: query heads must be a positive multiple of KV heads");
    const auto panel = [&](size_t i) { return Panel{packed[i], dims[3 * i], dims[3 * i + 1], dims[3 * i + 2]}; };
    for (size_t l = 0; l < layers; ++l) {
      const size_t p = kPanelsPerLayer * l;
      layers_.push_back({norms[2 * l], norms[2 * l + 1], panel(p), panel(p + 1), panel(p + 2), panel(p + 3)});
    }
  }

  // The KV pools the layers write and read, one (k, v) per layer; bound again only when the caller's change.
  void bind_pools(const std::vector<Tensor>& k_pools, const std::vector<Tensor>& v_pools) {
    TORCH_CHECK_VALUE(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
                      "DecoderStack: need one k and one v pool per layer (", layers_.size(), "), got ",
                      k_pools.size(), " and ", v_pools.size());
    k_pools_ = k_pools;
    v_pools_ = v_pools;
  }

  // h [T, hidden] (updated in place and returned): the residual stream after every layer. cos, sin_signed as
  // RotaryEmbedding.tables gives them; the rest is the step's AttentionMetadata.
  Tensor forward(Tensor h, const Tensor& cos, const Tensor& sin_signed, const Tensor& slot_mapping,
                     const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc) {
    TORCH_CHECK_VALUE(k_pools_.size() == layers_.size(), "DecoderStack: bind_pools first");
    TORCH_CHECK_VALUE(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
                      "DecoderStack: h must be a contiguous float32 [T, hidden] tensor");
    if (!ops_) ops_.emplace();  // here, not in the constructor: the GEMM's library may load after this one
    const Ops& ops = *ops_;
    const int64_t tokens = h.size(0), qk_heads = num_heads_ + num_kv_heads_;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // attention: LlamaDecoderLayer.forward -> LlamaAttention.forward -> KernelAttention.forward
      const Tensor qkv = layer.qkv(ops, ops.rms_norm.call(h, layer.input_norm, eps_, std::nullopt))
                                 .view({tokens, -1, head_dim_});
      Tensor qk = qkv.narrow(1, 0, qk_heads);
      ops.rope_.call(qk, cos, sin_signed);
      ops.write_kv.call(k_pools_[l], v_pools_[l], slot_mapping, qk.narrow(1, num_heads_, num_kv_heads_),
                        qkv.narrow(1, qk_heads, num_kv_heads_));
      const Tensor attended = ops.paged_attention.call(qk.narrow(1, 0, num_heads_), k_pools_[l], v_pools_[l],
                                                           block_tables, seq_lens, query_start_loc, scale_);
      const Tensor out = layer.o(ops, attended.view({tokens, -1}));
      // MLP: h += out, normalised; then h += down(silu(gate) * up)
      const Tensor x = ops.rms_norm.call(out, layer.post_norm, eps_, h);
      h.add_(layer.down(ops, ops.silu_mul.call(layer.gate_up(ops, x))));
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
  std::vector<Tensor> k_pools_, v_pools_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::optional<Ops> ops_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t,
                       int64_t, double, double>())
      .def("bind_pools", &DecoderStack::bind_pools)
      .def("forward", &DecoderStack::forward);
}
