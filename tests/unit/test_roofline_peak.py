"""The roofline's FMA peak loop runs on the path the kernels run on (`PDSERVE_ISA`): forced
onto AVX2 on an AVX-512 CPU it issues 256-bit FMAs, so that CPU stands in for an AVX2-only one
with the ceiling such a CPU has (issue 33 item 5), not its own AVX-512 one."""

from __future__ import annotations

# path -> the peak loop's vectors: (instruction set, fp32 lanes, independent chains)
EXPECTED = {"avx512_bf16": ("avx512", 16, 16), "avx512": ("avx512", 16, 16),
            "avx2": ("avx2", 8, 12), "scalar": ("scalar", 1, 8)}


def test_the_peak_loop_follows_the_kernel_path(kernel_isa):
    isa, lanes, chains = EXPECTED[kernel_isa.get_isa()]
    assert (kernel_isa.fma_isa(), kernel_isa.fma_lanes(), kernel_isa.fma_chains()) == (
        isa, lanes, chains)
    assert kernel_isa.fma_seconds(1, 10_000) > 0

