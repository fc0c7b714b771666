// Paged decode attention on the CPU: one query token per sequence attends over its whole
// context, read in place from the engine's paged KV cache (no gather copy).
//
// Cache view: chunks[num_chunks, block_size, num_kv_heads, head_dim], where chunk
// (block * num_layers + layer) * 2 + kv holds one block's K (kv = 0) or V (kv = 1) of one layer
// (see engine/worker/attention.py). `table[b, j]` is the layer-0 K chunk of sequence b's j-th
// block; layer l's K chunk is table[b, j] + 2 * l and its V chunk the one after.
//
// Work is split over sequences with at::parallel_for; each streams its K (then V) chunks block
// by block, every row once for all query heads, with software prefetch two blocks ahead.
// Scores, softmax and the weighted sum run in float32 whatever the cache dtype. The dot products
// and weighted sums run on the instruction-set path current_isa() names (isa.h, simd.h;
// float16 caches on the scalar one).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

// <q, k> over dim values, vector-wide on path P (simd.h), the remainder one by one.
template <typename P, typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  auto acc = P::zero();
  int64_t d = 0;
  for (; d + P::kStep <= dim; d += P::kStep)
    acc = P::template madd<T>(acc, P::load(q + d), P::load(k + d));
  float s = P::hsum(acc);
  for (; d < dim; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// <q, k_i> for the kStep rows k_i = k + i * ld, as one vector (lane i); dim % kStep == 0.
// The kStep accumulators are summed together at the end (P::hsums), not one by one.
template <typename P, typename T>
inline typename P::V dots(const float* q, const T* k, int64_t ld, int64_t dim) {
  typename P::V acc[P::kStep];
  for (int i = 0; i < P::kStep; ++i) acc[i] = P::zero();
  for (int64_t d = 0; d < dim; d += P::kStep) {
    const auto qv = P::load(q + d);
    for (int i = 0; i < P::kStep; ++i)
      acc[i] = P::template madd<T>(acc[i], qv, P::load(k + i * ld + d));
  }
  return P::hsums(acc);
}

// Asks for the `bytes` at p to be brought into cache ahead of use: a block's K (or V) chunk is
// 16 KiB at most 4 KiB pages long, too short for the hardware prefetcher to ramp up, so the
// chunk kAhead blocks on is requested while this one is computed on. Only the first kAhead
// chunks are asked for in one burst (nothing else to do then): a burst of a whole chunk's
// lines fills the core's miss buffers and the prefetch instructions wait for them in turn
// (a third of paged_decode's time on a Zen 3 EPYC with AVX2, `perf annotate`), so later
// chunks are asked for a few lines at a time between the dot products (prefetch_lines).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// The lines first, first + step, ... of the `bytes` at p (null p: none): a pass that reads
// one head's row asks for its share of the same row in the chunk ahead.
inline void prefetch_lines(const void* p, int64_t bytes, int64_t first, int64_t step) {
  if (p == nullptr) return;
  const char* c = static_cast<const char*>(p);
  for (int64_t i = first * 64; i < bytes; i += step * 64) __builtin_prefetch(c + i, 0, 3);
}

constexpr int64_t kAhead = 2;  // blocks prefetched ahead

// s[t] = exp(s[t] - max s) over n scores, kStep lanes at a time (the scalar exp_nonpos on the
// tail; the same polynomial): the compiler left the scalar loop unvectorized.
template <typename P>
inline void softmax_unnormalized(float* s, int64_t n) {
  auto mv = P::set1(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + P::kStep <= n; t += P::kStep) mv = P::max(mv, P::loadf(s + t));
  float m = P::hmax(mv);
  for (; t < n; ++t) m = std::max(m, s[t]);
  const auto mb = P::set1(m);
  for (t = 0; t + P::kStep <= n; t += P::kStep) P::storef(s + t, P::exp(P::sub(P::loadf(s + t), mb)));
  for (; t < n; ++t) s[t] = exp_nonpos(s[t] - m);
}

// The sum of n floats, kStep lanes at a time.
template <typename P>
inline float sum(const float* s, int64_t n) {
  auto acc = P::zero();
  int64_t t = 0;
  for (; t + P::kStep <= n; t += P::kStep) acc = P::add(acc, P::loadf(s + t));
  float total = P::hsum(acc);
  for (; t < n; ++t) total += s[t];
  return total;
}

// o[h, :] = sum_t p[h, t] * v_t (h's kv head) over the n positions: block by block, for each
// (kv head, query head, C vectors of head_dim) the running sums held in registers for the
// block's rows, `acc` ([heads, dim]) between blocks.
template <typename P, typename T>
void weighted_sums(const float* scores, const T* chunks, const int64_t* blocks, int64_t vchunk,
                   int64_t n, int64_t bs, int64_t kv_heads, int64_t group, int64_t dim,
                   float* acc) {
  constexpr int C = 4;
  const int64_t row_elems = kv_heads * dim, chunk_elems = bs * row_elems;
  std::fill(acc, acc + kv_heads * group * dim, 0.f);
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));  // one head's row
  const int64_t passes = group * ((dim + C * P::kStep - 1) / (C * P::kStep));  // per kv head
  for (int64_t t0 = 0, j = 0; t0 < n; t0 += bs, ++j) {
    const T* ahead = t0 + kAhead * bs < n ? chunks + (blocks[j + kAhead] + vchunk) * chunk_elems
                                          : nullptr;
    const T* vc = chunks + (blocks[j] + vchunk) * chunk_elems;
    const int64_t len = std::min(bs, n - t0);
    for (int64_t kh = 0, h = 0; kh < kv_heads; ++kh)
      for (int64_t g = 0, pass = 0; g < group; ++g, ++h) {
        const float* p = scores + h * n + t0;
        float* o = acc + h * dim;
        const T* v = vc + kh * dim;
        const T* va = ahead == nullptr ? nullptr : ahead + kh * dim;
        int64_t d = 0;
        for (; d + C * P::kStep <= dim; d += C * P::kStep, ++pass) {
          typename P::V a[C];
          for (int c = 0; c < C; ++c) a[c] = P::loadf(o + d + c * P::kStep);
          for (int64_t i = 0; i < len; ++i) {
            // this pass's lines of row i of the chunk ahead (each line once over the passes)
            if (va != nullptr) prefetch_lines(va + i * row_elems, row_bytes, pass, passes);
            const auto pv = P::set1(p[i]);
            for (int c = 0; c < C; ++c)
              a[c] = P::template madd<T>(a[c], pv, P::load(v + i * row_elems + d + c * P::kStep));
          }
          for (int c = 0; c < C; ++c) P::storef(o + d + c * P::kStep, a[c]);
        }
        for (; d < dim; ++d)
          for (int64_t i = 0; i < len; ++i) o[d] += p[i] * static_cast<float>(v[i * row_elems + d]);
        if (g == group - 1 && va != nullptr)  // the lines no vector pass asked for
          for (int64_t rest = pass; rest < passes; ++rest)
            for (int64_t i = 0; i < bs; ++i)
              prefetch_lines(va + i * row_elems, row_bytes, rest, passes);
      }
  }
}

