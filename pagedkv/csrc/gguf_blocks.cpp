// A GGUF tensor's raw ggml blocks, read natively: packed into panels for the GEMM, or de-quantised row by row.
//
//   gguf_pack(raw, ggml_type, n, k)  -> the panel bytes of panel_linear.cpp (16 outputs per panel, k-major;
//                                       its header says why), in the format its table gives for the type:
//                                       the file's codes and scales, never re-quantised.
//   gguf_rows(raw, ggml_type, ids, k) -> rows `ids` as fp32: embedding lookups straight on the file's
//                                       blocks, and the reference the packed weights are checked against.
//
// One decoder per ggml type, shared by both ops, is the only description of that type's block layout: it
// turns a block into one code per weight plus d (and m) per group of 32 or 16 weights, and for the K-quants
// and Q5_0 also the file's own two-level scales. A type packs into one of two panel formats:
//   - its "wide" one (q4, q8, q8m, q4g16, q8g16): the codes, and d (and m) per group multiplied out in fp32
//     per output: Q4_K in q4 takes 0.75 bytes a weight where the file takes 0.5625;
//   - a compact one (q4k, q6k, q5, q5k, q2k, q3k; the K-quants and Q5_0): the file's unsigned codes, its fp16
//     block scale(s) widened to fp32 and its integer sub-block scales (and mins) as bytes, so within 6 % of
//     the file's size; the GEMM multiplies the scales out in registers, once per sub-block.
// gguf_rows computes d * q + m (formats with a min) or d * q from the wide description; the GEMM computes
// the same values from either packing. The d and m are made in fp32 as gguf's numpy dequantize makes them
// (fp16 -> fp32, times the integer sub-block scale, which is exact: 11 + 7 significant bits at most), so:
//   - with a min, d * q is exact too (<= 17 bits times <= 5), and d * q + m rounds once, fused or not;
//     Q4_0's m = -8 d is exact and d * q - 8 d = d * (q - 8) exactly, numpy's value (up to the sign of a 0);
//   - without one, the weight is the product d * q, as in numpy.
// So both ops give numpy's dequantize bit for bit, which is what HF transformers loads.
//
// Load-time code, scalar and portable: a block is decoded into a small buffer and then scattered into the
// panel (or multiplied out), parallel over panels (over ids for gguf_rows). `raw` may be a read-only memory
// map: it is only read, and gguf_rows reads only the rows it is asked for, so other pages stay on disk.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int64_t kPanel = 16;    // outputs per panel (panel_linear.cpp)
constexpr int64_t kQK = 256;      // weights per K-quant super-block, the largest ggml block here
constexpr int64_t kMinGroup = 16;  // the smallest group of a panel format (q4g16, q8g16; q6k's sub-blocks)

// Panel format codes, as panel_linear takes them (kNone: a type without a compact format).
enum Format : int64_t {
  kNone = -1, kF32 = 0, kQ4 = 1, kQ8 = 2, kQ8m = 3, kQ4g16 = 4, kQ8g16 = 5, kF16 = 6, kBF16 = 7,
  kQ4K = 8, kQ6K = 9, kQ5 = 10, kQ5K = 11, kQ2K = 12, kQ3K = 13
};

// One record of a quantised format holds `group` k for 16 outputs: codes [group][16] (4-bit codes two k to
// a byte, even k in the low nibble), then float d[16], then float m[16] if the format has a min.
struct Record {
  int64_t group;
  int code_bits;
  bool has_min;

  constexpr int64_t code_bytes() const { return group * kPanel * code_bits / 8; }
  constexpr int64_t bytes() const {
    return code_bytes() + (has_min ? 2 : 1) * kPanel * static_cast<int64_t>(sizeof(float));
  }
};

constexpr Record record_of(int64_t format) {
  switch (format) {
    case kQ4: return {32, 4, true};
    case kQ8: return {32, 8, false};
    case kQ8m: return {32, 8, true};
    case kQ4g16: return {16, 4, true};
    default: return {16, 8, false};  // kQ8g16
  }
}

