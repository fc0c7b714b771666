// Paged decode attention on the CPU: one query token per sequence attends over its whole
// context, read in place from the engine's paged KV cache (no gather copy).
//
// Cache view: chunks[num_chunks, block_size, num_kv_heads, head_dim], where chunk
// (block * num_layers + layer) * 2 + kv holds one block's K (kv = 0) or V (kv = 1) of one layer
// (see engine/runner/attention.py). `table[b, j]` is the layer-0 K chunk of sequence b's j-th
// block; layer l's K chunk is table[b, j] + 2 * l and its V chunk the one after, so one
// block's K and V of a layer are one contiguous range.
//
// One pass over the KV, flash style: each block's K and V range is read once, front to back,
// for all query heads at once (the `group` query heads of a kv head share its rows: GQA; with
// bf16 rows two heads of a group share each vector's load and widening, kPairs), and
// folded into a running softmax per head (max m, sum l, the weighted sum rescaled by
// e^(m_old - m_new) when the max grows). The memory is asked for kLeadBytes ahead of the
// work, a line or a few per step of it (a vector of a score's dot product, a row of the
// weighted sum), in the order the work reads it: the run's K and V chunks one after the
// other, into the next sequence at a sequence's end (Ahead). So it streams at the rate the
// work consumes it: the hardware prefetcher does not follow the per-head column order a chunk
// is read in (nor cross its 4 KiB pages), and a burst of prefetches stalls on the core's miss
// buffers (asked for 32 lines at a time once a head instead, fp32 read 0.89-0.94x and bf16
// 0.84-0.90x the KV a second on a Zen 5 EPYC at 1 thread, batch 8-32 x 1024).
//
// Work items are runs of at most kPartPositions context positions of one sequence: a longer
// context is cut into several (computed apart, then combined), so one long sequence (batch 1)
// still spreads over the threads. The cut depends only on the sequence's length, never on the
// batch or the thread count, and so does its result. The items are cut into one contiguous run
// per thread of about equal work (positions read). Scores, softmax and the weighted sum run in
// float32 whatever the cache dtype (bf16 rows widened in registers); the products run on the
// instruction-set path current_isa() names (isa.h, simd.h; float16 caches on the scalar one).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

constexpr int64_t kPartPositions = 512;  // context positions per work item at most
// Prefetch distance: the fewest whole chunks (K or V of a block) of at least this. On a Zen 5
// EPYC (1 thread, batch 8-32 x 1024, paged_decode alone) 16 KiB took fp32 KV reads from
// 0.49-0.54 of a streaming read to 0.67-0.78 and bf16 from 0.49-0.67 to 0.58-0.83; 8 KiB
// (bf16: one chunk) or 32 KiB (fp32: two) were slower by 4-22 %. Distances from 32 KiB up
// let lines be evicted again before their turn came (the old two whole blocks, 64 KiB).
// With the prefetches spread over every step of the work (Ahead below), bf16 gained from a
// third chunk (24 KiB: 1.04-1.13x against 16 KiB at 1 thread), and fp32 read 0.79-0.80x with
// a second one (32 KiB).
template <typename T>
constexpr int64_t kLeadBytes = std::is_same_v<T, bf16> ? 24 << 10 : 16 << 10;

