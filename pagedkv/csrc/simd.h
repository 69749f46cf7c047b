// Eight floats as a GCC/Clang vector type, shared by the portable ops (paged attention, RMSNorm, SiLU, RoPE).
//
// Written once against the compiler's vector extension rather than against an instruction set: with
// -march=native it becomes AVX2/AVX-512 code on x86 and NEON on ARM, and plain SSE2 pairs elsewhere, so the
// library that uses it builds on any CPU. Only the panel GEMM (panel_linear.cpp) is written for AVX2.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace pagedkv::simd {

typedef float Vec __attribute__((vector_size(32)));
typedef int32_t Int8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline Vec splat(float x) { return Vec{x, x, x, x, x, x, x, x}; }

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// Eight fp16 values widened to floats, exactly (every fp16 is a float): for a KV pool held in 16 bits
// (kv_cache_dtype="float16"). One vcvtph2ps where the CPU has F16C; GCC 12 lowers __builtin_convertvector to a
// conversion per lane (measured 2.5x slower attention than fp32), so that is only the fallback elsewhere.
inline Vec load(const _Float16* p) {
#if defined(__F16C__) && defined(__AVX__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  Vec out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  typedef _Float16 Half8 __attribute__((vector_size(16)));
  Half8 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, Vec);
#endif
}

// p[0, 8) = v rounded to fp16: to nearest, ties to even, as torch's .half() and a scalar _Float16 cast round.
inline void store(_Float16* p, Vec v) {
#if defined(__F16C__) && defined(__AVX__)
  __m256 x;
  std::memcpy(&x, &v, sizeof(x));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<_Float16>(v[i]);
#endif
}

// v, kept in a register. Where a loaded vector feeds several FMAs, GCC folds the load into each of them (one
// memory operand per FMA); Zen 4 then runs out of load slots at about half its FMA rate. The empty asm
// "modifies" v in a register, which the compiler cannot see through; it emits no instruction. Only where a
// Vec fits one register (AVX); elsewhere a no-op.
inline Vec in_register(Vec v) {
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+v"(v));
#endif
  return v;
}

inline float hsum(Vec v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// e^x per lane, relative error ~1e-7: x = n ln2 + r, e^r by Cephes' expf polynomial, 2^n built from exponent
// bits. x is clamped to [-87, 88], where 2^n stays a normal float: below, e^x (< 1e-37) is as good as 0 next
// to anything it is added to (a softmax's max weight of 1, silu's 1 + e^-x); above, it would overflow.
inline Vec vexp(Vec x) {
  const Vec lo = splat(-87.0f), hi = splat(88.0f), round = splat(12582912.0f);  // + 1.5 * 2^23 rounds to an int
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const Vec n = (x * 1.44269504088896341f + round) - round;
  const Vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  Vec p = splat(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + c;
  p = p * r * r + r + 1.0f;
  const Int8 bits = (__builtin_convertvector(n, Int8) + 127) << 23;
  Vec two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

}  // namespace pagedkv::simd
