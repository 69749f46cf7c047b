// The tiled int8 GEMM of Q4_K, Q6_K and the 32-value types (Q8_0, Q5_0, Q4_0, Q4_1) on their repacked layout
// (int8_repack.h): a tile of R activation rows times one group of 16 output columns, the columns in the lanes (16
// dword lanes of a 512-bit vector; the AVX2 body does the group as two halves of 8), each activation dword
// broadcast. No lane ever mixes two columns, so there is no
// horizontal sum per block: a block costs 64 vpdpbusd (VNNI) per row and 16 columns.
//
// The canonical order, the same for every tile size and path (so a row's bits never depend on the other rows of
// its call, and AVX2 and AVX-512 agree bit for bit). Per output column, row, and block i (file order), with the
// activations' Q8_K codes q, scale da (fp32) and code sums bsum (per 32 for Q4_K, per 16 for Q6_K):
//   Q4_K: isum = sum_s sc_s sum_l u q            imin = sum_s mn_s bsum_s           (exact int32)
//         acc  = fmaf(float(isum), da * d, acc)  accm = fmaf(float(imin), -(da * dmin), accm)
//         y = acc + accm
//   Q6_K: isum = sum_s sc_s sum_l u q - 32 sum_s sc_s bsum_s                       (exact int32; u = code + 32)
//         acc  = fmaf(float(isum), da * d, acc)                                      y = acc
//   Q8_0: isum = sum_l c q (32 values, Q8_0 activations, da their fp16 scale)      (exact int32)
//   Q5_0, Q4_0: the same with c = u - 16, u - 8
//   Q4_1: isum = sum_l u q (Q8_1 activations, sa = fp16(da sum q))                  (exact int32)
//         acc  = fmaf(float(isum), da * d, acc)  accm = fmaf(m, sa, accm)           y = acc + accm
//         acc  = fmaf(float(isum), da * d, acc)                                      y = acc
// with acc = accm = 0 at the start and da * d, da * dmin rounded to fp32. The integer sums are exact (|isum| <
// 2^28), so how an instruction set groups them does not matter: VNNI sums a sub-block's codes with vpdpbusd and
// scales the sum with vpmulld; AVX2 multiplies each pair sum of maddubs by the scale in madd. Only the float steps
// above are canonical, and those are the same instructions lane for lane on both paths. The 32-value types share
// one body, templated on the layout (codes decoded to c = u - offset first). Signed codes (all but Q4_1): AVX2
// multiplies |c| by q with c's sign (maddubs, pair sums <= 2 * 128 * 127); VNNI reads the activations offset to
// unsigned (q ^ 0x80 = q + 128, done once per call) and takes 128 times the column's code sum (csum) off.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "int8_repack.h"

#define INT8_TILED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

namespace {

// One call: the repacked weight, the quantised activations (Q8_K), the output.
struct Tiled {
  const uint8_t* w;
  int64_t blocks, n, k, values;  // values: a block's (256, or 32 for Q8_0)
  const int8_t* q;
  const float* d;
  const int16_t* bsums;
  const float* sa;
  int64_t sums_per_row;
  float* y;
  int64_t ldy;

  const int8_t* q_at(int64_t row, int64_t i) const { return q + row * k + values * i; }
  float d_at(int64_t row, int64_t i) const { return d[row * blocks + i]; }
  float sa_at(int64_t row, int64_t i) const { return sa[row * blocks + i]; }  // Q4_1: Q8_1's fp16(da sum q)
  // The pair of code sums (2 p, 2 p + 1) of block i as one dword: what madd / vpdpwssd pairs with a scale pair.
  int pair_at(int64_t row, int64_t i, int p) const {
    int v;
    std::memcpy(&v, bsums + row * sums_per_row + (sums_per_row / blocks) * i + 2 * p, sizeof(v));
    return v;
  }
  // Columns of group `group` that are real outputs (the last group's padding rows are not written).
  int64_t real(int64_t group) const { return std::min<int64_t>(kGroup, n - kGroup * group); }
};

inline int dword_at(const int8_t* p) {
  int v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- AVX2: a group as two halves of 8 columns -----------------------------------------------------------------

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Int16 pairs (a, b) per dword -> (a, a) (`odd` false) or (b, b): the scale that madd multiplies both pair sums by.
inline __m256i spread(__m256i pairs, bool odd) {
  return odd ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xF5), 0xF5)
             : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xA0), 0xA0);
}

