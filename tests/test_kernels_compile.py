"""Static evidence without a GPU: every kernel variant compiles through CuPy's NVRTC for sm_80
and sm_90 without spills; decode stays in its register budget with 16-byte loads."""

from __future__ import annotations

import json

import pytest

from kvcore.kernels.cuda.dev import compile_check
from kvcore.kernels.cuda.dev.ptx_facts import tile_loop

cupy = pytest.importorskip("cupy", reason="cupy-cuda12x (the dev extra) provides NVRTC")

EXPECTED_KERNELS = {
    "cache_ops.cu": {"copy_blocks", "reshape_and_cache_f16_fp8", "reshape_and_cache_f32_f32"},
    "paged_attention_decode.cu": {"paged_attention_decode", "paged_attention_reduce"},
    "paged_attention_decode_tc.cu": {"paged_attention_decode_tc"},
    "paged_attention_prefill.cu": {"paged_attention_prefill_f16_f16",
                                   "paged_attention_prefill_bf16_fp8"},
    "paged_attention_prefill_tc.cu": {"paged_attention_prefill_tc"},
    "paged_attention_prefill_mma.cu": {"paged_attention_prefill_mma"},
    "layers.cu": {"rms_norm_f16", "rope_f16", "silu_and_mul_bf16"},
    "mla_attention.cu": {"mla_paged_attention", "mla_reduce"},
    "kv_int4_cache.cu": {"reshape_and_cache_int4_f16", "reshape_and_cache_int4_bf16",
                      "seal_blocks_int4"},
}


@pytest.mark.parametrize("arch", compile_check.ARCHS)
@pytest.mark.parametrize("source", sorted(set(EXPECTED_KERNELS) - {
    "paged_attention_decode.cu", "paged_attention_decode_tc.cu", "paged_attention_prefill_tc.cu",
    "paged_attention_prefill_mma.cu", "mla_attention.cu"}))
def test_compiles_without_spills(source: str, arch: str) -> None:
    reports = compile_check.compile_source(compile_check.KERNEL_DIR / source, arch)
    for r in reports:
        print(f"{r.kernel} sm_{r.arch}: {r.registers} registers, {r.stack_bytes} bytes stack")
    names = {r.kernel for r in reports}
    assert EXPECTED_KERNELS[source] <= names, f"missing kernels: {EXPECTED_KERNELS[source] - names}"
    assert all(r.arch == arch for r in reports)
    assert not compile_check.problems(reports, [])
    assert all(0 < r.registers <= 255 for r in reports)


# the decode variants of common models, on both archs: Llama-3 8B (128, 4), 70B (128, 8),
# SmolLM2 (64, 3), Gemma (256, 2), an MHA model (128, 1), with fp16, bf16 and fp8 caches
DECODE_VARIANTS = [(128, 8, "f16", "f16"), (128, 8, "f16", "fp8"), (128, 4, "bf16", "bf16"),
                   (64, 3, "f16", "fp8"), (256, 2, "bf16", "fp8"), (128, 1, "f16", "f16")]


@pytest.mark.parametrize("arch", compile_check.ARCHS)
@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_decode_variant_budget(variant: tuple[int, int, str, str], arch: str) -> None:
    head_dim, group, act, cache = variant
    chosen = next(v for v in compile_check.variants((head_dim,), (group,), ((act, cache),))
                  if v.group)
    reports = compile_check.check_variants([chosen], (arch,))
    decode = next(r for r in reports if r.kernel == "paged_attention_decode")
    print(f"{decode.variant} sm_{arch}: {decode.registers} registers, "
          f"{decode.vector_loads} 16-byte loads")
    assert {r.kernel for r in reports} == EXPECTED_KERNELS["paged_attention_decode.cu"]
    assert compile_check.problems(reports, [chosen]) == []
    # K and V: one 16-byte load each per unrolled step (4 steps for 16-bit caches, 2 for fp8)
    assert decode.vector_loads >= (4 if cache == "fp8" else 8)
    if arch == "90":
        assert decode.registers <= compile_check.DECODE_REGISTER_BUDGET


