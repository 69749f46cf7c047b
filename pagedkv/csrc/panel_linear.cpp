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
//
// Two ways through, by the number of rows M:
//   - tiled (M > 8: prefill, big batches): a quantised panel is expanded to fp32, 256 k at a time, into an
//     L1-resident buffer and then multiplied like an fp32 one, 6 rows per register tile: the expansion is
//     paid once per call and panel, not once per row.
//   - registers (M <= 8: decode): each k's weights of one panel are de-quantised straight into registers
//     and used by up to 4 rows at once, with software prefetch; at one row this reads the weights at close
//     to memory speed, where the tiled path waits on its FMA chains.
//
// Every output is summed in the same order on both (fused multiply-adds over k within 256-wide chunks, then
// the chunks), whatever M, the row's position in the batch, the thread split or the vector width: a
// request's numbers do not depend on what it is batched with.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
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

// ---- Few rows (decode): weights de-quantised in registers, a panel at a time ----------------------------
//
// At M = 1 the tiled path above does not stream the weights at memory speed. tile<1> has two dependency
// chains (8 outputs each), and every FMA waits for the previous one's result (~4 cycles), so a core runs 2
// FMAs per 4 cycles where it could run 8; a quantised chunk also makes a round trip through the buffer, paid
// for a single row. Here, for every k, the weights of one panel are decoded straight into registers and feed
// the accumulators of R <= 4 rows, and nothing goes to memory but y.
//
// A panel at a time, in one pass, not several side by side: on Zen 5 (2 threads, the default model's 121
// linears in model order, interleaved in one process) one panel at a time beat 2 and 4 side by side at every R
// from 1 to 4 and in both instruction sets by 10-25 % (gguf, one row: 6.8 / 8.0 / 8.4 ms for 1 / 2 / 4 panels
// with AVX-512; fp32: 16.5 / 20.5 / 20.8 ms), and in the engine one request decoded 92 / 84 / 76 tokens/s.
// More independent FMA chains did not pay either: walking two 256-k chunks of a panel side by side (each
// chunk's sums are a chain of their own, so the bits stay the same) took one request from 117-130 down to
// 86-100 tokens/s. One stream per thread, read in order, is what the prefetchers follow best.
//
// The arithmetic is exactly tile<>'s, in the same order: per 256-k chunk, every output is a chain of FMAs
// from zero over k ascending, and the chunk sums are added in chunk order; the weights are de-quantised as
// expand_q4 / expand_q8 do. A row therefore gets the same bits whichever path, vector width or thread
// computes it (tests/test_panel.py checks all of them against the tiled path). d * q is exact in fp32 (d is
// an fp16 value, q has 4 or 8 bits), so `d * q + m` rounds once whether or not the compiler fuses the
// multiply and the add (GCC does by default, here and in expand_q4): every path sees the same weights.

constexpr int kRows = 4;  // most rows per register kernel
constexpr int64_t kQ4Scales = kPanel * kGroup / 2;  // byte offset of d (then m) in a q4 record
constexpr int64_t kQ8Scales = kPanel * kGroup;      // byte offset of d in a q8 record
#define PAGEDKV_INLINE inline __attribute__((always_inline))

// Software prefetch. A panel is only a few KiB long (K = 576: 6.75 KiB of q4), so a thread's stream starts
// anew every few microseconds; the hardware prefetchers lose time on every new stream and do not run far
// enough ahead (measured without: 11-14 GB/s, a third of one core's sequential read). So the kernel asks for
// every line kAhead bytes before it reads it; near a panel's end that is the next panel, which this thread
// reads next (a thread's panels are consecutive). A prefetch past the weight's end is dropped, never a fault.
constexpr int64_t kAhead = 2048;  // bytes; 2-8 KiB measured alike, 1 KiB 25 % slower (too late)

PAGEDKV_INLINE void prefetch(const uint8_t* panel, int64_t offset, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(panel + offset + kAhead + line), _MM_HINT_T0);
}

// A unit of work is one k of an fp32 panel, or one group of 32 k of a quantised one.
template <int Format>
constexpr int64_t kUnit = Format == kF32 ? 1 : kGroup;

// -- AVX2: a panel's 16 outputs are two registers, [0] (outputs 0-7) and [1] (8-15).

// acc[r] += x[r][k] * w for R rows at one k (x points at row 0's x[k]).
template <int R>
PAGEDKV_INLINE void fma_rows_avx2(const float* x, int64_t ldx, const __m256 (&w)[2], __m256 (&acc)[R][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx);
    acc[r][0] = _mm256_fmadd_ps(xv, w[0], acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(xv, w[1], acc[r][1]);
  }
}

