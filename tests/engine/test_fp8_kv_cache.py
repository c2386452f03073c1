"""fp8 KV cache on CPU (torch references): quantisation is consistent and costs little accuracy.

Tiny random Qwen3 in float32. A float32 KV cache is the reference; fp8 (e4m3, per-tensor scale)
must stay close in logits (teacher-forced over prompt + 24 reference tokens) and greedy decoding
may only diverge from it at near-ties. A run with the scales deliberately broken shows the bounds
catch a quantisation bug. Block accounting: the same byte budget holds 2x the tokens of a
16-bit cache (4x float32); fp8 pages default to 32 tokens with V stored dims-major.
"""

from __future__ import annotations

import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.engine import kv_sizing
from nvcli.kernels import ops
from nvcli.kernels.kv_layout import PagedKV
from nvcli.kernels.reference import (
    dequantize_kv,
    paged_attention_ref,
    paged_decode_attention_ref,
    quantize_kv,
    store_kvcache_ref,
)
from nvcli.testing.kv_quality import compare_logits, greedy_agreement, teacher_forced_logits

FP8 = torch.float8_e4m3fn
PROMPTS = [list(range(1000, 1005)), list(range(2000, 2040)), list(range(3000, 3023)), list(range(4000, 4070))]
MAX_TOKENS = 24
SHORT = 8  # teacher-forced tokens for the secondary checks (CPU time)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUDGET_GIB = 2**20 / 2**30  # 1 MiB of KV: 64 float32 blocks of this model, 256 fp8 blocks

# Measured on this model (fp8, scale 1): max |dlogit| ~0.23, mean KL ~4e-4, teacher-forced top-1
# agreement ~0.92; with the store ignoring a 0.05 scale: max |dlogit| > 2. Bounds sit in between.
MAX_ABS_LOGIT = 0.6
MAX_MEAN_KL = 5e-3
MIN_TOP1 = 0.8


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", max_model_len=256, enable_prefix_caching=False,
               cpu_kvcache_space_gib=BUDGET_GIB, **kwargs)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """float32 model, float32 KV: greedy outputs and teacher-forced logits along them."""
    llm = make_llm(tiny_model_dir("qwen3"))
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    logits = teacher_forced_logits(llm.engine.executor.runner, PROMPTS, outs)
    return dict(llm=llm, outs=outs, logits=logits)


def runner_of(llm: LLM):
    return llm.engine.executor.runner


def test_fp8_kv_close_to_fp32(tiny_model_dir, ref) -> None:
    llm = make_llm(tiny_model_dir("qwen3"), kv_cache_dtype="fp8")
    runner = runner_of(llm)
    assert runner.kv_cache.dtype == FP8
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    logits = teacher_forced_logits(runner, PROMPTS, ref["outs"])
    st = compare_logits(ref["logits"], logits)
    agree = greedy_agreement(ref["outs"], outs)
    print(f"fp8 vs fp32 KV: {st}, greedy {agree}")
    assert 1e-4 < st.max_abs_logit < MAX_ABS_LOGIT  # > 0: the cache really quantises
    assert st.mean_kl < MAX_MEAN_KL
    assert st.top1_agree >= MIN_TOP1
    # Free-running greedy: identical until the first divergence, and that may only happen where
    # the reference's top-2 margin is within the logit error (a near-tie of this random model).
    for r, t, lg in zip(ref["outs"], outs, ref["logits"]):
        d = next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), None)
        if d is None:
            continue
        top2 = lg[d].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin <= 2 * MAX_ABS_LOGIT, f"diverged at {d} where the reference margin is {margin:.3f}"


