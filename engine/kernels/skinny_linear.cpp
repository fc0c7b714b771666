// y = x @ w^T for a few rows of x: the matmuls of a decode step with a small batch.
//
// With few rows the work is bound by reading the weight once from memory, and the BLAS gemm
// spends up to twice that (it packs the weight for every call). This kernel streams w
// straight from its [N, K] row-major layout: a tile of 3 weight rows (one vector-wide slice of
// each per step) against up to 4 rows of x, 12 accumulators, a horizontal sum at the end; for
// at most kSequentialRows rows of x one weight row at a time (a single sequential stream,
// software-prefetched ahead on AVX2). A tile's passes over x prefetch the next tile's rows.
// The weight rows are split over threads with at::parallel_for.
//
// float32 and bfloat16 (x and w of the same dtype; bf16 accumulates in float32 and rounds the
// result to bf16 once). One template, one "path" type per instruction set (isa.h):
// - Avx512Bf16: 32 bf16 per step, vdpbf16ps (two bf16 products per fp32 lane);
// - Avx512 / Avx2: 16 / 8 values per step, bf16 widened to fp32 by a shift, FMA;
// - Scalar: one value per step, plain C++ (a serial float sum: the compiler cannot vectorize
//   it without reassociating, so forcing it really runs scalar code).
// The K tail (K not a multiple of the step) is zero-padded into a vector, so each output sums
// its products in the same order whatever the number of rows: a sequence's result does not
// depend on its batch (per path; different paths round differently).
// bf16 on Avx512 / Avx2 runs its own loop (pair_tile below): x widened to float32 once per
// call, not once per weight tile, and two accumulators per output.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

// Up to this many rows of x, w is read one row at a time: one sequential stream, which the
// hardware prefetcher follows at the full streaming bandwidth (interleaved streams of one
// row each are too short for it: 0.55-0.65 of the streaming read on an AMD EPYC with
// AVX-512, against 0.95-1.0 for the single stream, `pdserve bench roofline`). Beyond it the
// tile's reuse of each x load matters more, and the tile prefetches its successor's rows
// itself (kTileRows below). The per-output sums are the same either way.
constexpr int64_t kSequentialRows = 3;

// The float32 tile: kTileRows rows of x against kTileCols rows of w, 12 accumulators. With the
// x vector and the 3 w vectors held in registers that is AVX2's 16, and a step loads 7 vectors
// for its 12 FMAs. GCC otherwise folds each x (or w) load into every FMA that uses it, and the
// 16 loads a step, not the 12 FMAs, are the limit: this core issues one 32-byte load a cycle
// (x alone held: the old 3 x 4's limit). w is held too from 8 rows of x on (1.03-1.15x at
// 8-32 rows; at 4 rows, one pass over w, 0.95x: that pass waits on memory). Each of a
// tile's passes over its rows of x prefetches the next tile's weight rows, a few lines a
// step: the 3-4 short interleaved streams of a tile left the hardware prefetcher behind, and
// asking again in every pass (the lines already on their way cost only the hint) keeps the
// memory busy through the whole tile (1.1-1.2x at 8-32 rows over the first pass alone). On a
// Zen 3 EPYC (AVX2, 1 thread, the bench model's matmuls, weights from DRAM) 4 x 3 with the
// first-pass prefetch ran 1.3-1.45x the old 3 x 4 at 4-8 rows of x, 1.1-1.2x at 16-32
// (scripts/decode_kernels_ab.py).
constexpr int kTileRows = 4, kTileCols = 3;

