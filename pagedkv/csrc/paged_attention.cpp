// Paged attention for every row of a step -- decodes and prefill chunks alike -- reading K/V straight from the
// pool through the block table (no gather copy), with results that are bitwise batch-invariant.
//
// Rows. Request b's new rows are q[qsl[b], qsl[b + 1]); row i sits at position p = seq_lens[b] - (qsl[b + 1] - i)
// and attends keys [0, p], causally (the caller has written its own K/V already); with a window w > 0 (a
// sliding-window layer, e.g. Gemma 3's) only keys (p - w, p]. A decode is a request with one row, so a prefill
// chunk, a decode and a speculative draft all run the same code.
//
// Invariance by construction: a row's float operations depend on its position p alone. Its keys are cut into
// partitions of a FIXED kPartition tokens (never chosen from the batch or the thread count), each walked in
// tiles of kTile tokens from the partition start, the last tile cut at p. Per tile the row keeps an online
// softmax (running max m and sum l) and accumulates p * V. Its partitions are then merged with log-sum-exp
// (vLLM's paged attention v2), always in ascending order, by one function; a row with one partition comes out
// as acc / l. Which work item, thread or neighbours a row gets changes what runs when, never what is computed:
// a request's rows are the same bits as one prefill chunk, as several, or one decode at a time.
//
// Windows. A row's keys before p - w + 1 are out of its view: tiles and partitions wholly before the view of
// every row of an item are not walked (a windowed layer's cost stays bounded however long the context), a
// partition out of one row's view is not merged into it (the first it merges is the one holding p - w + 1),
// and within a tile the keys before the view get weight 0 like the keys past p. All of this depends on p and
// w alone, so a windowed row is as batch-invariant as any other. Where a tile straddles the view's start, the
// keys before it are not read (the view's first key stands in, with weight 0): a windowed layer's released
// blocks -- its table's null entries, docs/sliding-window.md -- are never touched, whatever they hold.
//
// Work items: up to kRows consecutive rows of one request, over all their partitions in turn, merged as they
// come -- except a lone row (a decode) with a long context, whose partitions are items of their own, so that
// one long decode still keeps every thread busy; those are merged after all items are done. A lone row's
// items are also split by KV head (its query heads that share one), so that even a single short decode
// gives every thread work: the heads never meet, so no head's operations change. For each
// partition, tile and KV head, the item's query vectors -- its rows times the G query heads sharing that KV
// head (GQA) -- go through the tile kM at a time, always kM (padded with zero vectors), in micro-kernels that
// hold a kM x kKeys block of dot products (or a block of p * V accumulators) in registers, so each K or V
// vector loaded serves several queries. A vector's own operations are the same in every slot of that block,
// so neither the other vectors nor their number changes its bits. The tile stays in cache while all the
// item's vectors pass: a prefill chunk reads its K/V from memory once per kRows rows, not once per row. A tile
// spans blocks, so the softmax bookkeeping is amortised over kTile tokens whatever the block size. Vectors
// whose row ends inside the tile get weight 0 for the keys past it: adding 0 * v leaves their accumulators as
// they were. While a tile is used the next one's rows are prefetched into L2 (the blocks are scattered, so the
// hardware cannot guess them, but the table can). Items run on torch's intra-op threads and pull work from an
// atomic counter, biggest first. Queries and all arithmetic are fp32. The pools are fp32 (the default) or fp16
// (kv_cache_dtype="float16": half the memory and the K/V traffic); an fp16 K or V vector is widened to fp32 as
// it is loaded, so the results are the fp32 kernel's on the stored values, bit for bit.
//
// Only the headers it needs (not torch/extension.h): the first build takes a third of the time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace pagedkv::simd;

