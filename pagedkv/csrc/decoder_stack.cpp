// DecoderStack: every decoder layer of a Llama-family model in one call from Python.
//
// Why: at one row a step's work is ~10 small ops per layer, 30 layers. Each op is a few microseconds of
// compiled work, but reaching it from Python -- the module's forward, the wrapper's checks, pybind, the
// dispatcher -- costs about as much again: measured on the default model (gguf, 2 threads, one decode at
// 330 tokens of context), the layers took 12.5 ms through the nn.Modules, 10.9 ms calling the same
// torch.ops from a bare Python loop, and 8.4 ms in the GEMMs and attention alone. Here the same ops run
// in the same order on the same tensors, called through the dispatcher from C++, so the result is the
// per-module path's to the bit (tests/model/test_decoder_stack.py compares the two); only the Python goes.
//
// It covers every Llama-family layer the panel GEMM serves whole: each linear packed in one part or in
// several stacked by output rows (a GGUF file's fused q|k|v or gate|up whose parts it stores in different
// types, as every Q4_K_M file does), with or without a bias (Qwen2's q/k/v, Llama's attention_bias and
// mlp_bias), and Qwen3's q/k norm -- all run through the very ops the modules call, so they cost nothing
// in exactness. Gemma 3's layers too: the attention output and the MLP's output normalised before their adds
// (four norms a layer), GeLU-tanh in the MLP (torch's gelu and mul, as GatedMLP runs them), each layer's own
// attention window and RoPE table. Gemma is where the Python costs most: its 270M model spends a third of its
// weights' time per decode step in ~200 small ops. What it leaves to the modules
// (pagedkv/model/decoder_stack.py decides): torch's GEMM (weights not packed), torch's attention and norms,
// tensor parallelism (the row-parallel all-reduce is Python's). A partial rotary factor (Phi-4-mini rotates the
// first 3/4 of each head) is the modules' too: the same rope_ on the same strided view of each head's leading
// `rotary_dim` dimensions.
//
// The ops live in two libraries (the GEMM's needs AVX2), so they are found by name through the dispatcher
// when the first step runs, not linked: this file builds wherever the portable library does.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/rms_norm.h>
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
using PanelLinearInto = void(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, Tensor&, int64_t);
using Rope = Tensor&(Tensor&, const Tensor&, const Tensor&);
using WriteKv = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using PagedAttention = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              double, int64_t);
using SiluMul = Tensor(const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("pagedkv::rms_norm");
  c10::TypedOperatorHandle<PanelLinear> panel_linear = find_op<PanelLinear>("pagedkv::panel_linear");
  c10::TypedOperatorHandle<PanelLinearInto> panel_linear_into = find_op<PanelLinearInto>("pagedkv::panel_linear_into");
  // weight_format "gguf-int8": the file's blocks repacked, dotted with int8 activations (int8_linear.cpp)
  c10::TypedOperatorHandle<PanelLinear> int8_linear = find_op<PanelLinear>("pagedkv::int8_linear");
  c10::TypedOperatorHandle<PanelLinearInto> int8_linear_into = find_op<PanelLinearInto>("pagedkv::int8_linear_into");
  c10::TypedOperatorHandle<Rope> rope_ = find_op<Rope>("pagedkv::rope_");
  c10::TypedOperatorHandle<WriteKv> write_kv = find_op<WriteKv>("pagedkv::write_kv");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = find_op<PagedAttention>("pagedkv::paged_attention");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find_op<SiluMul>("pagedkv::silu_mul");
};

// One part of a packed weight (its rows of the output) and what the GEMM needs to read it. Formats from
// kInt8FormatBase on (panel.INT8_REPACKED_BASE) are a GGUF file's blocks repacked for the int8-activation GEMM, the
// others panel formats.
constexpr int64_t kInt8FormatBase = 128;

struct Part {
  Tensor packed;
  int64_t n, k, format;

  bool int8() const { return format >= kInt8FormatBase; }
};

// A linear layer as Linear.forward runs it on panels (see _panel_forward in pagedkv/model/layers.py): one part
// returns the GEMM's own output; several write their columns of one output, in row order; then the bias.
struct Linear {
  std::vector<Part> parts;
  int64_t out_features = 0;  // the parts' n summed
  std::optional<Tensor> bias;

  Tensor operator()(const Ops& ops, const Tensor& x) const {
    Tensor y;
    if (parts.size() == 1) {
      const Part& p = parts.front();
      y = (p.int8() ? ops.int8_linear : ops.panel_linear).call(x, p.packed, p.n, p.k, p.format);
    } else {
      y = x.new_empty({x.size(0), out_features});
      int64_t col = 0;
      for (const Part& p : parts) {
        (p.int8() ? ops.int8_linear_into : ops.panel_linear_into).call(x, p.packed, p.n, p.k, p.format, y, col);
        col += p.n;
      }
    }
    if (bias) y.add_(*bias);
    return y;
  }
};

