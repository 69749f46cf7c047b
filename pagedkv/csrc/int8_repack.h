// The repacked layout of the int8 GEMM's weights (Q4_K, Q6_K and the 32-value types) for its tiled kernel
// (int8_tiled.h), built once at load from the GGUF file's bytes, and its inverse (the file's blocks of chosen rows
// back, for the embedding lookup and tests).
//
// Why: the file keeps each output row's blocks together, so a kernel that reads them in place dots one output at a
// time and must fold and sum eight lanes per (block, row). Here 16 outputs ("a group"; zero rows pad the last) sit
// side by side: one 64-byte load gives 4 consecutive codes of each of the 16 columns in the 16 dword lanes, and one
// vpdpbusd with a broadcast activation dword adds 64 products into 16 columns' sums -- nothing to reduce across lanes.
//
// A group's data for block i lies at (group * blocks + i) * kBytes, every vector at a 64-byte multiple:
//
//   Q4_K (2368 bytes = 16 x 148; the file takes 16 x 144)
//     0     d[16]     fp16, the columns' block scales               32    dmin[16]  fp16
//     64    sc[4][16][2]  uint8: pair p, column n: (sc_2p, sc_2p+1)  192   mn[4][16][2] the mins, alike
//     320   qs[4][8][16][4]: [c][t][n][b] = the file's qs[32 c + 4 t + b] of column n (low nibble: sub-block 2c's
//           code 4 t + b, high nibble: sub-block 2c + 1's)
//   Q6_K (3392 bytes = 16 x 212; the file takes 16 x 210)
//     0     d[16]     fp16 (then 32 bytes of padding)
//     64    sc[8][16][2]  int8: pair p, column n: (sc_2p, sc_2p+1)
//     320   codes[2][8][3][16][4]: [h][t][0 or 1][n][b] = ql[64 h + 32 s + 4 t + b] for s = 0, 1,
//                                  [h][t][2][n][b]      = qh[32 h + 4 t + b]
//           (the kernel's reading order: one stream, which the hardware prefetcher follows; ql and qh in runs of
//           their own made a one-row GEMV four times slower, waiting on L3)
//   Q8_0 (576 bytes per 32 values = 16 x 36; the file takes 16 x 34)
//     0     d[16]     fp16, the columns' block scales           32    csum[16]  int16: the sum of the column's 32
//           codes (derived, not the file's: the VNNI body takes off the activations' offset of 128 through it)
//     64    qs[8][16][4]: [t][n][b] = the file's code 4 t + b of column n (int8)
//   Q4_0 (320 bytes = 16 x 20; file 16 x 18), Q4_1 (320 = 16 x 20, as the file): d[16] at 0; Q4_0's csum[16]
//           (the sum of codes u - 8) or Q4_1's m[16] (fp16) at 32; qs[4][16][4] at 64, as Q5_0's
//   Q5_0 (384 bytes per 32 values = 16 x 24; the file takes 16 x 22)
//     0     d[16], 32 csum[16]: as Q8_0's (csum: the sum of the column's 32 codes u - 16)
//     64    qs[4][16][4]: [t][n][b] = the file's qs[4 t + b] of column n (low nibble: code 4 t + b, high: 16 + 4 t + b)
//     320   qh[16][4]: column n's 32 high bits, rearranged: bit t of byte b is code 4 t + b's (the file's bit 4 t + b),
//           so that one shift and mask of the vector gives the high bits of codes 4 t .. 4 t + 3 of every column
// Every byte of a real row's blocks is kept (the 12 packed scale bytes of Q4_K are its 16 6-bit values), so the
// file's blocks come back exactly (repacked_rows).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kGroup = 16;  // output columns side by side

struct Q4KLayout {
  static constexpr int64_t kFileBytes = 144, kBytes = 2368;
  static constexpr int64_t kD = 0, kDmin = 32, kSc = 64, kMn = 192, kQs = 320;
};