@pytest.mark.parametrize("arch", compile_check.ARCHS)
@pytest.mark.parametrize("variant", [(128, "f16", "f16"), (256, "bf16", "fp8")],
                         ids=lambda v: "-".join(map(str, v)))
def test_prefill_uses_tensor_cores(variant: tuple[int, str, str], arch: str) -> None:
    head_dim, act, cache = variant
    (chosen,) = [v for v in compile_check.variants((head_dim,), (1,), ((act, cache),))
                 if v.source == "paged_attention_prefill_tc.cu"]
    (report,) = compile_check.check_variants([chosen], (arch,))
    print(f"{report.variant} sm_{arch}: {report.registers} registers, {report.tensor_core_ops} "
          f"wmma.mma, {report.dynamic_smem} bytes of dynamic shared memory")
    assert report.kernel == "paged_attention_prefill_tc"
    assert report.tensor_core_ops >= 2  # S = Q K^T and O += P V
    assert report.dynamic_smem > 48 * 1024  # opted in
    assert compile_check.problems([report], [chosen]) == []


# the register-tile decode kernel: Llama-3 8B's shape on both archs, a smaller fp8 one on sm_90
@pytest.mark.parametrize("variant", [(128, 4, "f16", "f16", "80"), (128, 4, "f16", "f16", "90"),
                                     (64, 8, "bf16", "fp8", "90")],
                         ids=lambda v: "-".join(map(str, v)))
def test_register_tile_decode_stages_asynchronously(variant: tuple[int, int, str, str, str]
                                                    ) -> None:
    head_dim, group, act, cache, arch = variant
    (chosen,) = [v for v in compile_check.variants((head_dim,), (group,), ((act, cache),))
                 if v.source == "paged_attention_decode_tc.cu"]
    (report,) = compile_check.check_variants([chosen], (arch,))
    print(f"{report.variant} sm_{arch}: {report.registers} registers, {report.tensor_core_ops} "
          f"mma.sync, {report.cp_async} cp.async, {report.tile_smem_bytes} shared bytes per "
          f"tile of {report.tile_global_bytes}")
    assert report.kernel == "paged_attention_decode_tc"
    # S: head_dim / 16 k-steps x 2 n-tiles, O: 1 key step x head_dim / 8 n-tiles
    assert report.tensor_core_ops == head_dim // 16 * 2 + head_dim // 8
    assert report.cp_async > 0
    # the tile in by cp.async and out once as fragments: exactly twice its global bytes
    assert report.tile_smem_bytes == 2 * report.tile_global_bytes
    assert compile_check.problems([report], [chosen]) == []


def test_register_tile_prefill_stays_under_the_tile_traffic_limit() -> None:
    (chosen,) = [v for v in compile_check.variants((128,), (1,), (("f16", "f16"),))
                 if v.source == "paged_attention_prefill_mma.cu"]
    (report,) = compile_check.check_variants([chosen], ("90",))
    print(f"{report.variant} sm_90: {report.registers} registers, {report.tensor_core_ops} "
          f"mma.sync, {report.cp_async} cp.async, {report.tile_smem_bytes} shared bytes per "
          "128 x 64 tile")
    # S: 8 k-steps x 8 n-tiles, O: 4 key steps x 16 n-tiles
    assert report.tensor_core_ops == 8 * 8 + 4 * 16
    assert report.cp_async > 0
    # 32 KB in by cp.async, each of 8 warps reads the tile's 32 KB once: 144 KB per 64 x 64
    assert report.tile_smem_bytes == 32 * 1024 + 8 * 32 * 1024
    assert compile_check.problems([report], [chosen]) == []


@pytest.mark.parametrize("variant", [(128, "f16", "f16"), (64, "bf16", "fp8")],
                         ids=lambda v: "-".join(map(str, v)))