constexpr int64_t kTile = 64;        // keys per online-softmax update
constexpr int64_t kPartition = 512;  // keys per partition: fixed, so a row's partitions depend on its position only
constexpr int64_t kRows = 32;        // rows of one request per work item, sharing each K/V tile
constexpr int64_t kM = 4;            // query vectors per micro-kernel call, always (padded with zero vectors)
constexpr int64_t kKeys = 4;         // keys per step of the scores micro-kernel
constexpr int64_t kPV = 2;           // query vectors per register block of the p * V micro-kernel
constexpr int64_t kOutVecs = 8;      // accumulator vectors per query held in registers by the p * V micro-kernel
static_assert(kPartition % kTile == 0, "tiles must not straddle partitions");
static_assert(kTile % kLanes == 0 && kLanes % kKeys == 0, "a tile is whole vectors of whole key steps");
// Work (keys x query heads x head dim) worth waking another thread for. Below it the step runs on the calling
// thread: waiting for a thread to be scheduled costs milliseconds when the cores are busy. The engine calls
// this between panel GEMMs, whose threads are still spinning, so on a quiet machine a second thread starts at
// once. Measured (one decode per layer, SmolLM2's 9 / 3 heads of 64, AMD EPYC Zen 5, 2 threads): a 1,000-token
// decode 194 -> 116 us a layer, its partitions and KV heads shared out. Alone, with its K/V in cache, a
// 300-token one took 23-24 us on one thread or two; but in the engine its K/V come from memory (the step's
// weights have gone through the caches since the layer's last step), and a 330-400-token decode took 39-54 us
// a layer on two threads against 58-60 on one (torch.profiler over 64-token generations, alternating builds),
// so the floor sits below it: ~110 tokens of context for this model.
constexpr int64_t kWorkPerThread = int64_t{1} << 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// {hsum(v[0]), ..., hsum(v[7])} as a transpose-and-add tree: 7 adds for 8 sums instead of 7 per sum. Every
// output lane is summed by the same tree, whatever its neighbours hold.
inline Vec hsum8(const Vec* v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  Vec pairs[4], quads[2];
  for (int j = 0; j < 4; ++j)
    pairs[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(v[2 * j], v[2 * j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int j = 0; j < 2; ++j)
    quads[j] = __builtin_shufflevector(pairs[2 * j], pairs[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(pairs[2 * j], pairs[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
  Vec out;
  for (int j = 0; j < 8; ++j)  // the tree above, lane by lane
    out[j] = ((v[j][0] + v[j][2]) + (v[j][1] + v[j][3])) + ((v[j][4] + v[j][6]) + (v[j][5] + v[j][7]));
  return out;
#endif
}

struct Problem {
  const float* q;  // row i, query head h at q + i * q_stride + h * dim
  int64_t q_stride;
  const void* k;  // pools [num_blocks, block_size, kv_heads, dim] of float or _Float16 (the kernels' T)
  const void* v;
  const int64_t* tables;     // [batch, max_blocks]
  const int64_t* seq_lens;   // [batch]
  const int64_t* query_loc;  // [batch + 1]
  int64_t q_heads, kv_heads, group, dim, block_size, max_blocks;
  float scale;
  int64_t window;  // 0: every row attends its whole context; w > 0: keys (p - w, p]

  // Row i of request b sits at position first_position(b) + i.
  int64_t first_position(int64_t b) const { return seq_lens[b] - query_loc[b + 1]; }
  // The first key the row at position p attends to, and the first partition holding one.
  int64_t view_start(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
  int64_t first_partition(int64_t p) const { return view_start(p) / kPartition; }
};

// Rows [row_begin, row_end) of `request` over partitions [part_begin, part_end): all of the rows' partitions,
// merged as they come, or -- for a lone row with a long context -- one of them, stored for the merge after;
// for KV heads [kv_begin, kv_end) and their query heads.
struct Item {
  int64_t request, row_begin, row_end, part_begin, part_end, kv_begin, kv_end;
  int64_t work;  // keys attended, summed over the rows: for the schedule only
};

// The partitions of the lone rows whose partitions are items of their own, merged once every item is done.
struct Partials {
  std::vector<int64_t> first;    // per row: the slot of its partition 0, or -1 if it is merged in its item
  std::vector<float> acc, m, l;  // [slot, q_heads, dim], [slot, q_heads], [slot, q_heads]
};

// Fold one partition's (m, l, acc) into a row's merge (M, L, O), partitions in ascending order: the first is
// copied, each later one rescales both sides to the larger max (log-sum-exp). One compiled copy (noinline)
// serves both the merge inside an item and the one after, so their floating-point operations are the same.
__attribute__((noinline)) void merge_partition(bool first, float m, float l, const float* acc, float& M, float& L,
                                               float* O, int64_t dim) {
  if (first) {
    M = m, L = l;
    std::copy(acc, acc + dim, O);
    return;
  }
  const float m_new = std::max(M, m), a = std::exp(M - m_new), b = std::exp(m - m_new);
  L = L * a + l * b;
  for (int64_t d = 0; d < dim; ++d) O[d] = O[d] * a + acc[d] * b;
  M = m_new;
}

// out = O / L: a row's result, however many partitions it had.
__attribute__((noinline)) void normalise(const float* O, float L, float* out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = O[d] / L;
}

// One worker's buffers. Per KV head, its query vectors are laid out (row, query head of the group), followed
// by kM zero vectors, so every micro-kernel call reads kM consecutive ones.
struct Scratch {
  int64_t vecs;  // per KV head: rows * group + kM
  std::vector<float> q, acc, m, l;  // [kv_heads, vecs, dim], ..., [kv_heads, vecs]: one partition's
  std::vector<float> O, M, L;       // the same shapes: the merge of the partitions so far
  std::vector<float> scores;        // one KV head's [vecs, kTile]: its vectors' scores, then weights, for a tile
  std::vector<Vec> partial;         // [kM, kTile]: the dot products' vectors before their sums
  std::vector<int64_t> offsets;     // pool offset of each key of the partition, padded to whole vectors
  Scratch(const Problem& pr, int64_t rows)
      : vecs(rows * pr.group + kM), q(pr.kv_heads * vecs * pr.dim), acc(q.size()), m(pr.kv_heads * vecs),
        l(m.size()), O(q.size()), M(m.size()), L(m.size()), scores(vecs * kTile), partial(kM * kTile),
        offsets(kPartition + kLanes) {}
};

// scores[j * kTile + i] = q_j . k_i for the kM query vectors q_j (dim floats apart) and keys i < n, key i at
// k + offsets[i] (offsets valid up to n rounded up to kLanes). Every pair gets one accumulator vector over the
// dim in order, then hsum8's tree, then the dim's scalar tail: the same operations whichever slot or key step
// it falls in. The kKeys keys of a step are n / kKeys apart, not adjacent (measured ~10% faster), and the
// loaded vectors are pinned in registers (see in_register: 1.6x the speed of GCC's memory operands here).
template <int kDim, typename T>
void qk_scores(float* scores, Vec* partial, const float* q, const T* k, const int64_t* offsets, int64_t n,
               int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim, vec_end = dim / kLanes * kLanes;
  const int64_t stride = (n + kKeys - 1) / kKeys;  // key slot i takes keys [i * stride, (i + 1) * stride)
  for (int64_t i0 = 0; i0 < stride; ++i0) {
    const T* rows[kKeys];
    for (int64_t i = 0; i < kKeys; ++i) rows[i] = k + offsets[i0 + i * stride];
    Vec acc[kM][kKeys] = {};
    for (int64_t c = 0; c < vec_end; c += kLanes) {
      Vec key[kKeys];
      for (int64_t i = 0; i < kKeys; ++i) key[i] = in_register(load(rows[i] + c));
      for (int64_t j = 0; j < kM; ++j) {
        const Vec query = in_register(load(q + j * dim + c));
        for (int64_t i = 0; i < kKeys; ++i) acc[j][i] += query * key[i];
      }
    }
    for (int64_t j = 0; j < kM; ++j)
      for (int64_t i = 0; i < kKeys; ++i) partial[j * kTile + i0 + i * stride] = acc[j][i];
  }
  for (int64_t j = 0; j < kM; ++j)
    for (int64_t i = 0; i < n; i += kLanes) store(scores + j * kTile + i, hsum8(partial + j * kTile + i));
  for (int64_t d = vec_end; d < dim; ++d)
    for (int64_t j = 0; j < kM; ++j)
      for (int64_t i = 0; i < n; ++i) scores[j * kTile + i] += q[j * dim + d] * k[offsets[i] + d];
}

// acc_j[c0, c0 + kVecs * kLanes) += sum_{i < n} p[j * kTile + i] * v_i[same] for query vectors j of [j0, j0 + kJ):
// the block of accumulators stays in registers while the keys stream by (kJ and kVecs are constants, so it can).
template <int kJ, int kVecs, typename T>
inline void accumulate_block(float* acc, int64_t dim, const float* p, const T* v, const int64_t* offsets,
                             int64_t n, int64_t j0, int64_t c0) {
  Vec a[kJ][kVecs];
  for (int64_t j = 0; j < kJ; ++j)
    for (int64_t c = 0; c < kVecs; ++c) a[j][c] = load(acc + (j0 + j) * dim + c0 + c * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    Vec value[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) value[c] = load(v + offsets[i] + c0 + c * kLanes);
    for (int64_t j = 0; j < kJ; ++j) {
      const Vec pj = splat(p[(j0 + j) * kTile + i]);
      for (int64_t c = 0; c < kVecs; ++c) a[j][c] += pj * value[c];
    }
  }
  for (int64_t j = 0; j < kJ; ++j)
    for (int64_t c = 0; c < kVecs; ++c) store(acc + (j0 + j) * dim + c0 + c * kLanes, a[j][c]);
}

// acc_j[0, dim) += sum_{i < n} p[j * kTile + i] * v_i[0, dim) for the kM query vectors, value i at v + offsets[i]:
// each output element is one chain over the keys in order, however the vectors and the dim are cut into
// register blocks.
template <int kDim, typename T>
void accumulate(float* acc, const float* p, const T* v, const int64_t* offsets, int64_t n, int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim, vec_end = dim / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < kM; j0 += kPV) {
    int64_t c0 = 0;
    for (; c0 + kOutVecs * kLanes <= vec_end; c0 += kOutVecs * kLanes)
      accumulate_block<kPV, kOutVecs>(acc, dim, p, v, offsets, n, j0, c0);
    for (; c0 < vec_end; c0 += kLanes) accumulate_block<kPV, 1>(acc, dim, p, v, offsets, n, j0, c0);
  }
  for (int64_t d = vec_end; d < dim; ++d)
    for (int64_t j = 0; j < kM; ++j)
      for (int64_t i = 0; i < n; ++i) acc[j * dim + d] += p[j * kTile + i] * v[offsets[i] + d];
}

// Fold one query's tile scores s[skip, n) into its online softmax: s becomes p = exp(s - m_new), then 0 up to
// `width` (the keys the group's accumulate reads) and below `skip` (keys before a window, skip < n); the sum
// and accumulator are rescaled when the max grows. Lanes [n, n rounded up to 8) are scratch. The operations
// depend on n and skip alone, not on `width`.
inline void softmax_update(float* s, int64_t skip, int64_t n, int64_t width, float& m, float& l, float* acc,
                           int64_t dim) {
  const int64_t padded = round_up(n, kLanes);
  std::fill(s, s + skip, kNegInf);
  std::fill(s + n, s + padded, kNegInf);
  Vec max = splat(m);
  for (int64_t i = 0; i < padded; i += kLanes) {
    const Vec x = load(s + i);
    max = x > max ? x : max;
  }
  float m_new = max[0];
  for (int j = 1; j < kLanes; ++j) m_new = std::max(m_new, max[j]);
  for (int64_t i = 0; i < padded; i += kLanes) store(s + i, vexp(load(s + i) - m_new));
  std::fill(s, s + skip, 0.0f);
  std::fill(s + n, s + std::max(padded, width), 0.0f);
  Vec sum = {};
  for (int64_t i = 0; i < padded; i += kLanes) sum += load(s + i);
  if (m_new > m) {
    const float alpha = vexp(splat(m - m_new))[0];
    for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
    l *= alpha;
    m = m_new;
  }
  l += hsum(sum);
}

// The item's queries, scaled, laid out per KV head; the vectors past its rows are zero.
void load_queries(const Problem& pr, const Item& item, Scratch& s) {
  const int64_t dim = pr.dim, group = pr.group;
  std::fill(s.q.begin(), s.q.end(), 0.0f);
  for (int64_t r = 0; r < item.row_end - item.row_begin; ++r)
    for (int64_t head = 0; head < pr.q_heads; ++head) {
      const float* src = pr.q + (item.row_begin + r) * pr.q_stride + head * dim;
      float* dst = s.q.data() + ((head / group) * s.vecs + r * group + head % group) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * pr.scale;
    }
}

// Where each key of the partition [begin, end) of `request` lies in the pool (KV head 0), read through the block
// table once, into `offsets`. The keys before `view` (weight 0 in every row) are not read: they take the view's
// first key's offset, so the blocks a windowed layer released (its table's null entries) are never touched.
const int64_t* key_offsets(const Problem& pr, int64_t request, int64_t begin, int64_t end, int64_t view,
                           int64_t* offsets) {
  const int64_t bs = pr.block_size, seen = std::max(begin, view), *table = pr.tables + request * pr.max_blocks;
  for (int64_t t = seen, block = seen / bs, offset = seen % bs; t < end; ++t) {
    offsets[t - begin] = (table[block] * bs + offset) * pr.kv_heads * pr.dim;
    if (++offset == bs) offset = 0, ++block;
  }
  std::fill(offsets, offsets + (seen - begin), offsets[seen - begin]);
  std::fill(offsets + (end - begin), offsets + round_up(end - begin, kLanes), offsets[0]);  // valid, discarded
  return offsets;
}

// Ask for the K and V rows of `n` keys (at k + offsets[i], v + offsets[i]) into L2, while the L1 is busy with the
// tile before them: the blocks are scattered, so the hardware cannot guess them, but the table can.
template <typename T>
void prefetch_keys(const T* k, const T* v, const int64_t* offsets, int64_t n, int64_t dim) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < dim; d += 64 / sizeof(T)) {
      __builtin_prefetch(k + offsets[i] + d, 0, 2);
      __builtin_prefetch(v + offsets[i] + d, 0, 2);
    }
}

// Attend the item's rows over the keys of partition `part`, each row cut at its own position, leaving per query
// vector the unnormalised accumulator, max and sum in `s` (rows that end before the partition are left alone).
template <int kDim, typename T>
void attend(const Problem& pr, const Item& item, int64_t part, Scratch& s) {
  const int64_t dim = kDim > 0 ? kDim : pr.dim, group = pr.group, vecs = s.vecs;
  const int64_t rows = item.row_end - item.row_begin;
  const int64_t first_pos = pr.first_position(item.request) + item.row_begin;  // the item's first row's position
  const int64_t begin = part * kPartition, end = std::min(begin + kPartition, first_pos + rows);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.m.begin(), s.m.end(), kNegInf);
  std::fill(s.l.begin(), s.l.end(), 0.0f);

  const int64_t view = pr.view_start(first_pos);  // the item's earliest view: its first row's
  const int64_t* offsets = key_offsets(pr, item.request, begin, end, view, s.offsets.data());

  // Keys per slice of the first and last pass: one KV head's rows of them fill half the L1 (32 KiB on most x86).
  const int64_t sub = std::clamp<int64_t>(16384 / (dim * sizeof(T)) / kLanes * kLanes, kLanes, kTile);
  // Tiles before the first row's view (the earliest of the item's) hold no key any row attends to.
  const int64_t first_tile = begin + std::max<int64_t>(0, view - begin) / kTile * kTile;
  for (int64_t t = first_tile; t < end; t += kTile) {
    const int64_t n = std::min(kTile, end - t), next = std::min(kTile, end - t - n);
    const int64_t* tile = offsets + (t - begin);
    const int64_t live = std::clamp<int64_t>(t - first_pos, 0, rows);  // rows before it ended before this tile
    for (int64_t h = item.kv_begin; h < item.kv_end; ++h) {
      const T *k = static_cast<const T*>(pr.k) + h * dim, *v = static_cast<const T*>(pr.v) + h * dim;
      prefetch_keys(k, v, tile + n, next, dim);  // the next tile's, while this one is used
      // Three passes over the live query vectors x (kM at a time, from x0) -- all dot products, all softmax
      // updates, all accumulates -- the first and last a slice of `sub` keys at a time, so that slice's K (or
      // V) rows stay in L1 while every vector uses them. Slicing the keys changes no vector's operations.
      const int64_t x_begin = live * group, x_end = rows * group;
      const auto keys = [&](int64_t x) {  // vector x's keys in this tile: its row's (>= 1), or 0 for padding
        return x < x_end ? std::min(first_pos + x / group + 1 - t, n) : 0;
      };
      const auto skip = [&](int64_t x) {  // vector x's keys before its row's window, in this tile (0 without one)
        return std::clamp<int64_t>(pr.view_start(first_pos + x / group) - t, 0, n);
      };
      const auto width = [&](int64_t x0) { return keys(std::min(x0 + kM, x_end) - 1); };  // the group's widest
      const auto scores = [&](int64_t x) { return s.scores.data() + (x - x_begin) * kTile; };
      const auto at = [&](int64_t x) { return h * vecs + x; };  // x's index into the scratch q, acc, m, l
      for (int64_t i0 = 0; i0 < n; i0 += sub)
        for (int64_t x0 = x_begin; x0 < x_end; x0 += kM)
          if (width(x0) > i0)
            qk_scores<kDim>(scores(x0) + i0, s.partial.data(), s.q.data() + at(x0) * dim, k, tile + i0,
                            std::min(width(x0) - i0, sub), dim);
      for (int64_t x0 = x_begin; x0 < x_end; x0 += kM)
        for (int64_t x = x0; x < x0 + kM; ++x) {
          if (keys(x) > skip(x))
            softmax_update(scores(x), skip(x), keys(x), width(x0), s.m[at(x)], s.l[at(x)], s.acc.data() + at(x) * dim,
                           dim);
          else
            std::fill(scores(x), scores(x) + width(x0), 0.0f);
        }
      for (int64_t i0 = 0; i0 < n; i0 += sub)
        for (int64_t x0 = x_begin; x0 < x_end; x0 += kM)
          if (width(x0) > i0)
            accumulate<kDim>(s.acc.data() + at(x0) * dim, scores(x0) + i0, v, tile + i0,
                             std::min(width(x0) - i0, sub), dim);
    }
  }
}

// The items of a call, biggest first, and the slots of the lone rows whose partitions are items of their own
// (a long decode: its partitions are all the parallel work it has).
std::vector<Item> plan(const Problem& pr, int64_t batch, Partials& partials) {
  std::vector<Item> items;
  partials.first.assign(pr.query_loc[batch], -1);
  int64_t slots = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first_pos = pr.first_position(b);
    const auto keys_in = [&](int64_t r0, int64_t r1, int64_t part) {  // keys rows [r0, r1) attend in `part`
      int64_t keys = 0;
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t lo = std::max(pr.view_start(first_pos + i), part * kPartition);
        keys += std::clamp<int64_t>(std::min(first_pos + i + 1, (part + 1) * kPartition) - lo, 0, kPartition);
      }
      return keys;
    };
    for (int64_t r0 = pr.query_loc[b]; r0 < pr.query_loc[b + 1]; r0 += kRows) {
      const int64_t r1 = std::min(r0 + kRows, pr.query_loc[b + 1]), parts = (first_pos + r1 - 1) / kPartition + 1;
      const int64_t first_part = pr.first_partition(first_pos + r0);  // the item's first row's: the earliest
      if (r1 - r0 == 1) {  // a lone row: an item per KV head (and per partition, when it has several)
        if (parts - first_part > 1) partials.first[r0] = slots, slots += parts - first_part;
        for (int64_t h = 0; h < pr.kv_heads; ++h)
          for (int64_t part = first_part; part < parts; ++part)
            items.push_back({b, r0, r1, part, part + 1, h, h + 1, keys_in(r0, r1, part) / pr.kv_heads});
      } else {
        int64_t work = 0;
        for (int64_t part = first_part; part < parts; ++part) work += keys_in(r0, r1, part);
        items.push_back({b, r0, r1, first_part, parts, 0, pr.kv_heads, work});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });
  partials.acc.resize(slots * pr.q_heads * pr.dim);
  partials.m.resize(slots * pr.q_heads);
  partials.l.resize(slots * pr.q_heads);
  return items;
}

// The lone rows' partitions (kept in `partials` by `run`), merged in ascending order into `out`.
void merge_lone_rows(const Problem& pr, int64_t batch, const Partials& partials, float* out) {
  const int64_t dim = pr.dim, heads = pr.q_heads;
  const int64_t total_rows = pr.query_loc[batch];
  at::parallel_for(0, partials.m.empty() ? 0 : total_rows * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> O(dim);
    float M = 0.0f, L = 0.0f;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t i = rh / heads, head = rh % heads, first = partials.first[i];
      if (first < 0) continue;
      const int64_t request = std::upper_bound(pr.query_loc, pr.query_loc + batch + 1, i) - pr.query_loc - 1;
      const int64_t position = pr.first_position(request) + i;
      const int64_t parts = position / kPartition + 1 - pr.first_partition(position);
      for (int64_t part = 0; part < parts; ++part) {  // counted from the row's first partition
        const int64_t slot = (first + part) * heads + head;
        merge_partition(part == 0, partials.m[slot], partials.l[slot], partials.acc.data() + slot * dim, M, L,
                        O.data(), dim);
      }
      normalise(O.data(), L, out + rh * dim, dim);
    }
  });
}