struct Q6KLayout {
  static constexpr int64_t kFileBytes = 210, kBytes = 3392;
  static constexpr int64_t kD = 0, kSc = 64, kCodes = 320;
  // the vector of 4 codes-bytes per column: ql's half s (0, 1) or qh (2) for (h, t)
  static constexpr int64_t at(int h, int t, int which) { return kCodes + ((h * 8 + t) * 3 + which) * 64; }
};

// The 32-value types: whether codes are nibbles, with Q5_0's high bits, the offset taken off them, a min (Q4_1).
struct Q80Layout {
  static constexpr int64_t kFileBytes = 34, kBytes = 576;
  static constexpr int64_t kD = 0, kSum = 32, kQs = 64;
  static constexpr bool kNibbles = false, kHighBits = false, kMin = false;
  static constexpr int kOffset = 0;
};

struct Q50Layout {
  static constexpr int64_t kFileBytes = 22, kBytes = 384;
  static constexpr int64_t kD = 0, kSum = 32, kQs = 64, kQh = 320;
  static constexpr bool kNibbles = true, kHighBits = true, kMin = false;
  static constexpr int kOffset = 16;
};

struct Q40Layout {
  static constexpr int64_t kFileBytes = 18, kBytes = 320, kFileQs = 2;
  static constexpr int64_t kD = 0, kSum = 32, kQs = 64;
  static constexpr bool kNibbles = true, kHighBits = false, kMin = false;
  static constexpr int kOffset = 8;
};

struct Q41Layout {
  static constexpr int64_t kFileBytes = 20, kBytes = 320, kFileQs = 4;
  static constexpr int64_t kD = 0, kM = 32, kQs = 64;
  static constexpr bool kNibbles = true, kHighBits = false, kMin = true;
  static constexpr int kOffset = 0;
};

// Q4_K's 12 scale bytes <-> its 8 6-bit scales and 8 6-bit mins (ggml's get_scale_min_k4 and its inverse).
inline void q4_k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

inline void q4_k_scale_bytes(const uint8_t* sc, const uint8_t* mn, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
    s[j + 4] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | (mn[j + 4] & 0x0F) << 4);
  }
}

// The group-block (written when repacking) and the file's block (written when unpacking) of one direction.
template <bool kToGroup>
using GroupPtr = std::conditional_t<kToGroup, uint8_t*, const uint8_t*>;
template <bool kToGroup>
using FilePtr = std::conditional_t<kToGroup, const uint8_t*, uint8_t*>;

// Bytes [file, file + bytes) of a column's block b to [group, group + bytes) of its group-block g, or back.
template <bool kToGroup>
void move_bytes(GroupPtr<kToGroup> g, FilePtr<kToGroup> b, int64_t file, int64_t group, int64_t bytes) {
  if constexpr (kToGroup) std::memcpy(g + group, b + file, bytes);
  else std::memcpy(b + file, g + group, bytes);
}

// Column n's block b (the file's bytes) into its group-block g (kToGroup), or out of it.
template <bool kToGroup>
void q4_k_column(GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  using L = Q4KLayout;
  move_bytes<kToGroup>(g, b, 0, L::kD + 2 * n, 2);
  move_bytes<kToGroup>(g, b, 2, L::kDmin + 2 * n, 2);
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < 8; ++t) move_bytes<kToGroup>(g, b, 16 + 32 * c + 4 * t, L::kQs + ((c * 8 + t) * 16 + n) * 4, 4);
  uint8_t sc[8], mn[8];  // the 12 packed scale bytes <-> the group's unpacked pairs
  if constexpr (kToGroup) q4_k_scales(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const auto to_sc = g + L::kSc + (j / 2) * 32 + 2 * n + j % 2;
    const auto to_mn = g + L::kMn + (j / 2) * 32 + 2 * n + j % 2;
    if constexpr (kToGroup) *to_sc = sc[j], *to_mn = mn[j];
    else sc[j] = *to_sc, mn[j] = *to_mn;
  }
  if constexpr (!kToGroup) q4_k_scale_bytes(sc, mn, b + 4);
}