// Prefetches two ranges of `bytes`, one after the other, a few lines per step(): start()
// spreads the first range's lines over `steps1` steps; second() asks for whatever the first
// has left and spreads the second's lines over `steps2` steps; finish() asks for whatever is
// left (a block shorter than bs takes fewer steps). Hint T0 (every level): a line is read
// within a chunk or two of its prefetch; NTA on AMD CPUs (kAmdCpu, isa.h).
// step() runs in the kernel's innermost loops, so it does no more than its lines: the switch
// to the second range is the caller's (second(), between a block's scores and its softmax).
// With that switch tested in every step, the AVX2 path read 0.59-0.93x the KV a second of
// prefetching once a head, and fp32 over KV in L2 0.80-0.82x (Zen 5 EPYC). The loops that
// step it (dots, dots2, weigh_v) take it by a pointer that may be null (no prefetching) and
// are always inlined into the block's loop: left to itself, GCC called them out of line
// after unrelated one-line changes, and fp32 at batch 8-32 then read 0.85-0.92x the KV a
// second, bf16 at batch 1 0.85-0.87x.
class Ahead {
 public:
  void start(const void* first, const void* second, int64_t bytes, int64_t steps1,
             int64_t steps2) {
    next_ = static_cast<const char*>(second);
    bytes_ = bytes;
    per2_ = per(steps2);
    set(static_cast<const char*>(first), per(steps1));
  }
  void second() {
    finish();
    set(next_, per2_);
    next_ = nullptr;
  }
  void step() {
    const char* stop = std::min(p_ + per_, end_);
    for (; p_ < stop; p_ += 64) __builtin_prefetch(p_, 0, kLocality);
  }
  void finish() {
    for (; p_ < end_; p_ += 64) __builtin_prefetch(p_, 0, kLocality);
  }

 private:
  static constexpr int kLocality = kAmdCpu ? 0 : 3;  // NTA on AMD (isa.h), else T0

  void set(const char* p, int64_t per) {
    p_ = p;
    end_ = p == nullptr ? p : p + bytes_;
    per_ = p == nullptr ? 0 : per;
  }
  int64_t per(int64_t steps) const {  // bytes a step of `steps` asks for
    steps = std::max<int64_t>(steps, 1);
    return 64 * (((bytes_ + 63) / 64 + steps - 1) / steps);
  }

  const char* p_ = nullptr;
  const char* end_ = nullptr;
  const char* next_ = nullptr;
  int64_t per_ = 0, per2_ = 0, bytes_ = 0;
};

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
// The kStep accumulators are summed together at the end (P::hsums), not one by one. One
// ahead.step() a vector of dim.
template <typename P, typename T>
[[gnu::always_inline]] inline typename P::V dots(const float* q, const T* k, int64_t ld,
                                                  int64_t dim, Ahead* ahead) {
  typename P::V acc[P::kStep];
  for (int i = 0; i < P::kStep; ++i) acc[i] = P::zero();
  for (int64_t d = 0; d < dim; d += P::kStep) {
    if (ahead != nullptr) ahead->step();
    const auto qv = P::load(q + d);
    for (int i = 0; i < P::kStep; ++i)
      acc[i] = P::template madd<T>(acc[i], qv, P::load(k + i * ld + d));
  }
  return P::hsums(acc);
}

// dots for two query heads q and q + dim over kStep / 2 rows: lane i < kStep / 2 is <q, k_i>,
// lane kStep / 2 + i is <q + dim, k_i> (each lane's sum in the order dots sums it, so the same
// bits); each K vector is loaded once for both. kStep >= 2, dim % kStep == 0. One
// ahead.step() a vector of dim.
template <typename P, typename T>
[[gnu::always_inline]] inline typename P::V dots2(const float* q, const T* k, int64_t ld,
                                                   int64_t dim, Ahead* ahead) {
  constexpr int H = P::kStep / 2;
  typename P::V acc[P::kStep];
  for (int i = 0; i < P::kStep; ++i) acc[i] = P::zero();
  for (int64_t d = 0; d < dim; d += P::kStep) {
    if (ahead != nullptr) ahead->step();
    const auto qa = P::load(q + d), qb = P::load(q + dim + d);
    for (int i = 0; i < H; ++i) {
      const auto kv = P::load(k + i * ld + d);
      acc[i] = P::template madd<T>(acc[i], qa, kv);
      acc[H + i] = P::template madd<T>(acc[H + i], qb, kv);
    }
  }
  return P::hsums(acc);
}

// One work item: blocks [j0, j1) of sequence b.
struct Item {
  int64_t b, j0, j1;
};