template <int kDim, typename T>
void run(const Problem& pr, int64_t batch, float* out) {
  const int64_t dim = pr.dim, heads = pr.q_heads, group = pr.group;
  Partials partials;
  const std::vector<Item> items = plan(pr, batch, partials);
  int64_t work = 0, max_rows = 0;
  for (const Item& it : items) work += it.work, max_rows = std::max(max_rows, it.row_end - it.row_begin);
  const int64_t threads =
      std::clamp<int64_t>(work * heads * dim / kWorkPerThread, 1, std::max(at::get_num_threads(), 1));

  std::atomic<int64_t> next{0};
  const auto num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch s(pr, max_rows);
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1)) {
      const Item& it = items[n];
      const int64_t first_pos = pr.first_position(it.request);
      const bool lone = partials.first[it.row_begin] >= 0;  // one partition of a lone row: kept for later
      load_queries(pr, it, s);
      for (int64_t part = it.part_begin; part < it.part_end; ++part) {
        attend<kDim, T>(pr, it, part, s);
        for (int64_t i = it.row_begin; i < it.row_end; ++i) {
          if (first_pos + i < part * kPartition) continue;  // the row ends before this partition
          const int64_t row_first = pr.first_partition(first_pos + i);
          if (part < row_first) continue;  // the partition ends before the row's window
          for (int64_t head = it.kv_begin * group; head < it.kv_end * group; ++head) {
            const int64_t at = (head / group) * s.vecs + (i - it.row_begin) * group + head % group;
            const float* acc = s.acc.data() + at * dim;
            if (lone) {
              const int64_t slot = (partials.first[i] + part - row_first) * heads + head;
              std::copy(acc, acc + dim, partials.acc.begin() + slot * dim);
              partials.m[slot] = s.m[at], partials.l[slot] = s.l[at];
            } else {
              merge_partition(part == row_first, s.m[at], s.l[at], acc, s.M[at], s.L[at], s.O.data() + at * dim,
                              dim);
            }
          }
        }
      }
      for (int64_t i = it.row_begin; i < it.row_end && !lone; ++i)
        for (int64_t head = it.kv_begin * group; head < it.kv_end * group; ++head) {
          const int64_t at = (head / group) * s.vecs + (i - it.row_begin) * group + head % group;
          normalise(s.O.data() + at * dim, s.L[at], out + (i * heads + head) * dim, dim);
        }
    }
  });

  merge_lone_rows(pr, batch, partials, out);
}