// A compact record holds one ggml block (`unit` k: 256, Q5_0's 32) of 16 outputs, in the order the GEMM
// reads it, front to back (with the scales at the record's end, read first, q4k streamed at 2/3 of this
// speed: the kernel's prefetches run ahead in address order): float d[16], the block's fp16 d widened (then
// dmin[16], with a min); then its sub-blocks of `sub` k (Q5_0: one), each
//   scales       u8 [16] (q6k: i8), the sub-block's scale of each output (if sub < unit), then with a min
//                its mins, u8 [16]
//   high bits    u32 [16] (if high): an output's word holds the bits past the nibble of its k = j of the
//                sub-block at bits high * j (sub = 32 / high k): one load brings 16 outputs' high bits of
//                the sub-block, and each k's are one shift and one and away from bit 4 of its code
//   low nibbles  u8 [sub / 2][16]: byte = (u[2p] & 15) | (u[2p + 1] & 15) << 4 for k-pair p, as q4's
// The weight of code u in sub-block s: with a min (q4k, q5k) fma(u, d sc, -(dmin mn)): d sc and dmin mn are
// exact in fp32 (11 + 6 significant bits), so is u (d sc) (+ 5), and the one rounding is numpy's
// (d sc) u - dmin mn; without one (q6k, q5) (d sc) (u - offset), exact (11 + 7 + 5 = 23 bits at most) as
// numpy's. Every record is a whole number of 64-byte lines.
struct Compact {
  int64_t unit, sub;
  int high;      // bits of a code past its low nibble
  bool has_min;
  int offset;    // subtracted from a code without a min (Q6_K: 32, Q5_0: 16)

  // Byte offsets: of the first sub-block in a record; of the parts in a sub-block
  constexpr int64_t head() const { return (has_min ? 2 : 1) * kPanel * static_cast<int64_t>(sizeof(float)); }
  constexpr int64_t high_at() const { return sub < unit ? (has_min ? 2 : 1) * kPanel : 0; }
  constexpr int64_t codes_at() const { return high_at() + (high > 0 ? kPanel * 4 : 0); }
  constexpr int64_t sub_bytes() const { return codes_at() + sub / 2 * kPanel; }
  constexpr int64_t bytes() const { return head() + unit / sub * sub_bytes(); }
};

constexpr Compact compact_of(int64_t format) {
  switch (format) {
    case kQ4K: return {256, 32, 0, true, 0};
    case kQ6K: return {256, 16, 2, false, 32};
    case kQ5: return {32, 32, 1, false, 16};
    case kQ2K: return {256, 16, 0, true, 0};
    case kQ3K: return {256, 16, 0, false, 4};
    default: return {256, 32, 1, true, 0};  // kQ5K
  }
}
static_assert(compact_of(kQ4K).bytes() == 2432 && compact_of(kQ6K).bytes() == 3392 &&
              compact_of(kQ5).bytes() == 384 && compact_of(kQ5K).bytes() == 2944 &&
              compact_of(kQ2K).bytes() == 2688 && compact_of(kQ3K).bytes() == 2368);
// one high-bits word per output and sub-block
static_assert(compact_of(kQ6K).high * compact_of(kQ6K).sub == 32 && compact_of(kQ5).high * compact_of(kQ5).sub == 32 &&
              compact_of(kQ5K).high * compact_of(kQ5K).sub == 32);

// A decoded block: one code per weight, d and m per group of the wide format; and for the compact formats the
// file's scales: the block's d (and dmin), each sub-block's integer scale (and min).
struct Block {
  int8_t q[kQK];
  float d[kQK / kMinGroup];
  float m[kQK / kMinGroup];
  float block_d, block_dmin;
  int8_t scale[kQK / kMinGroup];
  uint8_t min[kQK / kMinGroup];
};

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Block layouts: gguf/quants.py's dequantize_blocks, read as the byte offsets they imply (all little-endian).
// The ways they pack small fields into bytes, one helper each:

