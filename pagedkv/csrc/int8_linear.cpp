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
// Every type is repacked at load in groups of 16 outputs (format kRepackedBase + the ggml type id; int8_repack.h,
// built by the int8_repack op from the file's blocks): the tiled kernel (int8_tiled.h) puts a group's 16 outputs in
// the lanes of a vector, each activation dword broadcast, so a block needs no horizontal sum. Its canonical order,
// the same on every path and tile size, is stated there.
//
// Batch invariance: a row's result depends only on its own x row and W, in that order, whatever other rows share
// the call, however many threads split the outputs. Groups of 16 outputs are split over the threads; per group,
// the rows run in tiles (up to 8 on AVX-512, 4 on AVX2) while the group's weights stay in L1 / L2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>

#include "int8_quantise.h"
#include "int8_repack.h"
#include "int8_tiled.h"

namespace {

// + ggml type: every int8 type repacked in groups of 16 outputs (int8_repack.h), panel.INT8_REPACKED_BASE
constexpr int64_t kRepackedBase = 128;

bool has_vnni() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

// How to compute: kAuto picks VNNI where the CPU has it; the others are for tests (the private _int8_linear_path op).
enum Path : int64_t { kAuto = 0, kAvx2 = 1, kVnni = 2 };

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

// The ggml type of an int8-activation format; any other format is refused by name.
int64_t type_of(const char* op, int64_t format) {
  const int64_t type = format - kRepackedBase;
  TORCH_CHECK_VALUE(type == kQ4_K || type == kQ6_K || type == kQ8_0 || type == kQ5_0 || type == kQ4_0 || type == kQ4_1,
                    op, ": format ", format, " is not an int8-activation format (", kRepackedBase,
                    " + ggml type Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K, repacked in groups of 16 outputs)");
  return type;
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

// `w` holds N x K weights of `type`: repacked in groups of 16 outputs, or (`file`) the file's blocks [N][K / block].
void check_weight(const char* op, const at::Tensor& w, int64_t n, int64_t k, int64_t type, bool file) {
  const int64_t block = block_values(type);
  TORCH_CHECK_VALUE(n >= 0 && k >= 0 && k % block == 0, op, ": K = ", k, " is not a multiple of the block, ", block);
  const int64_t want = file ? n * (k / block) * file_bytes(type)
                            : (n + kGroup - 1) / kGroup * (k / block) * repacked_bytes(type);
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.is_contiguous() && w.nbytes() == static_cast<size_t>(want), op,
                    ": the weight must be ", want, " contiguous uint8 bytes (N = ", n, ", K = ", k, "), got ",
                    w.nbytes());
}

void into(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, int64_t format, at::Tensor& y, int64_t col,
          int64_t path) {
  const int64_t type = type_of("int8_linear", format);
  check_weight("int8_linear", w, n, k, type, false);
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
  const Quantised a = quantise(x.contiguous(), type);
  const int64_t values = block_values(type);
  if (type != kQ4_1 && !uses_q8_k(type) && vnni) a.q.bitwise_xor_(-128);  // q + 128, vpdpbusd's unsigned operand
  const Tiled p{static_cast<const uint8_t*>(w.data_ptr()), k / values, n, k, values, a.q.data_ptr<int8_t>(),
                a.d.data_ptr<float>(), uses_q8_k(type) ? a.sums.data_ptr<int16_t>() : nullptr,
                type == kQ4_1 ? a.sums.data_ptr<float>() : nullptr, a.sums.size(1), y.data_ptr<float>() + col,
                y.size(1)};
  run_groups(p, x.size(0), tiles_of(type, vnni));
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
  const int64_t type = type_of("_int8_quantise", format), block = block_values(type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0,
              "_int8_quantise: x must be a 2-D float32 tensor with a multiple of ", block, " columns");
  Quantised a = quantise(x.contiguous(), type);
  return {a.q, a.d, a.sums};
}

// Blocks [N][K / block] as the file holds them -> the repacked layout of `format` (int8_repack.h); the
// last group's padding columns are zeros.
at::Tensor int8_repack(const at::Tensor& blocks, int64_t n, int64_t k, int64_t format) {
  const int64_t type = type_of("int8_repack", format), blocks_per_row = k / block_values(type);
  const int64_t row_bytes = blocks_per_row * file_bytes(type);
  check_weight("int8_repack", blocks, n, k, type, true);
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

// Rows `ids` of a repacked weight as the file's blocks, [len(ids), K / block * block bytes] uint8: what gguf_rows
// de-quantises for the embedding lookup of a tied LM head.
at::Tensor int8_repacked_blocks(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k, int64_t format) {
  const int64_t type = type_of("int8_repacked_blocks", format);
  check_weight("int8_repacked_blocks", packed, n, k, type, false);
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                    "int8_repacked_blocks: ids must be a contiguous int64 [T] tensor");
  const int64_t blocks_per_row = k / block_values(type), row_bytes = blocks_per_row * file_bytes(type);
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