// A thread's run of items over one layer. State per item: the running max m and sum l of each
// query head and its weighted sum acc ([heads, dim]).
template <typename P, typename T>
class Decoder {
 public:
  Decoder(const T* chunks, const int64_t* table, int64_t max_blocks, int64_t layer, int64_t bs,
          int64_t kv_heads, int64_t group, int64_t dim, float scale)
      : chunks_(chunks), table_(table), max_blocks_(max_blocks), layer_(layer), bs_(bs),
        kv_heads_(kv_heads), group_(group), dim_(dim), heads_(kv_heads * group),
        row_(kv_heads * dim), chunk_(bs * kv_heads * dim), scale_(scale),
        s_(heads_ * bs), m_(heads_), l_(heads_), acc_(heads_ * dim),
        span_(span()), score_steps_(score_steps()), v_steps_(v_steps()) {}

  // Items [begin, end) of `items`; item i's normalized output goes to outs[i] ([heads, dim],
  // row stride ld) and, where ml is given, its m and l to ml[i * 2 * heads ...].
  void run(const Item* items, int64_t begin, int64_t end, const float* const* qs,
           float* const* outs, int64_t ld, float* ml) {
    if (begin >= end) return;
    // The run's chunks in the order the work reads them (K and V of each block, block after
    // block; null past the run's end): the one `lead` chunks on is prefetched during each.
    int64_t ai = begin, aj = items[begin].j0, kv = 0;
    auto next_chunk = [&]() -> const T* {
      if (ai >= end) return nullptr;
      const T* p = kchunk(items[ai].b, aj) + kv * chunk_;
      if (++kv == 2) {
        kv = 0;
        if (++aj == items[ai].j1 && ++ai < end) aj = items[ai].j0;
      }
      return p;
    };
    const int64_t bytes = chunk_ * static_cast<int64_t>(sizeof(T));
    const int64_t lead = std::clamp<int64_t>((kLeadBytes<T> + bytes - 1) / bytes, 1, 4);
    for (int64_t c = 0; c < lead; ++c) {  // the run's first chunks: nothing to hide behind
      Ahead first;
      first.start(next_chunk(), nullptr, bytes, 1, 1);
      first.finish();
    }
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t n = std::min(item.j1 * bs_, ctx_len_of(item));
      std::fill(m_.begin(), m_.end(), -std::numeric_limits<float>::infinity());
      std::fill(l_.begin(), l_.end(), 0.f);
      std::fill(acc_.begin(), acc_.end(), 0.f);
      for (int64_t j = item.j0; j < item.j1; ++j) {
        Ahead ahead;  // one chunk during the scores, the next during the weighted sum
        const T* k1 = next_chunk();  // the two in this order
        ahead.start(k1, next_chunk(), bytes, score_steps_, v_steps_);
        block(qs[it], kchunk(item.b, j), std::min(bs_, n - j * bs_), ahead);
        ahead.finish();
      }
      float* o = outs[it];
      for (int64_t h = 0; h < heads_; ++h) {
        const float inv = 1.f / l_[h];
        for (int64_t d = 0; d < dim_; ++d) o[h * ld + d] = acc_[h * dim_ + d] * inv;
        if (ml != nullptr) {
          ml[it * 2 * heads_ + h] = m_[h];
          ml[it * 2 * heads_ + heads_ + h] = l_[h];
        }
      }
    }
  }

  void set_ctx_lens(const int64_t* ctx_lens) { ctx_lens_ = ctx_lens; }

 private:
  int64_t ctx_len_of(const Item& item) const { return ctx_lens_[item.b]; }

  const T* kchunk(int64_t b, int64_t j) const {
    return chunks_ + (table_[b * max_blocks_ + j] + 2 * layer_) * chunk_;
  }

  // Folds one block's len rows (K chunk k, its V chunk right after) into m, l and acc.
  void block(const float* q, const T* k, int64_t len, Ahead& ahead) {
    const T* v = k + chunk_;
    float* s = s_.data();
    const bool wide = dim_ % P::kStep == 0;
    const auto sv = P::set1(scale_);
    // Scores s[h, i] = scale * <q_h, k_i of h's kv head>, kStep rows at a time; two heads of
    // a group at once where kPairs (each K vector loaded and widened once for both).
    for (int64_t i0 = 0; i0 < len; i0 += P::kStep)
      for (int64_t kh = 0, h = 0; kh < kv_heads_; ++kh) {
        const T* kr = k + i0 * row_ + kh * dim_;
        int64_t g = 0;
        if (kPairs && wide && i0 + P::kStep <= len)
          for (; g + 2 <= group_; g += 2, h += 2) {
            float* sh = s + h * bs_ + i0;
            for (int64_t half = 0; half < 2; ++half) {  // kStep / 2 rows of both heads
              alignas(64) float both[P::kStep];
              const T* rows = kr + half * kHalfStep * row_;
              P::storef(both, P::mul(sv, dots2<P>(q + h * dim_, rows, row_, dim_, &ahead)));
              std::copy(both, both + kHalfStep, sh + half * kHalfStep);
              std::copy(both + kHalfStep, both + P::kStep, sh + bs_ + half * kHalfStep);
            }
          }
        for (; g < group_; ++g, ++h) {
          const float* qh = q + h * dim_;
          float* sh = s + h * bs_;
          if (wide && i0 + P::kStep <= len)
            P::storef(sh + i0, P::mul(sv, dots<P>(qh, kr, row_, dim_, &ahead)));
          else
            for (int64_t i = i0; i < std::min(len, i0 + P::kStep); ++i)
              sh[i] = dot<P>(qh, kr + (i - i0) * row_, dim_) * scale_;
        }
      }
    ahead.second();
    // Running softmax: s[h, :] becomes e^(s - m_new); acc and l are rescaled when m grows.
    for (int64_t h = 0; h < heads_; ++h) {
      float* sh = s + h * bs_;
      auto mv = P::set1(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + P::kStep <= len; i += P::kStep) mv = P::max(mv, P::loadf(sh + i));
      float mb = P::hmax(mv);
      for (; i < len; ++i) mb = std::max(mb, sh[i]);
      const float m = std::max(m_[h], mb);
      const auto mvb = P::set1(m);
      auto sum = P::zero();
      for (i = 0; i + P::kStep <= len; i += P::kStep) {
        const auto e = P::exp(P::sub(P::loadf(sh + i), mvb));
        P::storef(sh + i, e);
        sum = P::add(sum, e);
      }
      float total = P::hsum(sum);
      for (; i < len; ++i) total += (sh[i] = exp_nonpos(sh[i] - m));
      if (m > m_[h]) {
        const float alpha = l_[h] == 0.f ? 0.f : exp_nonpos(m_[h] - m);
        l_[h] *= alpha;
        float* o = acc_.data() + h * dim_;
        for (int64_t d = 0; d < dim_; ++d) o[d] *= alpha;
        m_[h] = m;
      }
      l_[h] += total;
    }
    // acc[h, :] += sum_i s[h, i] * v_i of h's kv head: span_ kv heads a pass where span_
    // (weigh_span), else two heads of a group at a time where kPairs: each V vector loaded and
    // widened once for both.
    if constexpr (kSpans) {
      if (span_ == 2 && group_ == 2) return weigh_span<2, 2, 4>(s, v, len, ahead);
      if (span_ == 2 && group_ == 1) return weigh_span<2, 1, 8>(s, v, len, ahead);
      if (span_ == 4) return weigh_span<4, 1, 4>(s, v, len, ahead);
    }
    for (int64_t kh = 0, h = 0; kh < kv_heads_; ++kh) {
      const T* vh = v + kh * dim_;
      int64_t g = 0;
      for (; kPairs && g + 2 <= group_; g += 2, h += 2)
        weigh_v<2>(s + h * bs_, acc_.data() + h * dim_, vh, len, &ahead);
      for (; g < group_; ++g, ++h)
        weigh_v<1>(s + h * bs_, acc_.data() + h * dim_, vh, len, &ahead);
    }
  }

  // acc[h, :] += sum_i p[h * bs + i] * v_i for every head h, S kv heads a pass over the rows
  // (their G heads each, C vectors of head_dim each: S * G * C accumulators in registers), so
  // a pass reads S * head_dim values of each row together, in address order; kv heads past the
  // last whole pass go to weigh_v. Each head's sums run in weigh_v's order (the same bits). Two
  // ahead.step() a row and kv head (v_steps counts them).
  template <int S, int G, int C>
  [[gnu::always_inline]] void weigh_span(const float* p, const T* v, int64_t len, Ahead& ahead) {
    constexpr int64_t W = P::kStep;
    int64_t kh0 = 0;
    for (; kh0 + S <= kv_heads_; kh0 += S) {
      float* o = acc_.data() + kh0 * G * dim_;
      typename P::V a[S][G][C];
      for (int u = 0; u < S; ++u)
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) a[u][g][c] = P::loadf(o + (u * G + g) * dim_ + c * W);
      for (int64_t i = 0; i < len; ++i) {
        const T* vr = v + i * row_ + kh0 * dim_;
        for (int u = 0; u < S; ++u) {
          ahead.step();
          ahead.step();
          typename P::V pv[G];
          for (int g = 0; g < G; ++g) pv[g] = P::set1(p[((kh0 + u) * G + g) * bs_ + i]);
          for (int c = 0; c < C; ++c) {
            const auto x = P::load(vr + u * dim_ + c * W);
            for (int g = 0; g < G; ++g) a[u][g][c] = P::template madd<T>(a[u][g][c], pv[g], x);
          }
        }
      }
      for (int u = 0; u < S; ++u)
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) P::storef(o + (u * G + g) * dim_ + c * W, a[u][g][c]);
    }
    for (int64_t h = kh0 * G; h < heads_; ++h)
      weigh_v<1>(p + h * bs_, acc_.data() + h * dim_, v + h / G * dim_, len, &ahead);
  }

  // o[n * dim + :] += sum_i p[n * bs + i] * v_i for the G heads n < G sharing the kv head of
  // rows v (stride row_): C vectors of head_dim per head in registers, each V vector loaded
  // once for the G heads. Each head's sums run in the same order whatever G is. One
  // ahead.step() a row of each pass over the rows (v_steps counts them).
  template <int G>
  [[gnu::always_inline]] void weigh_v(const float* p, float* o, const T* v, int64_t len,
                                      Ahead* ahead) {
    constexpr int C = kWeighVectors;
    int64_t d = 0;
    for (; d + C * P::kStep <= dim_; d += C * P::kStep) {
      typename P::V a[G][C];
      for (int n = 0; n < G; ++n)
        for (int c = 0; c < C; ++c) a[n][c] = P::loadf(o + n * dim_ + d + c * P::kStep);
      for (int64_t i = 0; i < len; ++i) {
        if (ahead != nullptr) ahead->step();
        typename P::V pv[G];
        for (int n = 0; n < G; ++n) pv[n] = P::set1(p[n * bs_ + i]);
        for (int c = 0; c < C; ++c) {
          const auto vv = P::load(v + i * row_ + d + c * P::kStep);
          for (int n = 0; n < G; ++n) a[n][c] = P::template madd<T>(a[n][c], pv[n], vv);
        }
      }
      for (int n = 0; n < G; ++n)
        for (int c = 0; c < C; ++c) P::storef(o + n * dim_ + d + c * P::kStep, a[n][c]);
    }
    for (int n = 0; n < G; ++n) {
      const float* pn = p + n * bs_;
      float* on = o + n * dim_;
      int64_t e = d;
      for (; e + P::kStep <= dim_; e += P::kStep) {
        auto acc = P::loadf(on + e);
        for (int64_t i = 0; i < len; ++i) {
          if (ahead != nullptr) ahead->step();
          acc = P::template madd<T>(acc, P::set1(pn[i]), P::load(v + i * row_ + e));
        }
        P::storef(on + e, acc);
      }
      for (; e < dim_; ++e)
        for (int64_t i = 0; i < len; ++i) on[e] += pn[i] * static_cast<float>(v[i * row_ + e]);
    }
  }

  // Two query heads of a group at once, sharing each K and V vector's load: bf16 rows only,
  // where a load is a widening (on an Emerald Rapids Xeon, paged_decode bf16 1.09-1.14x at
  // batch 1-32 x 1024; fp32 0.93-0.98x: its loads are cheap and the pairs' stores are not).
  static constexpr bool kPairs = std::is_same_v<T, bf16> && P::kStep >= 2;
  static constexpr int64_t kHalfStep = P::kStep / 2;
  static constexpr int kWeighVectors = 4;  // weigh_v's C
  static constexpr bool kSpans = std::is_same_v<T, float> && P::kStep == 16;  // span()

  // The kv heads a weigh_span pass holds: 2 or 4 whole ones in 16 accumulators (group x
  // head_dim / 16 = 8 or 4 a kv head), float32 rows on the 16-lane path; else 0 (weigh_v, one
  // kv head a pass). On a Zen 5 EPYC (1 thread, batch 8 / 32 x 1024, paged_decode alone) the
  // passes over two kv heads read 1.06-1.08x / 1.10-1.12x the KV a second of weigh_v's at
  // 4 kv heads x 64 in groups of 2, and 1.03-1.23x at batch 1-32 with 8 x 64 or 4 x 128 kv
  // heads of one query head each; over one sequence's KV in L3 (no DRAM to wait on) 0.82-0.84x
  // at 4 x 64. One kv head a pass with its two heads together (weigh_v<2>, the scores paired
  // too) read 0.85-0.90x; V in memory accumulators, whole rows at a time, 0.75-1.24x by shape. bf16
  // rows (a group's pairs share each widened load) and 8-lane paths keep weigh_v.
  int64_t span() const {
    if (!kSpans || dim_ % P::kStep != 0) return 0;
    const int64_t c = dim_ / P::kStep;
    if (group_ == 2 && c == 4) return kv_heads_ >= 2 ? 2 : 0;
    if (group_ == 1 && c == 8) return kv_heads_ >= 2 ? 2 : 0;
    if (group_ == 1 && c == 4) return kv_heads_ >= 4 ? 4 : 0;
    return 0;
  }

  // The ahead.step() calls of a full block's scores (dots, dots2: one a vector of dim) and of
  // its weighted sum (weigh_v: one a row of each pass; weigh_span: two a row and kv head).
  int64_t score_steps() const {
    const int64_t per_head = dim_ % P::kStep == 0 ? dim_ / P::kStep : 0;
    return (bs_ / P::kStep) * heads_ * per_head;
  }
  int64_t v_steps() const {
    if (span_ > 0) {  // weigh_span's, then weigh_v<1>'s for the kv heads left (C = 4 vectors)
      const int64_t spanned = kv_heads_ / span_ * span_;
      return 2 * bs_ * spanned +
             (kv_heads_ - spanned) * group_ * bs_ * (dim_ / (kWeighVectors * P::kStep));
    }
    constexpr int64_t wide = kWeighVectors * P::kStep;
    const int64_t pairs = kPairs ? group_ / 2 : 0, singles = group_ - 2 * pairs;
    const int64_t pass = dim_ / wide;  // passes of one weigh_v<G> call, besides its tail's
    const int64_t tail = dim_ % wide / P::kStep;  // the tail's: one per head and vector
    return kv_heads_ * bs_ * (pairs * (pass + 2 * tail) + singles * (pass + tail));
  }

  const T* chunks_;
  const int64_t* table_;
  const int64_t* ctx_lens_ = nullptr;
  int64_t max_blocks_, layer_, bs_, kv_heads_, group_, dim_, heads_, row_, chunk_;
  float scale_;
  std::vector<float> s_, m_, l_, acc_;
  int64_t span_;  // kv heads a weigh_span pass, 0: none (span())
  int64_t score_steps_, v_steps_;  // ahead.step() calls of a block: score_steps(), v_steps()
};

