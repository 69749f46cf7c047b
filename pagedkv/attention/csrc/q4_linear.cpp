// y[M, N] = x[M, K] @ W^T with W in 4-bit groups: W[n, 32g + j] = d[n, g] * q + m[n, g], q in 0..15.
//
// Decode-size GEMMs (M of 1..32) on a CPU are bound by the bytes of W they read; 4-bit codes plus one fp32
// (d, m) pair per 32 weights are 0.75 bytes a weight instead of 4. Threads split the N weight rows; each
// row is read once per call. Up to 4 x rows, a row's groups go straight from codes to FMAs (with the m term
// as m * sum(x_group)); above that, 4 weight rows at a time are expanded to fp32 in an L1-resident buffer
// and multiplied with every x row, so the expansion is paid once, not once per x row.
//
// Packing of one group (16 bytes): byte j holds q[j] in its low nibble and q[j + 16] in its high nibble,
// so one 128-bit load and two masks give q[0..15] and q[16..31] in order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

struct Problem {
  const float* x;
  const uint8_t* q;
  const float* d;
  const float* m;
  const float* xsum;  // [rows, groups]: the sum of each group of x, for the m * sum(x) term
  float* y;
  int64_t rows, n, k, groups;
};

#if defined(__AVX2__) && defined(__FMA__)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Expands weight rows [n, n + rows) to fp32 in `out` ([rows, k]): decoding once per call and row, not
// once per activation row, keeps the conversion cost off the FMA loop when M is large.
void decode_rows(const Problem& p, int64_t n, int64_t rows, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* codes = p.q + (n + i) * (p.k / 2);
    float* row = out + i * p.k;
    for (int64_t g = 0; g < p.groups; ++g) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * (kGroup / 2)));
      const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      const __m256 scale = _mm256_set1_ps(p.d[(n + i) * p.groups + g]);
      const __m256 offset = _mm256_set1_ps(p.m[(n + i) * p.groups + g]);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int part = 0; part < 4; ++part) {
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[part]));
        _mm256_storeu_ps(row + g * kGroup + part * 8, _mm256_fmadd_ps(qf, scale, offset));
      }
    }
  }
}

// NR decoded weight rows times MR activation rows [r, r + MR): NR * MR accumulators along K.
template <int NR, int MR>
inline void tile(const Problem& p, const float* w, int64_t n, int64_t r) {
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < p.k; c += 8) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_loadu_ps(w + i * p.k + c);
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_loadu_ps(p.x + (r + j) * p.k + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) p.y[(r + j) * p.n + n + i] = hsum(acc[i][j]);
}

template <int NR>
inline void rows_of_x(const Problem& p, const float* w, int64_t n) {
  int64_t r = 0;
  for (; r + 3 <= p.rows; r += 3) tile<NR, 3>(p, w, n, r);
  if (p.rows - r == 2) tile<NR, 2>(p, w, n, r);
  if (p.rows - r == 1) tile<NR, 1>(p, w, n, r);
}

// One weight row times MR <= 4 x rows without leaving registers, for decode-size batches where expanding
// a row to memory first would cost more than the FMAs it feeds: y = sum_g d_g * (q_g . x_g) + m_g * sum(x_g).
template <int MR>
inline void direct_row(const Problem& p, int64_t n) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const uint8_t* codes = p.q + n * (p.k / 2);
  __m256 acc[MR];
  float offsets[MR] = {};
  for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * (kGroup / 2)));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m256 qf[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
    const float d = p.d[n * p.groups + g], m = p.m[n * p.groups + g];
    for (int j = 0; j < MR; ++j) {
      const float* xs = p.x + j * p.k + g * kGroup;
      __m256 dot = _mm256_mul_ps(qf[0], _mm256_loadu_ps(xs));
      dot = _mm256_fmadd_ps(qf[1], _mm256_loadu_ps(xs + 8), dot);
      dot = _mm256_fmadd_ps(qf[2], _mm256_loadu_ps(xs + 16), dot);
      dot = _mm256_fmadd_ps(qf[3], _mm256_loadu_ps(xs + 24), dot);
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d), dot, acc[j]);
      offsets[j] += m * p.xsum[j * p.groups + g];
    }
  }
  for (int j = 0; j < MR; ++j) p.y[j * p.n + n] = hsum(acc[j]) + offsets[j];
}

constexpr int64_t kBlockRows = 4;
constexpr int64_t kDirectRows = 4;

void weight_rows(const Problem& p, int64_t begin, int64_t end) {
  if (p.rows <= kDirectRows) {
    for (int64_t n = begin; n < end; ++n) {
      switch (p.rows) {
        case 4: direct_row<4>(p, n); break;
        case 3: direct_row<3>(p, n); break;
        case 2: direct_row<2>(p, n); break;
        default: direct_row<1>(p, n); break;
      }
    }
    return;
  }
  std::vector<float> block(kBlockRows * p.k);
  for (int64_t n = begin; n < end; n += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, end - n);
    decode_rows(p, n, rows, block.data());
    switch (rows) {
      case 4: rows_of_x<4>(p, block.data(), n); break;
      case 3: rows_of_x<3>(p, block.data(), n); break;
      case 2: rows_of_x<2>(p, block.data(), n); break;
      default: rows_of_x<1>(p, block.data(), n); break;
    }
  }
}

#else

void weight_rows(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < p.rows; ++r) {
      float total = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        const uint8_t* bytes = p.q + n * (p.k / 2) + g * (kGroup / 2);
        const float* xs = p.x + r * p.k + g * kGroup;
        float dot = 0.0f;
        for (int64_t j = 0; j < kGroup / 2; ++j) {
          dot += static_cast<float>(bytes[j] & 0x0F) * xs[j] + static_cast<float>(bytes[j] >> 4) * xs[j + 16];
        }
        total += p.d[n * p.groups + g] * dot + p.m[n * p.groups + g] * p.xsum[r * p.groups + g];
      }
      p.y[r * p.n + n] = total;
    }
  }
}

#endif

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "q4_linear: qweight must be a contiguous 2-D uint8 tensor [N, K / 2]");
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "q4_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(x.size(1) == k, "q4_linear: x has ", x.size(1), " columns but the weight has K = ", k);
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == groups,
                "q4_linear: d and m must be contiguous float32 tensors [N, K / 32] = [", n, ", ", groups, "]");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const at::Tensor xsum = xc.view({x.size(0), groups, kGroup}).sum(-1).contiguous();
  const Problem p{xc.data_ptr<float>(), qweight.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(),
                  xsum.data_ptr<float>(), y.data_ptr<float>(), x.size(0), n, k, groups};
  if (p.rows == 0 || n == 0) return y;
  // Grain of 16 rows: small enough for 2+ threads on the 576-row layers, large enough to amortise dispatch.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { weight_rows(p, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY(pagedkv_q4, lib) {
  lib.def("q4_linear(Tensor x, Tensor qweight, Tensor d, Tensor m) -> Tensor", &q4_linear);
}
