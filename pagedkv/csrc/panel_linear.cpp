// y[M, N] = x[M, K] @ W^T, with W stored in "panels": 16 output features at a time, K-major inside a panel.
//
// Why panels: the inner loop of a CPU GEMM is an outer product -- one x value broadcast against a vector
// of weights for 16 outputs, into 2 x MR register accumulators. That needs, for every k, the 16 weights of
// a panel side by side in memory, which row-major W [N, K] does not give. Packing once at load time makes
// every step read its weights as one sequential stream, at any batch size, with no per-call repacking.
//
// Formats of a panel (P = ceil(N / 16) panels, one after another; a last partial panel is zero-padded, codes,
// d and m 0, so its padded outputs compute 0). A float format holds each k's 16 weights side by side. A
// quantised one holds records of G consecutive k: the codes [G k][16 outputs] -- int8, or for 4-bit codes
// one byte per output and k-pair (byte = q[2p] | q[2p + 1] << 4, unsigned) -- then float d[16], then, in a
// format with a min, float m[16]. K must be a multiple of G.
//
//   code  name   G   codes      bytes        weight       what the GGUF converter packs into it
//   0     fp32   -   -          64 per k     w            F32
//   1     q4     32  4-bit u    384 record   d * q + m    Q4_0, Q4_1, Q4_K
//   2     q8     32  8-bit s    576 record   d * q        Q5_0, Q8_0
//   3     q8m    32  8-bit s    640 record   d * q + m    Q5_1, Q5_K
//   4     q4g16  16  4-bit u    256 record   d * q + m    Q2_K
//   5     q8g16  16  8-bit s    320 record   d * q        Q3_K, Q6_K
//   6     f16    -   fp16 bits  32 per k     (float) h    F16
//   7     bf16   -   bf16 bits  32 per k     bits << 16   BF16
//
// The compact formats keep a GGUF block's codes and two-level scales as the file does (within 6 % of its size;
// the wide formats above multiply the scales out per group: Q4_K takes 0.75 bytes a weight in q4, 0.59 in
// q4k). A record holds one block of U k of the 16 outputs, in the order the kernels read it, front to back
// (a record read out of order streams at half the speed: the prefetches below run ahead in address order):
// float d[16], the block's fp16 d widened (with a min, then dmin[16]); then each sub-block of S k:
//   scales       u8 [16] (q6k, q3k: int8; none in q5), the sub-block's scale of each output; with a min, then
//                the mins, u8 [16]
//   high bits    u32 [16] (H > 0): an output's word holds the H bits past the nibble of the sub-block's k = j
//                at bits H j (S = 32 / H), so one load brings the sub-block's high bits for 16 outputs, and a
//                k's are one shift and one and away from bit 4 of its code
//   low nibbles  u8 [S / 2 k-pairs][16], as q4's: byte = (u[2p] & 15) | (u[2p + 1] & 15) << 4
//
//   code  name   U    S   H  bytes          weight of code u (unsigned) in sub-block s   GGUF type
//   8     q4k    256  32  0  2432 record    fma(u, d sc[s], -(dmin mn[s]))               Q4_K
//   9     q6k    256  16  2  3392 record    (d sc[s]) (u - 32)                           Q6_K
//   10    q5     32   -   1  384 record     d (u - 16)                                   Q5_0
//   11    q5k    256  32  1  2944 record    fma(u, d sc[s], -(dmin mn[s]))               Q5_K
//   12    q2k    256  16  0  2688 record    fma(u, d sc[s], -(dmin mn[s]))               Q2_K (u: 0..3)
//   13    q3k    256  16  0  2368 record    (d sc[s]) (u - 4)                            Q3_K (u: 0..7, sc - 32)
//
// (Q2_K and Q3_K keep their 2- and 3-bit codes in nibbles: 0.66 and 0.58 bytes a weight against the file's
// 0.33 and 0.43, where q4g16 / q8g16 take 1 and 1.25.)
//
// The weights are exactly those gguf's numpy dequantize computes in fp32. With a min, d * q is exact: d has at
// most 17 significant bits (an fp16 value times a 6-bit scale) and q at most 7 (|q| <= 128), 24 in all; so
// d * q + m rounds once, fused or not, and every path here fuses it. Without a min, d * q may need 25 bits
// (Q6_K: an 8-bit scale), so the weight is that product rounded once, and only then multiplied by x: the
// reference's two roundings, on every path. The compact formats make d sc and dmin mn in registers, once per
// sub-block and exactly (11 + 6 significant bits; Q6_K's 11 + 7); u (d sc) is exact too (+ 5 bits; Q6_K's
// + 6: 24), so the fma rounds once, as numpy's (d sc) u - dmin mn. An offset is taken as a min, offset (d sc)
// (exact: a power of two): the fma's exact u (d sc) - offset (d sc) is (d sc) (u - offset), at most 23 bits,
// so it comes out exact, as numpy's product.
//
// Two ways through, by the number of rows M:
//   - tiled (M > 8: prefill, big batches): a panel other than fp32 is expanded to fp32, 256 k at a time, into
//     an L1-resident buffer and then multiplied like an fp32 one, 3 rows per register tile: the expansion is
//     paid once per call and panel, not once per row.
//   - registers (M <= 8: decode): each k's weights of one panel are decoded straight into registers and used
//     by up to 4 rows at once, with software prefetch; at one row this reads the weights at close to memory
//     speed, where the tiled path makes a round trip through its buffer.
//
// The summation order -- the determinism contract. Every output is summed in this one order on every path,
// whatever M, the row's position in the batch, the thread split or the vector width: a request's numbers do
// not depend on what it is batched with.
//   1. k goes in chunks of 256 (the last one shorter where K is not a multiple of 256).
//   2. In a chunk starting at k0, two partial sums per output: s0 = fma(x[k], w[k], s0) from s0 = 0 over the
//      chunk's even k (k0, k0 + 2, ...) in ascending order, s1 the same over its odd k (k0 + 1, k0 + 3, ...).
//   3. The chunk's sum is s0 + s1; the total is the first chunk's sum, then total + each next chunk's sum, in
//      chunk order (fp32 adds).
// Why two partials: with one chain of FMAs per output, every FMA waits for the previous one (~4 cycles), and an
// AVX-512 register holds a whole panel: at one row a core summed 16 weights per 4 cycles whatever the format,
// and q4, q4g16, q8, q8g16 and q8m all took 9.5-10.4 ms for the step below on one thread (6.8-7.4 ms with two
// partials). Two chains lift that bound above the cost of decoding (Zen 5 issues one 512-bit FMA a cycle, and
// a coded weight costs a multiply or FMA to decode and one to use). More did not pay: in cache (64 x 8192, one
// thread) q8 took 26.4, 26.4 and 26.8 us at one row with 2, 4 and 8 partials, and at 2 rows 4 partials took 42
// us with AVX-512 and 54 with AVX2 against 35 and 40 for 2: AVX2 holds 4 accumulators a row for 2 partials, so
// 2 rows fit its 16 registers. Two also suit the codes: a byte of 4-bit codes is a k-pair, its low nibble
// feeding s0 and its high nibble s1.
//
// Measured with benchmarks/panel_linear.py --formats (the default model's 121 linears, every weight in one
// format; 2 threads, 2-core Zen 5 with AVX-512), one chain -> two partials, ms a step at one row (GB/s): q4
// 6.9 -> 4.8 (15 -> 21), q4g16 7.1 -> 5.7 (19 -> 24), q8 7.6 -> 6.4 (20 -> 24), q8m 9.1 -> 7.6 (18 -> 22),
// q8g16 7.9 -> 6.3 (21 -> 27); fp32, f16 and bf16 read at memory speed before and after (25-29 GB/s). AVX2
// kernels forced: q4 7.8 -> 6.2, q4g16 7.3 -> 6.1, q8m 11 -> 9.4, q8g16 7.9 -> 7.5, the rest alike. 16, 128
// and 724 rows (the tiled path) alike within the noise: q4 38, 250 and 1350 ms before, 38, 248 and 1390 after.

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#else
#error "panel_linear needs AVX2, FMA and F16C (x86-64-v3): without them only this library is lost, torch runs the GEMM"
#endif