// Nibbles in runs of `width` bytes: run c holds weights [2 width c, 2 width c + width) in its low nibbles and
// the next `width` weights in its high ones. Legacy blocks are one run of 16; Q4_K / Q5_K runs of 32; Q6_K's
// low 4 bits runs of 64.
void nibbles(const uint8_t* qs, int width, int count, int8_t* q) {
  for (int run = 0; run < count / (2 * width); ++run)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < width; ++j)
        q[2 * width * run + width * h + j] = static_cast<int8_t>((qs[width * run + j] >> (4 * h)) & 0x0F);
}

// K-quants' 2-bit fields, qs[64] for 256 weights: weight 128 half + 32 s + j is at bits 2s of qs[32 half + j].
void crumbs(const uint8_t* qs, int8_t* q) {
  for (int half = 0; half < 2; ++half)
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 32; ++j) q[128 * half + 32 * s + j] = static_cast<int8_t>((qs[32 * half + j] >> (2 * s)) & 3);
}

// K-quants' one-bit fields, qh[32] for 256 weights: weight 32 s + j is bit s of qh[j].
void bits(const uint8_t* qh, int8_t* q) {
  for (int s = 0; s < 8; ++s)
    for (int j = 0; j < 32; ++j) q[32 * s + j] = static_cast<int8_t>((qh[j] >> s) & 1);
}

void decode_q4_0(const uint8_t* b, Block& out) {  // d, qs[16]: w = d * (nibble - 8)
  out.d[0] = half_at(b);
  out.m[0] = -8.0f * out.d[0];
  nibbles(b + 2, 16, 32, out.q);
}

void decode_q4_1(const uint8_t* b, Block& out) {  // d, m, qs[16]: w = d * nibble + m
  out.d[0] = half_at(b);
  out.m[0] = half_at(b + 2);
  nibbles(b + 4, 16, 32, out.q);
}

// Legacy 5-bit blocks: a little-endian uint32 qh holds bit 4 of weight i at bit i.
void add_fifth_bits(const uint8_t* qh, int8_t* q) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q[i] | ((bits >> i) & 1) << 4);
}

void decode_q5_0(const uint8_t* b, Block& out) {  // d, qh[4], qs[16]: w = d * (5-bit - 16)
  out.d[0] = out.block_d = half_at(b);
  nibbles(b + 6, 16, 32, out.q);
  add_fifth_bits(b + 2, out.q);
  for (int i = 0; i < 32; ++i) out.q[i] = static_cast<int8_t>(out.q[i] - 16);
}

void decode_q5_1(const uint8_t* b, Block& out) {  // d, m, qh[4], qs[16]: w = d * 5-bit + m
  out.d[0] = half_at(b);
  out.m[0] = half_at(b + 2);
  nibbles(b + 8, 16, 32, out.q);
  add_fifth_bits(b + 4, out.q);
}

void decode_q8_0(const uint8_t* b, Block& out) {  // d, int8 qs[32]: w = d * q
  out.d[0] = half_at(b);
  std::memcpy(out.q, b + 2, 32);
}

void decode_q2_k(const uint8_t* b, Block& out) {  // scales[16], qs[64], d, dmin; per 16: (d sc) q - dmin mn
  const uint8_t* scales = b;
  const float d = out.block_d = half_at(b + 80), dmin = out.block_dmin = half_at(b + 82);
  for (int s = 0; s < 16; ++s) {
    out.scale[s] = static_cast<int8_t>(scales[s] & 0x0F);
    out.min[s] = static_cast<uint8_t>(scales[s] >> 4);
    out.d[s] = d * static_cast<float>(out.scale[s]);
    out.m[s] = -(dmin * static_cast<float>(out.min[s]));
  }
  crumbs(b + 16, out.q);
}