def test_planner_reads_the_kernels_smem_formula_and_registers(tmp_path,
                                                              variant: tuple[int, str, str]
                                                              ) -> None:
    """The launcher's shared-memory sizes are the kernels' own kSmemBytes (a static_assert in
    each kernel's compile), and its register table bounds what ptxas reports on sm_90."""
    from kvcore.kernels.cuda.attention import (
        DECODE_TC_REGISTERS,
        decode_defines,
        decode_tc_smem_bytes,
        prefill_mma_smem_bytes,
        prefill_tc_defines,
    )

    head_dim, act, cache = variant
    itemsize = 1 if cache == "fp8" else 2
    probe = tmp_path / "smem_probe.cu"
    probe.write_text('#include "paged_attention_decode_tc.cu"\n'
                     f"static_assert(kSmemBytes == {decode_tc_smem_bytes(head_dim, itemsize)},"
                     ' "launcher and kernel disagree on shared memory");\n')
    reports = compile_check.compile_source(probe, "90", decode_defines(head_dim, 8, act, cache))
    (report,) = [r for r in reports if r.kernel == "paged_attention_decode_tc"]
    assert report.registers <= DECODE_TC_REGISTERS[head_dim, itemsize]
    probe.write_text('#include "paged_attention_prefill_mma.cu"\n'
                     f"static_assert(kSmemBytes == {prefill_mma_smem_bytes(head_dim, itemsize)},"
                     ' "launcher and kernel disagree on shared memory");\n')
    compile_check.compile_source(probe, "90", prefill_tc_defines(head_dim, act, cache))


# DeepSeek's latent shape (512 + 64): the 16-bit cache on one arch, fp8 on the other
@pytest.mark.parametrize("variant", [("bf16", "bf16", "80"), ("f16", "fp8", "90")],
                         ids=lambda v: "-".join(v))
def test_mla_kernel_is_a_register_tile_kernel(variant: tuple[str, str, str]) -> None:
    from kvcore.kernels.cuda.mla import MLA_REGISTERS, mla_tile_traffic

    act, cache, arch = variant
    (chosen,) = [v for v in compile_check.variants((), (), ((act, cache),))
                 if v.source == "mla_attention.cu" and arch in v.archs]
    reports = compile_check.check_variants([chosen], (arch,))
    assert {r.kernel for r in reports} == EXPECTED_KERNELS["mla_attention.cu"]
    report = next(r for r in reports if r.kernel == "mla_paged_attention")
    print(f"{report.variant} sm_{arch}: {report.registers} registers, {report.tensor_core_ops} "
          f"mma.sync, {report.cp_async} cp.async, {report.tile_smem_bytes} shared bytes per "
          f"tile of {report.tile_global_bytes}, {report.dynamic_smem} bytes of dynamic shared "
          "memory")
    # per tile (64 keys; 32 for a 16-bit cache on sm_80): S 36 k-steps x keys / 16 n-tiles per
    # warp, O keys / 16 key steps x 8 n-tiles x 4 row blocks (each V fragment loaded once)
    itemsize = 1 if cache == "fp8" else 2
    keys = 32 if (itemsize, arch) == (2, "80") else 64
    assert report.variant.endswith(f"KVC_MLA_KEYS={keys}")
    # the 16-bit cache's S loop (ldmatrix) is unrolled 3 pairs of k-steps at a time: 6 passes
    passes = 6 if itemsize == 2 else 1
    assert report.tile_mma + (passes - 1) * report.inner_mma == \
        36 * keys // 16 + keys // 16 * 8 * 4
    assert report.cp_async > 0
    tile, shared, _ = mla_tile_traffic(512, 64, itemsize, keys)
    assert report.tile_global_bytes == tile
    if passes == 1:
        assert report.tile_smem_bytes == shared  # the PTX moves exactly what the model counts
    assert report.registers <= MLA_REGISTERS
    assert 48 * 1024 < report.dynamic_smem <= compile_check.SMEM_OPT_IN[arch]
    assert compile_check.problems(reports, [chosen]) == []