namespace {

constexpr int64_t kPanel = 16;     // outputs per panel: two AVX2 vectors of 8 floats
constexpr int64_t kChunk = 256;    // k values expanded at a time: 16 KiB of fp32, stays in L1
constexpr int64_t kRowBlock = 96;  // x rows kept hot (in L2) while a thread walks its panels
constexpr int kTile = 3;           // x rows per register tile: 3 x 2 partials x 2 halves = 12 accumulators
constexpr int kPartials = 2;       // interleaved partial sums per output and chunk (the header's order)
static_assert(kPartials == 2, "the kernels add their partials as s0 + s1");

enum Format : int { kF32, kQ4, kQ8, kQ8M, kQ4G16, kQ8G16, kF16, kBF16, kQ4K, kQ6K, kQ5, kQ5K, kQ2K, kQ3K, kFormats };

// What one format's panel holds, k ascending, in "units": a record of G k, or one k of a float format.
template <int Bits, int64_t Group, bool Min>
struct Codes {
  static constexpr int kBits = Bits;
  static constexpr bool kMin = Min;
  static constexpr int64_t kUnit = Group;              // k per unit
  static constexpr int64_t kLines = Group * Bits / 8;  // 16-byte lines of codes, 1 k each (8-bit) or 2 (4-bit)
  static constexpr int64_t kScales = kLines * kPanel;  // byte offset of d[16] (then m[16])
  static constexpr int64_t kBytes = kScales + (Min ? 2 : 1) * kPanel * sizeof(float);
};
template <int64_t Bytes>  // per weight
struct Floats {
  static constexpr int64_t kUnit = 1;
  static constexpr int64_t kBytes = kPanel * Bytes;
};
// A compact format: a record of one block of Unit k in sub-blocks of Sub k, the header's layout. Byte offsets:
// d (then dmin) at 0, the first sub-block at kHead; in a sub-block, scales (then mins) at 0, the high-bit
// words at kHighBits, the low nibbles at kCodes.
template <int64_t Unit, int64_t Sub, int High, bool Min, int Offset, bool SignedScales>
struct Blocks {
  static constexpr int64_t kUnit = Unit, kSub = Sub;
  static constexpr int kHigh = High, kOffset = Offset;
  static constexpr bool kMin = Min, kSignedScales = SignedScales;
  static constexpr bool kSubScales = Sub < Unit;  // q5: d alone
  static constexpr int64_t kHead = (Min ? 2 : 1) * kPanel * sizeof(float);
  static constexpr int64_t kHighBits = kSubScales ? (Min ? 2 : 1) * kPanel : 0;
  static constexpr int64_t kCodes = kHighBits + (High > 0 ? kPanel * 4 : 0);
  static constexpr int64_t kSubBytes = kCodes + Sub / 2 * kPanel;
  static constexpr int64_t kBytes = kHead + Unit / Sub * kSubBytes;
  static_assert(High == 0 || 32 / High == Sub);  // one high-bits word per output and sub-block
};
template <int F>
constexpr bool kCompact = F >= kQ4K;
template <int F>
struct Spec;
template <> struct Spec<kF32> : Floats<4> {};
template <> struct Spec<kQ4> : Codes<4, 32, true> {};
template <> struct Spec<kQ8> : Codes<8, 32, false> {};
template <> struct Spec<kQ8M> : Codes<8, 32, true> {};
template <> struct Spec<kQ4G16> : Codes<4, 16, true> {};
template <> struct Spec<kQ8G16> : Codes<8, 16, false> {};
template <> struct Spec<kF16> : Floats<2> {};
template <> struct Spec<kBF16> : Floats<2> {};
template <> struct Spec<kQ4K> : Blocks<256, 32, 0, true, 0, false> {};
template <> struct Spec<kQ6K> : Blocks<256, 16, 2, false, 32, true> {};
template <> struct Spec<kQ5> : Blocks<32, 32, 1, false, 16, false> {};
template <> struct Spec<kQ5K> : Blocks<256, 32, 1, true, 0, false> {};
template <> struct Spec<kQ2K> : Blocks<256, 16, 0, true, 0, false> {};
template <> struct Spec<kQ3K> : Blocks<256, 16, 0, false, 4, true> {};
static_assert(Spec<kQ4>::kBytes == 384 && Spec<kQ8>::kBytes == 576 && Spec<kQ8M>::kBytes == 640 &&
              Spec<kQ4G16>::kBytes == 256 && Spec<kQ8G16>::kBytes == 320);
static_assert(Spec<kQ4K>::kBytes == 2432 && Spec<kQ6K>::kBytes == 3392 && Spec<kQ5>::kBytes == 384 &&
              Spec<kQ5K>::kBytes == 2944 && Spec<kQ2K>::kBytes == 2688 && Spec<kQ3K>::kBytes == 2368);

// What the run-time code looks up by format: kByFormat<Entry>[format] = Entry::of<format>().
template <class Entry, size_t... F>
constexpr auto by_format(std::index_sequence<F...>) {
  return std::array{Entry::template of<static_cast<int>(F)>()...};
}
template <class Entry>
constexpr auto kByFormat = by_format<Entry>(std::make_index_sequence<kFormats>());

struct Shape {
  int64_t unit, bytes;
  template <int F>
  static constexpr Shape of() { return {Spec<F>::kUnit, Spec<F>::kBytes}; }
};

int64_t panel_bytes(int64_t format, int64_t k) {
  const Shape s = kByFormat<Shape>[format];
  return k / s.unit * s.bytes;
}

struct Problem {
  const float* x;
  const uint8_t* w;
  float* y;  // column 0 of the output's columns for this weight
  int64_t rows, n, k, format, panel_bytes, ldy;
};

#define PAGEDKV_INLINE inline __attribute__((always_inline))

// v shifted left by `bits`, right by -bits if negative (a constant once the loops around are unrolled).
PAGEDKV_INLINE __m256i shift_avx2(__m256i v, int bits) {
  return bits >= 0 ? _mm256_slli_epi32(v, bits) : _mm256_srli_epi32(v, -bits);
}

// A compact record, as decode_avx2 gives it: per sub-block, its 16 outputs' d sc (and dmin mn) made once, in
// registers; then per k-pair the codes: the low nibbles as q4's, and past them the high bits, shifted out of
// the sub-block's word.
template <int F, class Use>
PAGEDKV_INLINE void decode_blocks_avx2(const uint8_t* unit, Use&& use) {
  using S = Spec<F>;
  // d and dmin are read again for every sub-block (from L1): kept in registers, they would leave too few
  const float* d = reinterpret_cast<const float*>(unit);
  for (int64_t sub = 0; sub < S::kUnit / S::kSub; ++sub) {
    const uint8_t* part = unit + S::kHead + sub * S::kSubBytes;
    const auto bytes8 = [&](int64_t at, int h) __attribute__((always_inline)) {  // 8 outputs' bytes
      return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(part + at + 8 * h));
    };
    __m256 scale[2] = {_mm256_loadu_ps(d), _mm256_loadu_ps(d + 8)}, min[2] = {};
    __m256i words[2] = {};
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      if constexpr (S::kSubScales) {
        const __m128i sc = bytes8(0, h);
        scale[h] = _mm256_mul_ps(scale[h], _mm256_cvtepi32_ps(S::kSignedScales ? _mm256_cvtepi8_epi32(sc) : _mm256_cvtepu8_epi32(sc)));
        if constexpr (S::kMin)
          min[h] = _mm256_mul_ps(_mm256_loadu_ps(d + kPanel + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(kPanel, h))));
      }
      if constexpr (S::kHigh > 0)
        words[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part + S::kHighBits + 32 * h));
    }
    if constexpr (!S::kMin) {  // the offset as a min: u (d sc) - offset (d sc) is exact, as (d sc) (u - offset)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) min[h] = _mm256_mul_ps(scale[h], _mm256_set1_ps(S::kOffset));
    }
    const auto weight = [&](__m256i q, int h) __attribute__((always_inline)) {
      return _mm256_fmsub_ps(_mm256_cvtepi32_ps(q), scale[h], min[h]);
    };
    const __m256i nibble = _mm256_set1_epi32(0x0F), high = _mm256_set1_epi32(((1 << S::kHigh) - 1) << 4);
