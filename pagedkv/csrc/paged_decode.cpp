// Paged decode attention that reads K/V straight from the pool through the block table: no gather copy.
//
// A work item is one request's context, or a partition of it, walked through the block table in tiles of up
// to 64 tokens (a tile may span blocks; the next tile's rows are prefetched, as the hardware cannot guess
// scattered blocks but the table can). For every KV head, the G query heads sharing it (GQA) read the tile's
// K/V rows of that head; each keeps an online softmax (running max m, running sum l) and accumulates p * V.
// An item handles all heads of its tokens, so it reads each block's K/V -- one contiguous stretch of the
// pool -- front to back. Items run on torch's intra-op threads and pull work from an atomic counter, longest
// first; long contexts are cut into partitions when the batch alone cannot keep the threads busy, and the
// partial results are merged with log-sum-exp (vLLM's paged attention v2 idea). Pools and queries are fp32,
// as the engine keeps them (bf16 attention measured several times slower on CPU).
//
// Only the headers it needs (not torch/extension.h): the first build takes a third of the time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "simd.h"

namespace {

using namespace pagedkv::simd;

constexpr int64_t kRegs = 8;             // vectors of q or of the accumulator held in registers at once
constexpr int64_t kTile = 64;            // tokens per softmax update
constexpr int64_t kMinPartition = 256;   // shorter partitions cost more to merge than they gain
constexpr int64_t kItemsPerThread = 8;   // enough items per thread for the dynamic schedule to balance
// Work (tokens x query heads x head dim) worth waking another thread for, ~100 us on one core. Below it the
// step runs on the calling thread: a second thread would save tens of microseconds on an idle machine,
// but waiting for it to be scheduled costs milliseconds when the cores are busy.
constexpr int64_t kWorkPerThread = int64_t{1} << 20;

// {hsum(v[0]), ..., hsum(v[7])} as a transpose-and-add tree: 7 adds for 8 sums instead of 7 per sum.
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
  for (int j = 0; j < 8; ++j) out[j] = hsum(v[j]);
  return out;
#endif
}

struct Problem {
  const float* q;  // [batch, q_heads, dim]
  const float* k;  // pools [num_blocks, block_size, kv_heads, dim]
  const float* v;
  const int64_t* tables;  // [batch, max_blocks]
  const std::vector<int64_t>& lens;
  int64_t q_heads, kv_heads, group, dim, block_size, max_blocks;
  float scale;
};

struct Item {
  int64_t request, begin, end, slot;  // slot: where a partition's partial result goes, -1 if unsplit
};

// One worker's state for one item: scaled queries, per query head accumulator, max and sum, and per tile
// the pool offsets of its tokens (this tile's and the next one's), its K/V rows and its scores.
struct Scratch {
  std::vector<float> q, acc, m, l, scores;
  std::vector<int64_t> offsets, next_offsets;
  std::vector<const float*> k_rows, v_rows;
  std::vector<Vec> partial;
  Scratch(int64_t heads, int64_t dim)
      : q(heads * dim), acc(heads * dim), m(heads), l(heads), scores(kTile), offsets(kTile), next_offsets(kTile),
        k_rows(kTile), v_rows(kTile), partial(kTile) {}
};

// scores[i] = q . k[i][0, dim) for i < n. The query stays in registers, kRegs vectors at a time, and each
// token's partial sums stay a vector until one shared transpose-add at the end.
template <int kDim>
void qk_scores(float* scores, Vec* partial, const float* q, const float* const* k, int64_t n,
               int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim, vec_end = dim / kLanes * kLanes;
  if (vec_end == 0) std::fill(partial, partial + (n + kLanes - 1) / kLanes * kLanes, Vec{});
  for (int64_t c0 = 0; c0 < vec_end; c0 += kRegs * kLanes) {
    const int64_t width = std::min(kRegs * kLanes, vec_end - c0);
    Vec qv[kRegs];
    for (int64_t c = 0; c < width; c += kLanes) qv[c / kLanes] = load(q + c0 + c);
    for (int64_t i = 0; i < n; ++i) {
      const float* k_row = k[i] + c0;
      Vec a = {}, b = {};
      int64_t c = 0;
      for (; c + 2 * kLanes <= width; c += 2 * kLanes) {
        a += qv[c / kLanes] * load(k_row + c);
        b += qv[c / kLanes + 1] * load(k_row + c + kLanes);
      }
      if (c < width) a += qv[c / kLanes] * load(k_row + c);
      partial[i] = c0 == 0 ? a + b : partial[i] + (a + b);
    }
  }
  for (int64_t i = 0; i < n; i += kLanes) store(scores + i, hsum8(partial + i));
  for (int64_t d = vec_end; d < dim; ++d)
    for (int64_t i = 0; i < n; ++i) scores[i] += q[d] * k[i][d];
}

