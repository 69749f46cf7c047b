// y[M, N] = x[M, K] @ W^T with llama.cpp's arithmetic: x quantised to int8 blocks, dotted with W's integer codes.
//
// The opt-in weight format "gguf-int8" (pagedkv/model/int8_linear.py). The exact default ("gguf", panel_linear.cpp)
// de-quantises every weight to fp32 and multiplies in fp32, which makes a step arithmetic-bound; here, as in
// ggml's vec_dot kernels, each step's activations are rounded per block to int8 codes with one scale, and a
// block's dot product is an integer sum of code products, scaled once in fp32. Per weight type, the activation
// blocks ggml pairs it with:
//
//   weight  block  bytes  codes                         activations  a block's (sub-block's) contribution
//   Q4_0    32     18     d, 4-bit u: w = d (u - 8)     Q8_0         (d da) sum (u - 8) q
//   Q4_1    32     20     d, m, 4-bit u: w = d u + m    Q8_1         (d da) sum u q + m sa
//   Q5_0    32     22     d, 5-bit u: w = d (u - 16)    Q8_0         (d da) sum (u - 16) q
//   Q8_0    32     34     d, int8 c: w = d c            Q8_0         (d da) sum c q
//   Q4_K    256    144    d, dmin, 6-bit sc/mn, 4-bit   Q8_K         (da d) sum_s sc_s sum u q - (da dmin) sum_s mn_s sum_s q
//   Q6_K    256    210    d, int8 sc, 6-bit u           Q8_K         (da d) sum_s sc_s sum (u - 32) q
//
// The activations, as ggml's reference quantisers (quantize_row_q8_0_ref, _q8_1_ref, _q8_K_ref) make them:
//   Q8_0 / Q8_1 (32): da = amax / 127, q = roundf(x / da) (half away from zero), da kept as fp16; Q8_1 adds
//                     sa = fp16(da sum q).
//   Q8_K (256):       m = the value of largest |x| (the first), s = -127 / m, q = nearest(s x) (half to even),
//                     da = 1 / s (fp32), and the sum of q per 32 (ggml keeps it per 16 and adds pairs).
//
// The integer sums are exact (int32 lanes: at most 2^25 here), so an AVX2 path (maddubs + madd) and an AVX-512
// VNNI one (vpdpbusd for the 32-value types; the K-quants' scaled sub-blocks use maddubs + madd on both) give the
// same lanes, and every float operation after them is the same: the two paths agree bit for bit. Per output and row: a block's eight int32 lanes are converted and fused into eight fp32 lanes
// (fma with the block's scale), blocks in file order; then the lanes are summed in one fixed order, and a type
// with a min adds its scalar sum last -- ggml's order of operations, up to how the lanes are summed.
//
// Batch invariance: a row's result depends only on its own x row and W, in that fixed order, whatever other rows
// share the call, however many threads split the outputs. Rows run in tiles of up to kTile per weight block: a
// block is decoded once (codes in natural order, as bytes) and dotted with every row of the tile; outputs go in
// chunks of kChunk, so the chunk's weights stay in L2 while every tile of rows passes over them.
//
// W is the GGUF file's blocks as they are, row-major [N][K / block] (a one-row GEMV reads it as one stream), so
// it may view the read-only memory map. Format code: kFormatBase + the ggml type id.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

#define INT8_INLINE inline __attribute__((always_inline))

constexpr int64_t kFormatBase = 64;
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };
constexpr int64_t kTile = 4;    // x rows per pass over a weight block (accumulators in registers)
constexpr int64_t kChunk = 16;  // outputs whose weights stay in L2 while every tile passes

// ---- Activations ----------------------------------------------------------------------------------------------

// A quantised x [M, K]: codes, a scale per block, and per type the extra sums (Q8_1's sa, Q8_K's int16 sum per 32).
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
void quantise_q8_k_row(const float* x, int64_t k, int8_t* q, float* d, int16_t* sum32) {
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
    for (int j = 0; j < 8; ++j) {
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[256 * b + 32 * j + i];
      sum32[8 * b + j] = static_cast<int16_t>(sum);  // |sum| <= 32 * 127
    }
    d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
  }
}

