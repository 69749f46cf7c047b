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
//   Q6_K    256    210    d, int8 sc, 6-bit u           Q8_K         (da d) (sum_s sc_s sum u q - 32 sum_s sc_s bsum_s)
//
// The activations, as ggml's reference quantisers (quantize_row_q8_0_ref, _q8_1_ref, _q8_K_ref) make them:
//   Q8_0 / Q8_1 (32): da = amax / 127, q = roundf(x / da) (half away from zero), da kept as fp16; Q8_1 adds
//                     sa = fp16(da sum q).
//   Q8_K (256):       m = the value of largest |x| (the first), s = -127 / m, q = nearest(s x) (half to even),
//                     da = 1 / s (fp32), and bsum, the sum of q per sub-block: per 32 for Q4_K (its mins), per 16
//                     for Q6_K (its offset of 32, taken off through them as ggml does).
//
// The canonical order, which every path and tile size follows (so a row's bits do not depend on its batch, and the
// AVX2 and AVX-512 paths agree bit for bit), per output and row:
//   1. a block's integer sum in eight int32 lanes, lane i holding the products of bytes 4i..4i+3 of every 32-code
//      group (with a K-quant's sub-block scales, minus Q6_K's offset lanes): exact (at most 2^27), so it does not
//      matter how an instruction set groups them -- maddubs + madd (AVX2), vpdpbusd (VNNI, the 32-value types),
//      512-bit maddubs + vpdpwssd over two groups, halves added (int8_avx512.h, the K-quants);
//   2. the lanes converted to fp32 and fused into the row's eight fp32 lanes with one fma by the block's scale
//      (da dw); Q4_K's min term likewise into four lanes, Q4_1's into a scalar; blocks in file order;
//   3. at the end, the eight lanes summed (ggml's hsum_float_8), plus the four min lanes, plus the scalar.
// That is ggml's order of operations, up to how the lanes are summed.
//
// Batch invariance: a row's result depends only on its own x row and W, in that order, whatever other rows share
// the call, however many threads split the outputs. Rows run in tiles of up to kTile per weight block: a block is
// decoded once (codes in natural order, as bytes) and dotted with every row of the tile; outputs go in chunks of
// kChunk, so the chunk's weights stay in L2 while every tile of rows passes over them.
//
// W is the GGUF file's blocks as they are, row-major [N][K / block] (a one-row GEMV reads it as one stream), so
// it may view the read-only memory map. Format code: kFormatBase + the ggml type id.
//
// Every type also comes repacked in groups of 16 outputs (format kRepackedBase + the type id; int8_repack.h,
// built by the int8_repack op), which is how "gguf-int8" loads them: their tiled kernel (int8_tiled.h) puts 16
// outputs in the lanes of a vector and has no per-block horizontal sum -- its own canonical order is stated there.
// The file-order kernel stays for comparison (benchmarks/int8_linear.py), still tested on every type.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "int8_avx512.h"
#include "int8_blocks.h"
#include "int8_quantise.h"
#include "int8_repack.h"
#include "int8_tiled.h"

namespace {

constexpr int64_t kFormatBase = 64;
constexpr int64_t kRepackedBase = 128;  // + ggml type: every int8 type repacked in groups of 16 outputs (int8_repack.h)
constexpr int64_t kTile = 4;    // x rows per pass over a weight block (accumulators in registers)
constexpr int64_t kChunk = 16;  // outputs whose weights stay in L2 while every tile passes

// ---- The GEMM ---------------------------------------------------------------------------------------------------

struct Problem {
  const uint8_t* w;
  int64_t row_bytes, blocks, m, k;
  const int8_t* q;
  const float *d, *sa;
  const int16_t* bsums;
  int64_t sums_per_row;  // of sa or bsums
  float* y;
  int64_t ldy;