// acc[0, dim) += sum_i p[i] * v[i][0, dim), kRegs accumulator vectors in registers at a time.
template <int kDim>
void accumulate(float* acc, const float* p, const float* const* v, int64_t n, int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim, vec_end = dim / kLanes * kLanes;
  for (int64_t c0 = 0; c0 < vec_end; c0 += kRegs * kLanes) {
    const int64_t width = std::min(kRegs * kLanes, vec_end - c0);
    Vec a[kRegs];
    for (int64_t c = 0; c < width; c += kLanes) a[c / kLanes] = load(acc + c0 + c);
    for (int64_t i = 0; i < n; ++i) {
      const Vec pi = splat(p[i]);
      for (int64_t c = 0; c < width; c += kLanes) a[c / kLanes] += pi * load(v[i] + c0 + c);
    }
    for (int64_t c = 0; c < width; c += kLanes) store(acc + c0 + c, a[c / kLanes]);
  }
  for (int64_t d = vec_end; d < dim; ++d)
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * v[i][d];
}

// Fold tile scores s[0, n) into one query head's online softmax: s becomes p = exp(s - m_new), the sum and
// accumulator are rescaled when the max grows. Lanes [n, next multiple of 8) of s are scratch.
inline void softmax_update(float* s, int64_t n, float& m, float& l, float* acc, int64_t dim) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  std::fill(s + n, s + padded, -std::numeric_limits<float>::infinity());
  Vec max = splat(m);
  for (int64_t i = 0; i < padded; i += kLanes) {
    const Vec x = load(s + i);
    max = x > max ? x : max;
  }
  float m_new = max[0];
  for (int j = 1; j < kLanes; ++j) m_new = std::max(m_new, max[j]);
  for (int64_t i = 0; i < padded; i += kLanes) store(s + i, vexp(load(s + i) - m_new));
  std::fill(s + n, s + padded, 0.0f);
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

// Attend all query heads of item.request over tokens [item.begin, item.end), leaving the unnormalised
// accumulators, maxima and sums in `s`. kDim > 0 fixes the head dim at compile time. A tile spans blocks
// (up to kTile tokens), so the per-tile softmax work is amortised over more tokens than one block holds.
template <int kDim>
void attend(const Problem& pr, const Item& item, Scratch& s) {
  const int64_t dim = kDim > 0 ? kDim : pr.dim, bs = pr.block_size;
  const int64_t row = pr.kv_heads * dim;  // pool elements per token
  const float* q = pr.q + item.request * pr.q_heads * dim;
  for (int64_t i = 0; i < pr.q_heads * dim; ++i) s.q[i] = q[i] * pr.scale;
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.0f);
  const int64_t* table = pr.tables + item.request * pr.max_blocks;
  const auto tile_offsets = [&](int64_t t, int64_t* out) {
    const int64_t n = std::min(kTile, item.end - t);
    int64_t block = t / bs, offset = t % bs;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = (table[block] * bs + offset) * row;
      if (++offset == bs) offset = 0, ++block;
    }
    return n;
  };
  int64_t n = tile_offsets(item.begin, s.offsets.data());
  for (int64_t t = item.begin; t < item.end;) {
    const int64_t n_next = t + n < item.end ? tile_offsets(t + n, s.next_offsets.data()) : 0;
    for (int64_t h = 0; h < pr.kv_heads; ++h) {
      // While this head's rows are used, ask for the next tile's: its blocks are scattered, so the hardware
      // prefetcher cannot guess them, but the block table can.
      for (int64_t i = 0; i < n_next; ++i)
        for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) {
          __builtin_prefetch(pr.k + s.next_offsets[i] + h * dim + d);
          __builtin_prefetch(pr.v + s.next_offsets[i] + h * dim + d);
        }
      for (int64_t i = 0; i < n; ++i) {
        s.k_rows[i] = pr.k + s.offsets[i] + h * dim;
        s.v_rows[i] = pr.v + s.offsets[i] + h * dim;
      }
      for (int64_t head = h * pr.group; head < (h + 1) * pr.group; ++head) {
        float* acc = s.acc.data() + head * dim;
        qk_scores<kDim>(s.scores.data(), s.partial.data(), s.q.data() + head * dim, s.k_rows.data(), n, dim);
        softmax_update(s.scores.data(), n, s.m[head], s.l[head], acc, dim);
        accumulate<kDim>(acc, s.scores.data(), s.v_rows.data(), n, dim);
      }
    }
    std::swap(s.offsets, s.next_offsets);
    t += n;
    n = n_next;
  }
}

// Partition length: contexts are cut only when there are several threads to share the work out.
int64_t choose_partition(int64_t total_tokens, int64_t threads, int64_t block_size, int64_t requested) {
  int64_t size = requested;
  if (size <= 0) {
    const int64_t items = kItemsPerThread * threads;
    size = threads > 1 ? std::max((total_tokens + items - 1) / items, kMinPartition) : total_tokens;
  }
  return (size + block_size - 1) / block_size * block_size;
}