inline __m256i scaled(__m256i u, int q, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(q)), scale);
}

inline void store8(float* y, __m256 v, int64_t count) {
  if (count >= 8) return _mm256_storeu_ps(y, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(y, tmp, sizeof(float) * std::max<int64_t>(count, 0));
}

template <int R>
void q4_k_half(const Tiled& p, int64_t group, int64_t r0, int h) {
  using L = Q4KLayout;
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    __m256i isum[R], imin[R];
    for (int r = 0; r < R; ++r) isum[r] = imin[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i pairs = _mm256_cvtepu8_epi16(load128(g + L::kSc + 32 * c + 16 * h));
      const __m256i even = spread(pairs, false), odd = spread(pairs, true);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i v = load256(g + L::kQs + (c * 8 + t) * 64 + 32 * h);
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = p.q_at(r0 + r, i) + 64 * c + 4 * t;
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(scaled(lo, dword_at(q), even),
                                                               scaled(hi, dword_at(q + 32), odd)));
        }
      }
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i mins = _mm256_cvtepu8_epi16(load128(g + L::kMn + 32 * c + 16 * h));
      for (int r = 0; r < R; ++r)
        imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(p.pair_at(r0 + r, i, c))));
    }
    const __m256 dw = _mm256_cvtph_ps(load128(g + L::kD + 16 * h));
    const __m256 dmin = _mm256_cvtph_ps(load128(g + L::kDmin + 16 * h));
    for (int r = 0; r < R; ++r) {
      const __m256 da = _mm256_set1_ps(p.d_at(r0 + r, i));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(da, dw), acc[r]);
      accm[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(da, dmin), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store8(p.y + (r0 + r) * p.ldy + kGroup * group + 8 * h, _mm256_add_ps(acc[r], accm[r]), p.real(group) - 8 * h);
}

// Q6_K's codes of 4 consecutive values of each column (t) for the four 32-value runs g of half h of the block:
// low 4 bits from ql (s = g % 2; nibble g / 2), high 2 from qh (bits 2 g).
#define INT8_Q6_K_CODES(AND, OR, SLL, SRL, ql0, ql1, qh, low, two, u)         \
  u[0] = OR(AND(ql0, low), AND(SLL(qh, 4), two));                                 \
  u[1] = OR(AND(ql1, low), AND(SLL(qh, 2), two));                                 \
  u[2] = OR(AND(SRL(ql0, 4), low), AND(qh, two));                                 \
  u[3] = OR(AND(SRL(ql1, 4), low), AND(SRL(qh, 2), two));

template <int R>
void q6_k_half(const Tiled& p, int64_t group, int64_t r0, int h8) {
  using L = Q6KLayout;
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    __m256i isum[R], offset[R];
    for (int r = 0; r < R; ++r) isum[r] = offset[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int t4 = 0; t4 < 2; ++t4) {  // sub-blocks 8 h + 2 gg + t4 (16 values each)
        __m256i scale[4];
        for (int gg = 0; gg < 4; ++gg)
          scale[gg] = spread(_mm256_cvtepi8_epi16(load128(g + L::kSc + 32 * (4 * h + gg) + 16 * h8)), t4 == 1);
#pragma GCC unroll 4
        for (int tt = 0; tt < 4; ++tt) {
          const int t = 4 * t4 + tt;
          const __m256i ql0 = load256(g + L::at(h, t, 0) + 32 * h8);
          const __m256i ql1 = load256(g + L::at(h, t, 1) + 32 * h8);
          const __m256i qh = load256(g + L::at(h, t, 2) + 32 * h8);
          __m256i u[4];
          INT8_Q6_K_CODES(_mm256_and_si256, _mm256_or_si256, _mm256_slli_epi16, _mm256_srli_epi16, ql0, ql1, qh,
                          low, two, u)
          for (int r = 0; r < R; ++r) {
            const int8_t* q = p.q_at(r0 + r, i) + 128 * h + 4 * t;
            for (int gg = 0; gg < 4; ++gg)
              isum[r] = _mm256_add_epi32(isum[r], scaled(u[gg], dword_at(q + 32 * gg), scale[gg]));
          }
        }
      }
    }
    for (int pp = 0; pp < 8; ++pp) {
      const __m256i scales = _mm256_cvtepi8_epi16(load128(g + L::kSc + 32 * pp + 16 * h8));
      for (int r = 0; r < R; ++r)
        offset[r] = _mm256_add_epi32(offset[r], _mm256_madd_epi16(scales, _mm256_set1_epi32(p.pair_at(r0 + r, i, pp))));
    }
    const __m256 dw = _mm256_cvtph_ps(load128(g + L::kD + 16 * h8));
    for (int r = 0; r < R; ++r) {
      const __m256i sum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset[r], 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(_mm256_set1_ps(p.d_at(r0 + r, i)), dw), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store8(p.y + (r0 + r) * p.ldy + kGroup * group + 8 * h8, acc[r], p.real(group) - 8 * h8);
}