#pragma GCC unroll 16
    for (int64_t pair = 0; pair < S::kSub / 2; ++pair) {
      const int64_t k = sub * S::kSub + 2 * pair;
      __m256 even[2], odd[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_cvtepu8_epi32(bytes8(S::kCodes + pair * kPanel, h));
        __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_srli_epi32(bytes, 4);
        if constexpr (S::kHigh > 0) {  // bits H j of the word to bit 4: shifted by 4 - H j
          lo = _mm256_or_si256(lo, _mm256_and_si256(shift_avx2(words[h], 4 - S::kHigh * 2 * pair), high));
          hi = _mm256_or_si256(hi, _mm256_and_si256(shift_avx2(words[h], 4 - S::kHigh * (2 * pair + 1)), high));
        }
        even[h] = weight(lo, h);
        odd[h] = weight(hi, h);
      }
      use(k, even);
      use(k + 1, odd);
    }
  }
}

// The unit of a format at `unit`, one k at a time in ascending order: use(j, w) for k = j of the unit, with w
// that k's 16 weights in two AVX2 registers (outputs 0-7, 8-15). The tiled path stores them, the AVX2
// register kernels multiply them in place. A quantised unit goes by k-pairs (2 p, 2 p + 1) -- one line of
// 4-bit codes (low nibbles, high), two of int8 -- so that k's parity, the partial sum a kernel adds it to, is
// a compile-time constant in every call, unrolled loop or not.
template <int F, class Use>
PAGEDKV_INLINE void decode_avx2(const uint8_t* unit, Use&& use) {
  using S = Spec<F>;
  if constexpr (kCompact<F>) {
    decode_blocks_avx2<F>(unit, use);
  } else if constexpr (F == kF32) {
    const float* src = reinterpret_cast<const float*>(unit);
    const __m256 w[2] = {_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)};
    use(0, w);
  } else if constexpr (F == kF16) {  // F16C converts exactly, subnormals included
    const __m128i* src = reinterpret_cast<const __m128i*>(unit);
    const __m256 w[2] = {_mm256_cvtph_ps(_mm_loadu_si128(src)), _mm256_cvtph_ps(_mm_loadu_si128(src + 1))};
    use(0, w);
  } else if constexpr (F == kBF16) {
    const __m128i* src = reinterpret_cast<const __m128i*>(unit);
    const __m256 w[2] = {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src)), 16)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src + 1)), 16))};
    use(0, w);
  } else {
    const float* scales = reinterpret_cast<const float*>(unit + S::kScales);
    const __m256 d[2] = {_mm256_loadu_ps(scales), _mm256_loadu_ps(scales + 8)};
    __m256 m[2] = {};
    if constexpr (S::kMin) m[0] = _mm256_loadu_ps(scales + kPanel), m[1] = _mm256_loadu_ps(scales + kPanel + 8);
    const auto weight = [&](__m256i q, int h) __attribute__((always_inline)) {  // fused where d * q is exact
      const __m256 qf = _mm256_cvtepi32_ps(q);
      return S::kMin ? _mm256_fmadd_ps(qf, d[h], m[h]) : _mm256_mul_ps(qf, d[h]);
    };
    // 8 outputs' code bytes of one line at a time, each widened to 32 bits
    const auto codes = [&](int64_t line, int h) __attribute__((always_inline)) {
      return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + line * kPanel + 8 * h));
    };
    for (int64_t pair = 0; pair < S::kUnit / 2; ++pair) {
      if constexpr (S::kBits == 8) {
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {
          __m256 w[2];
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) w[h] = weight(_mm256_cvtepi8_epi32(codes(2 * pair + i, h)), h);
          use(2 * pair + i, w);
        }
      } else {
        const __m256i low = _mm256_set1_epi32(0x0F);
        __m256 even[2], odd[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_cvtepu8_epi32(codes(pair, h));
          even[h] = weight(_mm256_and_si256(bytes, low), h);
          odd[h] = weight(_mm256_srli_epi32(bytes, 4), h);
        }
        use(2 * pair, even);
        use(2 * pair + 1, odd);
      }
    }
  }
}