// Decoder<P, T>::run on the best path current_isa() allows for T (float32 and bf16 caches
// have vector paths; other dtypes the scalar one).
template <typename T, typename Run>
void on_path(Run&& run) {
  constexpr bool wide = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (wide)
    if (current_isa() >= Isa::kAvx512) return run(Avx512{});
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (wide)
    if (current_isa() >= Isa::kAvx2) return run(Avx2{});
#endif
  run(Scalar{});
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
  const int64_t* tb = table.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  // Items: each sequence's blocks in runs of at most part_blocks; one longer than that writes
  // its runs' outputs (and m, l) to `parts`, combined below.
  const int64_t part_blocks = std::max<int64_t>(1, kPartPositions / bs);
  std::vector<Item> items;
  std::vector<int64_t> first_item(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(cl[b] >= 1 && cl[b] <= max_blocks * bs, "paged_decode: bad context length");
    TORCH_CHECK(rw[b] >= 0 && rw[b] < q.size(0) && out.size(0) == q.size(0),
                "paged_decode: row out of range");
    first_item[b] = static_cast<int64_t>(items.size());
    const int64_t nb = (cl[b] + bs - 1) / bs;
    for (int64_t j = 0; j < nb; ++j)  // a bad table would read outside the cache
      TORCH_CHECK(tb[b * max_blocks + j] >= 0 &&
                      tb[b * max_blocks + j] + 2 * layer + 1 < chunks.size(0),
                  "paged_decode: block table entry out of range");
    for (int64_t j = 0; j < nb; j += part_blocks)
      items.push_back({b, j, std::min(nb, j + part_blocks)});
  }
  first_item[batch] = static_cast<int64_t>(items.size());
  const int64_t count = first_item[batch];
  const int64_t hd = heads * dim;
  std::vector<float> parts, ml;
  std::vector<const float*> qs(count);
  std::vector<float*> outs(count);
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  bool split = false;
  for (int64_t b = 0; b < batch; ++b) split |= first_item[b + 1] - first_item[b] > 1;
  if (split) {
    parts.resize(count * hd);
    ml.resize(count * 2 * heads);
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = items[i].b;
    qs[i] = qp + rw[b] * hd;
    const bool alone = first_item[b + 1] - first_item[b] == 1;
    outs[i] = alone ? o + rw[b] * hd : parts.data() + i * hd;
  }
  // One contiguous run of items per thread, of about equal work (blocks read).
  const int64_t runs = std::min<int64_t>(at::get_num_threads(), count);
  std::vector<int64_t> cut(runs + 1, count);
  {
    std::vector<int64_t> done(count + 1, 0);
    for (int64_t i = 0; i < count; ++i) done[i + 1] = done[i] + items[i].j1 - items[i].j0;
    cut[0] = 0;
    for (int64_t k = 1, i = 0; k < runs; ++k) {
      while (i < count && done[i] * runs < done[count] * k) ++i;
      cut[k] = i;
    }
  }
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, chunks.scalar_type(), "paged_decode",
                                  [&] {
    const scalar_t* c = chunks.data_ptr<scalar_t>();
    at::parallel_for(0, runs, 1, [&](int64_t rb, int64_t re) {
      const FlushDenormals flush;  // simd.h: a peaked softmax's tiny weights cost assists
      on_path<scalar_t>([&](auto path) {
        using P = decltype(path);
        Decoder<P, scalar_t> dec(c, tb, max_blocks, layer, bs, kv_heads, group, dim, s);
        dec.set_ctx_lens(cl);
        dec.run(items.data(), cut[rb], cut[re], qs.data(), outs.data(), dim,
                split ? ml.data() : nullptr);
      });
    });
  });
  if (!split) return;
  // Sequences cut into several items: out = sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i,
  // items in order (acc_i: item i's normalized output times l_i). On the calling thread: a
  // few thousand multiply-adds a sequence, cheaper than a second fork and join of the pool.
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t i0 = first_item[b], i1 = first_item[b + 1];
    if (i1 - i0 == 1) continue;
    float* ob = o + rw[b] * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = i0; i < i1; ++i) m = std::max(m, ml[i * 2 * heads + h]);
      float total = 0.f;
      for (int64_t d = 0; d < dim; ++d) ob[h * dim + d] = 0.f;
      for (int64_t i = i0; i < i1; ++i) {
        const float w = exp_nonpos(ml[i * 2 * heads + h] - m) * ml[i * 2 * heads + heads + h];
        total += w;
        const float* pi = parts.data() + i * hd + h * dim;
        for (int64_t d = 0; d < dim; ++d) ob[h * dim + d] += w * pi[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < dim; ++d) ob[h * dim + d] *= inv;
    }
  }
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