// Codes 4 t .. 4 t + 3 of the 8 columns of half h (AVX2) or of all 16 (AVX-512): Q8_0's as stored; the others'
// nibble (run t % 4, low or high), with Q5_0's high bit (bit t of each byte of the rearranged qh), minus the type's
// offset (Q5_0 16, Q4_0 8; Q4_1's stay unsigned).
template <class L>
inline __m256i legacy_codes(const uint8_t* g, int t, int h) {
  if constexpr (!L::kNibbles) {
    return load256(g + L::kQs + 64 * t + 32 * h);
  } else {
    const __m256i v = load256(g + L::kQs + 64 * (t % 4) + 32 * h), low = _mm256_set1_epi8(0x0F);
    __m256i u = _mm256_and_si256(t < 4 ? v : _mm256_srli_epi16(v, 4), low);
    if constexpr (L::kHighBits) {
      const __m256i qh = load256(g + L::kQh + 32 * h);
      u = _mm256_or_si256(u, _mm256_and_si256(t < 4 ? _mm256_slli_epi32(qh, 4 - t) : _mm256_srli_epi32(qh, t - 4),
                                              _mm256_set1_epi8(0x10)));
    }
    if constexpr (L::kOffset != 0) u = _mm256_sub_epi8(u, _mm256_set1_epi8(L::kOffset));
    return u;
  }
}

template <class L, int R>
void legacy_half(const Tiled& p, int64_t group, int64_t r0, int h) {
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i c = legacy_codes<L>(g, t, h);
      const __m256i u = L::kMin ? c : _mm256_abs_epi8(c);  // Q4_1's codes are unsigned already
      for (int r = 0; r < R; ++r) {
        const __m256i q = _mm256_set1_epi32(dword_at(p.q_at(r0 + r, i) + 4 * t));
        const __m256i s = L::kMin ? q : _mm256_sign_epi8(q, c);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(load128(g + L::kD + 16 * h));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(p.d_at(r0 + r, i)), dw);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
    }
    if constexpr (L::kMin) {
      const __m256 mw = _mm256_cvtph_ps(load128(g + L::kM + 16 * h));
      for (int r = 0; r < R; ++r) accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(p.sa_at(r0 + r, i)), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 y = L::kMin ? _mm256_add_ps(acc[r], accm[r]) : acc[r];
    store8(p.y + (r0 + r) * p.ldy + kGroup * group + 8 * h, y, p.real(group) - 8 * h);
  }
}

template <class L, int R>
void legacy_tile(const Tiled& p, int64_t group, int64_t r0) {
  legacy_half<L, R>(p, group, r0, 0);
  if (p.real(group) > 8) legacy_half<L, R>(p, group, r0, 1);
}

template <int R>
void q4_k_tile(const Tiled& p, int64_t group, int64_t r0) {
  q4_k_half<R>(p, group, r0, 0);
  if (p.real(group) > 8) q4_k_half<R>(p, group, r0, 1);
}

template <int R>
void q6_k_tile(const Tiled& p, int64_t group, int64_t r0) {
  q6_k_half<R>(p, group, r0, 0);
  if (p.real(group) > 8) q6_k_half<R>(p, group, r0, 1);
}

