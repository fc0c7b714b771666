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



def test_a_stand_in_whose_gemm_beats_the_peak_is_told_which_library_kept_wide_vectors():
    from pdserve.bench.roofline import _standin_hint

    env = {"PDSERVE_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": None}
    assert "without MKL_ENABLE_INSTRUCTIONS" in _standin_hint({"isa_env": env})
    assert _standin_hint({"isa_env": {**env, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}) == ""
    assert _standin_hint({"isa_env": {"PDSERVE_ISA": None}}) == ""