// Sequences [begin, end): each reads its blocks' K (then V) chunks front to back, every row
// whole (all kv heads), so the memory is streamed; `heads` query heads, `group` per kv head.
// Scores go kStep positions at a time (dots) where head_dim is a multiple of kStep.
template <typename P, typename T>
void decode_seqs(float* out, const float* q, const T* chunks, const int64_t* table,
                 const int64_t* rows, const int64_t* ctx_lens, int64_t begin, int64_t end,
                 int64_t max_blocks, int64_t layer, int64_t bs, int64_t kv_heads,
                 int64_t group, int64_t dim, float scale) {
  const int64_t heads = kv_heads * group;
  const int64_t row_elems = kv_heads * dim;  // one position's K (or V) in a chunk
  const int64_t chunk_elems = bs * row_elems;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));  // one head's row
  const bool wide = dim % P::kStep == 0;
  const auto sv = P::set1(scale);
  std::vector<float> scores;  // [heads, n]
  std::vector<float> acc(heads * dim);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n = ctx_lens[b];
    const int64_t* blocks = table + b * max_blocks;
    const float* qb = q + rows[b] * heads * dim;
    scores.resize(heads * n);
    for (int64_t j = 0; j < kAhead && j * bs < n; ++j)
      prefetch(chunks + (blocks[j] + 2 * layer) * chunk_elems, chunk_elems * sizeof(T));
    // Scores: s[h, t] = scale * <q_h, k_t of h's kv head>.
    for (int64_t t0 = 0, j = 0; t0 < n; t0 += bs, ++j) {
      const T* ahead = t0 + kAhead * bs < n
                           ? chunks + (blocks[j + kAhead] + 2 * layer) * chunk_elems : nullptr;
      const T* kc = chunks + (blocks[j] + 2 * layer) * chunk_elems;
      const int64_t len = std::min(bs, n - t0);
      for (int64_t kh = 0, h = 0; kh < kv_heads; ++kh)
        for (int64_t g = 0; g < group; ++g, ++h) {
          const float* qh = qb + h * dim;
          float* sh = scores.data() + h * n + t0;
          const T* k = kc + kh * dim;
          // query head g of the group asks for lines g, g + group, ... of each row of its kv
          // head in the chunk ahead; the last one for every row, also those past len
          const T* ka = ahead == nullptr ? nullptr : ahead + kh * dim;
          int64_t i = 0;
          if (wide)
            for (; i + P::kStep <= len; i += P::kStep) {
              for (int r = 0; r < P::kStep && ka != nullptr; ++r)
                prefetch_lines(ka + (i + r) * row_elems, row_bytes, g, group);
              P::storef(sh + i, P::template madd<float>(
                                    P::zero(), sv, dots<P>(qh, k + i * row_elems, row_elems, dim)));
            }
          for (int64_t r = i; r < bs && ka != nullptr; ++r)
            prefetch_lines(ka + r * row_elems, row_bytes, g, group);
          for (; i < len; ++i) sh[i] = dot<P>(qh, k + i * row_elems, dim) * scale;
        }
    }
    // The V chunks of the first blocks are asked for while the softmax runs.
    for (int64_t j = 0; j < kAhead && j * bs < n; ++j)
      prefetch(chunks + (blocks[j] + 2 * layer + 1) * chunk_elems, chunk_elems * sizeof(T));
    for (int64_t h = 0; h < heads; ++h) softmax_unnormalized<P>(scores.data() + h * n, n);
    weighted_sums<P, T>(scores.data(), chunks, blocks, 2 * layer + 1, n, bs, kv_heads, group,
                        dim, acc.data());
    float* o = out + rows[b] * heads * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float inv = 1.f / sum<P>(scores.data() + h * n, n);
      for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = acc[h * dim + d] * inv;
    }
  }
}