// ---- Many rows: tiles of fp32 weights ------------------------------------------------------------------

// Expand the units covering k in [k0, k0 + kc) of one panel to fp32 out[kc][16].
template <int F>
void expand(const uint8_t* panel, int64_t k0, int64_t kc, float* out) {
  using S = Spec<F>;
  for (int64_t u = k0 / S::kUnit; u < (k0 + kc) / S::kUnit; ++u) {
    float* o = out + (u * S::kUnit - k0) * kPanel;
    decode_avx2<F>(panel + u * S::kBytes, [&](int64_t j, const __m256(&w)[2]) __attribute__((always_inline)) {
      _mm256_storeu_ps(o + j * kPanel, w[0]);
      _mm256_storeu_ps(o + j * kPanel + 8, w[1]);
    });
  }
}

using ExpandFn = void (*)(const uint8_t*, int64_t, int64_t, float*);
struct Expander {
  ExpandFn fn;
  template <int F>
  static constexpr Expander of() {
    if constexpr (F == kF32) return {nullptr};  // read in place
    else return {expand<F>};
  }
};

// fp32 weights [kc][16] of one panel for k in [k0, k0 + kc): in place for fp32, else expanded into buf.
inline const float* panel_chunk(const Problem& p, int64_t panel, int64_t k0, int64_t kc, float* buf) {
  const uint8_t* base = p.w + panel * p.panel_bytes;
  if (p.format == kF32) return reinterpret_cast<const float*>(base) + k0 * kPanel;
  kByFormat<Expander>[p.format].fn(base, k0, kc, buf);
  return buf;
}

// y[MR rows][16 cols] (+)= x[MR rows][kc] . w[kc][16], one chunk's sums in the fixed order: both partials in
// registers, k-pairs in ascending order (a pair's even k into s0, its odd k into s1), then s0 + s1 added to y
// (`accumulate`) or written. `cols` < 16 only for the zero-padded last panel.
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy, int64_t cols,
                 bool accumulate) {
  __m256 acc[kPartials][MR][2];
#pragma GCC unroll 2
  for (int p = 0; p < kPartials; ++p)
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[p][i][0] = acc[p][i][1] = _mm256_setzero_ps();
  const auto add = [&](int p, int64_t k) __attribute__((always_inline)) {  // k's products into partial p
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      acc[p][i][0] = _mm256_fmadd_ps(xv, w0, acc[p][i][0]);
      acc[p][i][1] = _mm256_fmadd_ps(xv, w1, acc[p][i][1]);
    }
  };
  int64_t k = 0;
#pragma GCC unroll 2
  for (; k + 2 <= kc; k += 2) add(0, k), add(1, k + 1);
  if (k < kc) add(0, k);  // the last k of an odd chunk (float formats, K odd)
  alignas(32) float out[MR][kPanel];  // registers leave through here, so the loop above owns them alone
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(out[i], _mm256_add_ps(acc[0][i][0], acc[1][i][0]));
    _mm256_store_ps(out[i] + 8, _mm256_add_ps(acc[0][i][1], acc[1][i][1]));
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
constexpr TileFn kTiles[kTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>};

// Panels [begin, end) for every x row: x rows in blocks that stay in L2, each panel's weights read once
// per block (once per call for decode-size M), k in L1-sized chunks.
void panels(const Problem& p, int64_t begin, int64_t end) {
  std::vector<float> buf(p.format == kF32 ? 0 : kChunk * kPanel);
  for (int64_t r0 = 0; r0 < p.rows; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, p.rows - r0), tiles = (rows + kTile - 1) / kTile;
    // Tiles of near-equal sizes (16 rows: 3 3 3 3 2 2, not 3 3 3 3 3 1): a row alone has only 4 FMA chains.
    const auto tile_rows = [&](int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); };
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t col = panel * kPanel, cols = std::min(kPanel, p.n - col);
      for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, p.k - k0);
        const float* w = panel_chunk(p, panel, k0, kc, buf.data());
        for (int64_t t = 0, r = r0; t < tiles; r += tile_rows(t++))
          kTiles[tile_rows(t)](p.x + r * p.k + k0, p.k, w, kc, p.y + r * p.ldy + col, p.ldy, cols, k0 > 0);
      }
    }
  }
}

