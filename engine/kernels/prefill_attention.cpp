// Causal prefill attention on the CPU, flash style: T query tokens at positions start ..
// start + T - 1 attend over keys 0 .. start + T - 1 (a fresh prefill has start = 0; a later
// chunk or a prefix-cache hit passes the whole context's K/V).
//
// Work items are (kv head, query block) pairs, split over threads by at::parallel_for. A query
// block is kBlockQ(group) positions x the `group` query heads sharing the kv head (GQA), packed
// as one matrix of rows (position, head), so every K/V tile is loaded once for
// all of them. Keys go by tiles of kBlockK: S = Q K^T into a tile (register-blocked: R rows x
// C vectors of keys per inner loop, K transposed once per kv head so keys lie along the
// vectors), then an online softmax per row (running max m and sum l; the output rows already
// summed are rescaled by e^(m_old - m_new)), then O += P V (R rows x C vectors of head_dim).
// Tiles entirely above the diagonal are never computed; in the diagonal tiles each row stops
// at its own position. Scores are scaled after Q K^T (float32: inside the exp's FMA; bf16: a
// pass of its own, SDPA's order); bf16 inputs' softmax weights are rounded to bf16 before P V
// (as torch's SDPA does). Everything accumulates in float32 whatever the input dtype; the
// products run on the path current_isa() names (isa.h, simd.h): FMA on float32 (FloatTiles;
// float32 q and V in place, other dtypes converted), or vdpbf16ps on bf16 pairs for bf16 on
// avx512_bf16 (Bf16Tiles, 1.6x the float32 path's speed).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

// Keys per tile (a multiple of every path's C * kStep): 128 for float32 and float16 inputs;
// 512 for bf16 inputs, the key blocks of torch's CPU flash attention (SDPA, which transformers
// calls): the softmax weights are rounded to bf16 relative to the running max of the keys seen
// so far, so only the same blocks round them as SDPA does (with 128-key tiles the bf16
// outputs differed from SDPA's by up to ~7 ulps).
constexpr int64_t kFloatKeys = 128, kBf16Keys = 512;

// Softmax weights P V may read past a row's last key: its R-row group sees up to R - 1
// positions more (one more for the bf16 pairs). They are zeroed, so it reads 0.
constexpr int64_t kPad = 32;

// Query positions per block: about 96 packed rows whatever the group size (64-128 keys x
// 48-96 rows measured within 10% of each other at 1024 tokens, this the fastest).
int64_t block_q(int64_t group) { return std::max<int64_t>(8, 96 / group); }

// Register blocking per path: R rows x C vectors of accumulators (AVX-512 has 32 registers,
// AVX2 16).
template <typename P>
struct Blocking {
  static constexpr int R = 4, C = 4;
};
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
struct Blocking<Avx512> {
  static constexpr int R = 6, C = 4;
};
static_assert(Blocking<Avx512>::R < kPad);
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <>
struct Blocking<Avx2> {  // 12 accumulators, 2 vectors of K or V, 1 broadcast: 15 of 16
  static constexpr int R = 6, C = 2;  // 1.09x 4 x 2 (1024 tokens, bench-llama, 1 thread)
};
#endif