template <bool kToGroup>
void q6_k_column(GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  using L = Q6KLayout;
  move_bytes<kToGroup>(g, b, 208, L::kD + 2 * n, 2);
  for (int p = 0; p < 8; ++p) move_bytes<kToGroup>(g, b, 192 + 2 * p, L::kSc + p * 32 + 2 * n, 2);
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 8; ++t) {
      for (int s = 0; s < 2; ++s) move_bytes<kToGroup>(g, b, 64 * h + 32 * s + 4 * t, L::at(h, t, s) + 4 * n, 4);
      move_bytes<kToGroup>(g, b, 128 + 32 * h + 4 * t, L::at(h, t, 2) + 4 * n, 4);
    }
  }
}

template <bool kToGroup>
void q8_0_column(GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  using L = Q80Layout;
  move_bytes<kToGroup>(g, b, 0, L::kD + 2 * n, 2);
  for (int t = 0; t < 8; ++t) move_bytes<kToGroup>(g, b, 2 + 4 * t, L::kQs + (t * 16 + n) * 4, 4);
  if constexpr (kToGroup) {
    int16_t sum = 0;
    for (int j = 0; j < 32; ++j) sum = static_cast<int16_t>(sum + static_cast<int8_t>(b[2 + j]));
    std::memcpy(g + L::kSum + 2 * n, &sum, sizeof(sum));
  }
}

template <bool kToGroup>
void q5_0_column(GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  using L = Q50Layout;
  move_bytes<kToGroup>(g, b, 0, L::kD + 2 * n, 2);
  for (int t = 0; t < 4; ++t) move_bytes<kToGroup>(g, b, 6 + 4 * t, L::kQs + (t * 16 + n) * 4, 4);
  const auto spread = g + L::kQh + 4 * n;  // the rearranged high bits <-> the file's word at b + 2
  uint32_t file = 0, ours = 0;
  if constexpr (kToGroup) std::memcpy(&file, b + 2, 4);
  else std::memcpy(&ours, spread, 4);
  for (int j = 0; j < 32; ++j) {  // code j = 4 t + b: the file's bit j, our byte j % 4's bit j / 4
    const int at = 8 * (j % 4) + j / 4;
    if constexpr (kToGroup) ours |= (file >> j & 1u) << at;
    else file |= (ours >> at & 1u) << j;
  }
  if constexpr (kToGroup) {
    std::memcpy(spread, &ours, 4);
    int16_t sum = 0;
    for (int j = 0; j < 32; ++j)
      sum = static_cast<int16_t>(sum + (j < 16 ? b[6 + j] & 15 : b[6 + j - 16] >> 4) + 16 * (file >> j & 1) - 16);
    std::memcpy(g + L::kSum + 2 * n, &sum, sizeof(sum));
  } else {
    std::memcpy(b + 2, &file, 4);
  }
}

// Q4_0 / Q4_1: d (and Q4_1's m) and the 16 bytes of nibbles; Q4_0's code sum.
template <class L, bool kToGroup>
void nibble_column(GroupPtr<kToGroup> g, int64_t n, FilePtr<kToGroup> b) {
  move_bytes<kToGroup>(g, b, 0, L::kD + 2 * n, 2);
  if constexpr (L::kMin) move_bytes<kToGroup>(g, b, 2, L::kM + 2 * n, 2);
  for (int t = 0; t < 4; ++t) move_bytes<kToGroup>(g, b, L::kFileQs + 4 * t, L::kQs + (t * 16 + n) * 4, 4);
  if constexpr (kToGroup && !L::kMin) {
    int16_t sum = -32 * L::kOffset;
    for (int j = 0; j < 16; ++j) sum = static_cast<int16_t>(sum + (b[L::kFileQs + j] & 15) + (b[L::kFileQs + j] >> 4));
    std::memcpy(g + L::kSum + 2 * n, &sum, sizeof(sum));
  }
}

}  // namespace