// ---- Few rows (decode): weights decoded in registers, a panel at a time ---------------------------------
//
// At M = 1 the tiled path above does not stream the weights at memory speed: a coded chunk makes a round trip
// through the buffer, paid for a single row. Here, for every k, the weights of one panel are decoded straight
// into registers and feed the accumulators of R <= 4 rows, and nothing goes to memory but y.
//
// A panel at a time, in one pass, not several side by side: on Zen 5 (2 threads, the default model's 121
// linears in model order, interleaved in one process) one panel at a time beat 2 and 4 side by side at every R
// from 1 to 4 and in both instruction sets by 10-25 % (gguf, one row: 6.8 / 8.0 / 8.4 ms for 1 / 2 / 4 panels
// with AVX-512; fp32: 16.5 / 20.5 / 20.8 ms), and in the engine one request decoded 92 / 84 / 76 tokens/s.
// Walking two 256-k chunks of a panel side by side for more FMA chains took one request from 117-130 down to
// 86-100 tokens/s. One stream per thread, read in order, is what the prefetchers follow best; the two
// partials of the summation order give the chains within that one stream.
//
// The arithmetic is exactly tile<>'s, in the same order (the header's); the weights are decoded as the
// expansion does (the same operations, whatever the vector width). A row therefore gets the same bits
// whichever path, vector width or thread computes it (tests/model/test_panel.py checks all of them against the
// tiled path and against the order itself, and every format against an fp32 panel of its decoded weights).

constexpr int kRows = 4;  // most rows per register kernel

// Software prefetch. A panel is only a few KiB long (K = 576: 6.75 KiB of q4), so a thread's stream starts
// anew every few microseconds; the hardware prefetchers lose time on every new stream and do not run far
// enough ahead (measured without: 11-14 GB/s, a third of one core's sequential read). So the kernel asks for
// every line kAhead bytes before it reads it; near a panel's end that is the next panel, which this thread
// reads next (a thread's panels are consecutive). A prefetch past the weight's end is dropped, never a fault.
constexpr int64_t kAhead = 2048;  // bytes; 2-8 KiB measured alike (again with two partials), 1 KiB 25 % slower

PAGEDKV_INLINE void prefetch(const uint8_t* unit, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(unit + kAhead + line), _MM_HINT_T0);
}

// The kernels read a chunk a step at a time, one prefetch each: a unit of a quantised format (16-32 k), 8 k
// (units) of a float format.
template <int F>
constexpr int64_t kStepUnits = Spec<F>::kUnit == 1 ? 8 : 1;

// A chunk of `units` units at `unit`, walked a step at a time by both register kernels: prefetch, then
// step(u, n) on the step's n units, the R rows' x pointers moved past it; the rest of a float format's last
// chunk (K not a multiple of 8) is one shorter step.
template <int F, int R, class Step>
PAGEDKV_INLINE void walk_chunk(const uint8_t* unit, int64_t units, const float* (&xs)[R], Step&& step) {
  using S = Spec<F>;
  constexpr int64_t kStep = kStepUnits<F>;
  int64_t left = units;
  for (; left >= kStep; left -= kStep, unit += kStep * S::kBytes) {
    prefetch(unit, kStep * S::kBytes);
    step(unit, kStep);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xs[r] += kStep * S::kUnit;
  }
  if (left > 0) step(unit, left);
}

// -- AVX2: a panel's 16 outputs are two registers, [0] (outputs 0-7) and [1] (8-15).

// acc[r] += x[r][k] * w for R rows at one k, row r's x at x[r].
template <int R>
PAGEDKV_INLINE void fma_rows_avx2(const float* const (&x)[R], int64_t k, const __m256 (&w)[2],
                                  __m256 (&acc)[R][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x[r] + k);
    acc[r][0] = _mm256_fmadd_ps(xv, w[0], acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(xv, w[1], acc[r][1]);
  }
}

// At 3-4 rows, the 4 R accumulators of both partials do not leave room in AVX2's 16 registers for decoding, so
// a step is walked twice, even k then odd k (the second time from L1): in the AVX2-only build one walk spilled
// accumulators and took 10-40 % longer at 4 rows (q4 to fp32, in cache).
constexpr bool avx2_walks_twice(int rows) { return rows > 2; }

// out[r] = the sum of one chunk for R rows, s0 + s1: `units` units of format F from `unit`, x at the chunk's
// first k (row r at x + r * ldx). Every loop over r or h is unrolled: the arrays then live in registers (an
// array indexed in a loop that is not, lives on the stack).
template <int F, int R>
PAGEDKV_INLINE void chunk_avx2(const uint8_t* unit, int64_t units, const float* x, int64_t ldx, __m256 (&out)[R][2]) {
  using S = Spec<F>;
  constexpr int64_t kStep = kStepUnits<F>;
  __m256 acc[kPartials][R][2];
#pragma GCC unroll 2
  for (int p = 0; p < kPartials; ++p)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = _mm256_setzero_ps();
  // Pointers that step, not indices: with u * kBytes and x + u * kUnit, GCC kept u on the stack in the
  // AVX2-only build (a store-to-load chain per k of fp32: 51.7 us instead of 41.5 for 4 rows, N = K = 576).
  const float* xs[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xs[r] = x + r * ldx;
  // The first n units of the step at u: the k of the partials in the bit mask Sums. Float units go by pairs
  // (2 p, 2 p + 1), as decode_avx2 goes by k-pairs: k's parity stays a compile-time constant.
  const auto walk = [&]<int Sums>(const uint8_t* u, int64_t n) __attribute__((always_inline)) {
    const auto add = [&](int64_t s) __attribute__((always_inline)) {
      decode_avx2<F>(u + s * S::kBytes, [&](int64_t j, const __m256(&w)[2]) __attribute__((always_inline)) {
        const int64_t k = s * S::kUnit + j;  // from the step's first k, a multiple of kPartials
        if ((Sums >> k % kPartials & 1) != 0) fma_rows_avx2<R>(xs, k, w, acc[k % kPartials]);
      });
    };
    if constexpr (kStep == 1) {
      add(0);
    } else {
      for (int64_t pair = 0; pair < n / 2; ++pair) add(2 * pair), add(2 * pair + 1);
      if (n % 2 != 0) add(2 * (n / 2));
    }
  };
  const auto step = [&](const uint8_t* u, int64_t n) __attribute__((always_inline)) {
    if constexpr (avx2_walks_twice(R)) {
      walk.template operator()<0b01>(u, n);
      walk.template operator()<0b10>(u, n);
    } else {
      walk.template operator()<0b11>(u, n);
    }
  };
  walk_chunk<F, R>(unit, units, xs, step);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) out[r][h] = _mm256_add_ps(acc[0][r][h], acc[1][r][h]);
}