// s[r, c*kStep ..] = sum_d q[r][d] * kt[d, c*kStep ..] for R rows and C vectors of keys.
template <typename P, int R, int C>
inline void qk_tile(const float* const* q, int64_t dim, const float* kt, int64_t ldk, float* s,
                    int64_t lds) {
  typename P::V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = P::zero();
  for (int64_t d = 0; d < dim; ++d) {
    typename P::V k[C];
    for (int c = 0; c < C; ++c) k[c] = P::loadf(kt + d * ldk + c * P::kStep);
    for (int r = 0; r < R; ++r) {
      const auto qv = P::set1(q[r][d]);
      for (int c = 0; c < C; ++c) acc[r][c] = P::template madd<float>(acc[r][c], qv, k[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) P::storef(s + r * lds + c * P::kStep, acc[r][c]);
}

// o[r][d + c*kStep ..] = alpha[r] * o[r][..] + sum_j p[r, j] * v[j, c*kStep ..] over n keys.
template <typename P, int R, int C>
inline void pv_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n,
                    const float* alpha, float* const* o, int64_t d) {
  typename P::V acc[R][C];
  for (int r = 0; r < R; ++r) {
    const auto a = P::set1(alpha[r]);
    for (int c = 0; c < C; ++c)
      acc[r][c] = P::template madd<float>(P::zero(), a, P::loadf(o[r] + d + c * P::kStep));
  }
  for (int64_t j = 0; j < n; ++j) {
    typename P::V x[C];
    for (int c = 0; c < C; ++c) x[c] = P::loadf(v + j * ldv + c * P::kStep);
    for (int r = 0; r < R; ++r) {
      const auto pv = P::set1(p[r * ldp + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = P::template madd<float>(acc[r][c], pv, x[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) P::storef(o[r] + d + c * P::kStep, acc[r][c]);
}

// Operand layouts. FloatTiles (every path): q rows of dim values, K by tiles [dim][kBlockK]
// (keys along the vectors), V [keys] rows of dim values (ldv apart), all float32, products by
// FMA. float32 inputs are read where they lie (q, V) and written where they go (O); only K is
// packed. Other input dtypes are converted: q per query block, V once per call.
template <typename P, int64_t KB>
struct FloatTiles {
  using E = float;
  static constexpr int64_t kBlockK = KB;
  static constexpr bool kBf16Weights = false;  // P V takes the softmax weights as float32
  // Keys jj .. jj + n - 1 of a tile (n <= 16, rows ldk apart), d-major: each pass over d
  // reads the same n rows (in L1) and writes n consecutive values.
  template <typename T>
  static void pack_k(E* tile, int64_t jj, const T* kr, int64_t ldk, int64_t n, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t i = 0; i < n; ++i)
        tile[d * kBlockK + jj + i] = static_cast<float>(kr[i * ldk + d]);
  }
  template <typename T>
  static void pack_v(E* vh, int64_t j, const T* vr, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) vh[j * dim + d] = static_cast<float>(vr[d]);
  }
  template <int R, int C>
  static void qk(const E* const* q, int64_t dim, const E* ktile, int64_t c0, float* s,
                 int64_t lds) {
    qk_tile<P, R, C>(q, dim, ktile + c0, kBlockK, s + c0, lds);
  }
  template <int R, int C>
  static void pv(const float* p, const bf16*, int64_t ldp, const E* v, int64_t ldv, int64_t k0,
                 int64_t d, int64_t n, const float* alpha, float* const* o) {
    pv_tile<P, R, C>(p, ldp, v + k0 * ldv + d, ldv, n, alpha, o, d);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// Bf16Tiles (bf16 inputs on the avx512_bf16 path): the same products by vdpbf16ps, two bf16
// pairs per fp32 lane (exact products, fp32 sums): q rows [rows, dim] (pairs along d), K by
// tiles [dim / 2][kBlockK][2], V [keys / 2][dim][2] (pairs along the keys), the softmax
// weights rounded to bf16 pairs (as torch's SDPA rounds them) before P V.
struct Bf16Tiles {
  using E = bf16;
  static constexpr int64_t kBlockK = kBf16Keys;
  static constexpr bool kBf16Weights = true;
  // 16 softmax weights rounded to bf16 by one vcvtneps2bf16: nearest even, as c10 (and
  // simd's store_bf16) round, but for denormals (below e^-87 of the row's max), which go to 0;
  // store_bf16's integer rounding here made the kernel slower (116-152 vs 158-161 GFLOP/s,
  // 1024 tokens, 1 thread, three alternating runs).
  static void store_weights(bf16* dst, __m512 e) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(e));
  }
  static __m512bh pair(const bf16* p) {  // p[0], p[1] in every lane
    int32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
  }
  template <typename T>
  static void pack_k(E* tile, int64_t jj, const T* kr, int64_t ldk, int64_t n, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t i = 0; i < n; ++i)
        tile[((d / 2) * kBlockK + jj + i) * 2 + d % 2] = kr[i * ldk + d];
  }
  template <typename T>
  static void pack_v(E* vh, int64_t j, const T* vr, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) vh[((j / 2) * dim + d) * 2 + j % 2] = vr[d];
  }
  template <int R, int C>
  static void qk(const E* const* q, int64_t dim, const E* ktile, int64_t c0, float* s,
                 int64_t lds) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim / 2; ++i) {
      __m512bh k[C];
      for (int c = 0; c < C; ++c)
        k[c] = (__m512bh)_mm512_loadu_si512(ktile + (i * kBlockK + c0 + c * 16) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = pair(q[r] + 2 * i);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, k[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * lds + c0 + c * 16, acc[r][c]);
  }
  template <int R, int C>
  static void pv(const float*, const bf16* p, int64_t ldp, const E* vh, int64_t dim, int64_t k0,
                 int64_t d, int64_t n, const float* alpha, float* const* o) {  // dim: V's ld
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o[r] + d + c * 16));
    for (int64_t j = 0; j < n; j += 2) {  // past n: weight 0 (and zero-padded V)
      __m512bh x[C];
      for (int c = 0; c < C; ++c)
        x[c] = (__m512bh)_mm512_loadu_si512(vh + (((k0 + j) / 2) * dim + d + c * 16) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh pv = pair(p + r * ldp + j);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, x[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o[r] + d + c * 16, acc[r][c]);
  }
};
#endif

// Calls f(std::integral_constant<int, n>{}) for n in 1 .. N (the rows left after whole
// groups of R), nothing for n = 0.
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 0) {
    if (n == N) return f(std::integral_constant<int, N>{});
    with_rows<N - 1>(n, f);
  }
}

// One query block of one kv head: q[r] its rows' queries, o[r] where their outputs go (dim
// float32 values each), kt the kv head's K tiles, v its V (rows ldv apart), in the layouts of
// Tiles; s the score tile (float32), pb its bf16 copy (Bf16Tiles only).
template <typename P, typename Tiles>
void query_block(const typename Tiles::E* const* q, int64_t rows, int64_t group,
                 int64_t first_pos, int64_t dim, const typename Tiles::E* kt,
                 const typename Tiles::E* v, int64_t ldv, float scale, float* s, bf16* pb,
                 float* const* o, float* m, float* l, float* alpha, bool round_p) {
  constexpr int R = Blocking<P>::R, C = Blocking<P>::C;
  constexpr int64_t kBlockK = Tiles::kBlockK;
  constexpr int64_t kw = C * P::kStep;  // keys (QK) or head_dim values (PV) per tile column
  for (int64_t r = 0; r < rows; ++r) std::fill(o[r], o[r] + dim, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  const int64_t keys = first_pos + (rows - 1) / group + 1;  // the last row's position + 1
  for (int64_t k0 = 0; k0 < keys; k0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, keys - k0);
    const auto* ktile = kt + k0 * dim;  // tile k0 / kBlockK, each dim * kBlockK values
    // Rows r .. r + n - 1 need keys up to the last one's position: later columns are skipped.
    auto seen = [&](int64_t r, int64_t n) {
      return std::min(nk, first_pos + (r + n - 1) / group - k0 + 1);
    };
    auto qk = [&](auto n, int64_t r) {
      constexpr int N = decltype(n)::value;
      const int64_t cols = seen(r, N);
      int64_t c = 0;
      for (; c + kw <= cols; c += kw)
        Tiles::template qk<N, C>(q + r, dim, ktile, c, s + r * kBlockK, kBlockK);
      // The diagonal tile's last columns: only the vectors of keys these rows see.
      with_rows<C>((cols - c + P::kStep - 1) / P::kStep, [&](auto vecs) {
        Tiles::template qk<N, decltype(vecs)::value>(q + r, dim, ktile, c, s + r * kBlockK,
                                                     kBlockK);
      });
    };
    int64_t r = 0;
    for (; r + R <= rows; r += R) qk(std::integral_constant<int, R>{}, r);
    with_rows<R - 1>(rows - r, [&](auto n) { qk(n, r); });
    // Online softmax: row r (position first_pos + r / group) sees keys up to its position;
    // the keys past it (diagonal tiles) are set to -inf before and to 0 after the exp. P V
    // reads a row's weights up to the last key its R-row group sees, under kPad past its own.
    for (r = 0; r < rows; ++r) {
      float* sr = s + r * kBlockK;
      bf16* pr = pb + r * kBlockK;
      const int64_t valid = std::min(nk, first_pos + r / group - k0 + 1);
      const int64_t tail = std::min(kBlockK, std::max<int64_t>(valid, 0) + kPad);
      if (valid <= 0) {
        alpha[r] = 1.f;
        if constexpr (Tiles::kBf16Weights) std::fill(pr, pr + tail, bf16(0.f));
        else std::fill(sr, sr + tail, 0.f);
        continue;
      }
      const int64_t cols = (valid + P::kStep - 1) / P::kStep * P::kStep;
      std::fill(sr + valid, sr + cols, -std::numeric_limits<float>::infinity());
      // The max of the raw scores (scale > 0 keeps it the max, and rounding s * scale keeps
      // the order: the same max as SDPA's of the scaled scores). Keys past the row's
      // position: -inf, then e^-87 (~1e-38, nothing to a sum that holds e^0 = 1 or what
      // earlier tiles gave), then 0 for P V.
      // Four running maxima: with one, each vector waits for the last max (AVX2 1.015x).
      const auto ninf = P::set1(-std::numeric_limits<float>::infinity());
      typename P::V mv4[4] = {ninf, ninf, ninf, ninf};
      int64_t jm = 0;
      for (; jm + 4 * P::kStep <= cols; jm += 4 * P::kStep)
        for (int u = 0; u < 4; ++u) mv4[u] = P::max(mv4[u], P::loadf(sr + jm + u * P::kStep));
      for (; jm < cols; jm += P::kStep) mv4[0] = P::max(mv4[0], P::loadf(sr + jm));
      const auto mv = P::max(P::max(mv4[0], mv4[1]), P::max(mv4[2], mv4[3]));
      const float mx = std::max(m[r], P::hmax(mv) * scale);
      const auto sv = P::set1(scale), neg = P::set1(-mx);
      auto sum = P::zero();
      if (!Tiles::kBf16Weights && !round_p) {
        // float32: e^(s * scale - m) by one FMA, stored, and summed.
        for (int64_t j = 0; j < cols; j += P::kStep) {
          const auto e = P::exp(P::template madd<float>(neg, P::loadf(sr + j), sv));
          P::storef(sr + j, e);
          sum = P::add(sum, e);
        }
        std::fill(sr + valid, sr + tail, 0.f);
      } else {
        // bf16 inputs: SDPA's order and roundings: s * scale rounded, minus the running max,
        // the exp summed in float32, the weights rounded to bf16 (nearest even) for P V.
        for (int64_t j = 0; j < cols; j += P::kStep) {
          const auto e = P::exp(P::add(P::mul(P::loadf(sr + j), sv), neg));
          sum = P::add(sum, e);
          if constexpr (Tiles::kBf16Weights) Tiles::store_weights(pr + j, e);
          else P::storef(sr + j, P::round_bf16(e));
        }
        if constexpr (Tiles::kBf16Weights) std::fill(pr + valid, pr + tail, bf16(0.f));
        else std::fill(sr + valid, sr + tail, 0.f);
      }
      alpha[r] = exp_nonpos(m[r] - mx);  // 0 on the first tile (m = -inf)
      l[r] = l[r] * alpha[r] + P::hsum(sum);
      m[r] = mx;
    }
    for (int64_t d = 0; d < dim; d += kw) {
      auto pv = [&](auto n, int64_t r) {
        constexpr int N = decltype(n)::value;
        const int64_t n_keys = std::max<int64_t>(0, seen(r, N));
        if (d + kw <= dim)
          Tiles::template pv<N, C>(s + r * kBlockK, pb + r * kBlockK, kBlockK, v, ldv, k0, d,
                                   n_keys, alpha + r, o + r);
        else  // head_dim not a multiple of kw: the rest vector by vector
          for (int64_t e = d; e < dim; e += P::kStep)
            Tiles::template pv<N, 1>(s + r * kBlockK, pb + r * kBlockK, kBlockK, v, ldv, k0, e,
                                     n_keys, alpha + r, o + r);
      };
      for (r = 0; r + R <= rows; r += R) pv(std::integral_constant<int, R>{}, r);
      with_rows<R - 1>(rows - r, [&](auto n) { pv(n, r); });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < dim; ++d) o[r][d] *= inv;
  }
}

template <typename P, typename Tiles, typename T>
void prefill(float* out, const T* q, const T* k, const T* v, int64_t ldq, int64_t ldk,
             int64_t ldv, int64_t tokens, int64_t keys, int64_t heads, int64_t kv_heads,
             int64_t dim, float scale) {
  using E = typename Tiles::E;
  constexpr int64_t kBlockK = Tiles::kBlockK;
  // Inputs already in the layout's element type are read in place (q and, with float32
  // tiles, V); others are converted (q per query block, V once).
  constexpr bool kInPlace = std::is_same_v<T, E>;
  constexpr bool kVInPlace = kInPlace && !Tiles::kBf16Weights;
  const int64_t group = heads / kv_heads, start = keys - tokens;
  const int64_t bq = block_q(group), blocks = (tokens + bq - 1) / bq;
  const int64_t padded = (keys + kBlockK - 1) / kBlockK * kBlockK;
  // Per kv head: K by tiles of kBlockK keys (zero-padded) and, unless read in place, V
  // (zero-padded), in Tiles' layouts.
  std::vector<E> kt(kv_heads * padded * dim, E(0.f));
  std::vector<E> vp(kVInPlace ? 0 : kv_heads * padded * dim, E(0.f));
  at::parallel_for(0, kv_heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t kh = b; kh < e; ++kh)
      for (int64_t j = 0; j < keys; j += 16) {  // 16 keys at a time, within one tile
        E* tile = kt.data() + kh * padded * dim + (j / kBlockK) * dim * kBlockK;
        Tiles::pack_k(tile, j % kBlockK, k + j * ldk + kh * dim, ldk,
                      std::min<int64_t>(16, keys - j), dim);
        if constexpr (!kVInPlace)
          for (int64_t i = j; i < std::min<int64_t>(j + 16, keys); ++i)
            Tiles::pack_v(vp.data() + kh * padded * dim, i, v + i * ldv + kh * dim, dim);
      }
  });
  // Items (kv head, block): kv head fastest, blocks paired long with short (0, last, 1, ...),
  // cut into one contiguous run per thread of about equal work (rows x keys seen).
  const int64_t items = kv_heads * blocks;
  auto block_of = [&](int64_t item) {
    const int64_t i = item / kv_heads;
    return i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
  };
  const int64_t runs = std::min<int64_t>(at::get_num_threads(), items);
  std::vector<int64_t> cut(runs + 1, items);
  {
    std::vector<double> done(items + 1, 0.0);
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t0 = block_of(item) * bq, nt = std::min(bq, tokens - t0);
      done[item + 1] = done[item] + static_cast<double>(nt) * (start + t0 + (nt + 1) / 2);
    }
    cut[0] = 0;
    for (int64_t k = 1, item = 0; k < runs; ++k) {
      while (item < items && done[item] < done[items] * k / runs) ++item;
      cut[k] = item;
    }
  }
  at::parallel_for(0, runs, 1, [&](int64_t rb, int64_t re) {
    const FlushDenormals flush;  // simd.h: a peaked softmax's tiny weights cost assists
    const int64_t rows_max = bq * group;
    std::vector<E> qp(kInPlace ? 0 : rows_max * dim);
    std::vector<const E*> qrows(rows_max);
    std::vector<float*> orows(rows_max);
    std::vector<float> s(rows_max * kBlockK), m(rows_max), l(rows_max), alpha(rows_max);
    std::vector<bf16> pb(Tiles::kBf16Weights ? rows_max * kBlockK : 0);
    for (int64_t item = cut[rb]; item < cut[re]; ++item) {
      const int64_t kh = item % kv_heads, blk = block_of(item);
      const int64_t t0 = blk * bq, nt = std::min(bq, tokens - t0), rows = nt * group;
      // Row (t, g): query head kh * group + g of token t0 + t.
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = t * group + g, h = kh * group + g;
          const T* src = q + (t0 + t) * ldq + h * dim;
          if constexpr (kInPlace) {
            qrows[r] = src;
          } else {
            std::copy(src, src + dim, qp.data() + r * dim);  // converted to E
            qrows[r] = qp.data() + r * dim;
          }
          orows[r] = out + ((t0 + t) * heads + h) * dim;
        }
      const E* vh = kVInPlace ? reinterpret_cast<const E*>(v) + kh * dim
                              : vp.data() + kh * padded * dim;
      query_block<P, Tiles>(qrows.data(), rows, group, start + t0, dim,
                            kt.data() + kh * padded * dim, vh, kVInPlace ? ldv : dim, scale,
                            s.data(), pb.data(), orows.data(), m.data(), l.data(), alpha.data(),
                            std::is_same_v<T, bf16>);
    }
  });
}

