"""Static evidence for the int4 variants of the register-tile kernels (KVC_INT4): NVRTC compiles
them for sm_80 and sm_90 without spills, with the 16-bit path's mma.sync steps, cp.async staging,
and the launcher's shared-memory sizes and register bounds."""

from __future__ import annotations

import pytest

from kvcore.kernels.cuda.attention_kv_int4 import (
    INT4_DECODE_REGISTERS,
    int4_decode_smem_bytes,
    int4_defines,
    int4_tiles_bytes,
)
from kvcore.kernels.cuda.dev import compile_check

cupy = pytest.importorskip("cupy", reason="cupy-cuda12x (the dev extra) provides NVRTC")


@pytest.mark.parametrize("variant", [(128, 8, "f16", "90"), (64, 1, "bf16", "80"),
                                     (64, 32, "f16", "90")], ids=lambda v: "-".join(map(str, v)))
def test_int4_decode_variant(variant: tuple[int, int, str, str]) -> None:
    head_dim, group, act, arch = variant
    (chosen,) = [v for v in compile_check.variants((head_dim,), (group,), ((act, "int4"),))
                 if v.source == "paged_attention_decode_tc.cu"]
    assert "KVC_INT4" in chosen.defines
    (report,) = compile_check.check_variants([chosen], (arch,))
    print(f"{report.variant} sm_{arch}: {report.registers} registers, {report.tensor_core_ops} "
          f"mma.sync, {report.cp_async} cp.async, {report.dynamic_smem} bytes of shared memory, "
          f"{report.tile_global_bytes} global bytes per tile")
    rows = 2 if group > 16 else 1  # two 16-row blocks of query heads: two S and O passes
    slices = 4 // rows
    assert report.tensor_core_ops == head_dim // 16 * 64 // slices // 8 + head_dim // 8 * (
        64 // slices // 16)
    assert report.cp_async > 0
    assert compile_check.problems([report], [chosen]) == []
    if arch == "90":
        assert report.registers <= INT4_DECODE_REGISTERS[head_dim]
    # a quarter of the 16-bit tile's K + V bytes plus the scales and zeros
    assert report.tile_global_bytes < 0.35 * 2 * 64 * head_dim * 2


@pytest.mark.parametrize("arch", compile_check.ARCHS)
def test_int4_prefill_variant(arch: str) -> None:
    (chosen,) = [v for v in compile_check.variants((128,), (1,), (("f16", "int4"),))
                 if v.source == "paged_attention_prefill_mma.cu"]
    (report,) = compile_check.check_variants([chosen], (arch,))
    # as the 16-bit variant: P V runs in passes of 4 n-tile pairs (2 per key step), whose body
    # the static count takes once
    assert report.tile_mma + report.inner_mma == 8 * 8 + 4 * 16
    assert report.cp_async > 0
    assert compile_check.problems([report], [chosen]) == []


def test_int4_launcher_smem_is_the_kernels(tmp_path) -> None:
    """The launcher's shared-memory sizes are the kernels' kSmemBytes (static_asserts)."""
    probe = tmp_path / "smem_probe.cu"
    for source, size, gqa in (("paged_attention_decode_tc.cu", int4_decode_smem_bytes, 4),
                              ("paged_attention_prefill_mma.cu", int4_tiles_bytes, None)):
        for head_dim, group in ((64, 64), (128, 32)):
            probe.write_text(f'#include "{source}"\n'
                             f"static_assert(kSmemBytes == {size(head_dim, group)},"
                             ' "launcher and kernel disagree on shared memory");\n')
            compile_check.compile_source(probe, "90", int4_defines(head_dim, "f16", group, gqa))