def test_mla_launcher_reads_the_kernels_smem_formula(tmp_path) -> None:
    """mla_smem_bytes is the kernel's kSmemBytes (a static_assert in the kernel's compile)."""
    from kvcore.kernels.cuda.mla import mla_defines, mla_smem_bytes

    probe = tmp_path / "smem_probe.cu"
    for rank, rope, cache, keys in ((512, 64, "fp8", 64), (512, 64, "bf16", 64),
                                    (512, 64, "f16", 32), (960, 64, "bf16", 16)):
        itemsize = 1 if cache == "fp8" else 2
        smem = mla_smem_bytes(rank, rope, itemsize, keys)
        probe.write_text('#include "mla_attention.cu"\n'
                         f"static_assert(kSmemBytes == {smem},"
                         ' "launcher and kernel disagree on shared memory");\n')
        act = "bf16" if cache == "fp8" else cache
        compile_check.compile_source(probe, "90", mla_defines(rank, rope, act, cache, keys))


def test_mla_traffic_limit_is_checked() -> None:
    chosen = [compile_check.Variant("mla_attention.cu")]
    tile = dict(tensor_core_ops=136, cp_async=18, tile_global_bytes=36864,
                variant="KVC_LORA_RANK=512 KVC_ROPE_DIM=64")
    assert compile_check.problems([_report("mla_paged_attention", **tile,
                                           tile_smem_bytes=32 * 14 * 1024)], chosen) == []
    (traffic,) = compile_check.problems([_report("mla_paged_attention", **tile,
                                                 tile_smem_bytes=32 * 14 * 1024 + 32)], chosen)
    assert traffic.startswith("shared-memory traffic per cached key")
    (no_cp,) = compile_check.problems([_report("mla_paged_attention", **{**tile, "cp_async": 0},
                                               tile_smem_bytes=1024)], chosen)
    assert no_cp.startswith("no cp.async staging")


def _report(kernel: str, **fields: int | str) -> compile_check.KernelReport:
    base: dict = dict(source="x.cu", kernel=kernel, arch="90", registers=64, stack_bytes=0,
                      spill_stores=0, spill_loads=0, static_smem=0, variant="KVC_GROUP=8",
                      vector_loads=8)
    return compile_check.KernelReport(**{**base, **fields})


def test_problems_flag_spills_budget_and_scalar_loads() -> None:
    chosen = [compile_check.Variant("paged_attention_decode.cu", ("KVC_GROUP=8",), 8),
              compile_check.Variant("paged_attention_decode.cu", ("KVC_GROUP=16",), 16)]
    assert compile_check.problems([_report("paged_attention_decode")], chosen) == []
    (spill,) = compile_check.problems([_report("k", spill_stores=8)], chosen)
    assert spill.startswith("register spill: k")
    (budget,) = compile_check.problems([_report("paged_attention_decode", registers=97)], chosen)
    assert "97 > 96" in budget
    # groups over 8 and sm_80 are outside the budget
    assert compile_check.problems([_report("paged_attention_decode", registers=120,
                                           variant="KVC_GROUP=16")], chosen) == []
    assert compile_check.problems([_report("paged_attention_decode", registers=120,
                                           arch="80")], chosen) == []
    (scalar,) = compile_check.problems([_report("paged_attention_decode", vector_loads=0)],
                                       chosen)
    assert scalar.startswith("no 16-byte global loads")
    (no_tc,) = compile_check.problems([_report("paged_attention_prefill_tc")], chosen)
    assert no_tc.startswith("no tensor-core instructions")
    (smem,) = compile_check.problems([_report("k", arch="80", dynamic_smem=170 * 1024)], chosen)
    assert smem.startswith("shared memory over the sm_80 limit")
    tile = dict(tensor_core_ops=32, cp_async=32, tile_global_bytes=32768)
    assert compile_check.problems([_report("paged_attention_decode_tc", **tile,
                                           tile_smem_bytes=65536)], chosen) == []
    (no_cp,) = compile_check.problems([_report("paged_attention_decode_tc", **{
        **tile, "cp_async": 0}, tile_smem_bytes=65536)], chosen)
    assert no_cp.startswith("no cp.async staging")
    (traffic,) = compile_check.problems([_report("paged_attention_decode_tc", **tile,
                                                 tile_smem_bytes=65537)], chosen)
    assert traffic.startswith("shared-memory traffic per key tile")