void decode_q3_k(const uint8_t* b, Block& out) {  // hmask[32], qs[64], scales[12], d; per 16: d (sc - 32) q
  const uint8_t* scales = b + 96;
  const float d = out.block_d = half_at(b + 108);
  for (int s = 0; s < 16; ++s) {  // low 4 bits: nibbles of bytes 0-7; high 2: crumbs of bytes 8-11
    const int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
    const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    out.scale[s] = static_cast<int8_t>((low | high << 4) - 32);
    out.d[s] = d * static_cast<float>(out.scale[s]);
  }
  int8_t high[256];
  crumbs(b + 32, out.q);
  bits(b, high);  // hmask: a clear bit subtracts 4
  for (int e = 0; e < 256; ++e) out.q[e] = static_cast<int8_t>(out.q[e] - 4 + 4 * high[e]);
}

// Q4_K / Q5_K's 12 scale bytes: 8 pairs of 6-bit (scale, min), one per 32 weights.
void scale_min_k4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// d (sc) and m = -(dmin mn) for each 32 weights of a Q4_K / Q5_K block (d, dmin, scales[12] at b).
void scales_k4(const uint8_t* b, Block& out) {
  const float d = out.block_d = half_at(b), dmin = out.block_dmin = half_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    scale_min_k4(b + 4, j, scale, min);
    out.d[j] = d * static_cast<float>(scale);
    out.m[j] = -(dmin * static_cast<float>(min));
    out.scale[j] = static_cast<int8_t>(scale);
    out.min[j] = static_cast<uint8_t>(min);
  }
}

void decode_q4_k(const uint8_t* b, Block& out) {  // d, dmin, scales[12], qs[128]
  scales_k4(b, out);
  nibbles(b + 16, 32, 256, out.q);
}

void decode_q5_k(const uint8_t* b, Block& out) {  // d, dmin, scales[12], qh[32], qs[128]
  scales_k4(b, out);
  int8_t high[256];
  nibbles(b + 48, 32, 256, out.q);
  bits(b + 16, high);
  for (int e = 0; e < 256; ++e) out.q[e] = static_cast<int8_t>(out.q[e] | high[e] << 4);
}

void decode_q6_k(const uint8_t* b, Block& out) {  // ql[128], qh[64], int8 scales[16], d; per 16: (d sc) (q - 32)
  const float d = out.block_d = half_at(b + 208);
  for (int s = 0; s < 16; ++s) {
    out.scale[s] = static_cast<int8_t>(b[192 + s]);
    out.d[s] = d * static_cast<float>(out.scale[s]);
  }
  int8_t high[256];
  nibbles(b, 64, 256, out.q);
  crumbs(b + 128, high);
  for (int e = 0; e < 256; ++e) out.q[e] = static_cast<int8_t>((out.q[e] | high[e] << 4) - 32);
}

float f32_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

float bf16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// A supported ggml type: its block, its panel formats (wide, and compact or kNone), and how to read it
// (decode for quantised blocks, to_float for the one-element blocks of the float types, which the panels keep
// as they are).
struct GgmlType {
  int64_t id;
  const char* name;
  int64_t block_size, type_size, format, compact;
  void (*decode)(const uint8_t*, Block&);
  float (*to_float)(const uint8_t*);
};

constexpr GgmlType kTypes[] = {
    {0, "F32", 1, 4, kF32, kNone, nullptr, f32_at},
    {1, "F16", 1, 2, kF16, kNone, nullptr, half_at},
    {30, "BF16", 1, 2, kBF16, kNone, nullptr, bf16_at},
    {2, "Q4_0", 32, 18, kQ4, kNone, decode_q4_0, nullptr},
    {3, "Q4_1", 32, 20, kQ4, kNone, decode_q4_1, nullptr},
    {6, "Q5_0", 32, 22, kQ8, kQ5, decode_q5_0, nullptr},
    {7, "Q5_1", 32, 24, kQ8m, kNone, decode_q5_1, nullptr},
    {8, "Q8_0", 32, 34, kQ8, kNone, decode_q8_0, nullptr},
    {10, "Q2_K", 256, 84, kQ4g16, kQ2K, decode_q2_k, nullptr},
    {11, "Q3_K", 256, 110, kQ8g16, kQ3K, decode_q3_k, nullptr},
    {12, "Q4_K", 256, 144, kQ4, kQ4K, decode_q4_k, nullptr},
    {13, "Q5_K", 256, 176, kQ8m, kQ5K, decode_q5_k, nullptr},
    {14, "Q6_K", 256, 210, kQ8g16, kQ6K, decode_q6_k, nullptr},
};