bool uses_q8_k(int64_t type) { return type == kQ4_K || type == kQ6_K; }

Quantised quantise(const at::Tensor& x, int64_t type) {
  const int64_t m = x.size(0), k = x.size(1), block = uses_q8_k(type) ? 256 : 32;
  Quantised out{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, k / block}, x.options()),
                at::empty({m, uses_q8_k(type) || type == kQ4_1 ? k / 32 : 0},
                          x.options().dtype(uses_q8_k(type) ? at::kShort : at::kFloat))};
  const float* xs = x.data_ptr<float>();
  int8_t* q = out.q.data_ptr<int8_t>();
  float* d = out.d.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (uses_q8_k(type)) {
        quantise_q8_k_row(xs + r * k, k, q + r * k, d + r * (k / 256), out.sums.data_ptr<int16_t>() + r * (k / 32));
      } else {
        float* sa = type == kQ4_1 ? out.sums.data_ptr<float>() + r * (k / 32) : nullptr;
        quantise_q8_0_row(xs + r * k, k, q + r * k, d + r * (k / 32), sa);
      }
    }
  });
  return out;
}

// One quantised row, as the dot products read it.
struct ActRow {
  const int8_t* q;
  const float* d;
  const float* sa;     // Q8_1
  const int16_t* sum32;  // Q8_K
};

// ---- Integer dot products -------------------------------------------------------------------------------------

// sum of u[4i..4i+3] * s[4i..4i+3] in lane i (u unsigned, s signed bytes). VNNI's vpdpbusd is written as inline
// assembly so that one kernel body serves both paths (an intrinsic would need the target attribute on every
// function around it); it only runs where the CPU has AVX512-VNNI and -VL (has_vnni). On AVX2, maddubs' pair sums
// stay inside int16 for every pairing here (|u| <= 128, |s| <= 127 and u <= 63 unless one of them is <= 8... see
// the table: at most 2 * 128 * 127 = 32512).
template <bool kVnni>
INT8_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
  if constexpr (kVnni) {
    __m256i acc = _mm256_setzero_si256();
    asm("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// The same for two signed vectors: |w| times s with w's sign (ggml's trick; w = -128 gives 128 * -s, exact).
template <bool kVnni>
INT8_INLINE __m256i dot_s8s8(__m256i w, __m256i s) {
  return dot_u8s8<kVnni>(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}

INT8_INLINE __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

INT8_INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// 32 4-bit codes of a legacy block's 16 bytes: low nibbles are codes 0..15, high ones 16..31.
INT8_INLINE __m256i nibbles32(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

// Byte i = 0xFF where bit i of the little-endian word at p is set (ggml's bytes_from_bits_32).
INT8_INLINE __m256i bits32(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i ones = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(ones, _mm256_set1_epi64x(-1));
}

// What a row accumulates for one output: eight fp32 lanes, and for a type with a min four more (Q4_K) or a
// scalar (Q4_1); summed in that order at the end.
struct Acc {
  __m256 lanes = _mm256_setzero_ps();
  __m128 mins = _mm_setzero_ps();
  float extra = 0.0f;
};

// ---- The weight types: decode a block once, dot it with each row of a tile ---------------------------------

struct Q4_0 {
  static constexpr int64_t kBlock = 32, kBytes = 18;
  struct Block { __m256i w; float d; };
  static INT8_INLINE Block decode(const uint8_t* b) {
    return {_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), half_at(b)};
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const __m256i sum = dot_s8s8<V>(w.w, load32(a.q + 32 * i));
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(w.d * a.d[i]), _mm256_cvtepi32_ps(sum), acc.lanes);
  }
};

struct Q4_1 {
  static constexpr int64_t kBlock = 32, kBytes = 20;
  struct Block { __m256i u; float d, m; };
  static INT8_INLINE Block decode(const uint8_t* b) { return {nibbles32(b + 4), half_at(b), half_at(b + 2)}; }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const __m256i sum = dot_u8s8<V>(w.u, load32(a.q + 32 * i));
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(w.d * a.d[i]), _mm256_cvtepi32_ps(sum), acc.lanes);
    acc.extra += w.m * a.sa[i];
  }
};

