"""The row-scale kernels, the structured-output mask and the sampling-filter floor compile for the H100 (sm_90), on any
machine.

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

    from nvcli.kernels import activation, rms_norm, rotary, sampling_filters, token_bitmask

    def compile_for_hopper(kernel, types, constexprs):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

    for rs_block in (1, 1024):  # precomputed 1 / RMS, and the rows themselves
        rs = "*fp32" if rs_block == 1 else "*bf16"
        compile_for_hopper(
            activation._silu_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "rs_ptr": rs, "rs_eps": "fp32"},
            dict(BLOCK=1024, PDL=False, ROW_SCALE=True, RS_BLOCK=rs_block))
        compile_for_hopper(
            rotary._rope_store_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32",
             "qw_ptr": "*bf16", "kw_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "k_scale_val": "fp32", "v_scale_val": "fp32",
             "eps": "fp32", "rs_ptr": rs, "rs_eps": "fp32"},
            dict(GROUP=2, GROUP_PAD=2, HALF=64, PAGE=16, NORM=True, STORE=True, QUANT=False, SCALE_IS_PTR=False,
                 FP8_MAX=448.0, PDL=False, ROW_SCALE=True, RS_BLOCK=rs_block))
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
    print("compiled")
""")


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
