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