// Per path: the rows of x a tile takes at once, and up to how many rows of x w is read one
// row at a time instead (kSequentialRows).
// - AVX-512's 32 registers hold an 8 x 3 tile (24 accumulators, the 3 w vectors, x), w always
//   held: 11 loads a step for 24 FMAs, and 8 rows of x (a batch-8 decode) in one pass over w
//   instead of two. On an Intel Xeon (Golden Cove cores, 2 loads and 2 FMAs a cycle) the 4 x 3
//   tile ran the bench model's matmuls at ~81 GFLOP/s a thread from 16 rows on (0.46 of the
//   FMA peak: time doubled with the rows).
// - On the AVX-512 paths (float32; bf16 with vdpbf16ps) the tile takes 2 and 3 rows of x too:
//   with each pass prefetching the next tile (which the measurement behind kSequentialRows
//   predates), on that Xeon the tile read 2-3 rows at the single stream's rate, 1.29-1.53x
//   the sequential path with the weights in DRAM and 1.25-1.64x in L3
//   (scripts/decode_kernels_ab.py; the sequential path lost ~4 cycles a step per row of x).
//   Not yet measured on an AMD EPYC with AVX-512, where that older measurement was taken.
template <typename P>
struct Tiling {
  static constexpr int rows = kTileRows;
  static constexpr int64_t sequential = kSequentialRows;
};
struct WideTiling {
  static constexpr int rows = 8;
  static constexpr int64_t sequential = 1;
};
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
struct Tiling<Avx512> : WideTiling {};
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
template <>
struct Tiling<Avx512Bf16> : WideTiling {};
#endif

// Whether a tile over M rows of x holds its w vectors in registers too (kTileRows above):
// always on the wide tiling, from two passes over w on the others.
template <typename P>
constexpr bool holds_w(int64_t M) {
  return Tiling<P>::rows > kTileRows || M >= 2 * Tiling<P>::rows;
}

// How far ahead of its loads the single-row stream prefetches w, in bytes. AVX2 (32-byte
// loads): the hardware prefetcher alone left the single stream at 0.73-0.91 of the streaming
// read on a Zen 3 EPYC, and 2 KB ahead (a few hundred ns of DRAM latency at ~20 GB/s) gained
// 5-15 % (paired runs, thread CPU time). AVX-512: on an AMD EPYC its 64-byte loads read at
// 0.95-1.0 without; on an Intel Xeon (Emerald Rapids) a bf16 row (vdpbf16ps, 32 weights a
// step) read only ~10.5 GB/s of a 15.9 GB/s stream, and 4 KB ahead took it to 13-14 GB/s at
// 1 thread, 16.8 -> 22-24 at 2 (weights in DRAM; 1.25x in L3), float32 1.01-1.08x; 2 KB gained
// less, 8 KB no more (bit-identical: only a hint).
template <typename P>
constexpr int64_t kPrefetchBytes = 0;
#if defined(__AVX2__) && defined(__FMA__)
template <>
constexpr int64_t kPrefetchBytes<Avx2> = 2048;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
constexpr int64_t kPrefetchBytes<Avx512> = 4096;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
template <>
constexpr int64_t kPrefetchBytes<Avx512Bf16> = 4096;
#endif

// A tile's share of its successor's weight rows: the NB rows of a tile are contiguous, so a
// tile that reads `bytes` of each of its rows a step asks for the next tile's `bytes` * NB at
// the same offset (only a hint: no fault past the end). float32 asks for them into L2, not L1:
// L1 then keeps the tile's rows of x (16 KiB at 8 rows of K = 512) and its own weight lines.
// On an Intel Xeon (Emerald Rapids; the bench model's matmuls, weights from DRAM:
// AB_WEIGHT_COPIES=4 scripts/decode_kernels_ab.py) that read 1.04-1.10x the weight a second at
// 2-8 rows of x at 1 thread, 1.03-1.06x at 3-8 rows at 2; prefetching 2 or 4 tiles ahead
// instead of 1 gained nothing more. bf16 (vdpbf16ps, half the FMA rate there) read
// 0.95-1.02x into L2: it stays in L1.
// On AMD CPUs float32 asks with NTA instead (kAmdCpu, isa.h: on a Zen 5 EPYC 1.11-1.29x at 2-8
// rows of x at 1 thread, 1.04-1.07x at 2, against T1; bf16 0.94-1.06x, so it keeps T0).
template <typename T>
inline void prefetch_share(const char* next, int64_t offset, int64_t bytes) {
  // float32: into L2 (2: prefetcht1), NTA on AMD (0); bf16: T0 (3)
  constexpr int kLocality = std::is_same_v<T, float> ? (kAmdCpu ? 0 : 2) : 3;
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(next + offset + l, 0, kLocality);
}