// y[row, row + R) x [the panel's outputs] = x W^T, chunk after chunk.
template <int F, int R>
void rows_avx2(const Problem& p, int64_t row, int64_t panel) {
  using S = Spec<F>;
  const uint8_t* w = p.w + panel * p.panel_bytes;
  const float* x = p.x + row * p.k;
  __m256 sum[R][2] = {};  // set by the first chunk (the zeros only quiet -Wmaybe-uninitialized)
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    __m256 chunk[R][2];
    chunk_avx2<F, R>(w + k0 / S::kUnit * S::kBytes, (std::min(k0 + kChunk, p.k) - k0) / S::kUnit, x + k0, p.k, chunk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)  // the chunk's sums join the total in chunk order, as tile<> adds them to y
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) sum[r][h] = k0 == 0 ? chunk[r][h] : _mm256_add_ps(sum[r][h], chunk[r][h]);
  }
  const int64_t cols = std::min(kPanel, p.n - panel * kPanel);  // < 16 in a last, padded panel
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (row + r) * p.ldy + panel * kPanel;
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
#define PAGEDKV_AVX512_INLINE __attribute__((target("avx512f"), always_inline))

PAGEDKV_AVX512 PAGEDKV_INLINE __m512i shift_avx512(__m512i v, int bits) {
  return bits >= 0 ? _mm512_slli_epi32(v, bits) : _mm512_srli_epi32(v, -bits);
}

// decode_blocks_avx2 with a panel's 16 weights in one register.
template <int F, class Use>
PAGEDKV_AVX512 PAGEDKV_INLINE void decode_blocks_avx512(const uint8_t* unit, Use&& use) {
  using S = Spec<F>;
  const __m512 d = _mm512_loadu_ps(unit);
  const __m512 dmin = S::kMin ? _mm512_loadu_ps(unit + kPanel * 4) : _mm512_setzero_ps();
  for (int64_t sub = 0; sub < S::kUnit / S::kSub; ++sub) {
    const uint8_t* part = unit + S::kHead + sub * S::kSubBytes;
    const auto bytes16 = [&](int64_t at) PAGEDKV_AVX512_INLINE {  // 16 outputs' bytes
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(part + at));
    };
    __m512 scale = d, min = _mm512_setzero_ps();
    if constexpr (S::kSubScales) {
      const __m128i sc = bytes16(0);
      scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(S::kSignedScales ? _mm512_cvtepi8_epi32(sc) : _mm512_cvtepu8_epi32(sc)));
      if constexpr (S::kMin) min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(kPanel))));
    }
    const __m512i words = S::kHigh > 0 ? _mm512_loadu_si512(part + S::kHighBits) : _mm512_setzero_si512();
    if constexpr (!S::kMin) min = _mm512_mul_ps(scale, _mm512_set1_ps(S::kOffset));  // as decode_blocks_avx2
    const auto weight = [&](__m512i q) PAGEDKV_AVX512_INLINE {
      return _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), scale, min);
    };
    const __m512i nibble = _mm512_set1_epi32(0x0F), high = _mm512_set1_epi32(((1 << S::kHigh) - 1) << 4);
#pragma GCC unroll 16
    for (int64_t pair = 0; pair < S::kSub / 2; ++pair) {
      const int64_t k = sub * S::kSub + 2 * pair;
      const __m512i bytes = _mm512_cvtepu8_epi32(bytes16(S::kCodes + pair * kPanel));
      __m512i lo = _mm512_and_si512(bytes, nibble), hi = _mm512_srli_epi32(bytes, 4);
      if constexpr (S::kHigh > 0) {
        // (shifted & high) | code in one instruction (0xEA: c | (a & b))
        lo = _mm512_ternarylogic_epi32(shift_avx512(words, 4 - S::kHigh * 2 * pair), high, lo, 0xEA);
        hi = _mm512_ternarylogic_epi32(shift_avx512(words, 4 - S::kHigh * (2 * pair + 1)), high, hi, 0xEA);
      }
      use(k, weight(lo));
      use(k + 1, weight(hi));
    }
  }
}

// decode_avx2 with a panel's 16 weights in one register: use(j, w) for each k = j of the unit, by k-pairs.
template <int F, class Use>
PAGEDKV_AVX512 PAGEDKV_INLINE void decode_avx512(const uint8_t* unit, Use&& use) {
  using S = Spec<F>;
  if constexpr (kCompact<F>) {
    decode_blocks_avx512<F>(unit, use);
  } else if constexpr (F == kF32) {
    use(0, _mm512_loadu_ps(unit));
  } else if constexpr (F == kF16) {
    use(0, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit))));
  } else if constexpr (F == kBF16) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
    use(0, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
  } else {
    const __m512 d = _mm512_loadu_ps(unit + S::kScales);
    const __m512 m = S::kMin ? _mm512_loadu_ps(unit + S::kScales + kPanel * 4) : _mm512_setzero_ps();
    const auto weight = [&](__m512i q) PAGEDKV_AVX512_INLINE {
      const __m512 qf = _mm512_cvtepi32_ps(q);
      return S::kMin ? _mm512_fmadd_ps(qf, d, m) : _mm512_mul_ps(qf, d);
    };
    const auto codes = [&](int64_t line) PAGEDKV_AVX512_INLINE {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + line * kPanel));
    };
    for (int64_t pair = 0; pair < S::kUnit / 2; ++pair) {
      if constexpr (S::kBits == 8) {
        use(2 * pair, weight(_mm512_cvtepi8_epi32(codes(2 * pair))));
        use(2 * pair + 1, weight(_mm512_cvtepi8_epi32(codes(2 * pair + 1))));
      } else {
        const __m512i bytes = _mm512_cvtepu8_epi32(codes(pair));
        use(2 * pair, weight(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))));
        use(2 * pair + 1, weight(_mm512_srli_epi32(bytes, 4)));
      }
    }
  }
}

template <int R>
PAGEDKV_AVX512 PAGEDKV_INLINE void fma_rows_avx512(const float* const (&x)[R], int64_t k, __m512 w,
                                                   __m512 (&acc)[R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r][k]), w, acc[r]);
}

