// How fast can one core read the KV the way a decode step must? (docs/performance.md, session 22)
// usage: g++ -O3 -march=native -o /tmp/kvp scripts/kv_pattern_probe.cpp && /tmp/kvp   (AVX-512)
// The engine's cache holds a block's every layer together (engine/runner/attention.py), so one
// layer's attention reads 32 KiB (bench-llama, float32: 16 rows x 4 kv heads x 64, K then V) of
// every 256 KiB block. This probe only sums those bytes, in that order, over the KV of batch 8
// and 32 x 1024 (128 and 512 MiB, on huge pages as the engine's), against a contiguous read of
// the same bytes: with no software prefetch (the hardware's own), and with prefetchnta `lead`
// bytes ahead in the pieces' order, a line per line read (what paged_decode must do: its reads
// within a chunk follow the heads' columns, which the hardware prefetcher does not follow).
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <sys/mman.h>

// Sums `piece` bytes at off, off + stride, ... below foot; prefetches `lead` bytes ahead in the
// pieces' order where lead > 0.
static float read(const char* b, size_t foot, size_t piece, size_t stride, size_t off,
                  size_t lead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t ps = off, pi = lead;  // the prefetch cursor: piece start, offset in it
  while (pi >= piece) pi -= piece, ps += stride;
  for (size_t s = off; s + piece <= foot; s += stride) {
    const float* p = reinterpret_cast<const float*>(b + s);
    for (size_t i = 0; i < piece / 4; i += 64) {
      if (lead > 0 && ps + piece <= foot) {
        for (int l = 0; l < 4; ++l) _mm_prefetch(b + ps + pi + 64 * l, _MM_HINT_NTA);
        if ((pi += 256) == piece) pi = 0, ps += stride;
      }
      a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
      a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
      a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
      a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

int main() {
  const size_t max_foot = size_t{512} << 20, piece = 32 << 10, stride = 256 << 10, layers = 8;
  char* b = static_cast<char*>(aligned_alloc(2 << 20, max_foot));
  madvise(b, max_foot, MADV_HUGEPAGE);
  memset(b, 1, max_foot);
  float sink = 0;
  auto best = [&](auto&& f) {
    double t = 1e30;
    for (int r = 0; r < 5; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      f();
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return t;
  };
  for (int rep = 0; rep < 2; ++rep)
    for (size_t foot : {size_t{128} << 20, max_foot})
      for (size_t lead : {size_t{0}, size_t{4096}, size_t{16384}}) {
        double pat = best([&] {
          for (size_t l = 0; l < layers; ++l) sink += read(b, foot, piece, stride, l * piece, lead);
        });
        double flat = best([&] { sink += read(b, foot, foot, foot, 0, lead); });
        printf("KV %3zu MiB  prefetch %5zu B ahead: 32 KiB of every 256 KiB %5.1f GB/s, contiguous "
               "%5.1f GB/s: %.2f\n", foot >> 20, lead, foot / pat / 1e9, foot / flat / 1e9,
               flat / pat);
      }
  return sink == 1.2345f;
}