struct Q5_0 {
  static constexpr int64_t kBlock = 32, kBytes = 22;
  using Block = Q4_0::Block;
  static INT8_INLINE Block decode(const uint8_t* b) {
    const __m256i u = _mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bits32(b + 2), _mm256_set1_epi8(0x10)));
    return {_mm256_sub_epi8(u, _mm256_set1_epi8(16)), half_at(b)};
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) { Q4_0::dot<V>(w, a, i, acc); }
};

struct Q8_0 {
  static constexpr int64_t kBlock = 32, kBytes = 34;
  using Block = Q4_0::Block;
  static INT8_INLINE Block decode(const uint8_t* b) { return {load32(b + 2), half_at(b)}; }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) { Q4_0::dot<V>(w, a, i, acc); }
};

// (a 32-code dot) scaled in int32 lanes, bytes 0-15 by `lo` and 16-31 by `hi`: maddubs' int16 pair sums times the
// scales (madd), on both paths. VNNI's alternative, vpdpbusd then vpmulld by the scales, was 10-20 % slower at 32
// rows on Zen 5 (Q4_K 5632 x 2048: 8.3-9.8 ms against 7.5-8.1; Q6_K 2048 x 5632 alike), so the K-quants use
// the same instructions everywhere; the integers would be the same either way.
INT8_INLINE __m256i scaled_dot(__m256i u, __m256i s, int lo, int hi) {
  const __m256i scales =
      _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales);
}

struct Q4_K {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  struct Block { __m256i u[8]; __m128i mins; uint64_t sc; float d, dmin; };  // sc: byte j, sub-block j's
  // The 6-bit scales and mins of the 8 sub-blocks, packed in 12 bytes: ggml's unpacking (get_scale_min_k4 in
  // four word operations), scales to bytes 0-7, mins to 8-15.
  static INT8_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.d = half_at(b);
    w.dmin = half_at(b + 2);
    uint32_t words[4];
    std::memcpy(words, b + 4, 12);
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    words[3] = ((words[2] >> 4) & kLow4) | (((words[1] >> 6) & kLow2) << 4);
    const uint32_t mins_low = words[1] & kLow6;
    words[1] = (words[2] & kLow4) | (((words[0] >> 6) & kLow2) << 4);
    words[2] = mins_low;
    words[0] &= kLow6;
    // The scales stay in a register: copied to the stack as bytes and read back as a word, they stalled every
    // block on a failed store-to-load forward (a third of the one-row kernel's time, perf).
    w.sc = words[0] | static_cast<uint64_t>(words[1]) << 32;
    w.mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(words[3]), static_cast<int>(words[2])));
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i bytes = load32(b + 16 + 32 * c);
      w.u[2 * c] = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
      w.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
    }
    return w;
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const int8_t* q = a.q + 256 * i;
    __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int sc = static_cast<int>(w.sc >> (8 * j) & 0xff);
      sum = _mm256_add_epi32(sum, scaled_dot(w.u[j], load32(q + 32 * j), sc, sc));
    }
    const __m128i mins = _mm_madd_epi16(w.mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32 + 8 * i)));
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(a.d[i] * w.d), _mm256_cvtepi32_ps(sum), acc.lanes);
    acc.mins = _mm_fmadd_ps(_mm_set1_ps(-(a.d[i] * w.dmin)), _mm_cvtepi32_ps(mins), acc.mins);
  }
};

struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  struct Block { __m256i w[8]; int sc[16]; float d; };
  // Code 128 h + 32 g + l: its low 4 bits are nibble g / 2 of ql[64 h + 32 (g % 2) + l], its high 2 bits are
  // bits 2 g of qh[32 h + l]; minus 32. Scale of code c: the int8 sc[c / 16].
  static INT8_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.d = half_at(b + 208);
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      const __m256i codes[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two)),
          _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), two))};
      for (int g = 0; g < 4; ++g) w.w[4 * h + g] = _mm256_sub_epi8(codes[g], offset);
    }
    for (int j = 0; j < 16; ++j) w.sc[j] = static_cast<int8_t>(b[192 + j]);
    return w;
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const int8_t* q = a.q + 256 * i;
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i s = load32(q + 32 * g);  // signed codes: |w| times s with w's sign
      sum = _mm256_add_epi32(sum, scaled_dot(_mm256_sign_epi8(w.w[g], w.w[g]), _mm256_sign_epi8(s, w.w[g]),
                                                w.sc[2 * g], w.sc[2 * g + 1]));
    }
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(a.d[i] * w.d), _mm256_cvtepi32_ps(sum), acc.lanes);
  }
};