// chunk_avx2 with a panel in one register: both partials in one walk (8 accumulators at 4 rows).
template <int F, int R>
PAGEDKV_AVX512 PAGEDKV_INLINE void chunk_avx512(const uint8_t* unit, int64_t units, const float* x, int64_t ldx,
                                                __m512 (&out)[R]) {
  using S = Spec<F>;
  constexpr int64_t kStep = kStepUnits<F>;
  __m512 acc[kPartials][R];
#pragma GCC unroll 2
  for (int p = 0; p < kPartials; ++p)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  const float* xs[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xs[r] = x + r * ldx;
  const auto step = [&](const uint8_t* u, int64_t n) PAGEDKV_AVX512 {  // inlined by rows_avx512's flatten
    const auto add = [&](int64_t s) PAGEDKV_AVX512_INLINE {
      decode_avx512<F>(u + s * S::kBytes, [&](int64_t j, __m512 w) PAGEDKV_AVX512_INLINE {
        const int64_t k = s * S::kUnit + j;
        fma_rows_avx512<R>(xs, k, w, acc[k % kPartials]);
      });
    };
    if constexpr (kStep == 1) {
      add(0);
    } else {
      for (int64_t pair = 0; pair < n / 2; ++pair) add(2 * pair), add(2 * pair + 1);
      if (n % 2 != 0) add(2 * (n / 2));
    }
  };
  walk_chunk<F, R>(unit, units, xs, step);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r] = _mm512_add_ps(acc[0][r], acc[1][r]);
}

// flatten, not always_inline on chunk_avx512's step: GCC inlines walk_chunk's body on its own first, and an
// always_inline AVX-512 lambda called from that generic body is an error where the build flags lack AVX-512
// (x86-64-v3: the wheel, an AVX2 machine). Flattening inlines the step here, checked against this function.
template <int F, int R>
PAGEDKV_AVX512 __attribute__((flatten)) void rows_avx512(const Problem& p, int64_t row, int64_t panel) {
  using S = Spec<F>;
  const uint8_t* w = p.w + panel * p.panel_bytes;
  const float* x = p.x + row * p.k;
  __m512 sum[R] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    __m512 chunk[R];
    chunk_avx512<F, R>(w + k0 / S::kUnit * S::kBytes, (std::min(k0 + kChunk, p.k) - k0) / S::kUnit, x + k0, p.k,
                       chunk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sum[r] = k0 == 0 ? chunk[r] : _mm512_add_ps(sum[r], chunk[r]);
  }
  const int64_t cols = std::min(kPanel, p.n - panel * kPanel);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + (row + r) * p.ldy + panel * kPanel, (1u << cols) - 1, sum[r]);
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
}

// The register kernels of one instruction set for one format, by R - 1.
using RowsFn = void (*)(const Problem&, int64_t, int64_t);
using RowsKernels = std::array<RowsFn, kRows>;
struct Avx2Rows {
  template <int F>
  static constexpr RowsKernels of() { return {rows_avx2<F, 1>, rows_avx2<F, 2>, rows_avx2<F, 3>, rows_avx2<F, 4>}; }
};
struct Avx512Rows {
  template <int F>
  static constexpr RowsKernels of() {
    return {rows_avx512<F, 1>, rows_avx512<F, 2>, rows_avx512<F, 3>, rows_avx512<F, 4>};
  }
};

// Panels [begin, end) for every x row. Rows go in as few groups of at most kRows as cover them, of even
// sizes (6 rows: 3 + 3, not 4 + 2: every group keeps enough chains).
void rows_panels(const Problem& p, int64_t begin, int64_t end, const RowsKernels& kernels) {
  const int64_t groups = (p.rows + kRows - 1) / kRows, most = (p.rows + groups - 1) / groups;
  for (int64_t panel = begin; panel < end; ++panel) {
    for (int64_t row = 0; row < p.rows; row += most) {
      const int64_t rows = std::min(most, p.rows - row);
      kernels[rows - 1](p, row, panel);
    }
  }
}

// ---- The ops --------------------------------------------------------------------------------------------

// How to compute: kAuto picks; the others are for tests and benchmarks (the private _panel_linear_*path ops).
enum Path : int64_t { kAuto = 0, kTiled = 1, kRowsAvx2 = 2, kRowsAvx512 = 3 };

// Up to this many rows the register kernels run (in groups of at most kRows, each decoding the weights
// again). Measured on the default model's 121 linears (benchmarks/panel_linear.py, 1 thread, Zen 5): at
// 8 rows they still take 0.4x (AVX-512) and 0.6x (AVX2) of the tiled path's time; at 16 rows AVX2 is even.
constexpr int64_t kRegisterRows = 8;

// The packed weight's size for N x K in `format`; checks the format and K (`op` names the op in messages).
int64_t checked_bytes(const char* op, const at::Tensor& packed, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK_VALUE(format >= 0 && format < kFormats, op, ": unknown format ", format);
  const int64_t unit = kByFormat<Shape>[format].unit;
  TORCH_CHECK_VALUE(n >= 0 && k >= 0 && k % unit == 0, op, ": format ", format, " needs K a multiple of ", unit,
                    ", got N = ", n, ", K = ", k);
  const int64_t num_panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(format, k);
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.nbytes() == static_cast<size_t>(num_panels * bytes), op,
                    ": packed weight has ", packed.nbytes(), " bytes, expected ", num_panels * bytes, " for N = ", n,
                    ", K = ", k, ", format ", format);
  return bytes;
}

// y[:, col : col + n] = x W^T, for a contiguous fp32 y of any width; its other columns are not touched.
void into(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format, at::Tensor& y,
          int64_t col, int64_t path) {
  const int64_t bytes = checked_bytes("panel_linear", packed, n, k, format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == k, "panel_linear: x has ", x.size(1), " columns but the weight has K = ", k);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "panel_linear: y must be a contiguous float32 [", x.size(0), ", N] tensor");
  TORCH_CHECK(col >= 0 && col + n <= y.size(1), "panel_linear: columns [", col, ", ", col + n,
              ") do not fit y's ", y.size(1));
  TORCH_CHECK(path >= kAuto && path <= kRowsAvx512, "panel_linear: unknown path ", path);
  TORCH_CHECK(path != kRowsAvx512 || has_avx512(), "panel_linear: this CPU has no AVX-512F");
  at::assert_no_overlap(y, x);
  if (x.size(0) == 0 || n == 0) return;
  if (k == 0) {
    y.narrow(1, col, n).zero_();
    return;
  }
  const at::Tensor xc = x.contiguous();
  const Problem p{xc.data_ptr<float>(), static_cast<const uint8_t*>(packed.data_ptr()), y.data_ptr<float>() + col,
                  x.size(0), n, k, format, bytes, y.size(1)};
  if (path == kAuto) path = p.rows > kRegisterRows ? kTiled : has_avx512() ? kRowsAvx512 : kRowsAvx2;
  const RowsKernels& kernels = path == kRowsAvx512 ? kByFormat<Avx512Rows>[format] : kByFormat<Avx2Rows>[format];
  // Grain of 4 panels (64 outputs): the 576-output layers still split across threads.
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 4, [&](int64_t begin, int64_t end) {
    if (path == kTiled) {
      panels(p, begin, end);
    } else {
      rows_panels(p, begin, end, kernels);
    }
  });
}

