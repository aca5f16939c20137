"""Every .cu kernel compiles for sm_80 and sm_90 through CuPy's NVRTC without spills (no GPU)."""

from __future__ import annotations

import pytest

from kvcore.kernels import compile_check

cupy = pytest.importorskip("cupy", reason="cupy-cuda12x (the dev extra) provides NVRTC")

EXPECTED_KERNELS = {
    "cache_ops.cu": {"copy_blocks", "reshape_and_cache_f16_fp8", "reshape_and_cache_f32_f32"},
    "paged_attention_decode.cu": {"paged_attention_decode_f16_f16",
                                  "paged_attention_decode_f16_fp8", "paged_attention_reduce_f16"},
    "paged_attention_prefill.cu": {"paged_attention_prefill_f16_f16",
                                   "paged_attention_prefill_bf16_fp8"},
    "layers.cu": {"rms_norm_f16", "rope_f16", "silu_and_mul_bf16"},
}


@pytest.mark.parametrize("arch", compile_check.ARCHS)
@pytest.mark.parametrize("source", sorted(EXPECTED_KERNELS))
def test_compiles_without_spills(source: str, arch: str) -> None:
    reports = compile_check.compile_source(compile_check.KERNEL_DIR / source, arch)
    for r in reports:
        print(f"{r.kernel} sm_{r.arch}: {r.registers} registers, {r.stack_bytes} bytes stack")
    names = {r.kernel for r in reports}
    assert EXPECTED_KERNELS[source] <= names, f"missing kernels: {EXPECTED_KERNELS[source] - names}"
    assert all(r.arch == arch for r in reports)
    spilled = [r.kernel for r in reports if r.spill_stores or r.spill_loads]
    assert not spilled, f"register spills in {spilled}"
    assert all(0 < r.registers <= 255 for r in reports)


def test_every_source_is_checked() -> None:
    assert {p.name for p in compile_check.kernel_sources()} == set(EXPECTED_KERNELS)


def test_compile_error_is_reported(tmp_path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[0] = y; }\n')
    with pytest.raises(Exception, match="identifier \"y\" is undefined"):
        compile_check.compile_source(bad, "80")


def test_spill_report_is_parsed() -> None:
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem\n")
    (report,) = compile_check.parse_ptxas_log("k.cu", log)
    assert (report.kernel, report.arch, report.registers) == ("k", "90", 255)
    assert (report.stack_bytes, report.spill_stores, report.spill_loads) == (24, 8, 12)
    assert report.static_smem == 1024


def test_cuda_module_mirrors_the_reference_signatures() -> None:
    """kvcore.kernels.cuda imports without a device and has the reference kernels' signatures."""
    import inspect

    from kvcore.kernels import cpu as reference
    from kvcore.kernels import cuda

    for name in ("reshape_and_cache", "paged_attention", "copy_blocks", "rms_norm",
                 "silu_and_mul", "rope"):
        want = inspect.signature(getattr(reference, name)).parameters
        got = inspect.signature(getattr(cuda, name)).parameters
        assert [(p.name, p.default) for p in got.values()] == \
            [(p.name, p.default) for p in want.values()], name