// ---- The GEMM ---------------------------------------------------------------------------------------------------

struct Problem {
  const uint8_t* w;
  int64_t row_bytes, blocks, m, k;
  const int8_t* q;
  const float *d, *sa;
  const int16_t* sum32;
  float* y;
  int64_t ldy;

  template <class T>
  ActRow row(int64_t r) const {
    const int64_t per = k / T::kBlock;
    return {q + r * k, d + r * per, sa ? sa + r * (k / 32) : nullptr, sum32 ? sum32 + r * (k / 32) : nullptr};
  }
};

// ggml's hsum_float_8: the halves, then pairs, then the last two.
INT8_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ggml's hsum of four lanes (the pairs, then the two).
INT8_INLINE float hsum(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output o for rows [r0, r0 + R): each block decoded once, dotted with the R rows; a compile-time R keeps the
// accumulators in registers.
template <class T, bool V, int R>
void tile(const Problem& p, int64_t r0, int64_t o) {
  ActRow act[R];
  for (int r = 0; r < R; ++r) act[r] = p.row<T>(r0 + r);
  const uint8_t* w = p.w + o * p.row_bytes;
  Acc acc[R];
  for (int64_t i = 0; i < p.blocks; ++i) {
    const typename T::Block block = T::decode(w + i * T::kBytes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) T::template dot<V>(block, act[r], i, acc[r]);
  }
  for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.ldy + o] = hsum(acc[r].lanes) + hsum(acc[r].mins) + acc[r].extra;
}

// Outputs [begin, end) for every row: chunks of kChunk outputs, whose weights stay in L2 while the rows pass over
// them in tiles of kTile (a last one of 1 to kTile - 1).
template <class T, bool V>
void outputs(const Problem& p, int64_t begin, int64_t end) {
  using TileFn = void (*)(const Problem&, int64_t, int64_t);
  static constexpr TileFn kTiles[kTile] = {tile<T, V, 1>, tile<T, V, 2>, tile<T, V, 3>, tile<T, V, 4>};
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    for (int64_t r0 = 0; r0 < p.m; r0 += kTile) {
      const TileFn run = kTiles[std::min(kTile, p.m - r0) - 1];
      for (int64_t o = chunk; o < std::min(chunk + kChunk, end); ++o) run(p, r0, o);
    }
  }
}

bool has_vnni() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

// How to compute: kAuto picks VNNI where the CPU has it; the others are for tests (the private _int8_linear_path op).
enum Path : int64_t { kAuto = 0, kAvx2 = 1, kVnni = 2 };

template <class T>
void run_type(const Problem& p, int64_t n, bool vnni) {
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kChunk, last = std::min(end * kChunk, n);
    if (vnni) {
      outputs<T, true>(p, first, last);
    } else {
      outputs<T, false>(p, first, last);
    }
  });
}

// (values, bytes) of a block of a supported type.
std::pair<int64_t, int64_t> block_of(const char* op, int64_t format) {
  switch (format - kFormatBase) {
    case kQ4_0: return {Q4_0::kBlock, Q4_0::kBytes};
    case kQ4_1: return {Q4_1::kBlock, Q4_1::kBytes};
    case kQ5_0: return {Q5_0::kBlock, Q5_0::kBytes};
    case kQ8_0: return {Q8_0::kBlock, Q8_0::kBytes};
    case kQ4_K: return {Q4_K::kBlock, Q4_K::kBytes};
    case kQ6_K: return {Q6_K::kBlock, Q6_K::kBytes};
    default: TORCH_CHECK_VALUE(false, op, ": format ", format, " is not an int8-activation format (", kFormatBase,
                               " + ggml type Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K)");
  }
}