// prefill on the best path current_isa() allows (any input dtype: the kernel computes on
// float32 copies, or, unless bf16_pairs is false, bf16 pairs for bf16 on avx512_bf16), a
// vector one when head_dim is a multiple of its width.
template <typename T, typename... A>
void prefill_on_path(bool bf16_pairs, int64_t dim, A... args) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>)
    if (bf16_pairs && current_isa() >= Isa::kAvx512Bf16 && dim % Avx512::kStep == 0)
      return prefill<Avx512, Bf16Tiles, T>(args...);
#else
  (void)bf16_pairs;
#endif
  constexpr int64_t kb = std::is_same_v<T, bf16> ? kBf16Keys : kFloatKeys;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (current_isa() >= Isa::kAvx512 && dim % Avx512::kStep == 0)
    return prefill<Avx512, FloatTiles<Avx512, kb>, T>(args...);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (current_isa() >= Isa::kAvx2 && dim % Avx2::kStep == 0)
    return prefill<Avx2, FloatTiles<Avx2, kb>, T>(args...);
#endif
  prefill<Scalar, FloatTiles<Scalar, kb>, T>(args...);
}

}  // namespace

// out: float32 [T, H, D] contiguous; q: [T, H, D]; k, v: [S, KV, D] with S >= T, q, k, v of
// one dtype, each with contiguous heads (any row stride: views of the fused q|k|v matmul
// output do). Query i sits at position S - T + i and sees keys 0 .. S - T + i. bf16_pairs:
// bf16 inputs on the avx512_bf16 path take vdpbf16ps (else float32 FMA tiles, as on avx512:
// faster on a core whose vdpbf16ps runs at half its FMAs' rate; engine/kernels/linear.py
// measures which).
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       double scale, bool bf16_pairs) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat, "prefill_attention: out must be float32");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "prefill_attention: q, k and v must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes(),
              "prefill_attention: bad shapes");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t keys = k.size(0), kv_heads = k.size(1);
  auto heads_contiguous = [&](const torch::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == dim;
  };
  TORCH_CHECK(out.is_contiguous() && heads_contiguous(q) && heads_contiguous(k) &&
                  heads_contiguous(v),
              "prefill_attention: out contiguous, q, k, v with contiguous heads");
  TORCH_CHECK(k.size(2) == dim && heads % kv_heads == 0 && keys >= tokens,
              "prefill_attention: head shapes differ or fewer keys than queries");
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention",
                                  [&] {
    prefill_on_path<scalar_t>(bf16_pairs, dim, out.data_ptr<float>(), q.data_ptr<scalar_t>(),
                              k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), q.stride(0),
                              k.stride(0), v.stride(0), tokens, keys, heads, kv_heads, dim, s);
  });
}