// ---- AVX-512 + VNNI: a group in one vector ----------------------------------------------------------------------

// A block's weights are asked for kPrefetchBlocks blocks ahead (software prefetch, a cache line at a time): a
// one-row step streams every weight once from memory, and the hardware prefetcher alone left the 1.1B Q4_K_M
// model's one request at 0.91-1.01x llama.cpp; 4 blocks ahead (~9 KiB for Q4_K) gave 1.11-1.38x, alternating
// runs of benchmarks/int8_decode.py (Zen 5, 2 threads). A prefetch past the weights' end does not fault.
constexpr int64_t kPrefetchBlocks = 4;

INT8_TILED_AVX512 inline void prefetch_block(const uint8_t* g, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(g + kPrefetchBlocks * bytes + at), _MM_HINT_T0);
}

INT8_TILED_AVX512 inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

INT8_TILED_AVX512 inline void store16(float* y, __m512 v, int64_t count) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << count) - 1), v);
}

// Per sub-block: its codes' sums for the tile's R rows (R registers, vpdpbusd), then scaled into each row's block
// sum with one vpmulld; R = 8 rows share each decoded code vector.
template <int R>
INT8_TILED_AVX512 void q4_k_tile_512(const Tiled& p, int64_t group, int64_t r0) {
  using L = Q4KLayout;
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  const __m512i low = _mm512_set1_epi8(0x0F), half = _mm512_set1_epi32(0xFFFF);
  __m512 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    prefetch_block(g, L::kBytes);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {  // sub-block j: the low nibbles of qs run j / 2 (j even), else the high ones
      const int c = j / 2;
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i v = load512(g + L::kQs + (c * 8 + t) * 64);
        const __m512i u = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low);
        for (int r = 0; r < R; ++r)
          sums[r] = _mm512_dpbusd_epi32(sums[r], u, _mm512_set1_epi32(dword_at(p.q_at(r0 + r, i) + 32 * j + 4 * t)));
      }
      const __m512i pairs = _mm512_cvtepu8_epi16(load256(g + L::kSc + 32 * c));
      const __m512i scale = j % 2 ? _mm512_srli_epi32(pairs, 16) : _mm512_and_si512(pairs, half);
      for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sums[r], scale));
    }
    const __m512 dw = _mm512_cvtph_ps(load256(g + L::kD)), dmin = _mm512_cvtph_ps(load256(g + L::kDmin));
    __m512i mins[4];
    for (int c = 0; c < 4; ++c) mins[c] = _mm512_cvtepu8_epi16(load256(g + L::kMn + 32 * c));
    for (int r = 0; r < R; ++r) {
      __m512i imin = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) imin = _mm512_dpwssd_epi32(imin, mins[c], _mm512_set1_epi32(p.pair_at(r0 + r, i, c)));
      const __m512 da = _mm512_set1_ps(p.d_at(r0 + r, i));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(da, dw), acc[r]);
      accm[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(da, dmin), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store16(p.y + (r0 + r) * p.ldy + kGroup * group, _mm512_add_ps(acc[r], accm[r]), p.real(group));
}

// Q6_K's code vector of run gg (0-3) of half h at t: ql's nibble gg / 2 of half gg % 2, qh's bits 2 gg.
INT8_TILED_AVX512 inline __m512i q6_k_codes(const uint8_t* g, int h, int t, int gg) {
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  const __m512i ql = load512(g + Q6KLayout::at(h, t, gg % 2)), qh = load512(g + Q6KLayout::at(h, t, 2));
  const __m512i high = gg == 0 ? _mm512_slli_epi16(qh, 4) : gg == 1 ? _mm512_slli_epi16(qh, 2)
                     : gg == 2 ? qh : _mm512_srli_epi16(qh, 2);
  return _mm512_or_si512(_mm512_and_si512(gg < 2 ? ql : _mm512_srli_epi16(ql, 4), low), _mm512_and_si512(high, two));
}

