// y[M, N] = x[M, K] @ W^T, with W stored in "panels": 16 output features at a time, K-major inside a panel.
//
// Why panels: the inner loop of a CPU GEMM is an outer product -- one x value broadcast against a vector
// of weights for 16 outputs, into 2 x MR register accumulators. That needs, for every k, the 16 weights of
// a panel side by side in memory, which row-major W [N, K] does not give. Packing once at load time makes
// every step read its weights as one sequential stream, at any batch size, with no per-call repacking.
//
// Formats of a panel (P = ceil(N / 16) panels; a last partial panel is zero-padded):
//   fp32: float [K][16].
//   q4:   per group of 32 k, 384 bytes: codes [16 k-pairs][16 outputs] (byte = q[2p] | q[2p + 1] << 4),
//         then float d[16], then float m[16];  w = d * q + m, q in 0..15 (GGUF Q4_1).
//   q8:   per group of 32 k, 576 bytes: int8 codes [32 k][16 outputs], then float d[16];  w = d * q (Q8_0).
// A quantised panel is expanded to fp32, 256 k at a time, into an L1-resident buffer and then multiplied
// like an fp32 one: the expansion is paid once per call and panel, not once per activation row.
//
// Every output is summed in the same order (fused multiply-adds over k within 256-wide chunks, then the
// chunks), whatever M, the row's position in the batch or the thread split: a request's numbers do not
// depend on what it is batched with.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#else
#error "panel_linear needs AVX2 and FMA (x86-64-v3): without them only this library is lost, torch runs the GEMM"
#endif

namespace {

constexpr int64_t kPanel = 16;     // outputs per panel: two AVX2 vectors of 8 floats
constexpr int64_t kGroup = 32;     // quantisation group along K
constexpr int64_t kChunk = 256;    // k values expanded at a time: 16 KiB of fp32, stays in L1
constexpr int64_t kRowBlock = 96;  // x rows kept hot (in L2) while a thread walks its panels
constexpr int kTile = 6;           // x rows per register tile: 12 accumulators + 2 weights + 1 broadcast

enum Format : int64_t { kF32 = 0, kQ4 = 1, kQ8 = 2 };
constexpr int64_t kQ4Record = kPanel * kGroup / 2 + 2 * kPanel * sizeof(float);  // 384 bytes
constexpr int64_t kQ8Record = kPanel * kGroup + kPanel * sizeof(float);          // 576 bytes

struct Problem {
  const float* x;
  const uint8_t* w;
  float* y;
  int64_t rows, n, k, format, panel_bytes;
};

// Expand q4 groups covering k in [k0, k0 + kc) of one panel into out[kc][16].
void expand_q4(const uint8_t* panel, int64_t k0, int64_t kc, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = k0 / kGroup; g < (k0 + kc) / kGroup; ++g) {
    const uint8_t* record = panel + g * kQ4Record;
    const float* d = reinterpret_cast<const float*>(record + kPanel * kGroup / 2);
    const float* m = d + kPanel;
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    const __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
    float* o = out + (g * kGroup - k0) * kPanel;
    for (int64_t pair = 0; pair < kGroup / 2; ++pair) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + pair * kPanel));
      const __m128i codes[2] = {_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)};
      for (int half = 0; half < 2; ++half) {  // k = 2 * pair + half
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes[half]));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes[half], 8)));
        float* row = o + (2 * pair + half) * kPanel;
        // multiply, then add: the two roundings of the reference de-quantiser (d * q + m), bit for bit
        _mm256_storeu_ps(row, _mm256_add_ps(_mm256_mul_ps(q0, d0), m0));
        _mm256_storeu_ps(row + 8, _mm256_add_ps(_mm256_mul_ps(q1, d1), m1));
      }
    }
  }
}

// Expand q8 groups covering k in [k0, k0 + kc) of one panel into out[kc][16].
void expand_q8(const uint8_t* panel, int64_t k0, int64_t kc, float* out) {
  for (int64_t g = k0 / kGroup; g < (k0 + kc) / kGroup; ++g) {
    const uint8_t* record = panel + g * kQ8Record;
    const float* d = reinterpret_cast<const float*>(record + kPanel * kGroup);
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    float* o = out + (g * kGroup - k0) * kPanel;
    for (int64_t j = 0; j < kGroup; ++j) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + j * kPanel));
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)));
      _mm256_storeu_ps(o + j * kPanel, _mm256_mul_ps(q0, d0));
      _mm256_storeu_ps(o + j * kPanel + 8, _mm256_mul_ps(q1, d1));
    }
  }
}

