// One "path" type per instruction set (see isa.h), shared by the kernels: V is the float32
// accumulator vector, In<T> what one load of kStep values of T becomes (bf16 widened to fp32
// by a 16-bit shift, except on Avx512Bf16 where vdpbf16ps takes bf16 pairs as they are).
// load(p) reads kStep values, madd(acc, a, b) = acc + a * b, hsum sums the lanes, hsums(v)
// sums each of kStep vectors into one lane of the result; set1, loadf, storef, max, hmax,
// add, sub, mul, div, abs, exp (exp_nonpos lane by lane) and nonneg_select(x, a, b) (a where
// x >= 0, else b) on float32 vectors serve the attention and activation kernels; round_bf16
// and store_bf16 round to bf16 as c10 does (nearest even, NaN to 0x7fc0).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace simd {

using bf16 = c10::BFloat16;

// exp(x) for x <= 0 (softmax after subtracting the max), vectorizable: x = k ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7 there), 2^k put
// into the exponent bits. Below -87 the result is 0 (e^-87 is under float's normal range).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f,
                kLn2Lo = 1.428606765330187e-06f;
// The vector paths round x log2(e) to k by adding kShifter = 1.5 * 2^23 + 127 in the FMA
// that forms the product (one rounding, to an integer: the ulp there is 1), take k back by
// one subtraction, and shift t's bits left by 23, which leaves (k + 127) << 23: 2^k. Three
// uops fewer than multiply, round, convert, add (prefill attention 1.02x on the AVX2 path);
// k differs from nearbyint's only where x log2(e) lies within half an ulp of a half-integer,
// and then |r| exceeds ln2 / 2 by no more than that.
constexpr float kShifter = 12583039.f;
inline float exp_nonpos(float x) {
  x = std::max(x, -87.f);
  const float k = std::nearbyint(x * kLog2e);
  const float r = x - k * kLn2Hi - k * kLn2Lo;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Denormals flushed to zero on this thread while in scope (MXCSR's FTZ for results and DAZ
// for inputs), restored after: what the attention kernels run under. A peaked softmax gives
// weights near e^-87 whose products with V are denormal, and each denormal result costs x86 a
// microcode assist (1024-token prefill attention, scores ~100 wide: avx512 23 vs 117 GFLOP/s
// flushed, avx2 14 vs 70; ~50 wide: 2.1x). What is lost is under 1.2e-38 in a weighted mean
// whose weights sum to at least 1: far below the output's ulp (the outputs were bit-equal).
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#endif
};

struct Scalar {
  using V = float;
  template <typename T>
  using In = float;
  static constexpr int kStep = 1;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  template <typename T>
  static In<T> load(const T* p) { return static_cast<float>(*p); }
  static V loadf(const float* p) { return *p; }
  static void storef(float* p, V v) { *p = v; }
  template <typename T>
  static V madd(V acc, In<T> a, In<T> b) {
    // Fused where the CPU has FMA: GCC contracts `acc + a * b` into an FMA in some loop shapes
    // and not in others, so a row's skinny_linear result depended on its batch's tile shape.
#if defined(__FMA__)
    return std::fma(a, b, acc);
#else
    return acc + a * b;
#endif
  }
  static float hsum(V v) { return v; }
  static V hsums(const V* v) { return v[0]; }
  static V max(V a, V b) { return std::max(a, b); }
  static float hmax(V v) { return v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V abs(V x) { return std::fabs(x); }
  static V nonneg_select(V x, V a, V b) { return x >= 0.f ? a : b; }
  static V exp(V x) { return exp_nonpos(x); }
  static V round_bf16(V x) { return static_cast<float>(static_cast<bf16>(x)); }
  static void store_bf16(bf16* p, V x) { *p = static_cast<bf16>(x); }
};

#if defined(__AVX2__) && defined(__FMA__)
// Lane i of the result = the sum of v[i]'s 8 lanes (8 horizontal sums for the price of ~2).
inline __m256 hsums8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 lo4 = _mm256_hadd_ps(s01, s23), hi4 = _mm256_hadd_ps(s45, s67);
  // lo4 = [v0..v3 sums of lanes 0-3 | v0..v3 sums of lanes 4-7], hi4 the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                       _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

struct Avx2 {
  using V = __m256;
  template <typename T>
  using In = __m256;
  static constexpr int kStep = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static In<float> load(const float* p) { return _mm256_loadu_ps(p); }
  static In<bf16> load(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <typename T>
  static V madd(V acc, In<T> a, In<T> b) { return _mm256_fmadd_ps(a, b, acc); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V hsums(const V* v) { return hsums8(v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hmax(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V abs(V x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }
  static V nonneg_select(V x, V a, V b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static __m256i bf16_bits(V x) {  // see Avx512::bf16_bits
    const __m256i b = _mm256_castps_si256(x);
    const __m256i bias = _mm256_add_epi32(
        _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, bias), _mm256_set1_epi32(-65536));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                                _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static V round_bf16(V x) { return _mm256_castsi256_ps(bf16_bits(x)); }
  static void store_bf16(bf16* p, V x) {
    const __m256i h = _mm256_srli_epi32(bf16_bits(x), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V exp(V x) {  // exp_nonpos, 8 lanes (k and 2^k by kShifter)
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kShifter));
    const __m256 k = _mm256_sub_ps(t, _mm256_set1_ps(kShifter));
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
      p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  using V = __m512;
  template <typename T>
  using In = __m512;
  static constexpr int kStep = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static In<float> load(const float* p) { return _mm512_loadu_ps(p); }
  static In<bf16> load(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <typename T>
  static V madd(V acc, In<T> a, In<T> b) { return _mm512_fmadd_ps(a, b, acc); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static V hsums(const V* v) {  // each vector's halves added, then two hsums8
    __m256 h[16];
    for (int i = 0; i < 16; ++i)
      h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
    const __m512d lo = _mm512_castps_pd(_mm512_castps256_ps512(hsums8(h)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(hsums8(h + 8)), 1));
  }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V abs(V x) { return _mm512_abs_ps(x); }
  static V nonneg_select(V x, V a, V b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
  }
  // x rounded to bf16 as c10 rounds (nearest even; NaN to 0x7fc0), in each lane's high half.
  static __m512i bf16_bits(V x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(
        _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, bias), _mm512_set1_epi32(-65536));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(0x7fc00000));
  }
  static V round_bf16(V x) { return _mm512_castsi512_ps(bf16_bits(x)); }
  static void store_bf16(bf16* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16)));
  }
  static V exp(V x) {  // exp_nonpos, 16 lanes (k and 2^k by kShifter)
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kShifter));
    const __m512 k = _mm512_sub_ps(t, _mm512_set1_ps(kShifter));
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23)));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
struct Avx512Bf16 {  // bf16 x bf16 dot products only
  using V = __m512;
  template <typename T>
  using In = __m512bh;
  static constexpr int kStep = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static In<bf16> load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  template <typename T>
  static V madd(V acc, In<T> a, In<T> b) { return _mm512_dpbf16_ps(acc, a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
};
#endif

// f(P{}) for the float32 vector path current_isa() allows (Avx512, Avx2, else Scalar): the one
// dispatch of the row kernels (rope, rms_norm, silu_mul).
template <typename F>
inline void on_float_path(F&& f) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (current_isa() >= Isa::kAvx512) return f(Avx512{});
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (current_isa() >= Isa::kAvx2) return f(Avx2{});
#endif
  f(Scalar{});
}

}  // namespace simd
