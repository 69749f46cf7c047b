// 512-bit bodies of the K-quants (int8_blocks.h's Q4_K and Q6_K) for CPUs with AVX512-VNNI: two 32-code groups an
// instruction, maddubs then vpdpwssd (the scales' madd and the add in one), compiled for AVX-512 (the target
// attribute: the wheel's GEMM library is built for x86-64-v3) so that a tile's decoded block and its rows'
// accumulators have 32 registers -- with 16, the 256-bit 4-row Q4_K tile spilled to the stack.
//
// Same integers, same lanes: a 512-bit sum's lane i (first group) and lane i + 8 (second group) add up to lane i of
// the 256-bit body's sum (exact int32 additions), and every float step after it is the 256-bit body's own.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "int8_blocks.h"

#define INT8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INT8_AVX512_INLINE INT8_AVX512 inline __attribute__((always_inline))

namespace {

INT8_AVX512_INLINE __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

// The two 256-bit halves of `v` added: the 256-bit body's lanes.
INT8_AVX512_INLINE __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Four 16-bit values a, b, c, d (as int16 lane indices into a vector of scales), each repeated over a quarter: the
// index vector that spreads those scales over a 512-bit vector of int16 lanes.
INT8_AVX512_INLINE __m512i quarters(int a, int b, int c, int d) {
  const __m256i low = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b)), _mm_set1_epi16(static_cast<int16_t>(a)));
  const __m256i high =
      _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(d)), _mm_set1_epi16(static_cast<int16_t>(c)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// The same 32 bytes in both halves, the second half's int16 lanes shifted right by `high` bits (the first by `low`).
INT8_AVX512_INLINE __m512i both_halves_shifted(const uint8_t* p, int low, int high, bool left) {
  const __m512i bytes = _mm512_broadcast_i64x4(load32(p));
  const __m512i counts = quarters(low, low, high, high);
  return left ? _mm512_sllv_epi16(bytes, counts) : _mm512_srlv_epi16(bytes, counts);
}

// The 256 codes of one block (four vectors of two 32-code groups, as unsigned bytes) dotted with the row's 256
// int8 activations, each group's products weighted by its scales: Q4_K's and Q6_K's integer core.
INT8_AVX512_INLINE __m512i scaled_dot(const __m512i (&u)[4], const __m512i (&sc)[4], const int8_t* q) {
  __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u[c], load64(q + 64 * c)), sc[c]);
  return sum;
}

struct Q4_K_512 {
  static constexpr int64_t kBlock = Q4_K::kBlock, kBytes = Q4_K::kBytes;
  struct Block { __m512i u[4], sc[4]; Q4_K::Scales s; };  // u[c]: sub-blocks 2c and 2c + 1; sc[c]: their scales
  static INT8_AVX512_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.s = Q4_K::scales(b);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(w.s.sc))));
    for (int c = 0; c < 4; ++c) {  // the 32 bytes of sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
      w.u[c] = _mm512_and_si512(both_halves_shifted(b + 16 + 32 * c, 0, 4, false), _mm512_set1_epi8(0x0F));
      w.sc[c] = _mm512_permutexvar_epi16(quarters(2 * c, 2 * c, 2 * c + 1, 2 * c + 1), sc16);
    }
    return w;
  }
  template <bool V>
  static INT8_AVX512_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    Q4_K::accumulate(w.s, a, i, fold(scaled_dot(w.u, w.sc, a.q + 256 * i)), acc);
  }
};

struct Q6_K_512 {
  static constexpr int64_t kBlock = Q6_K::kBlock, kBytes = Q6_K::kBytes;
  struct Block { __m512i u[4], sc[4]; __m256i sc16; float d; };  // u[p]: code groups 2p and 2p + 1 (Q6_K's order)
  static INT8_AVX512_INLINE Block decode(const uint8_t* b) {
    Block w;
    w.d = half_at(b + 208);
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = load64(b + 64 * h);  // groups 4h, 4h + 1 in the low nibbles, 4h + 2, 4h + 3 in the high
      const __m512i up = both_halves_shifted(b + 128 + 32 * h, 4, 2, true);
      const __m512i down = both_halves_shifted(b + 128 + 32 * h, 0, 2, false);
      w.u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(up, two));
      w.u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), _mm512_and_si512(down, two));
    }
    w.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    for (int p = 0; p < 4; ++p)  // group g's halves have scales 2g and 2g + 1
      w.sc[p] = _mm512_permutexvar_epi16(quarters(4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3),
                                         _mm512_castsi256_si512(w.sc16));
    return w;
  }
  template <bool V>
  static INT8_AVX512_INLINE void dot(const Block& w, const ActRow& a, int64_t i, Acc& acc) {
    Q6_K::accumulate(w.sc16, w.d, a, i, fold(scaled_dot(w.u, w.sc, a.q + 256 * i)), acc);
  }
};

}  // namespace
