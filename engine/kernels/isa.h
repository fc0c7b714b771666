// Which instruction-set path the kernels run: the best this build has (the build is
// -march=native, so what it has is what this CPU has), unless set_isa() forces a lower one
// (PDSERVE_ISA, read by engine/worker/kernels/__init__.py; the tests force each in turn).
// Levels, lowest first: scalar (plain C++), avx2 (AVX2+FMA, 8 floats), avx512 (AVX-512F/BW,
// 16 floats), avx512_bf16 (avx512 plus vdpbf16ps for bf16 x bf16 dot products).
#pragma once

#include <string>
#include <vector>

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

constexpr Isa kBestIsa =
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    Isa::kAvx512Bf16;
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    Isa::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
    Isa::kAvx2;
#else
    Isa::kScalar;
#endif

Isa current_isa();  // defined in ops.cpp

// Whether this CPU is AMD's: data a decode step reads once (the KV cache, the weights) is
// prefetched with NTA there. On a Zen 5 EPYC paged_decode read 1.10x (fp32) and 1.14x (bf16)
// the KV a second against T0 at batch 32 x 1024, and the float32 skinny kernel 1.11-1.29x the
// weights against T1 at 2-8 rows (1 thread; 1.0-1.07x at 2; scripts/decode_kernels_ab.py):
// lines read once are not written back into its L3, a victim cache, on their way out. Intel
// CPUs keep the hints measured on them (NTA's placement differs most between vendors).
// PDSERVE_AMD_CPU: set by the build (engine/kernels/__init__.py reads /proc/cpuinfo; each
// machine builds its own -march=native copy). A compile-time choice: a run-time flag tested in
// the skinny kernel's inner loop cost it 25-33 % at 2-8 rows.
#if defined(PDSERVE_AMD_CPU)
constexpr bool kAmdCpu = true;
#else
constexpr bool kAmdCpu = false;
#endif
