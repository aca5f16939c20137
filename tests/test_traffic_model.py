"""The traffic model (kvcore.kernels.cuda.dev.traffic_model): pipe slots and instruction counts
read from PTX, the floors' arithmetic, and docs/gpu-performance.md's tables equal to the tool's
output (compiled here through NVRTC)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.kernels.cuda.dev import traffic_model
from kvcore.kernels.cuda.dev.ptx_facts import inner_loops, instructions, ptx_facts, smem_slots

DOC = Path(__file__).resolve().parents[1] / "docs" / "gpu-performance.md"

PTX = """
.visible .entry k(
)
.maxntid 64, 1, 1
{
$L__BB0_1:
\tcp.async.cg.shared.global [%r1], [%rd1], 16, %r2;
\tcp.async.wait_group 1;
\tld.shared.u16 %rs1, [%r3];
\tld.shared.v4.u32 {%r4, %r5, %r6, %r7}, [%r8];
\tldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%r9, %r10, %r11, %r12}, [%r13];
$L__BB0_2:
\tadd.s32 %r14, %r14, 1;
\t@%p1 bra $L__BB0_2;
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4},
 {%r5, %r6}, {%f1, %f2, %f3, %f4};
\tst.shared.u32 [%r3], %r9;
\tbra.uni $L__BB0_1;
}
"""


def test_slots_instructions_and_inner_loops_from_ptx() -> None:
    """A 16-bit load is one slot (64 bytes), a 128-bit one four, an ldmatrix.x4 four, a 16-byte
    cp.async four; the inner loop is found and its body counted."""
    assert smem_slots("\tld.shared.u16 %rs1, [%r3];") == 1
    assert smem_slots("\tld.shared.v4.u32 {%r4, %r5, %r6, %r7}, [%r8];") == 4
    assert smem_slots(PTX) == 4 + 1 + 4 + 4 + 1
    facts = ptx_facts(PTX)["k"]
    assert facts.tile_mma == 1 and facts.tile_ldmatrix == 1
    assert facts.tile_instructions == instructions(PTX) == 10
    assert facts.tile_inner_loops == 1 and facts.inner_instructions == 2
    assert len(inner_loops(PTX)) == 1


def test_floors_and_the_int4_target() -> None:
    """The model's arithmetic on fixed counts: the decode fp16 step is HBM-bound, and int4 (a
    third of the bytes, 30% more instructions) is >= 1.8x faster at b64 x 4k."""
    fp16 = traffic_model.TileCost("fp16", 4, 714, 32, 128, 32768, 168, 0)
    int4 = traffic_model.TileCost("int4", 4, 935, 32, 150, 11264, 183, 0)
    a = traffic_model.decode_workload(fp16, 64, 4096)
    b = traffic_model.decode_workload(int4, 64, 4096)
    assert a.bound == "HBM" and b.bound == "issue"
    # 64 x 8 KV heads x 64 tiles x 32 KB + the 512-token partitions' partials
    assert a.hbm_us == pytest.approx((64 * 8 * 64 * 32768 + 64 * 32 * 8 * 130 * 8) / 4.3e6)
    assert a.estimate_us / b.estimate_us >= 1.8


@pytest.mark.slow
def test_doc_tables_are_the_tools_output() -> None:
    pytest.importorskip("cupy", reason="cupy-cuda12x (the dev extra) provides NVRTC")
    costs = traffic_model.tile_costs()
    want = traffic_model.markdown(costs, traffic_model.estimates(costs))
    text = DOC.read_text()
    begin, end = "<!-- traffic-model:begin -->\n", "\n<!-- traffic-model:end -->"
    got = text[text.index(begin) + len(begin):text.index(end)]
    assert got == want, "docs/gpu-performance.md: rerun python -m " \
                        "kvcore.kernels.cuda.dev.traffic_model and paste its tables"
