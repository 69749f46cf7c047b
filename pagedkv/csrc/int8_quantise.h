// The activations of the int8-activation GEMM (int8_linear.cpp): each row of x quantised to int8 blocks as
// ggml's reference quantisers (quantize_row_q8_0_ref, _q8_1_ref, _q8_K_ref) make them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

// A quantised x [M, K]: codes, a scale per block, and per type the extra sums: Q8_1's sa, Q8_K's int16 code sums
// per sub-block of the weight type (Q4_K's mins have one per 32 values, Q6_K's scales one per 16).
struct Quantised {
  at::Tensor q, d, sums;
};

float fp16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

// Q8_0 (sa == nullptr) or Q8_1 blocks of one row, as quantize_row_q8_0_ref / _q8_1_ref.
void quantise_q8_0_row(const float* x, int64_t k, int8_t* q, float* d, float* sa) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::clamp(std::roundf(xb[j] * id), -127.0f, 127.0f));
      q[32 * b + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = fp16_round(db);
    if (sa != nullptr) sa[b] = fp16_round(static_cast<float>(sum) * db);
  }
}

// Q8_K blocks of one row, as quantize_row_q8_K_ref (its nearest_int rounds half to even, as nearbyint does).
void quantise_q8_k_row(const float* x, int64_t k, int64_t group, int8_t* q, float* d, int16_t* sums) {
  for (int64_t b = 0; b < k / 256; ++b) {
    const float* xb = x + 256 * b;
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < 256; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
    for (int j = 0; j < 256; ++j)
      q[256 * b + j] = static_cast<int8_t>(std::clamp(std::nearbyint(iscale * xb[j]), -127.0f, 127.0f));
    for (int64_t j = 0; j < 256 / group; ++j) {
      int sum = 0;
      for (int64_t i = 0; i < group; ++i) sum += q[256 * b + group * j + i];
      sums[256 / group * b + j] = static_cast<int16_t>(sum);  // |sum| <= 32 * 127
    }
    d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
  }
}

bool uses_q8_k(int64_t type) { return type == kQ4_K || type == kQ6_K; }

// Values per activation code sum: Q4_K's sub-blocks (its mins), Q6_K's (its scales), Q4_1's blocks (its min).
int64_t sum_group(int64_t type) { return type == kQ6_K ? 16 : 32; }

Quantised quantise(const at::Tensor& x, int64_t type) {
  const int64_t m = x.size(0), k = x.size(1), block = uses_q8_k(type) ? 256 : 32, group = sum_group(type);
  Quantised out{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, k / block}, x.options()),
                at::empty({m, uses_q8_k(type) || type == kQ4_1 ? k / group : 0},
                          x.options().dtype(uses_q8_k(type) ? at::kShort : at::kFloat))};
  const float* xs = x.data_ptr<float>();
  int8_t* q = out.q.data_ptr<int8_t>();
  float* d = out.d.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (uses_q8_k(type)) {
        quantise_q8_k_row(xs + r * k, k, group, q + r * k, d + r * (k / 256),
                          out.sums.data_ptr<int16_t>() + r * (k / group));
      } else {
        float* sa = type == kQ4_1 ? out.sums.data_ptr<float>() + r * (k / 32) : nullptr;
        quantise_q8_0_row(xs + r * k, k, q + r * k, d + r * (k / 32), sa);
      }
    }
  });
  return out;
}

}  // namespace