// acc += the x rows' products with unit u of the panel at w.
template <int Format, int R>
PAGEDKV_INLINE void unit_avx2(const Problem& p, const uint8_t* w, const float* x, int64_t u, __m256 (&acc)[R][2]) {
  if constexpr (Format == kF32) {
    const int64_t offset = u * kPanel * sizeof(float);
    prefetch(w, offset, kPanel * sizeof(float));
    const float* src = reinterpret_cast<const float*>(w + offset);
    const __m256 wk[2] = {_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)};
    fma_rows_avx2<R>(x + u, p.k, wk, acc);
  } else if constexpr (Format == kQ4) {
    prefetch(w, u * kQ4Record, kQ4Record);
    const uint8_t* codes = w + u * kQ4Record;
    const float* scales = reinterpret_cast<const float*>(codes + kQ4Scales);
    const __m256 d[2] = {_mm256_loadu_ps(scales), _mm256_loadu_ps(scales + 8)};
    const __m256 m[2] = {_mm256_loadu_ps(scales + kPanel), _mm256_loadu_ps(scales + kPanel + 8)};
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t pair = 0; pair < kGroup / 2; ++pair) {  // k = 2 pair (low nibbles), 2 pair + 1 (high)
      __m256 even[2], odd[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // 8 outputs' code bytes, each zero-extended to 32 bits
        const __m256i bytes = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + pair * kPanel + 8 * h)));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        even[h] = _mm256_add_ps(_mm256_mul_ps(q0, d[h]), m[h]);
        odd[h] = _mm256_add_ps(_mm256_mul_ps(q1, d[h]), m[h]);
      }
      fma_rows_avx2<R>(x + u * kGroup + 2 * pair, p.k, even, acc);
      fma_rows_avx2<R>(x + u * kGroup + 2 * pair + 1, p.k, odd, acc);
    }
  } else {
    prefetch(w, u * kQ8Record, kQ8Record);
    const uint8_t* codes = w + u * kQ8Record;
    const float* scales = reinterpret_cast<const float*>(codes + kQ8Scales);
    const __m256 d[2] = {_mm256_loadu_ps(scales), _mm256_loadu_ps(scales + 8)};
    for (int64_t i = 0; i < kGroup; ++i) {
      __m256 wk[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i q =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel + 8 * h)));
        wk[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d[h]);
      }
      fma_rows_avx2<R>(x + u * kGroup + i, p.k, wk, acc);
    }
  }
}

// y[row, row + R) x [the panel's outputs] = x W^T, chunk after chunk. Every loop over r, c or h is unrolled:
// the arrays then live in registers (an array indexed in a loop that is not, lives on the stack).
template <int Format, int R>
void rows_avx2(const Problem& p, int64_t row, int64_t panel) {
  const uint8_t* w = p.w + panel * p.panel_bytes;
  const float* x = p.x + row * p.k;
  __m256 sum[R][2] = {};  // set by the first chunk (the zeros only quiet -Wmaybe-uninitialized)
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    __m256 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t u = k0 / kUnit<Format>; u < std::min(k0 + kChunk, p.k) / kUnit<Format>; ++u)
      unit_avx2<Format, R>(p, w, x, u, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)  // the chunk's sums join the total in chunk order, as tile<> adds them to y
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) sum[r][h] = k0 == 0 ? acc[r][h] : _mm256_add_ps(sum[r][h], acc[r][h]);
  }
  const int64_t cols = std::min(kPanel, p.n - panel * kPanel);  // < 16 in a last, padded panel
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (row + r) * p.n + panel * kPanel;
    if (cols == kPanel) {
      _mm256_storeu_ps(y, sum[r][0]);
      _mm256_storeu_ps(y + 8, sum[r][1]);
    } else {
      alignas(32) float out[kPanel];
      _mm256_store_ps(out, sum[r][0]);
      _mm256_store_ps(out + 8, sum[r][1]);
      std::memcpy(y, out, cols * sizeof(float));
    }
  }
}

// -- AVX-512: the same kernel, a whole panel (16 floats) in one register. Compiled for AVX-512F whatever the
// build flags (the function attribute), and called only where the CPU has it (has_avx512).
#define PAGEDKV_AVX512 __attribute__((target("avx512f")))

template <int R>
PAGEDKV_AVX512 PAGEDKV_INLINE void fma_rows_avx512(const float* x, int64_t ldx, __m512 w, __m512 (&acc)[R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx]), w, acc[r]);
}