  template <class T>
  ActRow row(int64_t r) const {
    const int64_t per = k / T::kBlock;
    return {q + r * k, d + r * per, sa ? sa + r * sums_per_row : nullptr, bsums ? bsums + r * sums_per_row : nullptr};
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
// accumulators in registers. One definition, compiled twice: `tile` for the 256-bit bodies, `tile_avx512` for AVX-512
// (a function's target cannot be a template argument, and the 512-bit bodies inline only into an AVX-512 caller).
#define INT8_DEFINE_TILE(NAME, TARGET)                                                                              \
  template <class T, bool V, int R>                                                                                 \
  TARGET void NAME(const Problem& p, int64_t r0, int64_t o) {                                                       \
    ActRow act[R];                                                                                                  \
    for (int r = 0; r < R; ++r) act[r] = p.row<T>(r0 + r);                                                          \
    const uint8_t* w = p.w + o * p.row_bytes;                                                                       \
    Acc acc[R];                                                                                                     \
    for (int64_t i = 0; i < p.blocks; ++i) {                                                                        \
      const typename T::Block block = T::decode(w + i * T::kBytes);                                                 \
      for (int r = 0; r < R; ++r) T::template dot<V>(block, act[r], i, acc[r]);                                    \
    }                                                                                                               \
    for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.ldy + o] = hsum(acc[r].lanes) + hsum(acc[r].mins) + acc[r].extra; \
  }
INT8_DEFINE_TILE(tile, )
INT8_DEFINE_TILE(tile_avx512, INT8_AVX512)
#undef INT8_DEFINE_TILE

using TileFn = void (*)(const Problem&, int64_t, int64_t);

// The tile functions of type T's body on a path: 1 to kTile rows.
template <class T, bool V>
constexpr TileFn kTiles[kTile] = {tile<T, V, 1>, tile<T, V, 2>, tile<T, V, 3>, tile<T, V, 4>};
template <class T>
constexpr TileFn kTilesAvx512[kTile] = {tile_avx512<T, true, 1>, tile_avx512<T, true, 2>,
                                              tile_avx512<T, true, 3>, tile_avx512<T, true, 4>};

// Outputs [begin, end) for every row: chunks of kChunk outputs, whose weights stay in L2 while the rows pass over
// them in tiles of kTile (a last one of 1 to kTile - 1).
void outputs(const Problem& p, const TileFn (&tiles)[kTile], int64_t begin, int64_t end) {
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    for (int64_t r0 = 0; r0 < p.m; r0 += kTile) {
      const TileFn run = tiles[std::min(kTile, p.m - r0) - 1];
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

void run_tiles(const Problem& p, int64_t n, const TileFn (&tiles)[kTile]) {
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    outputs(p, tiles, begin * kChunk, std::min(end * kChunk, n));
  });
}

// Type T on the chosen path; Wide, where given, is T's 512-bit body, which the VNNI path then takes.
template <class T, class Wide = void>
void run_type(const Problem& p, int64_t n, bool vnni) {
  if constexpr (!std::is_void_v<Wide>) {
    if (vnni) return run_tiles(p, n, kTilesAvx512<Wide>);
  }
  run_tiles(p, n, vnni ? kTiles<T, true> : kTiles<T, false>);
}

// ---- The repacked K-quants (int8_repack.h, int8_tiled.h) --------------------------------------------------------

using TiledFn = void (*)(const Tiled&, int64_t, int64_t);

// The tile functions of a type on a path, for 1 to `rows` activation rows: 8 for AVX-512 (32 vector registers: a
// sub-block's sums and each row's block sum and accumulators), 4 for AVX2 (16 registers).
struct TileSet {
  const TiledFn* fns;
  int64_t rows;
};

template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q4_k_avx2 = {q4_k_tile<R>...};
template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q6_k_avx2 = {q6_k_tile<R>...};
template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q8_0_avx2 = {legacy_tile<Q80Layout, R>...};
template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q8_0_avx512 = {legacy_tile_512<Q80Layout, R>...};
template <class L, int... R>
constexpr std::array<TiledFn, sizeof...(R)> legacy_avx2 = {legacy_tile<L, R>...};
template <class L, int... R>
constexpr std::array<TiledFn, sizeof...(R)> legacy_avx512 = {legacy_tile_512<L, R>...};
template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q4_k_avx512 = {q4_k_tile_512<R>...};
template <int... R>
constexpr std::array<TiledFn, sizeof...(R)> q6_k_avx512 = {q6_k_tile_512<R>...};

TileSet tiles_of(int64_t type, bool vnni) {
  if (vnni) {
    switch (type) {
      case kQ4_K: return {q4_k_avx512<1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
      case kQ6_K: return {q6_k_avx512<1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
      case kQ8_0: return {q8_0_avx512<1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
      case kQ5_0: return {legacy_avx512<Q50Layout, 1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
      case kQ4_0: return {legacy_avx512<Q40Layout, 1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
      default: return {legacy_avx512<Q41Layout, 1, 2, 3, 4, 5, 6, 7, 8>.data(), 8};
    }
  }
  switch (type) {
    case kQ4_K: return {q4_k_avx2<1, 2, 3, 4>.data(), 4};
    case kQ6_K: return {q6_k_avx2<1, 2, 3, 4>.data(), 4};
    case kQ8_0: return {q8_0_avx2<1, 2, 3, 4>.data(), 4};
    case kQ5_0: return {legacy_avx2<Q50Layout, 1, 2, 3, 4>.data(), 4};
    case kQ4_0: return {legacy_avx2<Q40Layout, 1, 2, 3, 4>.data(), 4};
    default: return {legacy_avx2<Q41Layout, 1, 2, 3, 4>.data(), 4};
  }
}

// Groups split over threads; per group, every tile of rows in turn (the group's weights stay in L1 / L2).
void run_groups(const Tiled& p, int64_t m, TileSet tiles) {
  at::parallel_for(0, (p.n + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      for (int64_t r0 = 0; r0 < m; r0 += tiles.rows) tiles.fns[std::min(tiles.rows, m - r0) - 1](p, group, r0);
  });
}

int64_t repacked_bytes(int64_t type) {
  switch (type) {
    case kQ4_K: return Q4KLayout::kBytes;
    case kQ6_K: return Q6KLayout::kBytes;
    case kQ8_0: return Q80Layout::kBytes;
    case kQ5_0: return Q50Layout::kBytes;
    case kQ4_0: return Q40Layout::kBytes;
    default: return Q41Layout::kBytes;
  }
}
int64_t file_bytes(int64_t type) {
  switch (type) {
    case kQ4_K: return Q4KLayout::kFileBytes;
    case kQ6_K: return Q6KLayout::kFileBytes;
    case kQ8_0: return Q80Layout::kFileBytes;
    case kQ5_0: return Q50Layout::kFileBytes;
    case kQ4_0: return Q40Layout::kFileBytes;
    default: return Q41Layout::kFileBytes;
  }
}
int64_t block_values(int64_t type) { return type == kQ4_K || type == kQ6_K ? 256 : 32; }

bool is_repacked(int64_t format) {
  const int64_t type = format - kRepackedBase;
  return type == kQ4_K || type == kQ6_K || type == kQ8_0 || type == kQ5_0 || type == kQ4_0 || type == kQ4_1;
}

// Column n's block of a repacked type into its group-block (kToGroup) or out of it.
template <bool kToGroup>
void column(int64_t type, GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  if (type == kQ4_K) q4_k_column<kToGroup>(g, n, b);
  else if (type == kQ6_K) q6_k_column<kToGroup>(g, n, b);
  else if (type == kQ8_0) q8_0_column<kToGroup>(g, n, b);
  else if (type == kQ5_0) q5_0_column<kToGroup>(g, n, b);
  else if (type == kQ4_0) nibble_column<Q40Layout, kToGroup>(g, n, b);
  else nibble_column<Q41Layout, kToGroup>(g, n, b);
}

// (values, bytes) of a block of a supported type.
std::pair<int64_t, int64_t> block_of(const char* op, int64_t format) {
  if (is_repacked(format)) return {block_values(format - kRepackedBase), file_bytes(format - kRepackedBase)};
  switch (format - kFormatBase) {
    case kQ4_0: return {Q4_0::kBlock, Q4_0::kBytes};
    case kQ4_1: return {Q4_1::kBlock, Q4_1::kBytes};
    case kQ5_0: return {Q5_0::kBlock, Q5_0::kBytes};
    case kQ8_0: return {Q8_0::kBlock, Q8_0::kBytes};
    case kQ4_K: return {Q4_K::kBlock, Q4_K::kBytes};
    case kQ6_K: return {Q6_K::kBlock, Q6_K::kBytes};
    default: TORCH_CHECK_VALUE(false, op, ": format ", format, " is not an int8-activation format (", kFormatBase,
                               " + ggml type Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K; ", kRepackedBase,
                               " + Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 or Q4_1 repacked)");
  }
}

void check_weight(const char* op, const at::Tensor& w, int64_t n, int64_t k, int64_t format) {
  const auto [block, bytes] = block_of(op, format);
  TORCH_CHECK_VALUE(n >= 0 && k >= 0 && k % block == 0, op, ": K = ", k, " is not a multiple of the block, ", block);
  const int64_t want = is_repacked(format)
                           ? (n + kGroup - 1) / kGroup * (k / block) * repacked_bytes(format - kRepackedBase)
                           : n * (k / block) * bytes;
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.is_contiguous() && w.nbytes() == static_cast<size_t>(want), op,
                    ": the weight must be ", want, " contiguous uint8 bytes (N = ", n, ", K = ", k, "), got ",
                    w.nbytes());
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
  const bool vnni = path == kVnni || (path == kAuto && has_vnni());
  const int64_t type = format - (is_repacked(format) ? kRepackedBase : kFormatBase);
  const Quantised a = quantise(x.contiguous(), type);
  if (is_repacked(format)) {
    const int64_t values = block_values(type);
    if (type != kQ4_1 && !uses_q8_k(type) && vnni) a.q.bitwise_xor_(-128);  // q + 128, vpdpbusd's unsigned operand
    const Tiled p{static_cast<const uint8_t*>(w.data_ptr()), k / values, n, k, values, a.q.data_ptr<int8_t>(),
                  a.d.data_ptr<float>(), uses_q8_k(type) ? a.sums.data_ptr<int16_t>() : nullptr,
                  type == kQ4_1 ? a.sums.data_ptr<float>() : nullptr, a.sums.size(1),
                  y.data_ptr<float>() + col, y.size(1)};
    return run_groups(p, x.size(0), tiles_of(type, vnni));
  }
  const auto [block, bytes] = block_of("int8_linear", format);
  const Problem p{static_cast<const uint8_t*>(w.data_ptr()), k / block * bytes, k / block, x.size(0), k,
                  a.q.data_ptr<int8_t>(), a.d.data_ptr<float>(), type == kQ4_1 ? a.sums.data_ptr<float>() : nullptr,
                  uses_q8_k(type) ? a.sums.data_ptr<int16_t>() : nullptr, a.sums.size(1), y.data_ptr<float>() + col,
                  y.size(1)};
  switch (type) {
    case kQ4_0: run_type<Q4_0>(p, n, vnni); break;
    case kQ4_1: run_type<Q4_1>(p, n, vnni); break;
    case kQ5_0: run_type<Q5_0>(p, n, vnni); break;
    case kQ8_0: run_type<Q8_0>(p, n, vnni); break;
    case kQ4_K: run_type<Q4_K, Q4_K_512>(p, n, vnni); break;
    default: run_type<Q6_K, Q6_K_512>(p, n, vnni); break;
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
// sums: Q8_1's fp32 sa [M, K / 32], Q8_K's int16 bsums [M, K / 32] (Q4_K) or [M, K / 16] (Q6_K), else [M, 0]).
// For tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_quantise(const at::Tensor& x, int64_t format) {
  const auto [block, bytes] = block_of("_int8_quantise", format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0,
              "_int8_quantise: x must be a 2-D float32 tensor with a multiple of ", block, " columns");
  Quantised a = quantise(x.contiguous(), format - (is_repacked(format) ? kRepackedBase : kFormatBase));
  return {a.q, a.d, a.sums};
}

// Blocks [N][K / block] as the file holds them -> the repacked layout of `format` (int8_repack.h); the
// last group's padding columns are zeros.
at::Tensor int8_repack(const at::Tensor& blocks, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK_VALUE(is_repacked(format), "int8_repack: format ", format, " is not a repacked format (", kRepackedBase,
                    " + Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 or Q4_1)");
  const int64_t type = format - kRepackedBase, blocks_per_row = k / block_values(type);
  const int64_t row_bytes = blocks_per_row * file_bytes(type);
  check_weight("int8_repack", blocks, n, k, kFormatBase + type);
  const int64_t groups = (n + kGroup - 1) / kGroup, per_group = blocks_per_row * repacked_bytes(type);
  at::Tensor out = at::zeros({groups * per_group}, blocks.options());
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t col = 0; col < std::min(kGroup, n - kGroup * g); ++col) {
        for (int64_t i = 0; i < blocks_per_row; ++i) {
          uint8_t* block = dst + g * per_group + i * repacked_bytes(type);
          column<true>(type, block, col, src + (kGroup * g + col) * row_bytes + i * file_bytes(type));
        }
      }
    }
  });
  return out;
}

// Rows `ids` of a repacked weight as the file's blocks, [len(ids), K / 256 * block bytes] uint8: what gguf_rows
// de-quantises for the embedding lookup of a tied LM head.
at::Tensor int8_repacked_blocks(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK_VALUE(is_repacked(format), "int8_repacked_blocks: format ", format, " is not a repacked format");
  check_weight("int8_repacked_blocks", packed, n, k, format);
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                    "int8_repacked_blocks: ids must be a contiguous int64 [T] tensor");
  const int64_t type = format - kRepackedBase, blocks_per_row = k / block_values(type);
  const int64_t row_bytes = blocks_per_row * file_bytes(type);
  const int64_t per_group = blocks_per_row * repacked_bytes(type), count = ids.numel();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK_VALUE(id[r] >= 0 && id[r] < n, "int8_repacked_blocks: ids[", r, "] = ", id[r], " is outside [0, ", n,
                      ")");
  at::Tensor out = at::empty({count, row_bytes}, packed.options());
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t i = 0; i < blocks_per_row; ++i) {
      const uint8_t* block = src + id[r] / kGroup * per_group + i * repacked_bytes(type);
      column<false>(type, block, id[r] % kGroup, dst + r * row_bytes + i * file_bytes(type));
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("int8_linear(Tensor x, Tensor blocks, int n, int k, int format) -> Tensor", &int8_linear);
  lib.def("int8_linear_into(Tensor x, Tensor blocks, int n, int k, int format, Tensor(a!) y, int col) -> ()",
          &int8_linear_into);
  // Private: the same with the path forced (0 auto, 1 AVX2, 2 AVX512-VNNI); the activations as quantised.
  lib.def("_int8_linear_path(Tensor x, Tensor blocks, int n, int k, int format, int path) -> Tensor", &run);
  lib.def("_int8_quantise(Tensor x, int format) -> (Tensor, Tensor, Tensor)", &int8_quantise);
  lib.def("int8_repack(Tensor blocks, int n, int k, int format) -> Tensor", &int8_repack);
  lib.def("int8_repacked_blocks(Tensor packed, Tensor ids, int n, int k, int format) -> Tensor",
          &int8_repacked_blocks);
}
