// The two element-wise steps of a decoder layer that torch runs as chains of small ops:
//   silu_mul(gate_up [T, 2I]) = silu(gate) * up      (torch: split, silu, mul -- two passes, two outputs)
//   rope_(x [T, H, D], cos, sin_signed)              (torch: roll, mul, addcmul -- three passes, three outputs)
// At decode sizes each torch op costs tens of microseconds of dispatch and threading, 30 layers a step.
// Here each is one pass, rows split over torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace pagedkv::simd;

void silu_mul_row(const float* gate, const float* up, float* out, int64_t size) {
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) {
    const Vec g = load(gate + i);
    store(out + i, g * (1.0f / (1.0f + vexp(-g))) * load(up + i));
  }
  for (; i < size; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous float32 [T, 2 * I] tensor");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * size, in + r * 2 * size + size, o + r * size, size);
  });
  return out;
}

// x[t, h, :] = x * cos[t] + roll(x, D/2) * sin_signed[t], in place; x may be a strided view (e.g. q|k of qkv).
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x must be float32 [T, H, D] with unit stride in D, D even");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  for (const at::Tensor* t : {&cos, &sin_signed}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == tokens * dim,
                "rope_: cos and sin_signed must be contiguous float32 with T * D = ", tokens * dim, " values");
  }
  float* base = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin_signed.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * dim, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> old(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = base + t * token_stride + h * head_stride;
        std::copy(v, v + dim, old.begin());
        for (int64_t d = 0; d < half; ++d) v[d] = old[d] * ct[d] + old[d + half] * st[d];
        for (int64_t d = half; d < dim; ++d) v[d] = old[d] * ct[d] + old[d - half] * st[d];
      }
    }
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  lib.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin_signed) -> Tensor(a!)", &rope_);
}