template <int R>
INT8_TILED_AVX512 void q6_k_tile_512(const Tiled& p, int64_t group, int64_t r0) {
  using L = Q6KLayout;
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    prefetch_block(g, L::kBytes);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int t4 = 0; t4 < 2; ++t4) {
#pragma GCC unroll 4
        for (int gg = 0; gg < 4; ++gg) {  // sub-block 8 h + 2 gg + t4: 16 codes, 4 of each column a vector
          __m512i sums[R];
          for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int tt = 0; tt < 4; ++tt) {
            const int t = 4 * t4 + tt;
            const __m512i u = q6_k_codes(g, h, t, gg);
            for (int r = 0; r < R; ++r) {
              const int8_t* q = p.q_at(r0 + r, i) + 128 * h + 32 * gg + 4 * t;
              sums[r] = _mm512_dpbusd_epi32(sums[r], u, _mm512_set1_epi32(dword_at(q)));
            }
          }
          const __m512i pairs = _mm512_cvtepi8_epi16(load256(g + L::kSc + 32 * (4 * h + gg)));
          const __m512i scale = t4 ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
          for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sums[r], scale));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(load256(g + L::kD));
    for (int r = 0; r < R; ++r) {
      __m512i offset = _mm512_setzero_si512();
      for (int pp = 0; pp < 8; ++pp)
        offset = _mm512_dpwssd_epi32(offset, _mm512_cvtepi8_epi16(load256(g + L::kSc + 32 * pp)),
                                     _mm512_set1_epi32(p.pair_at(r0 + r, i, pp)));
      const __m512i sum = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(offset, 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(p.d_at(r0 + r, i)), dw), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(p.y + (r0 + r) * p.ldy + kGroup * group, acc[r], p.real(group));
}

template <class L>
INT8_TILED_AVX512 inline __m512i legacy_codes_512(const uint8_t* g, int t) {
  if constexpr (!L::kNibbles) {
    return load512(g + L::kQs + 64 * t);
  } else {
    const __m512i v = load512(g + L::kQs + 64 * (t % 4)), low = _mm512_set1_epi8(0x0F);
    __m512i u = _mm512_and_si512(t < 4 ? v : _mm512_srli_epi16(v, 4), low);
    if constexpr (L::kHighBits) {
      const __m512i qh = load512(g + L::kQh);
      u = _mm512_or_si512(u, _mm512_and_si512(t < 4 ? _mm512_slli_epi32(qh, 4 - t) : _mm512_srli_epi32(qh, t - 4),
                                              _mm512_set1_epi8(0x10)));
    }
    if constexpr (L::kOffset != 0) u = _mm512_sub_epi8(u, _mm512_set1_epi8(L::kOffset));
    return u;
  }
}

// Signed codes: the activation codes come offset to unsigned (q ^ 0x80, once per call), 128 csum taken off per
// block. Q4_1's unsigned codes take the activations as they are.
template <class L, int R>
INT8_TILED_AVX512 void legacy_tile_512(const Tiled& p, int64_t group, int64_t r0) {
  const uint8_t* base = p.w + group * p.blocks * L::kBytes;
  __m512 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < p.blocks; ++i) {
    const uint8_t* g = base + i * L::kBytes;
    prefetch_block(g, L::kBytes);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i c = legacy_codes_512<L>(g, t);
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_set1_epi32(dword_at(p.q_at(r0 + r, i) + 4 * t));
        isum[r] = L::kMin ? _mm512_dpbusd_epi32(isum[r], c, q) : _mm512_dpbusd_epi32(isum[r], q, c);
      }
    }
    if constexpr (!L::kMin) {
      const __m512i offset = _mm512_slli_epi32(_mm512_cvtepi16_epi32(load256(g + L::kSum)), 7);
      for (int r = 0; r < R; ++r) isum[r] = _mm512_sub_epi32(isum[r], offset);
    }
    const __m512 dw = _mm512_cvtph_ps(load256(g + L::kD));
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(p.d_at(r0 + r, i)), dw);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
    }
    if constexpr (L::kMin) {
      const __m512 mw = _mm512_cvtph_ps(load256(g + L::kM));
      for (int r = 0; r < R; ++r) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(p.sa_at(r0 + r, i)), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store16(p.y + (r0 + r) * p.ldy + kGroup * group, L::kMin ? _mm512_add_ps(acc[r], accm[r]) : acc[r], p.real(group));
}

#undef INT8_Q6_K_CODES

}  // namespace
