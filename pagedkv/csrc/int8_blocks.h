// The weight types of the int8-activation GEMM (int8_linear.cpp): how a block of each decodes to integer codes,
// and how it dots with one quantised activation row into eight int32 lanes, then fused into the row's fp32
// accumulators -- 256-bit bodies, the AVX2 baseline (VNNI's vpdpbusd through inline assembly where the template
// flag asks for it). int8_avx512.h has the 512-bit bodies of the K-quants; both compute the same lanes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define INT8_INLINE inline __attribute__((always_inline))

namespace {

// One quantised row, as the dot products read it.
struct ActRow {
  const int8_t* q;
  const float* d;
  const float* sa;        // Q8_1
  const int16_t* bsums;   // Q8_K: code sums per 32 values (Q4_K) or per 16 (Q6_K)
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
  // What both bodies keep of a block besides its codes. sc: byte j is sub-block j's 6-bit scale (kept in a
  // register: copied to the stack as bytes and read back as a word, the scales stalled every block on a failed
  // store-to-load forward, a third of the one-row kernel's time, perf); mins: the 8 6-bit mins as int16.
  struct Scales { __m128i mins; uint64_t sc; float d, dmin; };
  struct Block { __m256i u[8]; Scales s; };
  // The scales and mins of the 8 sub-blocks, packed in 12 bytes: ggml's unpacking (get_scale_min_k4 in four
  // word operations), scales to bytes 0-7, mins to 8-15.
  static INT8_INLINE Scales scales(const uint8_t* b) {
    uint32_t words[4];
    std::memcpy(words, b + 4, 12);
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    words[3] = ((words[2] >> 4) & kLow4) | (((words[1] >> 6) & kLow2) << 4);
    const uint32_t mins_low = words[1] & kLow6;
    words[1] = (words[2] & kLow4) | (((words[0] >> 6) & kLow2) << 4);
    words[2] = mins_low;
    words[0] &= kLow6;
    return {_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(words[3]), static_cast<int>(words[2]))),
            words[0] | static_cast<uint64_t>(words[1]) << 32, half_at(b), half_at(b + 2)};
  }
  static INT8_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.s = scales(b);
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i bytes = load32(b + 16 + 32 * c);
      w.u[2 * c] = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
      w.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
    }
    return w;
  }
  // The float steps of a block, after its scaled integer lanes `sum`: the same for every body.
  static INT8_INLINE void accumulate(const Scales& w, const ActRow& a, int64_t i, __m256i sum, Acc& acc) {
    const __m128i mins = _mm_madd_epi16(w.mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsums + 8 * i)));
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(a.d[i] * w.d), _mm256_cvtepi32_ps(sum), acc.lanes);
    acc.mins = _mm_fmadd_ps(_mm_set1_ps(-(a.d[i] * w.dmin)), _mm_cvtepi32_ps(mins), acc.mins);
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const int8_t* q = a.q + 256 * i;
    __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int sc = static_cast<int>(w.s.sc >> (8 * j) & 0xff);
      sum = _mm256_add_epi32(sum, scaled_dot(w.u[j], load32(q + 32 * j), sc, sc));
    }
    accumulate(w.s, a, i, sum, acc);
  }
};

struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  struct Block { __m256i u[8]; __m256i sc16; float d; };
  // Code 128 h + 32 g + l: its low 4 bits are nibble g / 2 of ql[64 h + 32 (g % 2) + l], its high 2 bits are
  // bits 2 g of qh[32 h + l]; w = d sc[c / 16] (u - 32). The codes stay unsigned (maddubs' unsigned operand) and
  // the offset is taken off through the activations' sums per 16 (ggml's trick): sum sc (u - 32) q =
  // sum sc u q - 32 sum_s sc_s bsum_s, the second as one madd of the 16 scales with the 16 sums.
  static INT8_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.d = half_at(b + 208);
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
      w.u[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      w.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      w.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, two));
      w.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
    }
    w.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    return w;
  }
  // The float steps of a block after its scaled integer lanes `sum`, the same for every body: the offset's lanes
  // taken off (lane i: 32 (sc_2i bsum_2i + sc_2i+1 bsum_2i+1), exact), then one fma by the block's scale.
  static INT8_INLINE void accumulate(__m256i sc16, float d, const ActRow& a, int64_t i, __m256i sum, Acc& acc) {
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, load32(a.bsums + 16 * i)), 5);
    acc.lanes = _mm256_fmadd_ps(_mm256_set1_ps(a.d[i] * d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, offset)),
                                acc.lanes);
  }
  template <bool V>
  static INT8_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    const int8_t* q = a.q + 256 * i;
    alignas(32) int16_t sc[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc), w.sc16);
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g)
      sum = _mm256_add_epi32(sum, scaled_dot(w.u[g], load32(q + 32 * g), sc[2 * g], sc[2 * g + 1]));
    accumulate(w.sc16, w.d, a, i, sum, acc);
  }
};

}  // namespace