const GgmlType& type_of(const char* op, int64_t id) {
  for (const GgmlType& t : kTypes)
    if (t.id == id) return t;
  std::string supported;
  for (const GgmlType& t : kTypes) supported += (supported.empty() ? "" : ", ") + std::to_string(t.id) + " " + t.name;
  TORCH_CHECK_VALUE(false, op, ": ggml type ", id, " is unknown or has no panel format (supported: ", supported, ")");
}

// The checks both ops share; returns the bytes of one row.
int64_t row_bytes_of(const char* op, const GgmlType& t, const at::Tensor& raw, int64_t k) {
  TORCH_CHECK_VALUE(raw.scalar_type() == at::kByte && raw.is_contiguous(), op,
                    ": raw must be a contiguous uint8 tensor of ggml blocks, got ", raw.scalar_type(),
                    raw.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK_VALUE(k > 0 && k % t.block_size == 0, op, ": k = ", k, " is not a positive multiple of ", t.name,
                    "'s block size ", t.block_size);
  return k / t.block_size * t.type_size;
}

int64_t panel_bytes(const GgmlType& t, int64_t format, int64_t k) {
  if (t.decode == nullptr) return k * kPanel * t.type_size;
  if (format == t.compact) return k / t.block_size * compact_of(format).bytes();
  const Record r = record_of(format);
  return k / r.group * r.bytes();
}

// One group's codes, d and m into its record at output `lane`.
inline void store_group(const Record& r, const int8_t* q, float d, float m, int64_t lane, uint8_t* record) {
  if (r.code_bits == 4) {
    for (int64_t pair = 0; pair < r.group / 2; ++pair)
      record[pair * kPanel + lane] = static_cast<uint8_t>((q[2 * pair] & 0x0F) | (q[2 * pair + 1] << 4));
  } else {
    for (int64_t i = 0; i < r.group; ++i) record[i * kPanel + lane] = static_cast<uint8_t>(q[i]);
  }
  uint8_t* scales = record + r.code_bytes();  // float d[16], then float m[16]
  std::memcpy(scales + lane * sizeof(float), &d, sizeof(d));
  if (r.has_min) std::memcpy(scales + (kPanel + lane) * sizeof(float), &m, sizeof(m));
}

// Elements of `Size` bytes from `lanes` rows into [k][16], written in order.
template <int64_t Size>
void transpose_elements(const uint8_t* rows, int64_t row_bytes, int64_t lanes, int64_t k, uint8_t* out) {
  for (int64_t i = 0; i < k; ++i)
    for (int64_t lane = 0; lane < lanes; ++lane)
      std::memcpy(out + (i * kPanel + lane) * Size, rows + lane * row_bytes + i * Size, Size);
}

// A quantised panel: block by block, all 16 lanes of one before the next, so the records being filled stay
// in L1 (a whole panel is tens of KiB). Lanes past the `lanes` rows get codes 0, d 0, m 0.
template <int64_t F>
void pack_blocks(const GgmlType& t, const uint8_t* rows, int64_t row_bytes, int64_t lanes, int64_t k, uint8_t* out) {
  constexpr Record r = record_of(F);
  const int64_t groups_per_block = t.block_size / r.group;
  Block block;
  for (int64_t b = 0; b < k / t.block_size; ++b) {
    uint8_t* records = out + b * groups_per_block * r.bytes();
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      if (lane < lanes) {
        t.decode(rows + lane * row_bytes + b * t.type_size, block);
      } else {
        block = Block{};
      }
      for (int64_t g = 0; g < groups_per_block; ++g)
        store_group(r, block.q + g * r.group, block.d[g], block.m[g], lane, records + g * r.bytes());
    }
  }
}