def test_ptx_facts_count_per_kernel() -> None:
    ptx = (".visible .entry a(\n ld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
           " ld.global.v2.u64 {%rd2, %rd3}, [%rd4];\n ld.global.v2.u32 {%r5, %r6}, [%rd4];\n}\n"
           ".visible .entry b(\n wmma.mma.sync.aligned.row.col.m16n16k16.f32.f16 ...;\n"
           " mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 ...;\n ld.global.f32 %f1;\n}\n")
    facts = compile_check.ptx_facts(ptx)
    assert (facts["a"].vector_loads, facts["a"].tensor_core_ops) == (2, 0)
    assert (facts["b"].vector_loads, facts["b"].tensor_core_ops) == (0, 2)


def test_tile_loop_traffic_is_read_from_the_ptx() -> None:
    """The key-tile loop is the smallest loop holding a wait_group and an mma; its shared bytes
    are the ld/st.shared widths and cp.async sizes, times .maxntid's threads."""
    ptx = (".visible .entry k(\n.maxntid 128, 1, 1\n"
           " ld.shared.v4.u32 {%r1, %r2, %r3, %r4}, [%r9];\n$L__BB0_2:\n"
           " cp.async.cg.shared.global [%r5], [%rd1], 16, %r6;\n"
           " cp.async.wait_group 1;\n$L__BB0_3:\n ld.shared.u16 %rs1, [%r7];\n"
           " mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 ...;\n"
           " st.shared.v2.f32 [%r8], {%f1, %f2};\n @%p1 bra $L__BB0_3;\n"
           " @%p2 bra.uni $L__BB0_2;\n @%p3 bra $L__BB0_9;\n$L__BB0_9:\n ret;\n}\n")
    (facts,) = compile_check.ptx_facts(ptx).values()
    assert facts.cp_async == 1
    # the inner loop (label 3) has no wait_group: the tile loop runs from label 2
    assert facts.tile_smem_bytes == (16 + 2 + 8) * 128
    assert tile_loop("$L__BB0_1:\n mma.sync ...;\n bra $L__BB0_1;\n") == ""


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code = compile_check.main(["--json", "--head-dims", "128", "--groups", "8", "--dtypes",
                               "f16-fp8", "--sources", "paged_attention_decode.cu",
                               "paged_attention_prefill_tc.cu"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    decode = [r for r in rows if r["kernel"] == "paged_attention_decode"]
    assert {r["arch"] for r in decode} == set(compile_check.ARCHS)
    assert all(r["vector_loads"] > 0 and r["spill_stores"] == 0 for r in decode)
    assert {"registers", "static_smem", "dynamic_smem", "tensor_core_ops"} <= set(rows[0])
    assert {r["source"] for r in rows} == {"paged_attention_decode.cu",
                                           "paged_attention_prefill_tc.cu"}
    prefill = [r for r in rows if r["kernel"] == "paged_attention_prefill_tc"]
    assert prefill and all(r["tensor_core_ops"] > 0 for r in prefill)


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


def test_cuda_module_mirrors_the_cpu_signatures() -> None:
    """kvcore.kernels.cuda imports without a device and has the CPU kernels' signatures."""
    import inspect

    from kvcore.kernels import cpu, cuda

    for name in ("reshape_and_cache", "paged_attention", "copy_blocks", "rms_norm",
                 "silu_and_mul", "rope"):
        want = inspect.signature(getattr(cpu, name)).parameters
        got = inspect.signature(getattr(cuda, name)).parameters
        assert [(p.name, p.default) for p in got.values()] == \
            [(p.name, p.default) for p in want.values()], name
