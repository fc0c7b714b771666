// Paged decode attention on the CPU: one query token per sequence attends over its whole
// context, read in place from the engine's paged KV cache (no gather copy).
//
// Cache view: chunks[num_chunks, block_size, num_kv_heads, head_dim], where chunk
// (block * num_layers + layer) * 2 + kv holds one block's K (kv = 0) or V (kv = 1) of one layer
// (see engine/worker/attention.py). `table[b, j]` is the layer-0 K chunk of sequence b's j-th
// block; layer l's K chunk is table[b, j] + 2 * l and its V chunk the one after.
//
// Work is split over (sequence, kv head) pairs with at::parallel_for; each pair handles the
// `group` query heads that share the kv head, so every K/V row is loaded once for all of them.
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

// a += p * v over dim values.
template <typename P, typename T>
inline void axpy(float p, const T* v, float* a, int64_t dim) {
  const auto pv = P::set1(p);
  int64_t d = 0;
  for (; d + P::kStep <= dim; d += P::kStep)
    P::storef(a + d, P::template madd<T>(P::loadf(a + d), pv, P::load(v + d)));
  for (; d < dim; ++d) a[d] += p * static_cast<float>(v[d]);
}

// Sequences [begin, end): each reads its blocks' K (then V) chunks front to back, every row
// whole (all kv heads), so the memory is streamed; `heads` query heads, `group` per kv head.
template <typename P, typename T>
void decode_seqs(float* out, const float* q, const T* chunks, const int64_t* table,
                 const int64_t* rows, const int64_t* ctx_lens, int64_t begin, int64_t end,
                 int64_t max_blocks, int64_t layer, int64_t bs, int64_t kv_heads,
                 int64_t group, int64_t dim, float scale) {
  const int64_t heads = kv_heads * group;
  const int64_t row_elems = kv_heads * dim;  // one position's K (or V) in a chunk
  const int64_t chunk_elems = bs * row_elems;
  std::vector<float> scores;  // [heads, n]
  std::vector<float> acc(heads * dim);
  std::vector<float> denom(heads);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n = ctx_lens[b];
    const int64_t* blocks = table + b * max_blocks;
    const float* qb = q + rows[b] * heads * dim;
    scores.resize(heads * n);
    // Scores: s[h, t] = scale * <q_h, k_t of h's kv head>.
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
      const T* kc = chunks + (blocks[t0 / bs] + 2 * layer) * chunk_elems;
      const int64_t len = std::min(bs, n - t0);
      for (int64_t i = 0; i < len; ++i) {
        const T* k = kc + i * row_elems;
        for (int64_t kh = 0, h = 0; kh < kv_heads; ++kh)
          for (int64_t g = 0; g < group; ++g, ++h)
            scores[h * n + t0 + i] = dot<P>(qb + h * dim, k + kh * dim, dim) * scale;
      }
    }
    // Softmax per query head.
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores.data() + h * n;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) s[t] = exp_nonpos(s[t] - m);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += s[t];
      denom[h] = sum;
    }
    // Weighted sum of V rows.
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
      const T* vc = chunks + (blocks[t0 / bs] + 2 * layer + 1) * chunk_elems;
      const int64_t len = std::min(bs, n - t0);
      for (int64_t i = 0; i < len; ++i) {
        const T* v = vc + i * row_elems;
        for (int64_t kh = 0, h = 0; kh < kv_heads; ++kh) {
          const T* vh = v + kh * dim;
          for (int64_t g = 0; g < group; ++g, ++h) {
            axpy<P>(scores[h * n + t0 + i], vh, acc.data() + h * dim, dim);
          }
        }
      }
    }
    float* o = out + rows[b] * heads * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float inv = 1.f / denom[h];
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