// A compact panel, block by block as pack_blocks, into a zeroed `out`: lanes past `lanes` keep
// codes 0, scales 0, d 0.
template <int64_t F>
void pack_compact(const GgmlType& t, const uint8_t* rows, int64_t row_bytes, int64_t lanes, int64_t k, uint8_t* out) {
  constexpr Compact c = compact_of(F);
  Block block;
  for (int64_t b = 0; b < k / c.unit; ++b) {
    uint8_t* record = out + b * c.bytes();
    for (int64_t lane = 0; lane < lanes; ++lane) {
      t.decode(rows + lane * row_bytes + b * t.type_size, block);
      // the file's unsigned codes: the wide decoders subtract the offset of a format without a min
      uint8_t u[kQK];
      for (int64_t i = 0; i < c.unit; ++i) u[i] = static_cast<uint8_t>(block.q[i] + c.offset);
      std::memcpy(record + lane * sizeof(float), &block.block_d, sizeof(float));
      if (c.has_min) std::memcpy(record + (kPanel + lane) * sizeof(float), &block.block_dmin, sizeof(float));
      for (int64_t s = 0; s < c.unit / c.sub; ++s) {
        uint8_t* part = record + c.head() + s * c.sub_bytes();
        const uint8_t* su = u + s * c.sub;  // the sub-block's codes
        if (c.sub < c.unit) {
          part[lane] = static_cast<uint8_t>(block.scale[s]);
          if (c.has_min) part[kPanel + lane] = block.min[s];
        }
        if (c.high > 0) {
          uint32_t word = 0;
          for (int64_t j = 0; j < c.sub; ++j) word |= static_cast<uint32_t>(su[j] >> 4) << (c.high * j);
          std::memcpy(part + c.high_at() + lane * sizeof(word), &word, sizeof(word));
        }
        for (int64_t pair = 0; pair < c.sub / 2; ++pair) {
          const int low = su[2 * pair] & 0x0F, high = su[2 * pair + 1] & 0x0F;
          part[c.codes_at() + pair * kPanel + lane] = static_cast<uint8_t>(low | high << 4);
        }
      }
    }
  }
}

// Panel `panel` of the weight into `out` (its panel_bytes) in `format`. Every byte is written; lanes past n
// get codes 0, d 0, m 0 (float formats: 0), so padded outputs compute 0.
void pack_panel(const GgmlType& t, int64_t format, const uint8_t* raw, int64_t row_bytes, int64_t n, int64_t k,
                int64_t panel, int64_t bytes, uint8_t* out) {
  const int64_t lanes = std::min(kPanel, n - panel * kPanel);
  const uint8_t* rows = raw + panel * kPanel * row_bytes;
  if (t.decode == nullptr) {  // float types: element i of a lane at [i][lane], as it is
    if (lanes < kPanel) std::memset(out, 0, k * kPanel * t.type_size);
    if (t.type_size == 4) {
      transpose_elements<4>(rows, row_bytes, lanes, k, out);
    } else {
      transpose_elements<2>(rows, row_bytes, lanes, k, out);
    }
    return;
  }
  if (format == t.compact) {
    std::memset(out, 0, bytes);
    switch (format) {
      case kQ4K: return pack_compact<kQ4K>(t, rows, row_bytes, lanes, k, out);
      case kQ6K: return pack_compact<kQ6K>(t, rows, row_bytes, lanes, k, out);
      case kQ5: return pack_compact<kQ5>(t, rows, row_bytes, lanes, k, out);
      case kQ2K: return pack_compact<kQ2K>(t, rows, row_bytes, lanes, k, out);
      case kQ3K: return pack_compact<kQ3K>(t, rows, row_bytes, lanes, k, out);
      default: return pack_compact<kQ5K>(t, rows, row_bytes, lanes, k, out);
    }
  }
  switch (format) {  // the record layout a compile-time constant: store_group's loops unrolled
    case kQ4: return pack_blocks<kQ4>(t, rows, row_bytes, lanes, k, out);
    case kQ8: return pack_blocks<kQ8>(t, rows, row_bytes, lanes, k, out);
    case kQ8m: return pack_blocks<kQ8m>(t, rows, row_bytes, lanes, k, out);
    case kQ4g16: return pack_blocks<kQ4g16>(t, rows, row_bytes, lanes, k, out);
    default: return pack_blocks<kQ8g16>(t, rows, row_bytes, lanes, k, out);
  }
}