// Where tile t + ahead of a thread's run [t0, t1) is a full tile of NB rows in that run, its
// first weight row; else null.
template <typename T>
inline const char* next_tile(const T* w, int64_t t, int64_t t1, int64_t NB, int64_t K,
                             int64_t N, int64_t ahead = 1) {
  const int64_t n = (t + ahead) * NB;
  return t + ahead < t1 && n + NB <= N ? reinterpret_cast<const char*>(w + n * K) : nullptr;
}

// Columns [k0, k1) (whole steps) of MB rows of x (stride K) against NB rows of w (stride K),
// added to acc. Where `next` is given it is prefetched along the way (only a hint: no fault
// past the end): Sliced, the same columns of the NB rows from `next` on (the next tile's share
// of a slice, run_sliced), else the NB rows of w after these, front to back (prefetch_share).
// HoldW: the NB w vectors of a step held in registers too (kTileRows above).
template <typename P, typename T, int MB, int NB, bool HoldW, bool Sliced = false>
[[gnu::always_inline]] inline void columns(const T* x, const T* w, int64_t K, int64_t k0,
                                           int64_t k1, typename P::V (&acc)[MB][NB],
                                           const char* next) {
  for (int64_t k = k0; k < k1; k += P::kStep) {
    typename P::template In<T> wv[NB];
    if constexpr (NB == 1 && kPrefetchBytes<P> > 0)  // no fault past the end: only a hint
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes<P>);
    if (next != nullptr) {
      if constexpr (Sliced)
        for (int j = 0; j < NB; ++j)
          prefetch_share<T>(next + j * K * sizeof(T), (k - k0) * sizeof(T), P::kStep * sizeof(T));
      else
        prefetch_share<T>(next, k * NB * sizeof(T), NB * P::kStep * sizeof(T));
    }
    for (int j = 0; j < NB; ++j) {
      wv[j] = P::load(w + j * K + k);
      if constexpr (HoldW) asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MB; ++i) {
      auto xv = P::load(x + i * K + k);
      if constexpr (NB > 1) asm("" : "+v"(xv));  // held in a register (kTileRows above)
      for (int j = 0; j < NB; ++j) acc[i][j] = P::template madd<T>(acc[i][j], xv, wv[j]);
    }
  }
}