at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format, int64_t path) {
  TORCH_CHECK(x.dim() == 2, "panel_linear: x must be a 2-D float32 tensor");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  into(x, packed, n, k, format, y, 0, path);
  return y;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format) {
  return run(x, packed, n, k, format, kAuto);
}

void panel_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t format,
                       at::Tensor& y, int64_t col) {
  into(x, packed, n, k, format, y, col, kAuto);
}

// Output `lane` of a panel as fp32 row[K], decoded as the kernels decode it (the same operations, scalar).
template <int F>
void panel_row(const uint8_t* panel, int64_t lane, int64_t k, float* row) {
  using S = Spec<F>;
  const auto load = [](auto value, const uint8_t* at) {
    std::memcpy(&value, at, sizeof(value));
    return value;
  };
  for (int64_t u = 0; u < k / S::kUnit; ++u) {
    const uint8_t* unit = panel + u * S::kBytes;
    if constexpr (kCompact<F>) {
      const float d = load(float{}, unit + 4 * lane);
      for (int64_t j = 0; j < S::kUnit; ++j) {
        const uint8_t* part = unit + S::kHead + j / S::kSub * S::kSubBytes;
        const int64_t i = j % S::kSub;  // k in the sub-block
        int code = part[S::kCodes + i / 2 * kPanel + lane] >> (4 * (i % 2)) & 0x0F;
        if constexpr (S::kHigh > 0) {
          const uint32_t word = load(uint32_t{}, part + S::kHighBits + 4 * lane);
          code |= static_cast<int>(word >> (S::kHigh * i) & ((1u << S::kHigh) - 1)) << 4;
        }
        float scale = d;
        if constexpr (S::kSubScales) {
          const uint8_t sc = part[lane];
          scale = d * static_cast<float>(S::kSignedScales ? static_cast<int8_t>(sc) : sc);
        }
        if constexpr (S::kMin) {
          const float min = load(float{}, unit + 4 * (kPanel + lane)) * static_cast<float>(part[kPanel + lane]);
          row[u * S::kUnit + j] = std::fma(static_cast<float>(code), scale, -min);
        } else {
          row[u * S::kUnit + j] = static_cast<float>(code - S::kOffset) * scale;
        }
      }
    } else if constexpr (F == kF32) {
      row[u] = load(float{}, unit + 4 * lane);
    } else if constexpr (F == kF16) {
      row[u] = _cvtsh_ss(load(uint16_t{}, unit + 2 * lane));
    } else if constexpr (F == kBF16) {
      const uint32_t bits = static_cast<uint32_t>(load(uint16_t{}, unit + 2 * lane)) << 16;
      row[u] = load(float{}, reinterpret_cast<const uint8_t*>(&bits));
    } else {
      const float d = load(float{}, unit + S::kScales + 4 * lane);
      for (int64_t j = 0; j < S::kUnit; ++j) {
        float q;
        if constexpr (S::kBits == 8) {
          q = static_cast<int8_t>(unit[j * kPanel + lane]);
        } else {
          const uint8_t byte = unit[j / 2 * kPanel + lane];
          q = j % 2 == 0 ? byte & 0x0F : byte >> 4;
        }
        if constexpr (S::kMin) {
          row[u * S::kUnit + j] = std::fma(q, d, load(float{}, unit + S::kScales + 4 * (kPanel + lane)));
        } else {
          row[u * S::kUnit + j] = q * d;
        }
      }
    }
  }
}

struct RowDecoder {
  void (*fn)(const uint8_t*, int64_t, int64_t, float*);
  template <int F>
  static constexpr RowDecoder of() { return {panel_row<F>}; }
};

// Rows `ids` of a packed weight as fp32 [len(ids), K]: the embedding lookup of a tied LM head whose panel holds
// the only copy of the vocabulary matrix; the weights that were packed, bit for bit.
at::Tensor panel_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k, int64_t format) {
  const int64_t bytes = checked_bytes("panel_rows", packed, n, k, format);
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                    "panel_rows: ids must be a contiguous int64 [T] tensor");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK_VALUE(id[t] >= 0 && id[t] < n, "panel_rows: ids[", t, "] = ", id[t], " is outside [0, ", n, ")");
  at::Tensor out = at::empty({ids.numel(), k}, ids.options().dtype(at::kFloat));
  const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
  const auto decode = kByFormat<RowDecoder>[format].fn;
  for (int64_t t = 0; t < ids.numel(); ++t)
    decode(w + id[t] / kPanel * bytes, id[t] % kPanel, k, out.data_ptr<float>() + t * k);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("panel_linear(Tensor x, Tensor packed, int n, int k, int format) -> Tensor", &panel_linear);
  // y[:, col : col + n] = x W^T into an existing contiguous fp32 y: one call per part of a fused layer.
  lib.def("panel_linear_into(Tensor x, Tensor packed, int n, int k, int format, Tensor(a!) y, int col) -> ()",
          &panel_linear_into);
  lib.def("panel_rows(Tensor packed, Tensor ids, int n, int k, int format) -> Tensor", &panel_rows);
  // Private: the same with the path forced (0 auto, 1 tiled, 2 AVX2 registers, 3 AVX-512 registers).
  lib.def("_panel_linear_path(Tensor x, Tensor packed, int n, int k, int format, int path) -> Tensor", &run);
  lib.def("_panel_linear_into_path(Tensor x, Tensor packed, int n, int k, int format, Tensor(a!) y, int col, "
          "int path) -> ()",
          &into);
}