def test_fp8_kv_nonunit_scale_and_broken_scale(tiny_model_dir, ref, monkeypatch) -> None:
    scale = 0.05
    llm = make_llm(tiny_model_dir("qwen3"), kv_cache_dtype="fp8", kv_cache_scale=scale)
    runner = runner_of(llm)
    assert all(a.kv.k_scale.item() == a.kv.v_scale.item() == pytest.approx(scale) for a in runner.attn_layers)
    short = [o[:SHORT] for o in ref["outs"]]
    st = compare_logits([x[:SHORT] for x in ref["logits"]], teacher_forced_logits(runner, PROMPTS, short))
    print(f"fp8 (scale {scale}) vs fp32 KV: {st}")
    assert st.max_abs_logit < MAX_ABS_LOGIT and st.mean_kl < MAX_MEAN_KL and st.top1_agree >= MIN_TOP1
    # the store divided by the scale: the fp8 codes are ~1/scale times the float32 reference's
    amax_fp8 = runner.kv_cache.float().abs().max().item()
    amax_ref = runner_of(ref["llm"]).kv_cache.abs().max().item()
    assert amax_fp8 == pytest.approx(amax_ref / scale, rel=0.07)

    # Negative control: a store that ignores the scale (attention still dequantises with it).
    store = ops.store_kvcache
    monkeypatch.setattr(ops, "store_kvcache", lambda k, v, kv, sm: store(k, v, PagedKV(kv.k, kv.v), sm))
    first = [o[:1] for o in ref["outs"]]  # prefill logits only
    broken = compare_logits([x[:1] for x in ref["logits"]], teacher_forced_logits(runner, PROMPTS, first))
    print(f"broken scale: {broken}")
    assert broken.max_abs_logit > 2 * MAX_ABS_LOGIT and broken.mean_kl > 10 * MAX_MEAN_KL


def test_bf16_kv_under_fp32_model(tiny_model_dir, ref) -> None:
    llm = make_llm(tiny_model_dir("qwen3"), kv_cache_dtype="bfloat16")
    runner = runner_of(llm)
    assert runner.dtype == torch.float32 and runner.kv_cache.dtype == torch.bfloat16
    short = [o[:SHORT] for o in ref["outs"]]
    st = compare_logits([x[:SHORT] for x in ref["logits"]], teacher_forced_logits(runner, PROMPTS, short))
    print(f"bf16 vs fp32 KV: {st}")
    assert st.max_abs_logit < 0.1 and st.top1_agree >= 0.95


def test_block_accounting_same_budget(tiny_model_dir, ref) -> None:
    # num_kvcache_blocks=None on CPU: blocks = cpu_kvcache_space_gib // bytes per block
    runners = {"float32": runner_of(ref["llm"])}
    for kv in ("bfloat16", "fp8"):
        runners[kv] = runner_of(make_llm(tiny_model_dir("qwen3"), kv_cache_dtype=kv))
    blocks = {k: r.num_kvcache_blocks for k, r in runners.items()}
    tokens = {k: r.num_kvcache_blocks * r.block_size for k, r in runners.items()}
    assert blocks["float32"] == 64 and runners["float32"].block_size == 16
    assert tokens["bfloat16"] == 2 * tokens["float32"]
    assert runners["fp8"].block_size == 32  # the fp8 default: 32-token pages, V dims-major
    assert tokens["fp8"] == 2 * tokens["bfloat16"]  # fp8 doubles a 16-bit cache's tokens
    for kv, r in runners.items():
        assert r.kv_cache.nbytes == blocks[kv] * kv_sizing.kv_bytes_per_block(r) <= BUDGET_GIB * 2**30
    assert kv_sizing.kv_bytes_per_block(runners["fp8"]) == kv_sizing.kv_bytes_per_block(runners["bfloat16"])  # twice the tokens


def test_fp8_default_pages_store_v_dims_major(tiny_model_dir) -> None:
    """fp8 caches default to 32-token pages with V stored dims-major (kernels/kv_layout.py). The layout is
    invisible to the results: greedy outputs are token for token those of 16-token token-major pages."""
    from nvcli.kernels.kv_layout import is_dims_major

    dims_major = make_llm(tiny_model_dir("qwen3"), kv_cache_dtype="fp8")
    token_major = make_llm(tiny_model_dir("qwen3"), kv_cache_dtype="fp8", kvcache_block_size=16)
    for llm, expect in ((dims_major, True), (token_major, False)):
        attn = runner_of(llm).attn_layers[0]
        assert is_dims_major(attn.kv.v) is expect and not is_dims_major(attn.kv.k) and attn.kv.v_dims_major is expect
    outs = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] for llm in (dims_major, token_major)]
    assert outs[0] == outs[1]
    # the cache really holds the prompts' values in dims-major storage: the written V slots are nonzero there
    storage = runner_of(dims_major).kv_cache[1, 0]  # [num_blocks, page elements] of layer 0's V
    assert storage.float().abs().sum() > 0