template <int Format, int R>
PAGEDKV_AVX512 PAGEDKV_INLINE void unit_avx512(const Problem& p, const uint8_t* w, const float* x, int64_t u,
                                               __m512 (&acc)[R]) {
  if constexpr (Format == kF32) {
    const int64_t offset = u * kPanel * sizeof(float);
    prefetch(w, offset, kPanel * sizeof(float));
    fma_rows_avx512<R>(x + u, p.k, _mm512_loadu_ps(w + offset), acc);
  } else if constexpr (Format == kQ4) {
    prefetch(w, u * kQ4Record, kQ4Record);
    const uint8_t* codes = w + u * kQ4Record;
    const __m512 d = _mm512_loadu_ps(codes + kQ4Scales), m = _mm512_loadu_ps(codes + kQ4Scales + kPanel * 4);
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int64_t pair = 0; pair < kGroup / 2; ++pair) {
      const __m512i bytes =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + pair * kPanel)));
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
      fma_rows_avx512<R>(x + u * kGroup + 2 * pair, p.k, _mm512_add_ps(_mm512_mul_ps(q0, d), m), acc);
      fma_rows_avx512<R>(x + u * kGroup + 2 * pair + 1, p.k, _mm512_add_ps(_mm512_mul_ps(q1, d), m), acc);
    }
  } else {
    prefetch(w, u * kQ8Record, kQ8Record);
    const uint8_t* codes = w + u * kQ8Record;
    const __m512 d = _mm512_loadu_ps(codes + kQ8Scales);
    for (int64_t i = 0; i < kGroup; ++i) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * kPanel)));
      fma_rows_avx512<R>(x + u * kGroup + i, p.k, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d), acc);
    }
  }
}

template <int Format, int R>
PAGEDKV_AVX512 void rows_avx512(const Problem& p, int64_t row, int64_t panel) {
  const uint8_t* w = p.w + panel * p.panel_bytes;
  const float* x = p.x + row * p.k;
  __m512 sum[R] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = k0 / kUnit<Format>; u < std::min(k0 + kChunk, p.k) / kUnit<Format>; ++u)
      unit_avx512<Format, R>(p, w, x, u, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sum[r] = k0 == 0 ? acc[r] : _mm512_add_ps(sum[r], acc[r]);
  }
  const int64_t cols = std::min(kPanel, p.n - panel * kPanel);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + (row + r) * p.n + panel * kPanel, (1u << cols) - 1, sum[r]);
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
}

// The register kernels, one table per instruction set, by [format][R - 1].
using RowsFn = void (*)(const Problem&, int64_t, int64_t);
using RowsKernels = std::array<std::array<RowsFn, kRows>, 3>;

template <int F>
constexpr std::array<RowsFn, kRows> kAvx2ByRows{rows_avx2<F, 1>, rows_avx2<F, 2>, rows_avx2<F, 3>, rows_avx2<F, 4>};
template <int F>
constexpr std::array<RowsFn, kRows> kAvx512ByRows{rows_avx512<F, 1>, rows_avx512<F, 2>, rows_avx512<F, 3>,
                                                  rows_avx512<F, 4>};
constexpr RowsKernels kAvx2Rows{kAvx2ByRows<kF32>, kAvx2ByRows<kQ4>, kAvx2ByRows<kQ8>};
constexpr RowsKernels kAvx512Rows{kAvx512ByRows<kF32>, kAvx512ByRows<kQ4>, kAvx512ByRows<kQ8>};

// Panels [begin, end) for every x row. Rows go in as few groups of at most kRows as cover them, of even
// sizes (6 rows: 3 + 3, not 4 + 2: every group keeps enough chains).
void rows_panels(const Problem& p, int64_t begin, int64_t end, const RowsKernels& kernels) {
  const int64_t groups = (p.rows + kRows - 1) / kRows, most = (p.rows + groups - 1) / groups;
  for (int64_t panel = begin; panel < end; ++panel) {
    for (int64_t row = 0; row < p.rows; row += most) {
      const int64_t rows = std::min(most, p.rows - row);
      kernels[p.format][rows - 1](p, row, panel);
    }
  }
}

// ---- The op ---------------------------------------------------------------------------------------------

// How to compute: kAuto picks; the others are for tests and benchmarks (torch.ops.pagedkv._panel_linear_path).
enum Path : int64_t { kAuto = 0, kTiled = 1, kRowsAvx2 = 2, kRowsAvx512 = 3 };

// Up to this many rows the register kernels run (in groups of at most kRows, each decoding the weights
// again). Measured on the default model's 121 linears (benchmarks/panel_linear.py, 1 thread, Zen 5): at
// 8 rows they still take 0.4x (AVX-512) and 0.6x (AVX2) of the tiled path's time; at 16 rows AVX2 is even.
constexpr int64_t kRegisterRows = 8;

int64_t panel_bytes(int64_t format, int64_t k) {
  switch (format) {
    case kQ4: return (k / kGroup) * kQ4Record;
    case kQ8: return (k / kGroup) * kQ8Record;
    default: return k * kPanel * static_cast<int64_t>(sizeof(float));
  }
}