// decode_seqs on the best path current_isa() allows for T (float32 and bf16 caches have vector
// paths; other dtypes the scalar one).
template <typename T, typename... A>
void decode_on_path(A... args) {
  constexpr bool wide = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (wide)
    if (current_isa() >= Isa::kAvx512) return decode_seqs<Avx512, T>(args...);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (wide)
    if (current_isa() >= Isa::kAvx2) return decode_seqs<Avx2, T>(args...);
#endif
  decode_seqs<Scalar, T>(args...);
}

}  // namespace

// out, q: float32 [T, H, D] (out is written only at `rows`); chunks: [N, bs, KV, D];
// table: int64 [B, max_blocks]; rows, ctx_lens: int64 [B].
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor chunks, torch::Tensor table,
                  torch::Tensor rows, torch::Tensor ctx_lens, int64_t layer, double scale) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat && q.scalar_type() == torch::kFloat,
              "paged_decode: q and out must be float32");
  TORCH_CHECK(out.is_contiguous() && q.is_contiguous() && chunks.is_contiguous() &&
                  table.is_contiguous() && rows.is_contiguous() && ctx_lens.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(q.dim() == 3 && chunks.dim() == 4 && table.dim() == 2, "paged_decode: bad ranks");
  TORCH_CHECK(table.scalar_type() == torch::kLong && rows.scalar_type() == torch::kLong &&
                  ctx_lens.scalar_type() == torch::kLong,
              "paged_decode: table, rows and ctx_lens must be int64");
  const int64_t batch = table.size(0);
  const int64_t bs = chunks.size(1), kv_heads = chunks.size(2), dim = chunks.size(3);
  const int64_t heads = q.size(1);
  TORCH_CHECK(q.size(2) == dim && heads % kv_heads == 0, "paged_decode: head shapes differ");
  TORCH_CHECK(rows.size(0) == batch && ctx_lens.size(0) == batch, "paged_decode: batch sizes");
  const int64_t group = heads / kv_heads, max_blocks = table.size(1);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, chunks.scalar_type(), "paged_decode",
                                  [&] {
    const scalar_t* c = chunks.data_ptr<scalar_t>();
    float* o = out.data_ptr<float>();
    const float* qp = q.data_ptr<float>();
    const int64_t* tb = table.data_ptr<int64_t>();
    const int64_t* rw = rows.data_ptr<int64_t>();
    const int64_t* cl = ctx_lens.data_ptr<int64_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      decode_on_path<scalar_t>(o, qp, c, tb, rw, cl, begin, end, max_blocks, layer, bs,
                               kv_heads, group, dim, s);
    });
  });
}

// Writes one step's K and V at their cache slots: rows[slots[i] + offset] = k[i] and
// rows[slots[i] + offset + bs] = v[i] (the V chunk follows the K chunk by bs rows). rows: the
// cache as [N, KV * D]; k, v: [T, KV * D] of the cache's dtype, unit column stride (any row
// stride: views of the fused q|k|v matmul output do); slots: int64 [T]. One call per layer
// instead of four torch ops (two cats, an add, an index_copy_).
void write_kv(torch::Tensor rows, torch::Tensor slots, int64_t offset, int64_t bs,
              torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(rows.scalar_type() == k.scalar_type() && rows.scalar_type() == v.scalar_type(),
              "write_kv: k and v must have the cache's dtype");
  TORCH_CHECK(rows.is_contiguous() && slots.is_contiguous() && slots.scalar_type() == torch::kLong,
              "write_kv: contiguous cache and int64 slots");
  const int64_t t = slots.size(0), width = rows.size(1), n = rows.size(0);
  TORCH_CHECK(k.dim() == 2 && v.dim() == 2 && k.size(0) == t && v.size(0) == t &&
                  k.size(1) == width && v.size(1) == width && k.stride(1) == 1 &&
                  v.stride(1) == 1,
              "write_kv: k and v must be [T, KV * D] with unit column stride");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t item = rows.element_size(), bytes = width * item;
  auto* dst = static_cast<char*>(rows.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t i = 0; i < t; ++i) {
    const int64_t r = sl[i] + offset;
    TORCH_CHECK(r >= 0 && r + bs < n, "write_kv: slot out of range");
    std::memcpy(dst + r * bytes, ks + i * k.stride(0) * item, bytes);
    std::memcpy(dst + (r + bs) * bytes, vs + i * v.stride(0) * item, bytes);
  }
}