// fp32 weights [kc][16] of one panel for k in [k0, k0 + kc): in place for fp32, else expanded into buf.
inline const float* panel_chunk(const Problem& p, int64_t panel, int64_t k0, int64_t kc, float* buf) {
  const uint8_t* base = p.w + panel * p.panel_bytes;
  switch (p.format) {
    case kQ4: expand_q4(base, k0, kc, buf); return buf;
    case kQ8: expand_q8(base, k0, kc, buf); return buf;
    default: return reinterpret_cast<const float*>(base) + k0 * kPanel;
  }
}

// y[MR rows][16 cols] (+)= x[MR rows][kc] . w[kc][16]. Each k chunk sums from zero in registers and is
// then added to y (`accumulate`): a chain of at most 256 terms per chunk instead of K keeps the rounding
// error near that of a blocked BLAS, and the chunking is fixed, so results still do not depend on M.
// `cols` < 16 only for the zero-padded last panel.
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy, int64_t cols,
                 bool accumulate) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  alignas(32) float out[MR][kPanel];  // registers leave through here, so the loop above owns them alone
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(out[i], acc[i][0]);
    _mm256_store_ps(out[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < MR; ++i) {
    float* target = y + i * ldy;
    if (accumulate) {
      for (int64_t c = 0; c < cols; ++c) target[c] += out[i][c];
    } else {
      std::memcpy(target, out[i], cols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool);
constexpr TileFn kTiles[kTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Panels [begin, end) for every x row: x rows in blocks that stay in L2, each panel's weights read once
// per block (once per call for decode-size M), k in L1-sized chunks.
void panels(const Problem& p, int64_t begin, int64_t end) {
  std::vector<float> buf(p.format == kF32 ? 0 : kChunk * kPanel);
  for (int64_t r0 = 0; r0 < p.rows; r0 += kRowBlock) {
    const int64_t r1 = std::min(r0 + kRowBlock, p.rows);
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t col = panel * kPanel, cols = std::min(kPanel, p.n - col);
      for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, p.k - k0);
        const float* w = panel_chunk(p, panel, k0, kc, buf.data());
        for (int64_t r = r0; r < r1; r += kTile) {
          const int64_t mr = std::min<int64_t>(kTile, r1 - r);
          kTiles[mr](p.x + r * p.k + k0, p.k, w, kc, p.y + r * p.n + col, p.n, cols, k0 > 0);
        }
      }
    }
  }
}

int64_t panel_bytes(int64_t format, int64_t k) {
  switch (format) {
    case kQ4: return (k / kGroup) * kQ4Record;
    case kQ8: return (k / kGroup) * kQ8Record;
    default: return k * kPanel * static_cast<int64_t>(sizeof(float));
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK(format == kF32 || format == kQ4 || format == kQ8, "panel_linear: unknown format ", format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == k, "panel_linear: x has ", x.size(1), " columns but the weight has K = ", k);
  TORCH_CHECK(format == kF32 || k % kGroup == 0, "panel_linear: quantised K must be a multiple of 32, got ", k);
  const int64_t num_panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(format, k);
  TORCH_CHECK(packed.is_contiguous() && packed.nbytes() == static_cast<size_t>(num_panels * bytes),
              "panel_linear: packed weight has ", packed.nbytes(), " bytes, expected ", num_panels * bytes,
              " for N = ", n, ", K = ", k, ", format ", format);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const Problem p{xc.data_ptr<float>(), static_cast<const uint8_t*>(packed.data_ptr()), y.data_ptr<float>(),
                  x.size(0), n, k, format, bytes};
  // Grain of 4 panels (64 outputs): the 576-output layers still split across threads.
  at::parallel_for(0, num_panels, 4, [&](int64_t begin, int64_t end) { panels(p, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("panel_linear(Tensor x, Tensor packed, int n, int k, int format) -> Tensor", &panel_linear);
}