// The tail from column k (K - k < one step, zero-padded to one) added to acc, then each sum
// into y (row stride N).
template <typename P, typename T, int MB, int NB>
[[gnu::always_inline]] inline void tile_end(const T* x, const T* w, T* y, int64_t K, int64_t N,
                                            int64_t k, typename P::V (&acc)[MB][NB]) {
  if (k < K) {
    T pad[P::kStep];
    for (int i = 0; i < MB; ++i) {
      std::memset(static_cast<void*>(pad), 0, sizeof(pad));
      std::copy(x + i * K + k, x + (i + 1) * K, pad);
      const auto xv = P::load(pad);
      for (int j = 0; j < NB; ++j) {
        std::memset(static_cast<void*>(pad), 0, sizeof(pad));
        std::copy(w + j * K + k, w + (j + 1) * K, pad);
        acc[i][j] = P::template madd<T>(acc[i][j], xv, P::load(pad));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * N + j] = static_cast<T>(P::hsum(acc[i][j]));
}

// MB rows of x against NB rows of w into y (row stride N), prefetching `next` (columns).
template <typename P, typename T, int MB, int NB, bool HoldW = false>
inline void tile(const T* x, const T* w, T* y, int64_t K, int64_t N,
                 const char* next = nullptr) {
  typename P::V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = P::zero();
  const int64_t kv = K - K % P::kStep;
  columns<P, T, MB, NB, HoldW>(x, w, K, 0, kv, acc, next);
  tile_end<P, T, MB, NB>(x, w, y, K, N, kv, acc);
}

// The last R (< the path's tile rows) rows of x against NB rows of w.
template <typename P, typename T, int NB, int R>
inline void last_rows(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N,
                      const char* next) {
  if constexpr (R > 0) {
    if (rows == R) return tile<P, T, R, NB>(x, w, y, K, N, next);
    last_rows<P, T, NB, R - 1>(x, w, y, rows, K, N, next);
  }
}

// Every row of x against NB rows of w; each full pass prefetches `next` (see tile).
template <typename P, typename T, int NB>
inline void all_rows(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N,
                     const char* next = nullptr) {
  constexpr int TR = Tiling<P>::rows;
  int64_t m = 0;
  if (NB > 1 && holds_w<P>(M))
    for (; m + TR <= M; m += TR)
      tile<P, T, TR, NB, true>(x + m * K, w, y + m * N, K, N, next);
  for (; m + TR <= M; m += TR)
    tile<P, T, TR, NB>(x + m * K, w, y + m * N, K, N, next);
  last_rows<P, T, NB, TR - 1>(x + m * K, w, y + m * N, M - m, K, N, next);
}

// With many rows of x on the wide float32 tiling (AVX-512: 8 rows a pass), a thread's tiles go
// in blocks of kBlockTiles: each pass of TR rows of x runs over the whole block (its weight
// rows stay in L2, its rows of x in L1, its outputs on a few lines) instead of every pass
// over one tile. On an Intel Xeon (Emerald Rapids; AB_WEIGHT_COPIES=4
// scripts/decode_kernels_ab.py) 1.07x at 32 rows, 1 and 2 threads (a variant build: 1.10-1.13x
// at 32 and 64); at 16 rows 0.93-0.98x, on the AVX2 path 0.91-1.0x and bf16 (vdpbf16ps)
// 0.97-0.99x, so those keep one tile at a time. The sums are the same (bit-identical).
constexpr int64_t kBlockTiles = 16;

// The most bytes of x a pass over several tiles reads from L1 (a core's L1 holds 32-48 KiB,
// and the tiles' weight lines pass through it too): beyond, run_sliced. With 2 passes or more
// (16+ rows of x on AVX-512), 16 KiB: on a Zen 5 EPYC bf16 rows of 22-24 KiB (K = 1408-1536)
// read 1.14-1.22x the weight a second sliced, float32 rows of 16 KiB (K = 512) lost 0.6-0.9x
// at a limit of 8 KiB. With one pass (8-15 rows), 40 KiB: rows of 32 KiB (float32 K = 1024,
// bf16 K = 2048) read 0.85-0.98x sliced, and from 45 KiB on 1.26-1.61x.
constexpr int64_t kPassXBytes = 16 << 10, kOnePassXBytes = 40 << 10;

// Tiles [t0, t1) of NB rows of w, TR rows of x a pass over each block of them; returns where
// it stopped (the first tile without NB rows).
template <typename P, typename T, int NB>
int64_t run_blocks(const T* xp, const T* wp, T* yp, int64_t M, int64_t K, int64_t N,
                   int64_t t0, int64_t t1) {
  constexpr int TR = Tiling<P>::rows;
  const int64_t full = std::min(t1, N / NB);
  for (int64_t t = t0; t < full; t += kBlockTiles) {
    const int64_t tb = std::min(full, t + kBlockTiles);
    int64_t m = 0;
    for (; m + TR <= M; m += TR)
      for (int64_t u = t; u < tb; ++u)  // the first pass asks for the next block's rows
        tile<P, T, TR, NB, true>(xp + m * K, wp + u * NB * K, yp + m * N + u * NB, K, N,
                                 m == 0 ? next_tile(wp, u, t1, NB, K, N, kBlockTiles) : nullptr);
    for (int64_t u = t; u < tb && m < M; ++u)
      last_rows<P, T, NB, TR - 1>(xp + m * K, wp + u * NB * K, yp + m * N + u * NB, M - m, K,
                                  N, nullptr);
  }
  return std::max(t0, full);
}

// Long rows of x do not stay in L1 from one tile to the next: where a pass's rows of x take
// more than kPassXBytes, every tile read them again from L2 (on a Zen 5 EPYC, 8 rows of float32
// at K = 1408-4096 read 17-21 GB/s of weights against 28 at K = 512-576; sliced 1.25-1.58x at
// 8 rows, 1.25-1.35x at 16, up to 1.51x at 32-64, bf16 at K = 4096 1.22-1.49x at 8-64 rows, the
// AVX2 path 1.11-1.30x at K = 4096: AB_SHAPES scripts/decode_kernels_ab.py, bench/results/
// session23/sliced_ab_*.txt). There tiles go in groups of kGroupTiles, and each pass of rows
// of x over a group reads K in slices of at most kPassXBytes of x: each tile of the group adds
// its slice of columns to its sums, kept in `acc` from one slice to the next, and sums them
// up after the last. The same products summed in the same order: bit-identical. Each tile
// prefetches the next one's columns of its slice (after the group's last tile, the first
// one's next slice; after the last slice, `after`).
constexpr int64_t kGroupTiles = 8;

template <typename P, typename T, int MB, int NB, bool HoldW>
void group_pass(const T* x, const T* w, T* y, int64_t K, int64_t N, int64_t tiles,
                int64_t slice, const T* after) {
  typename P::V acc[kGroupTiles][MB][NB];
  for (int64_t u = 0; u < tiles; ++u)
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[u][i][j] = P::zero();
  const int64_t kv = K - K % P::kStep;
  for (int64_t k0 = 0; k0 < kv; k0 += slice) {
    const int64_t k1 = std::min(kv, k0 + slice);
    for (int64_t u = 0; u < tiles; ++u) {
      const T* next = u + 1 < tiles ? w + (u + 1) * NB * K + k0 : k1 < kv ? w + k1 : after;
      typename P::V a[MB][NB];  // in registers for the slice (acc[u] is memory)
      std::memcpy(static_cast<void*>(a), acc[u], sizeof(a));
      columns<P, T, MB, NB, HoldW, true>(x, w + u * NB * K, K, k0, k1, a,
                                         reinterpret_cast<const char*>(next));
      std::memcpy(static_cast<void*>(acc[u]), a, sizeof(a));
    }
  }
  for (int64_t u = 0; u < tiles; ++u) {
    typename P::V a[MB][NB];
    std::memcpy(static_cast<void*>(a), acc[u], sizeof(a));
    tile_end<P, T, MB, NB>(x, w + u * NB * K, y + u * NB, K, N, kv, a);
  }
}

// group_pass for the last `rows` (<= R) rows of x.
template <typename P, typename T, int NB, int R, bool HoldW>
void group_rows(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N,
                int64_t tiles, int64_t slice, const T* after) {
  if constexpr (R > 0) {
    if (rows == R) return group_pass<P, T, R, NB, HoldW>(x, w, y, K, N, tiles, slice, after);
    group_rows<P, T, NB, R - 1, HoldW>(x, w, y, rows, K, N, tiles, slice, after);
  }
}

// Tiles [t0, t1) of NB rows of w in groups, K in slices (above); returns where it stopped (the
// first tile without NB rows).
template <typename P, typename T, int NB, bool HoldW>
int64_t run_sliced(const T* xp, const T* wp, T* yp, int64_t M, int64_t K, int64_t N,
                   int64_t t0, int64_t t1) {
  constexpr int TR = Tiling<P>::rows;
  const int64_t steps = K / P::kStep;  // whole steps, split into slices of about equal steps
  const int64_t most = std::max<int64_t>(1, kPassXBytes / (TR * sizeof(T) * P::kStep));
  const int64_t slices = std::max<int64_t>(1, (steps + most - 1) / most);
  const int64_t slice = (steps + slices - 1) / slices * P::kStep;
  const int64_t full = std::min(t1, N / NB);
  for (int64_t t = t0; t < full; t += kGroupTiles) {
    const int64_t tg = std::min(full, t + kGroupTiles);
    const T* after = tg < full ? wp + tg * NB * K : nullptr;
    for (int64_t m = 0; m < M; m += TR)
      group_rows<P, T, NB, TR, HoldW>(xp + m * K, wp + t * NB * K, yp + m * N + t * NB,
                                     std::min<int64_t>(TR, M - m), K, N, tg - t, slice, after);
  }
  return std::max(t0, full);
}

template <typename P, typename T>
void run(const T* xp, const T* wp, T* yp, int64_t M, int64_t K, int64_t N) {
  constexpr int NB = kTileCols, TR = Tiling<P>::rows;
  const int64_t tiles = (N + NB - 1) / NB;
  at::parallel_for(0, tiles, 64 / NB, [&](int64_t t0, int64_t t1) {
    int64_t t = t0;
    if (M >= TR && TR * K * static_cast<int64_t>(sizeof(T)) >
                       (M >= 2 * TR ? kPassXBytes : kOnePassXBytes))
      t = holds_w<P>(M) ? run_sliced<P, T, NB, true>(xp, wp, yp, M, K, N, t0, t1)
                        : run_sliced<P, T, NB, false>(xp, wp, yp, M, K, N, t0, t1);
    else if (std::is_same_v<T, float> && TR > kTileRows && M >= 4 * TR)
      t = run_blocks<P, T, NB>(xp, wp, yp, M, K, N, t0, t1);
    for (; t < t1; ++t) {
      const int64_t n = t * NB, nb = std::min<int64_t>(NB, N - n);
      if (nb == NB && M > Tiling<P>::sequential) {
        all_rows<P, T, NB>(xp, wp + n * K, yp + n, M, K, N, next_tile(wp, t, t1, NB, K, N));
      } else {
        for (int64_t j = 0; j < nb; ++j)
          all_rows<P, T, 1>(xp, wp + (n + j) * K, yp + n + j, M, K, N);
      }
    }
  });
}

// bf16 on the paths that widen it (Avx512, Avx2). The old loop widened x again for every tile
// of weight rows and fed one accumulator per output, so at one row of x each 16 bytes of w
// waited on the previous FMA (4 cycles on Zen 3: ~12 GB/s, under the streaming read) and
// 7 of every 12 vector ops were conversions (`pdserve bench roofline`: bf16 decode as slow as
// fp32 at half the bytes). Here x is widened to float32 once per call, in the order the
// weight comes out of one vector load of 2 * kStep bf16: a 32-bit lane l holds the pair
// (2l, 2l+1), and a 16-bit shift gives the even ones as float32, a mask the odd ones. Each
// output sums its even and its odd products in two accumulators (two FMA chains: a row of
// x streams w at twice the old rate), added at the end; the order is the same for every
// tile shape, so a row's result still does not depend on its batch.
template <typename P>
struct Pairs;

#if defined(__AVX2__) && defined(__FMA__)
template <>
struct Pairs<Avx2> {
  static void load(const bf16* p, __m256& even, __m256& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
  }
  static constexpr int kCols = 2;  // weight rows per tile: 3 x 2 x 2 accumulators of 16 ymm
};
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
struct Pairs<Avx512> {
  static void load(const bf16* p, __m512& even, __m512& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
  }
  static constexpr int kCols = 4;  // 3 x 4 x 2 accumulators of 32 zmm
};
#endif

// n floats from a 64-byte boundary. A vector<float>'s data sits at 16 bytes, where every
// other 32-byte load straddles two cache lines: with xs in one, bf16 at 4-16 rows of x read
// 10-19 % less weight a second on a Zen 3 EPYC (AVX2, 1 thread; scripts/decode_kernels_ab.py).
class LineAligned {
 public:
  explicit LineAligned(int64_t n) : buf_(static_cast<size_t>(n) + 16) {}
  float* data() {
    const auto p = reinterpret_cast<uintptr_t>(buf_.data());
    return reinterpret_cast<float*>((p + 63) & ~static_cast<uintptr_t>(63));
  }

 private:
  std::vector<float> buf_;
};

// x [M, K] bf16 -> xs [M, Kp] float32 (Kp: K rounded up to 2 * S, zeros after K), each block
// of 2 * S values as S even ones then S odd ones.
template <int S>
void widen_x(const bf16* x, float* xs, int64_t M, int64_t K, int64_t Kp) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < Kp; b += 2 * S)
      for (int64_t l = 0; l < 2 * S; ++l) {
        const int64_t k = b + 2 * (l % S) + l / S;
        xs[m * Kp + b + l] = k < K ? static_cast<float>(x[m * K + k]) : 0.f;
      }
}