at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format, int64_t path) {
  TORCH_CHECK(format == kF32 || format == kQ4 || format == kQ8, "panel_linear: unknown format ", format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == k, "panel_linear: x has ", x.size(1), " columns but the weight has K = ", k);
  TORCH_CHECK(format == kF32 || k % kGroup == 0, "panel_linear: quantised K must be a multiple of 32, got ", k);
  TORCH_CHECK(path >= kAuto && path <= kRowsAvx512, "panel_linear: unknown path ", path);
  TORCH_CHECK(path != kRowsAvx512 || has_avx512(), "panel_linear: this CPU has no AVX-512F");
  const int64_t num_panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(format, k);
  TORCH_CHECK(packed.is_contiguous() && packed.nbytes() == static_cast<size_t>(num_panels * bytes),
              "panel_linear: packed weight has ", packed.nbytes(), " bytes, expected ", num_panels * bytes,
              " for N = ", n, ", K = ", k, ", format ", format);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  const Problem p{xc.data_ptr<float>(), static_cast<const uint8_t*>(packed.data_ptr()), y.data_ptr<float>(),
                  x.size(0), n, k, format, bytes};
  if (path == kAuto) path = p.rows > kRegisterRows ? kTiled : has_avx512() ? kRowsAvx512 : kRowsAvx2;
  const RowsKernels& kernels = path == kRowsAvx512 ? kAvx512Rows : kAvx2Rows;
  // Grain of 4 panels (64 outputs): the 576-output layers still split across threads.
  at::parallel_for(0, num_panels, 4, [&](int64_t begin, int64_t end) {
    if (path == kTiled) {
      panels(p, begin, end);
    } else {
      rows_panels(p, begin, end, kernels);
    }
  });
  return y;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format) {
  return run(x, packed, n, k, format, kAuto);
}

// Rows `ids` of a packed weight as fp32 [len(ids), K]: the embedding lookup of a tied LM head whose panel holds
// the only copy of the vocabulary matrix. Exact: d * q is exact in fp32 (an fp16 d, a 4- or 8-bit q), so
// d * q + m rounds once, fused or not -- the weights that were packed, bit for bit.
at::Tensor panel_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK_VALUE(format == kF32 || format == kQ4 || format == kQ8, "panel_rows: unknown format ", format);
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                    "panel_rows: ids must be a contiguous int64 [T] tensor");
  const int64_t bytes = panel_bytes(format, k), num_panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.nbytes() == static_cast<size_t>(num_panels * bytes),
                    "panel_rows: packed weight has ", packed.nbytes(), " bytes, expected ", num_panels * bytes);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK_VALUE(id[t] >= 0 && id[t] < n, "panel_rows: ids[", t, "] = ", id[t], " is outside [0, ", n, ")");
  at::Tensor out = at::empty({ids.numel(), k}, ids.options().dtype(at::kFloat));
  const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
  const auto at_float = [](const uint8_t* p, int64_t i) {
    float f;
    std::memcpy(&f, p + i * sizeof(float), sizeof(float));
    return f;
  };
  for (int64_t t = 0; t < ids.numel(); ++t) {
    const uint8_t* base = w + (id[t] / kPanel) * bytes;
    const int64_t lane = id[t] % kPanel;
    float* row = out.data_ptr<float>() + t * k;
    if (format == kF32) {
      for (int64_t i = 0; i < k; ++i) row[i] = at_float(base, i * kPanel + lane);
      continue;
    }
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const uint8_t* rec = base + g * (format == kQ4 ? kQ4Record : kQ8Record);
      float* o = row + g * kGroup;
      if (format == kQ4) {
        const float d = at_float(rec + kPanel * kGroup / 2, lane), m = at_float(rec + kPanel * kGroup / 2, kPanel + lane);
        for (int64_t pair = 0; pair < kGroup / 2; ++pair) {
          const uint8_t byte = rec[pair * kPanel + lane];
          o[2 * pair] = d * static_cast<float>(byte & 0x0F) + m;
          o[2 * pair + 1] = d * static_cast<float>(byte >> 4) + m;
        }
      } else {
        const float d = at_float(rec + kPanel * kGroup, lane);
        for (int64_t i = 0; i < kGroup; ++i) o[i] = d * static_cast<float>(static_cast<int8_t>(rec[i * kPanel + lane]));
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("panel_linear(Tensor x, Tensor packed, int n, int k, int format) -> Tensor", &panel_linear);
  lib.def("panel_rows(Tensor packed, Tensor ids, int n, int k, int format) -> Tensor", &panel_rows);
  // Private: the same with the path forced (0 auto, 1 tiled, 2 AVX2 registers, 3 AVX-512 registers).
  lib.def("_panel_linear_path(Tensor x, Tensor packed, int n, int k, int format, int path) -> Tensor", &run);
}
