"""The row-scale kernels (the deferred norm's, and a row-scaled FP8 layer's), the structured-output mask, the
sampling-filter floor and the MoE routing kernels (route, align) compile for the H100 (sm_90), on any machine.

The Triton interpreter runs the kernels on the CPU without checking what only the GPU compiler rejects: a jit
function reading a global that is not a `tl.constexpr`, a type error in a branch the tests' shapes do not take.
So the kernels are compiled for sm_90 here, in a subprocess (this test session's kernels are interpreted), with
the deferred norm's row scale in both forms: the rows, and their 1 / RMS precomputed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nvcli.kernels import (
        activation,
        fp8_gemm,
        fp8_rows,
        fused_moe,
        moe_route,
        rms_norm,
        rotary,
        sampling_filters,
        token_bitmask,
    )

    def compile_for_hopper(kernel, types, constexprs, num_warps=4):
        names = kernel.arg_names
        # constexpr parameters left out take their defaults (not "i32")
        constexprs = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | constexprs
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

    for rs_block in (1, 1024):  # precomputed 1 / RMS, and the rows themselves
        rs = "*fp32" if rs_block == 1 else "*bf16"
        compile_for_hopper(
            activation._silu_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "rs_ptr": rs, "rs_eps": "fp32"},
            dict(BLOCK=1024, PDL=False, ROW_SCALE=True, RS_BLOCK=rs_block, QUANT=False))
        compile_for_hopper(
            rotary._rope_store_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32",
             "qw_ptr": "*bf16", "kw_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_scale_val": "fp32", "v_scale_val": "fp32",
             "eps": "fp32", "rs_ptr": rs, "rs_eps": "fp32"},
            dict(GROUP=2, GROUP_PAD=2, HALF=64, PAGE=16, NORM=True, STORE=True, QUANT=False, SCALE_IS_PTR=False,
                 FP8_MAX=448.0, PDL=False, ROW_SCALE=True, RS_BLOCK=rs_block, RATIOS=False))
    # a row-scaled FP8 layer (kernels/fp8_rows.py): q / k / v and gate / up factors beside the row scale, the
    # norm and SiLU-and-mul writing their rows quantized, the attention output's row kernel
    compile_for_hopper(
        rotary._rope_store_kernel,
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32",
         "qw_ptr": "*bf16", "kw_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
         "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_scale_val": "fp32", "v_scale_val": "fp32",
         "eps": "fp32", "rs_ptr": "*fp32", "rs_eps": "fp32", "ratio_ptr": "*fp32"},
        dict(GROUP=2, GROUP_PAD=2, HALF=64, PAGE=16, NORM=True, STORE=True, QUANT=False, SCALE_IS_PTR=False,
             FP8_MAX=448.0, PDL=False, ROW_SCALE=True, RS_BLOCK=1, RATIOS=True))
    for block in (16384, 2048):  # the row held whole, and in two passes
        compile_for_hopper(
            activation._silu_and_mul_quant_rows_kernel,
            {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rs_ptr": "*fp32", "ratio_ptr": "*fp32",
             "rs_eps": "fp32"},
            dict(BLOCK=block, ROW_SCALE=True, RS_BLOCK=1, RATIOS=True, FP8_MAX=448.0, ACT_EPS=1e-10), num_warps=16)
    compile_for_hopper(
        rms_norm._rms_norm_kernel,
        {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "new_res_ptr": "*bf16",
         "eps": "fp32", "xs_ptr": "*fp32", "qs_ptr": "*fp32"},
        dict(N=4096, BLOCK=4096, HAS_RES=True, PDL=False, X_SCALE=True, QUANT=True), num_warps=8)
    compile_for_hopper(fp8_rows._quant_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                       dict(BLOCK=2048, FP8_MAX=448.0, ACT_EPS=1e-10), num_warps=8)
    # FP8 activations, through quantize_groups: the quantization kernel, and SiLU-and-mul writing them
    compile_for_hopper(fp8_gemm._quant_act_kernel,
                       {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "eps": "fp32"},
                       dict(FP8_MAX=448.0, GROUP=128, GROUPS=8))
    compile_for_hopper(activation._silu_and_mul_kernel,
                       {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "rs_ptr": "*bf16", "rs_eps": "fp32", "s_ptr": "*fp32"},
                       dict(BLOCK=1024, PDL=False, ROW_SCALE=False, RS_BLOCK=1, QUANT=True))
    compile_for_hopper(rms_norm._row_rstd_kernel, {"x_ptr": "*bf16", "out_ptr": "*fp32", "eps": "fp32"},
                       dict(ROWS=8, BLOCK=1024))
    for logits in ("*bf16", "*fp32", "*fp16"):  # structured outputs' mask, in the model's dtype
        compile_for_hopper(token_bitmask._apply_token_bitmask_kernel,
                           {"logits_ptr": logits, "rows_ptr": "*i64", "mask_ptr": "*i32"},
                           dict(BLOCK=token_bitmask._BLOCK))
    for logits, key16 in (("*bf16", True), ("*fp32", False)):  # 16-bit order keys, and float32's
        compile_for_hopper(sampling_filters._filter_floor_kernel,
                           {"logits_ptr": logits, "temps_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
                            "min_p_ptr": "*fp32", "floor_ptr": "*fp32", "scratch_ptr": logits},
                           dict(KEY16=key16, NUM_PROBES=sampling_filters.PROBES, BLOCK_N=sampling_filters.BLOCK,
                                SCAN_N=sampling_filters.SCAN_BLOCK, CAP=sampling_filters.CAPACITY,
                                STAGES=sampling_filters.STAGES, NUCLEUS_LANES=sampling_filters.NUCLEUS_LANES))
    for num_rows, block_m in ((1024, 16), (131072, 64)):  # the alignment kernel's two chunk sizes, 128 experts
        chunk, warps = fused_moe.align_chunk(num_rows)
        compile_for_hopper(fused_moe._moe_align_kernel,
                           {"ids_ptr": "*i64", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                            "num_padded_ptr": "*i32"},
                           dict(NUM_EXPERTS=128, BINS=256, BLOCK_M=block_m, CHUNK=chunk), num_warps=warps)
    for logits, experts, top_k in (("*bf16", 128, 8), ("*fp32", 60, 6)):  # Qwen3-MoE's; k and experts off powers of 2
        compile_for_hopper(moe_route._moe_route_kernel, {"logits_ptr": logits, "weights_ptr": logits, "ids_ptr": "*i64"},
                           dict(**moe_route.route_constexprs(experts, top_k), ROWS=8, RENORMALIZE=True,
                                EXACT_EXP=True), num_warps=2)
    print("compiled")
""")


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