// MB rows of widened x (stride Kp) against NB rows of bf16 w (stride K) into y (stride N);
// `next` as in tile().
template <typename P, int MB, int NB>
inline void pair_tile(const float* xs, int64_t Kp, const bf16* w, int64_t K, bf16* y,
                      int64_t N, const char* next = nullptr) {
  constexpr int S = P::kStep;
  typename P::V even[MB][NB], odd[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) even[i][j] = odd[i][j] = P::zero();
  auto step = [&](const bf16* const* wk, int64_t k) {
    typename P::V we[NB], wo[NB];
    for (int j = 0; j < NB; ++j) Pairs<P>::load(wk[j], we[j], wo[j]);
    for (int i = 0; i < MB; ++i) {
      const auto xe = P::loadf(xs + i * Kp + k), xo = P::loadf(xs + i * Kp + k + S);
      for (int j = 0; j < NB; ++j) {
        even[i][j] = P::template madd<float>(even[i][j], xe, we[j]);
        odd[i][j] = P::template madd<float>(odd[i][j], xo, wo[j]);
      }
    }
  };
  int64_t k = 0;
  const bf16* wk[NB];
  for (; k + 2 * S <= K; k += 2 * S) {
    if constexpr (NB == 1 && kPrefetchBytes<P> > 0)  // no fault past the end: only a hint
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes<P>);
    if (next != nullptr)
      prefetch_share<bf16>(next, k * NB * sizeof(bf16), NB * 2 * S * sizeof(bf16));
    for (int j = 0; j < NB; ++j) wk[j] = w + j * K + k;
    step(wk, k);
  }
  if (k < K) {  // the tail, zero-padded to one full step (xs is zero there already)
    bf16 pad[NB][2 * S];
    for (int j = 0; j < NB; ++j) {
      std::memset(static_cast<void*>(pad[j]), 0, sizeof(pad[j]));
      std::copy(w + j * K + k, w + (j + 1) * K, pad[j]);
      wk[j] = pad[j];
    }
    step(wk, k);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[i * N + j] = static_cast<bf16>(P::hsum(P::add(even[i][j], odd[i][j])));
}