// The head dims the engine's models use get compiled-in loop bounds; any other runs the generic loops.
template <typename T>
void run_for_dim(const Problem& pr, int64_t batch, float* out) {
  switch (pr.dim) {
    case 64: run<64, T>(pr, batch, out); break;
    case 128: run<128, T>(pr, batch, out); break;
    default: run<0, T>(pr, batch, out);
  }
}

// Both pools [num_blocks, block_size, Hkv, D], contiguous, of one dtype: fp32, or fp16 (kv_cache_dtype="float16",
// widened to fp32 as it is read: the arithmetic is the fp32 kernel's on the stored values).
void check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const char* op) {
  const auto dtype = k_pool.scalar_type();
  TORCH_CHECK_VALUE(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                        v_pool.is_contiguous() && v_pool.scalar_type() == dtype &&
                        (dtype == at::kFloat || dtype == at::kHalf),
                    op, ": pools must be contiguous fp32 or fp16 (both the same) [num_blocks, block_size, Hkv, D]");
}

// dst[0, n) = src[0, n), rounded to the pool's dtype (fp16: to nearest, ties to even, as torch's .half()).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t window) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
                    "q must be fp32 [T, Hq, D], contiguous within each row");
  check_pools(k_pool, v_pool, "paged_attention");
  TORCH_CHECK_VALUE(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0,
                    "q [T, Hq, D] needs the pool's D and Hq a multiple of its Hkv");
  TORCH_CHECK_VALUE(window >= 0, "paged_attention: window must be >= 0 (0: none), got ", window);
  const int64_t batch = seq_lens.numel();
  const auto is_index = [](const at::Tensor& t, int64_t dims, int64_t rows) {
    return t.dim() == dims && t.scalar_type() == at::kLong && t.is_contiguous() && t.size(0) == rows;
  };
  TORCH_CHECK_VALUE(is_index(seq_lens, 1, batch) && is_index(block_tables, 2, batch) &&
                        is_index(query_start_loc, 1, batch + 1),
                    "need contiguous int64 seq_lens [B], block_tables [B, max_blocks] and query_start_loc [B + 1]");
  const int64_t rows = q.size(0), bs = k_pool.size(1), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[batch] == rows, "query_start_loc must run from 0 to q's ", rows,
                    " rows, got ", qsl[0], " ... ", qsl[batch]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 1 && lens[b] <= max_blocks * bs, "seq_lens[", b, "] = ", lens[b],
                      " must lie in [1, max_blocks * block_size = ", max_blocks * bs, "]");
    TORCH_CHECK_VALUE(qsl[b + 1] - qsl[b] >= 1 && qsl[b + 1] - qsl[b] <= lens[b], "request ", b, " has ",
                      qsl[b + 1] - qsl[b], " rows by query_start_loc, but needs 1 <= rows <= seq_lens[", b,
                      "] = ", lens[b]);
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK_VALUE(block >= 0 && block < k_pool.size(0), "block_tables[", b, ", ", i, "] = ", block,
                        " is outside the pool's ", k_pool.size(0), " blocks");
    }
  }
  const int64_t kv_heads = k_pool.size(2), q_heads = q.size(1), dim = q.size(2);
  auto out = at::empty({rows, q_heads, dim}, q.options());
  if (batch == 0) return out;
  const Problem pr{q.data_ptr<float>(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                   tables, lens, qsl, q_heads, kv_heads, q_heads / kv_heads, dim, bs, max_blocks,
                   static_cast<float>(scale), window};
  if (k_pool.scalar_type() == at::kHalf)
    run_for_dim<_Float16>(pr, batch, out.data_ptr<float>());
  else
    run_for_dim<float>(pr, batch, out.data_ptr<float>());
  return out;
}