struct Layer {
  // input_norm: the attention's input. post_norm: the MLP's input (Llama), or the attention's output (Gemma).
  Tensor input_norm, post_norm;
  std::optional<Tensor> qk_norm;  // Qwen3's and Gemma's q_norm and k_norm weights, one row per head: [Hq + Hkv, D]
  // Gemma's sandwich: the MLP's input norm (with the residual add) and its output's norm; both or neither
  std::optional<Tensor> pre_mlp_norm, post_mlp_norm;
  int64_t window;  // the attention window (0: the whole context)
  int64_t rope;    // which of forward's cos/sin tables rotates this layer's q and k
  bool gelu;       // GeLU-tanh (Gemma) instead of SiLU as the gate's activation
  Linear qkv, o, gate_up, down;
};

constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down

class DecoderStack : public torch::CustomClassHolder {
 public:
  // rotary_dim: how many leading dimensions of each q/k head RoPE rotates (head_dim but for a partial factor).
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double eps,
               double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim),
        eps_(eps), scale_(scale) {
    TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                      "DecoderStack: query heads must be a positive multiple of KV heads");
    TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
                      "DecoderStack: rotary_dim must be even and in (0, head_dim]; got ", rotary_dim);
  }

  // The next layer. Its linears are qkv, o, gate_up, down, in that order: `parts` holds how many parts each
  // has, `packed` every part in turn (each linear's in row order) and `dims` (n, k, format) for each part;
  // `biases` one per linear, None where it has none. `qk_norm`: Qwen3's or Gemma's, or None. `mlp_norms`: Gemma's
  // pre- and post-feedforward norms, or none. `window`, `rope` and `gelu` as in Layer.
  void add_layer(const Tensor& input_norm, const Tensor& post_norm, const std::optional<Tensor>& qk_norm,
                 const std::vector<Tensor>& packed, const std::vector<int64_t>& dims,
                 const std::vector<int64_t>& parts, const std::vector<std::optional<Tensor>>& biases,
                 const std::vector<Tensor>& mlp_norms, int64_t window, int64_t rope, bool gelu) {
    TORCH_CHECK_VALUE(mlp_norms.empty() || mlp_norms.size() == 2,
                      "DecoderStack: mlp_norms holds both of Gemma's MLP norms (pre, post) or none");
    TORCH_CHECK_VALUE(window >= 0 && rope >= 0, "DecoderStack: window and rope must be >= 0");
    TORCH_CHECK_VALUE(parts.size() == kLinearsPerLayer && biases.size() == kLinearsPerLayer,
                      "DecoderStack: need the part counts and biases of 4 linears (qkv, o, gate_up, down)");
    TORCH_CHECK_VALUE(dims.size() == 3 * packed.size(), "DecoderStack: need (n, k, format) for each part");
    Linear linears[kLinearsPerLayer];
    size_t next = 0;
    for (int64_t i = 0; i < kLinearsPerLayer; ++i) {
      TORCH_CHECK_VALUE(parts[i] > 0 && next + parts[i] <= packed.size(),
                        "DecoderStack: every linear needs one part or more, all of them in packed");
      Linear& linear = linears[i];
      for (int64_t j = 0; j < parts[i]; ++j, ++next) {
        linear.parts.push_back({packed[next], dims[3 * next], dims[3 * next + 1], dims[3 * next + 2]});
        linear.out_features += dims[3 * next];
      }
      linear.bias = biases[i];
    }
    TORCH_CHECK_VALUE(next == packed.size(), "DecoderStack: packed holds more parts than the part counts say");
    std::optional<Tensor> pre_mlp_norm, post_mlp_norm;
    if (!mlp_norms.empty()) {
      pre_mlp_norm = mlp_norms[0];
      post_mlp_norm = mlp_norms[1];
    }
    layers_.push_back({input_norm, post_norm, qk_norm, pre_mlp_norm, post_mlp_norm, window, rope, gelu,
                       std::move(linears[0]), std::move(linears[1]), std::move(linears[2]), std::move(linears[3])});
  }

  // The KV pools the layers write and read, one (k, v) per layer; bound again only when the caller's change.
  void bind_pools(const std::vector<Tensor>& k_pools, const std::vector<Tensor>& v_pools) {
    TORCH_CHECK_VALUE(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
                      "DecoderStack: need one k and one v pool per layer (", layers_.size(), "), got ",
                      k_pools.size(), " and ", v_pools.size());
    k_pools_ = k_pools;
    v_pools_ = v_pools;
  }

  // h [T, hidden] (updated in place and returned): the residual stream after every layer. cos, sin_signed: one
  // table pair per RoPE the layers use, as RotaryEmbedding.tables gives them; the rest is the step's
  // AttentionMetadata, and the windowed layers' own slots and block tables where the KV manager keeps those
  // layers' blocks apart (pagedkv.kv.hybrid; None: every layer reads the first ones).
  Tensor forward(Tensor h, const std::vector<Tensor>& cos, const std::vector<Tensor>& sin_signed,
                 const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                 const Tensor& query_start_loc, const std::optional<Tensor>& window_slot_mapping,
                 const std::optional<Tensor>& window_block_tables) {
    TORCH_CHECK_VALUE(window_slot_mapping.has_value() == window_block_tables.has_value(),
                      "DecoderStack: the windowed layers' slots and block tables come together");
    TORCH_CHECK_VALUE(!layers_.empty() && k_pools_.size() == layers_.size(), "DecoderStack: bind_pools first");
    TORCH_CHECK_VALUE(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
                      "DecoderStack: h must be a contiguous float32 [T, hidden] tensor");
    TORCH_CHECK_VALUE(cos.size() == sin_signed.size(), "DecoderStack: one sin table per cos table");
    for (size_t i = 0; i < cos.size(); ++i) {
      TORCH_CHECK_VALUE(cos[i].size(-1) == rotary_dim_ && sin_signed[i].size(-1) == rotary_dim_,
                        "DecoderStack: RoPE tables must be ", rotary_dim_, " wide (rotary_dim), table ", i, " is ",
                        cos[i].size(-1));
    }
    for (const Layer& layer : layers_) {
      TORCH_CHECK_VALUE(layer.rope < static_cast<int64_t>(cos.size()), "DecoderStack: a layer rotates with RoPE table ",
                        layer.rope, " but forward got ", cos.size());
    }
    if (!ops_) ops_.emplace();  // here, not in the constructor: the GEMM's library may load after this one
    const Ops& ops = *ops_;
    const int64_t tokens = h.size(0), qk_heads = num_heads_ + num_kv_heads_;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // attention: LlamaDecoderLayer.forward -> LlamaAttention.forward -> KernelAttention.forward
      const Tensor qkv = layer.qkv(ops, ops.rms_norm.call(h, layer.input_norm, eps_, std::nullopt))
                             .view({tokens, -1, head_dim_});
      Tensor qk = qkv.narrow(1, 0, qk_heads);
      if (layer.qk_norm) {  // F.rms_norm(qk, (head_dim,), eps=eps) * qk_norm_weight: torch's own ops, as there
        qk = at::rms_norm(qk, {head_dim_}, std::nullopt, eps_).mul(*layer.qk_norm);
      }
      Tensor rotated = rotary_dim_ == head_dim_ ? qk : qk.narrow(2, 0, rotary_dim_);  // rotate_heads' view
      ops.rope_.call(rotated, cos[layer.rope], sin_signed[layer.rope]);
      const bool own_tables = layer.window > 0 && window_block_tables.has_value();
      ops.write_kv.call(k_pools_[l], v_pools_[l], own_tables ? *window_slot_mapping : slot_mapping,
                        qk.narrow(1, num_heads_, num_kv_heads_), qkv.narrow(1, qk_heads, num_kv_heads_));
      const Tensor attended = ops.paged_attention.call(qk.narrow(1, 0, num_heads_), k_pools_[l], v_pools_[l],
                                                       own_tables ? *window_block_tables : block_tables,
                                                       seq_lens, query_start_loc, scale_,
                                                       layer.window);
      const Tensor out = layer.o(ops, attended.view({tokens, -1}));
      if (!layer.pre_mlp_norm) {  // Llama: h += out, normalised; then h += down(silu(gate) * up)
        const Tensor x = ops.rms_norm.call(out, layer.post_norm, eps_, h);
        h.add_(layer.down(ops, activate(ops, layer, layer.gate_up(ops, x))));
        continue;
      }
      // Gemma: h += norm(out), normalised; then h += norm(down(gelu(gate) * up))
      const Tensor normed_out = ops.rms_norm.call(out, layer.post_norm, eps_, std::nullopt);
      const Tensor x = ops.rms_norm.call(normed_out, *layer.pre_mlp_norm, eps_, h);
      const Tensor mlp = layer.down(ops, activate(ops, layer, layer.gate_up(ops, x)));
      h.add_(ops.rms_norm.call(mlp, *layer.post_mlp_norm, eps_, std::nullopt));
    }
    return h;
  }

 private:
  // act(gate) * up of gate_up [T, 2 I], as GatedMLP.forward computes it: SiLU in one compiled pass, GeLU-tanh
  // through torch's gelu and mul.
  static Tensor activate(const Ops& ops, const Layer& layer, const Tensor& gate_up) {
    if (!layer.gelu) return ops.silu_mul.call(gate_up);
    const int64_t intermediate = gate_up.size(1) / 2;
    return at::gelu(gate_up.narrow(1, 0, intermediate), "tanh").mul(gate_up.narrow(1, intermediate, intermediate));
  }

  std::vector<Layer> layers_;
  std::vector<Tensor> k_pools_, v_pools_;
  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double eps_, scale_;
  std::optional<Ops> ops_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("bind_pools", &DecoderStack::bind_pools)
      .def("forward", &DecoderStack::forward);
}