template <typename P, int NB>
inline void pair_rows(const float* xs, int64_t Kp, const bf16* w, int64_t K, bf16* y,
                      int64_t M, int64_t N, const char* next = nullptr) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3)
    pair_tile<P, 3, NB>(xs + m * Kp, Kp, w, K, y + m * N, N, m == 0 ? next : nullptr);
  if (M - m == 2) pair_tile<P, 2, NB>(xs + m * Kp, Kp, w, K, y + m * N, N);
  if (M - m == 1) pair_tile<P, 1, NB>(xs + m * Kp, Kp, w, K, y + m * N, N);
}

template <typename P>
void run_pairs(const bf16* xp, const bf16* wp, bf16* yp, int64_t M, int64_t K, int64_t N) {
  constexpr int S = P::kStep, NB = Pairs<P>::kCols;
  const int64_t Kp = (K + 2 * S - 1) / (2 * S) * (2 * S);
  LineAligned xs(M * Kp);  // Kp is a multiple of 2 * S: every row starts a line too
  widen_x<S>(xp, xs.data(), M, K, Kp);
  const int64_t tiles = (N + NB - 1) / NB;
  at::parallel_for(0, tiles, 16 * 4 / NB, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NB, nb = std::min<int64_t>(NB, N - n);
      if (nb == NB && M > kSequentialRows) {
        pair_rows<P, NB>(xs.data(), Kp, wp + n * K, K, yp + n, M, N,
                         next_tile(wp, t, t1, NB, K, N));
      } else {
        for (int64_t j = 0; j < nb; ++j)
          pair_rows<P, 1>(xs.data(), Kp, wp + (n + j) * K, K, yp + n + j, M, N);
      }
    }
  });
}

template <typename T>
void dispatch(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  const Isa isa = current_isa();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>)
    if (isa >= Isa::kAvx512Bf16) return run<Avx512Bf16, T>(x, w, y, M, K, N);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, bf16>)
    if (isa >= Isa::kAvx512) return run_pairs<Avx512>(x, w, y, M, K, N);
  if (isa >= Isa::kAvx512) return run<Avx512, T>(x, w, y, M, K, N);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, bf16>)
    if (isa >= Isa::kAvx2) return run_pairs<Avx2>(x, w, y, M, K, N);
  if (isa >= Isa::kAvx2) return run<Avx2, T>(x, w, y, M, K, N);
#endif
  (void)isa;
  run<Scalar, T>(x, w, y, M, K, N);
}

}  // namespace

// x: [M, K], w: [N, K], both float32 or both bfloat16, contiguous. Returns [M, N], same dtype.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && w.scalar_type() == dt,
              "skinny_linear: x and w must be both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (dt == torch::kFloat)
    dispatch<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  else
    dispatch<bf16>(x.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>(), M, K, N);
  return y;
}