// The step's new keys and values into both pools at their slots, in one call: at decode sizes this replaces
// two index_copy_ calls and their range checks, 30 layers a step (~0.4 ms of a 12 ms one-row step in
// torch.profiler: index_copy_, aminmax, item and the Python checks). A slot of -1
// is skipped (that row's K/V already lies in a shared cached block). Every slot is checked before anything is
// written, so a bad one changes nothing. k and v rows may be strided: they are views into the fused qkv output.
void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v) {
  check_pools(k_pool, v_pool, "write_kv");
  const int64_t rows = slot_mapping.numel(), heads = k_pool.size(2), dim = k_pool.size(3);
  const auto is_rows = [&](const at::Tensor& t) {
    return t.dim() == 3 && t.scalar_type() == at::kFloat && t.size(0) == rows && t.size(1) == heads &&
           t.size(2) == dim && t.stride(2) == 1 && t.stride(1) == dim;
  };
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "write_kv: slot_mapping must be a contiguous int64 [T] tensor");
  TORCH_CHECK_VALUE(is_rows(k) && is_rows(v), "write_kv: k and v must be fp32 [", rows, ", ", heads, ", ", dim,
                    "] (heads contiguous within a row) to match the slots and the pool");
  const int64_t num_slots = k_pool.size(0) * k_pool.size(1), width = heads * dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "write_kv: slot_mapping[", t, "] = ", slots[t],
                      " is outside the pool's ", num_slots, " slots (-1 skips a row)");
  const float *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  const auto write = [&](auto* kp, auto* vp) {
    for (int64_t t = 0; t < rows; ++t) {
      if (slots[t] < 0) continue;
      store_row(kp + slots[t] * width, ks + t * k.stride(0), width);
      store_row(vp + slots[t] * width, vs + t * v.stride(0), width);
    }
  };
  if (k_pool.scalar_type() == at::kHalf)
    write(static_cast<_Float16*>(k_pool.data_ptr()), static_cast<_Float16*>(v_pool.data_ptr()));
  else
    write(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
}

// torch.ops.pagedkv.paged_attention: q [T, Hq, D] -> [T, Hq, D], each row causal over its request's context
// (window > 0: over its last `window` keys).
TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("write_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping, Tensor k, Tensor v) -> ()", &write_kv);
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window=0) -> Tensor",
        &paged_attention);
}
