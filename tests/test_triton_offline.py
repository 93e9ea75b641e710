"""experiments/triton_offline.py (what a kernel compiles to, without a GPU): the lowering for an abstract H100 and
the SASS / ptxas readers run here; compiling needs the optional ``triton`` package, which CI does not install."""

from __future__ import annotations

import pytest

from conftest import load_experiment

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0040*/              @P0  HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
.L_x_1:
        /*0070*/                   BRA `(.L_x_1) ;
"""


def test_main_loop_is_the_longest_backward_branch_and_guards_are_dropped():
    mod = load_experiment("triton_offline")
    size, loop, total = mod.main_loop_mix(SASS)
    assert size == 4 and loop == {"LDSM": 1, "HMMA": 2, "BRA": 1}
    assert total["HMMA"] == 2 and total["BRA"] == 2 and total["EXIT"] == 1


def test_ptxas_report_reads_registers_and_spills():
    mod = load_experiment("triton_offline")
    text = ("ptxas info    : Function properties for k\n    344 bytes stack frame, 832 bytes spill stores, 568 bytes "
            "spill loads\nptxas info    : Used 255 registers, used 1 barriers")
    assert mod.ptxas_report(text) == {"registers": 255, "spill_stores": 832, "spill_loads": 568}


@pytest.mark.parametrize("op,kv,warps", [("paged_decode", "fp8", 8), ("tree_attention", "bf16", 8),
                                         ("paged_decode_pairs", "fp8", 8), ("tree_attention_pairs", "fp8", 8),
                                         ("skinny_matmul", "fp8", 4)])
def test_kernels_lower_to_one_triton_module_with_their_launch(op, kv, warps):
    mod = load_experiment("triton_offline")
    fn, args = mod.case(op, kv, b=2, n=64 if op == "skinny_matmul" else 16, prefix=1024, overrides={})
    ttir, params = mod.lower_for_h100(fn, *args)
    assert ttir.count("tt.func public") == 1
    assert ("tt.dot" in ttir) == (op != "skinny_matmul")  # two rows of x take the gemv form: no tensor cores
    assert params == {"num_warps": warps, "num_stages": 2}
    if op.endswith("_pairs"):  # the pair conversion is inline PTX, both halves
        assert ttir.count("cvt.rn.f16x2.e4m3x2") == 4  # even / odd of K and of V


@pytest.mark.parametrize("op", ["gdn_tree", "gdn_tree_gated"])
def test_tree_gdn_cases_lower(op):
    """The model's tree GDN launch at B1 x 23 slots lowers with its defaults; no solve has a barrier in the module
    (the substitution's cross-warp reductions are the compiler's, inserted later)."""
    mod = load_experiment("triton_offline")
    for solve in ("substitution", "doubling"):
        fn, args = mod.case(op, "fp8", b=1, n=23, prefix=0, overrides={"solve": solve})
        ttir, params = mod.lower_for_h100(fn, *args)
        assert ttir.count("tt.func public") == 1 and "tt.dot" in ttir
        assert params == {"num_warps": 8, "num_stages": 1}
        assert ttir.count("gpu.barrier") == 0, solve


def test_kernel_ptx_splits_entries_and_counts_instruction_families():
    mod = load_experiment("kernel_ptx")
    ptx = """
.visible .entry paged_decode_gp16(
    .param .u64 a
)
{
    cp.async.cg.shared.global [%r1], [%rd1], 16;
    @%p1 ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f1, %f2, %f3, %f4};
    cvt.rn.f16x2.e4m3x2 %r5, %rs1;
    bar.sync 0;
}
.visible .entry other(
)
{
    ld.local.u32 %r1, [%rd1];
}
"""
    entries = mod.ptx_entries(ptx)
    assert set(entries) == {"paged_decode_gp16", "other"}
    mix = mod.instruction_mix(entries["paged_decode_gp16"])
    assert (mix["cp_async"], mix["ld_global"], mix["mma_sync"], mix["cvt_fp8"], mix["bar"]) == (1, 1, 1, 1, 1)
    assert mix["ld_local"] == 0 and mod.instruction_mix(entries["other"])["ld_local"] == 1
