"""The DESIGN workload's floor for a model shape on a GPU: the fastest any engine could run it.

    python3 benchmarks/floor.py                                   # the table of benchmarks/RESULTS.md's floors
    python3 benchmarks/floor.py --model qwen3-30b-a3b --gpu h100 --tp 1 --weights fp8

The workload is DESIGN.md's (256 requests, prompts randint(100, 1024), outputs randint(100, 1024), random.seed(0)).
The floor assumes every request is admitted at once (checked against the KV cache the GPU leaves) and its prompt
computed at the GPU's peak FLOP rate; then decode step s runs every request with more than s tokens still to make.
A step is its matmuls, then its attention, each at its own roofline (one kernel after the other, so they cannot hide
each other): max(weight bytes / copy bandwidth, 2 x active parameters x tokens / peak FLOP rate) +
max(KV bytes / copy bandwidth, 4 x context x heads x head_dim x layers / peak), where
- the weights are those the step touches: every dense weight once (the LM head too); of a mixture-of-experts layer
  the experts the step's tokens route to, E (1 - (1 - k/E)^B) of E for B tokens choosing k each (uniform routing:
  dummy weights' routers are near uniform; a trained router's skew touches fewer), plus attention and router weights;
- the KV bytes are every running request's cache once (its prompt and the tokens made so far). With
tensor parallelism each GPU reads and computes 1/TP of it (KV heads replicate where fewer than TP); all-reduce time is
not counted. GPU figures are measured, not datasheet: device-to-device copy (read + write) and bf16 dense matmul
rates (DESIGN.md section 4); FP8 weights double the matmul rate.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# measured copy bandwidth (bytes/s, read + write), bf16 dense matmul rate (FLOP/s), memory (bytes)
GPUS = {
    "h100": dict(bandwidth=3.0e12, flops=790e12, memory=79.6e9),
    "h200": dict(bandwidth=4.3e12, flops=790e12, memory=139.8e9),
}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_mlp: int  # parameters of one layer's dense MLP (0 for MoE layers)
    experts: int
    top_k: int
    expert_params: int  # one expert's parameters


def shape_of(preset: str) -> Shape:
    from nvcli.models.presets import PRESETS

    c = PRESETS[preset]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    experts = c.get("num_experts", 0)
    return Shape(layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
                 kv_heads=c["num_key_value_heads"], head_dim=head_dim, vocab=c["vocab_size"],
                 dense_mlp=0 if experts else 3 * c["hidden_size"] * c["intermediate_size"],
                 experts=experts, top_k=c.get("num_experts_per_tok", 0),
                 expert_params=3 * c["hidden_size"] * c.get("moe_intermediate_size", 0))


def workload(seed: int = 0, n: int = 256) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prompts = [rng.randint(100, 1024) for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, outputs


@dataclass(frozen=True)
class Floor:
    seconds: float
    tokens_per_s: float
    prefill_s: float
    weight_s: float  # decode time of the matmuls (weights read or FLOPs, whichever is longer)
    kv_s: float  # decode time of reading the KV cache
    compute_bound_steps: int  # decode steps whose matmuls are bound by FLOPs, not weight reads
    steps: int
    weights_gb: float  # per GPU, read per dense step
    kv_peak_gb: float  # per GPU, the workload's largest KV cache
    fits: bool


def design_floor(preset: str, gpu: str = "h100", tp: int = 1, weight_bytes: float = 2.0,
                 kv_bytes: float = 2.0) -> Floor:
    s, g = shape_of(preset), GPUS[gpu]
    attn = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    router = s.hidden * s.experts
    lm_head = s.vocab * s.hidden * 2.0  # bf16 whatever the projections' format
    kv_per_token = s.layers * 2 * max(1, s.kv_heads // tp) * s.head_dim * kv_bytes  # per GPU
    active = s.layers * (attn + router + s.dense_mlp + s.top_k * s.expert_params) + s.vocab * s.hidden
    flops_rate = g["flops"] * (2.0 if weight_bytes == 1.0 else 1.0)
    prompts, outputs = workload()

    total_weights = s.layers * (attn + s.dense_mlp + s.experts * s.expert_params) * weight_bytes + \
        s.layers * router * 2.0 + lm_head
    kv_peak = sum(p + o for p, o in zip(prompts, outputs)) * kv_per_token
    fits = total_weights / tp + kv_peak <= 0.9 * g["memory"]

    prefill_flops = sum(2 * active * p + s.layers * 2 * p * p * s.heads * s.head_dim for p in prompts)
    prefill_s = prefill_flops / tp / flops_rate
    seconds, weight_s, kv_s, bound = prefill_s, 0.0, 0.0, 0
    steps = max(outputs)
    for step in range(steps):
        running = [p + step for p, o in zip(prompts, outputs) if o > step]
        b = len(running)
        touched = s.experts * (1 - (1 - s.top_k / s.experts) ** b) if s.experts else 0.0
        weights = (s.layers * (attn + s.dense_mlp + touched * s.expert_params) * weight_bytes
                   + s.layers * router * 2.0 + lm_head) / tp
        kv = sum(running) * kv_per_token
        mm_flops = 2 * active * b / tp
        attn_flops = s.layers * 4 * sum(running) * s.heads * s.head_dim / tp
        t_mm = max(weights / g["bandwidth"], mm_flops / flops_rate)
        seconds += t_mm + max(kv / g["bandwidth"], attn_flops / g["flops"])
        weight_s += t_mm
        kv_s += kv / g["bandwidth"]
        bound += mm_flops / flops_rate > weights / g["bandwidth"]
    return Floor(seconds=seconds, tokens_per_s=sum(outputs) / seconds, prefill_s=prefill_s, weight_s=weight_s,
                 kv_s=kv_s, compute_bound_steps=bound, steps=steps, weights_gb=total_weights / tp / 1e9,
                 kv_peak_gb=kv_peak / 1e9, fits=fits)


DEFAULT_ROWS = [
    ("qwen3-0.6b", "h100", 1, "bf16", "bf16"),
    ("qwen3-8b", "h100", 1, "bf16", "bf16"),
    ("qwen3-8b", "h100", 1, "fp8", "bf16"),
    ("qwen3-8b", "h100", 2, "bf16", "bf16"),
    ("qwen3-8b", "h200", 1, "bf16", "bf16"),
    ("qwen3-8b", "h200", 2, "bf16", "bf16"),
    ("qwen3-8b", "h200", 1, "fp8", "bf16"),
    ("qwen3-8b", "h200", 4, "bf16", "bf16"),
    ("qwen3-30b-a3b", "h100", 1, "fp8", "bf16"),
    ("qwen3-30b-a3b", "h100", 2, "bf16", "bf16"),
    ("qwen3-30b-a3b", "h200", 1, "fp8", "bf16"),
    ("qwen3-30b-a3b", "h200", 1, "bf16", "bf16"),
    ("qwen3-30b-a3b", "h200", 2, "bf16", "bf16"),
    ("llama-3-70b", "h100", 4, "bf16", "bf16"),
    ("llama-3-70b", "h200", 4, "bf16", "bf16"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8"])
    args = ap.parse_args()
    rows = [(args.model, args.gpu, args.tp, args.weights, args.kv)] if args.model else DEFAULT_ROWS
    print("| model | GPU | TP | weights | KV | floor s | floor tok/s | prefill s | matmuls s | KV s | FLOP-bound "
          "matmul steps | weights GB/GPU | KV peak GB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, gpu, tp, w, kv in rows:
        f = design_floor(model, gpu, tp, 1.0 if w == "fp8" else 2.0, 1.0 if kv == "fp8" else 2.0)
        print(f"| {model} | {gpu} | {tp} | {w} | {kv} | {f.seconds:.2f} | {f.tokens_per_s:,.0f} | {f.prefill_s:.2f} | "
              f"{f.weight_s:.2f} | {f.kv_s:.2f} | {f.compute_bound_steps}/{f.steps} | {f.weights_gb:.1f} | "
              f"{f.kv_peak_gb:.1f} | {'yes' if f.fits else 'no'} |")


if __name__ == "__main__":
    main()