void check_weight(const char* op, const at::Tensor& w, int64_t n, int64_t k, int64_t format) {
  const auto [block, bytes] = block_of(op, format);
  TORCH_CHECK_VALUE(n >= 0 && k >= 0 && k % block == 0, op, ": K = ", k, " is not a multiple of the block, ", block);
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.is_contiguous() &&
                        w.nbytes() == static_cast<size_t>(n * (k / block) * bytes),
                    op, ": the weight must be ", n * (k / block) * bytes, " contiguous uint8 bytes (N = ", n,
                    ", K = ", k, "), got ", w.nbytes());
}

void into(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t format, at::Tensor& y, int64_t col,
          int64_t path) {
  check_weight("int8_linear", w, n, k, format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == k,
              "int8_linear: x must be a 2-D float32 tensor with K = ", k, " columns");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "int8_linear: y must be a contiguous float32 [", x.size(0), ", N] tensor");
  TORCH_CHECK(col >= 0 && col + n <= y.size(1), "int8_linear: columns [", col, ", ", col + n, ") do not fit y's ",
              y.size(1));
  TORCH_CHECK(path >= kAuto && path <= kVnni, "int8_linear: unknown path ", path);
  TORCH_CHECK(path != kVnni || has_vnni(), "int8_linear: this CPU has no AVX512-VNNI");
  if (x.size(0) == 0 || n == 0) return;
  if (k == 0) {
    y.narrow(1, col, n).zero_();
    return;
  }
  const int64_t type = format - kFormatBase;
  const Quantised a = quantise(x.contiguous(), type);
  const auto [block, bytes] = block_of("int8_linear", format);
  const Problem p{static_cast<const uint8_t*>(w.data_ptr()), k / block * bytes, k / block, x.size(0), k,
                  a.q.data_ptr<int8_t>(), a.d.data_ptr<float>(), type == kQ4_1 ? a.sums.data_ptr<float>() : nullptr,
                  uses_q8_k(type) ? a.sums.data_ptr<int16_t>() : nullptr, y.data_ptr<float>() + col, y.size(1)};
  const bool vnni = path == kVnni || (path == kAuto && has_vnni());
  switch (type) {
    case kQ4_0: run_type<Q4_0>(p, n, vnni); break;
    case kQ4_1: run_type<Q4_1>(p, n, vnni); break;
    case kQ5_0: run_type<Q5_0>(p, n, vnni); break;
    case kQ8_0: run_type<Q8_0>(p, n, vnni); break;
    case kQ4_K: run_type<Q4_K>(p, n, vnni); break;
    default: run_type<Q6_K>(p, n, vnni); break;
  }
}

at::Tensor run(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t format, int64_t path) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be a 2-D float32 tensor");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  into(x, w, n, k, format, y, 0, path);
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t format) {
  return run(x, w, n, k, format, kAuto);
}

void int8_linear_into(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t format, at::Tensor& y,
                      int64_t col) {
  into(x, w, n, k, format, y, col, kAuto);
}

// The activations as the kernels quantise them for `format`'s type: (codes int8 [M, K], scales fp32 [M, blocks],
// sums: Q8_1's fp32 sa [M, K / 32], Q8_K's int16 sums [M, K / 32], else [M, 0]). For tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_quantise(const at::Tensor& x, int64_t format) {
  const auto [block, bytes] = block_of("_int8_quantise", format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0,
              "_int8_quantise: x must be a 2-D float32 tensor with a multiple of ", block, " columns");
  Quantised a = quantise(x.contiguous(), format - kFormatBase);
  return {a.q, a.d, a.sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("int8_linear(Tensor x, Tensor blocks, int n, int k, int format) -> Tensor", &int8_linear);
  lib.def("int8_linear_into(Tensor x, Tensor blocks, int n, int k, int format, Tensor(a!) y, int col) -> ()",
          &int8_linear_into);
  // Private: the same with the path forced (0 auto, 1 AVX2, 2 AVX512-VNNI); the activations as quantised.
  lib.def("_int8_linear_path(Tensor x, Tensor blocks, int n, int k, int format, int path) -> Tensor", &run);
  lib.def("_int8_quantise(Tensor x, int format) -> (Tensor, Tensor, Tensor)", &int8_quantise);
}