template <int kDim>
void run(const Problem& pr, int64_t partition, int64_t threads, float* out) {
  const int64_t dim = pr.dim, heads = pr.q_heads, batch = static_cast<int64_t>(pr.lens.size());
  std::vector<Item> items;
  std::vector<int64_t> first_slot(batch + 1, 0);  // partitions of request b: slots [first_slot[b], [b + 1])
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t parts = (pr.lens[b] + partition - 1) / partition;
    first_slot[b + 1] = first_slot[b] + (parts > 1 ? parts : 0);
    for (int64_t p = 0; p < parts; ++p)
      items.push_back({b, p * partition, std::min(pr.lens[b], (p + 1) * partition),
                       parts > 1 ? first_slot[b] + p : -1});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.begin > b.end - b.begin; });
  std::vector<float> part_acc(first_slot[batch] * heads * dim), part_m(first_slot[batch] * heads),
      part_l(first_slot[batch] * heads);

  std::atomic<int64_t> next{0};
  const auto num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch s(heads, dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      attend<kDim>(pr, it, s);
      if (it.slot >= 0) {
        std::copy(s.acc.begin(), s.acc.end(), part_acc.begin() + it.slot * heads * dim);
        std::copy(s.m.begin(), s.m.end(), part_m.begin() + it.slot * heads);
        std::copy(s.l.begin(), s.l.end(), part_l.begin() + it.slot * heads);
        continue;
      }
      for (int64_t head = 0; head < heads; ++head)
        for (int64_t d = 0; d < dim; ++d)
          out[(it.request * heads + head) * dim + d] = s.acc[head * dim + d] / s.l[head];
    }
  });

  // Merge partitions: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, with M the largest m_p.
  at::parallel_for(0, first_slot[batch] > 0 ? batch * heads : 0, 256, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, head = bh % heads, lo = first_slot[b], hi = first_slot[b + 1];
      if (lo == hi) continue;
      float m_max = -std::numeric_limits<float>::infinity(), total = 0.0f;
      for (int64_t p = lo; p < hi; ++p) m_max = std::max(m_max, part_m[p * heads + head]);
      float* o = out + bh * dim;
      std::fill(o, o + dim, 0.0f);
      for (int64_t p = lo; p < hi; ++p) {
        const float w = std::exp(part_m[p * heads + head] - m_max);
        total += w * part_l[p * heads + head];
        const float* acc = part_acc.data() + (p * heads + head) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] += w * acc[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= total;
    }
  });
}

void dispatch_dim(const Problem& pr, int64_t partition_tokens, float* out) {
  const int64_t tokens = std::accumulate(pr.lens.begin(), pr.lens.end(), int64_t{0});
  const int64_t threads = std::clamp<int64_t>(tokens * pr.q_heads * pr.dim / kWorkPerThread, 1,
                                              std::max(at::get_num_threads(), 1));
  const int64_t partition = choose_partition(tokens, threads, pr.block_size, partition_tokens);
  switch (pr.dim) {
    case 64: return run<64>(pr, partition, threads, out);
    case 128: return run<128>(pr, partition, threads, out);
    default: return run<0>(pr, partition, threads, out);
  }
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t partition_tokens) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
                    "q must be contiguous fp32 [B, Hq, D]");
  TORCH_CHECK_VALUE(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                        v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat &&
                        v_pool.scalar_type() == at::kFloat,
                    "pools must be contiguous fp32 [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK_VALUE(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0,
                    "q [B, Hq, D] needs the pool's D and Hq a multiple of its Hkv");
  const auto is_index = [&](const at::Tensor& t, int64_t dims) {
    return t.dim() == dims && t.scalar_type() == at::kLong && t.is_contiguous() && t.size(0) == q.size(0);
  };
  TORCH_CHECK_VALUE(is_index(block_tables, 2) && is_index(seq_lens, 1),
                    "block_tables must be contiguous int64 [B, max_blocks], seq_lens contiguous int64 [B]");
  const int64_t batch = q.size(0), bs = k_pool.size(1), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const std::vector<int64_t> lens(seq_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>() + batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 1 && lens[b] <= max_blocks * bs, "seq_lens[", b, "] = ", lens[b],
                      " must lie in [1, max_blocks * block_size = ", max_blocks * bs, "]");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK_VALUE(block >= 0 && block < k_pool.size(0), "block_tables[", b, ", ", i, "] = ", block,
                        " is outside the pool's ", k_pool.size(0), " blocks");
    }
  }
  auto out = at::empty_like(q);
  if (batch == 0) return out;
  const int64_t kv_heads = k_pool.size(2), q_heads = q.size(1), dim = q.size(2);
  const Problem pr{q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables, lens,
                   q_heads, kv_heads, q_heads / kv_heads, dim, bs, max_blocks, static_cast<float>(scale)};
  dispatch_dim(pr, partition_tokens, out.data_ptr<float>());
  return out;
}

// torch.ops.pagedkv.paged_decode: q [B, Hq, D] -> [B, Hq, D]; partition_tokens <= 0 picks the context
// partition size from the thread count.
TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
        "float scale, int partition_tokens) -> Tensor",
        &paged_decode);
}