# ----------------------------------------------------------------------------- reference kernels


def test_reference_store_quantizes_and_attention_dequantizes() -> None:
    gen = torch.Generator().manual_seed(0)
    nb, bs, h, d, n = 4, 16, 2, 32, 40
    ks, vs = 0.02, torch.tensor([0.5])
    k = torch.randn(n, h, d, generator=gen)
    v = torch.randn(n, h, d, generator=gen) * 20
    k[0, 0, :3] = torch.tensor([100.0, -100.0, 448 * 0.02 * 1.01])  # beyond 448 * ks: saturate
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[5] = -1  # padding: skipped
    k_cache = torch.zeros(nb, bs, h, d, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    store_kvcache_ref(k, v, PagedKV(k_cache, v_cache, ks, vs), slots)

    valid = slots >= 0
    kq = k_cache.view(-1, h, d)[slots[valid]]
    vq = v_cache.view(-1, h, d)[slots[valid]]
    # the codes are x / scale, clamped to +-448, rounded to nearest e4m3
    assert torch.equal(kq.view(torch.uint8), (k[valid] / ks).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(vq.view(torch.uint8), (v[valid] / vs).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert kq[0, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    assert not torch.isnan(k_cache.float()).any()
    # dequantised: x within e4m3's half-ulp (2**-4 relative) in the normal range; saturated = +-448 * scale
    k_deq, v_deq = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
    kk = (k[valid] / ks).abs()
    normal = (kk >= 2**-6) & (kk <= 448)
    assert ((k_deq - k[valid]).abs() <= k[valid].abs() * 2**-4 + 1e-9)[normal].all()
    assert ((v_deq - v[valid]).abs() <= v[valid].abs() * 2**-4 + 2**-10 * vs).all()
    assert k_deq[0, 0, :2].tolist() == pytest.approx([448 * ks, -448 * ks])
    # the same helpers round-trip: quantize_kv / dequantize_kv are what the store / attention use
    assert torch.equal(quantize_kv(k[valid], FP8, ks).view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(quantize_kv(k, torch.bfloat16, ks), k.to(torch.bfloat16))  # scales: fp8 only

    # attention over the fp8 cache with its scales == attention over the dequantised float cache
    tables = torch.arange(nb, dtype=torch.int32).view(2, 2)
    seq_lens = torch.tensor([20, 32], dtype=torch.int32)
    k_f, v_f = dequantize_kv(k_cache, ks), dequantize_kv(v_cache, vs)
    q = torch.randn(2, 4, d, generator=gen)
    out = paged_decode_attention_ref(q, PagedKV(k_cache, v_cache, ks, vs), tables, seq_lens, d**-0.5)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, PagedKV(k_f, v_f), tables, seq_lens, d**-0.5))
    qp = torch.randn(7, 4, d, generator=gen)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = paged_attention_ref(qp, PagedKV(k_cache, v_cache, ks, vs), qsl, seq_lens, tables, d**-0.5)
    torch.testing.assert_close(out, paged_attention_ref(qp, PagedKV(k_f, v_f), qsl, seq_lens, tables, d**-0.5))
    # ops (CPU -> references) pass the scales through; a wrong scale changes the result
    out_ops = ops.paged_prefill_attention(qp, PagedKV(k_cache, v_cache, ks, vs), qsl, seq_lens, tables, 4, 32,
                                          d**-0.5)
    torch.testing.assert_close(out_ops, out)
    wrong = ops.paged_prefill_attention(qp, PagedKV(k_cache, v_cache, 1.0, vs), qsl, seq_lens, tables, 4, 32, d**-0.5)
    assert (wrong - out).abs().max() > 0.1
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ops.store_kvcache(k, v, PagedKV(k2, v2, ks, vs), slots)
    assert torch.equal(k2.view(torch.uint8), k_cache.view(torch.uint8))