at::Tensor gguf_pack(const at::Tensor& raw, int64_t ggml_type, int64_t n, int64_t k, int64_t format) {
  const GgmlType& t = type_of("gguf_pack", ggml_type);
  const int64_t row_bytes = row_bytes_of("gguf_pack", t, raw, k);
  TORCH_CHECK_VALUE(format == t.format || (format == t.compact && format != kNone), "gguf_pack: ", t.name,
                    " packs into panel format ", t.format, t.compact == kNone ? "" : " or " + std::to_string(t.compact),
                    ", not ", format);
  TORCH_CHECK_VALUE(n >= 0, "gguf_pack: n = ", n, " is negative");
  TORCH_CHECK_VALUE(raw.nbytes() == static_cast<size_t>(n * row_bytes), "gguf_pack: raw has ", raw.nbytes(),
                    " bytes, but ", n, " rows of k = ", k, " ", t.name, " weights take ", n * row_bytes);
  const int64_t num_panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(t, format, k);
  at::Tensor packed = at::empty({num_panels * bytes}, raw.options());
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  // >= 1 MiB a thread (about a millisecond): a smaller weight is packed in less time than waking threads can
  // take on a busy machine (measured: 1.3 ms on one thread, 16 ms on two, for a 0.7 MB weight under load).
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / bytes);
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      pack_panel(t, format, src, row_bytes, n, k, panel, bytes, dst + panel * bytes);
  });
  return packed;
}

// One row (k weights at src) as fp32: d * q + m with a min, d * q without, as the GEMM reads the panels.
void dequantize_row(const GgmlType& t, const uint8_t* src, int64_t k, float* out) {
  if (t.decode == nullptr) {
    for (int64_t i = 0; i < k; ++i) out[i] = t.to_float(src + i * t.type_size);
    return;
  }
  const Record r = record_of(t.format);
  Block block;
  for (int64_t b = 0; b < k / t.block_size; ++b) {
    t.decode(src + b * t.type_size, block);
    for (int64_t g = 0; g < t.block_size / r.group; ++g) {
      const int8_t* q = block.q + g * r.group;
      const float d = block.d[g], m = block.m[g];
      float* o = out + b * t.block_size + g * r.group;
      if (r.has_min) {
        for (int64_t i = 0; i < r.group; ++i) o[i] = d * static_cast<float>(q[i]) + m;
      } else {
        for (int64_t i = 0; i < r.group; ++i) o[i] = d * static_cast<float>(q[i]);
      }
    }
  }
}

at::Tensor gguf_rows(const at::Tensor& raw, int64_t ggml_type, const at::Tensor& ids, int64_t k) {
  const GgmlType& t = type_of("gguf_rows", ggml_type);
  const int64_t row_bytes = row_bytes_of("gguf_rows", t, raw, k);
  TORCH_CHECK_VALUE(raw.nbytes() % row_bytes == 0, "gguf_rows: raw has ", raw.nbytes(),
                    " bytes, not a whole number of rows of k = ", k, " ", t.name, " weights (", row_bytes, " bytes)");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                    "gguf_rows: ids must be a contiguous int64 [T] tensor");
  const int64_t n = static_cast<int64_t>(raw.nbytes()) / row_bytes, count = ids.numel();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < n, "gguf_rows: ids[", i, "] = ", id[i], " is outside [0, ", n, ")");
  at::Tensor out = at::empty({count, k}, ids.options().dtype(at::kFloat));
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(t, src + id[i] * row_bytes, k, dst + i * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, lib) {
  lib.def("gguf_pack(Tensor raw, int ggml_type, int n, int k, int format) -> Tensor", &gguf_pack);
  lib.def("gguf_rows(Tensor raw, int ggml_type, Tensor ids, int k) -> Tensor", &gguf_rows);
}
