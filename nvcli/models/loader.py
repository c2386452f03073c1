"""Weights into a model: safetensors (single file or sharded index), or dummy random values.

Checkpoint tensors stream one at a time (never the whole checkpoint in memory) into each
parameter's weight_loader, which takes this rank's shard. Only safetensors are read: no pickle.
An FP8 checkpoint's `<name>.weight_scale_inv` goes to the scale_loader of `<name>.weight`'s parameter
(models/layers/fp8.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; nv loads safetensors or GGUF only "
            "(convert .bin/.pt checkpoints, or pass --load-format dummy for random weights)"
        )
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules", {})
    # a model's own names first (models/qwen3_moe.py: one expert's tensor -> (stacked parameter, its shard))
    own_target: Callable[[str], tuple[str, Any] | None] = getattr(model, "checkpoint_target", lambda name: None)
    loaded: set[str] = set()
    shards: dict[str, set[Any]] = {}  # parameters with `num_shards` (stacked experts): the shards loaded so far
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        is_scale = name.endswith(".weight_scale_inv")
        weight_name = name.removesuffix("_scale_inv")
        target, shard = weight_name, None
        mapped = own_target(weight_name)
        if mapped is not None:
            target, shard = mapped
        else:
            for ckpt_part, (our_part, shard_id) in packed.items():
                if f".{ckpt_part}." in weight_name:
                    target, shard = weight_name.replace(f".{ckpt_part}.", f".{our_part}."), shard_id
                    break
        param = params.get(target)
        if param is None:
            if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if is_scale:  # not a parameter of its own: the FP8 layer checks that every fp8 weight got its scales
            scale_loader = getattr(param, "scale_loader", None)
            if scale_loader is None:
                raise ValueError(f"checkpoint tensor {name!r} scales FP8 weights, but {target} is not FP8 "
                                 "(is config.json's quantization_config missing?)")
            scale_loader(tensor, shard, name)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        if hasattr(param, "num_shards") and shard is not None:
            shards.setdefault(target, set()).add(shard)
            if len(shards[target]) < param.num_shards:
                continue
        loaded.add(target)
    missing = [
        n for n in params
        if n not in loaded and not (n == "lm_head.weight" and getattr(model, "tie_word_embeddings", False))
    ]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the real shape: the speed of the engine does not depend on their values."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        dummy_loader = getattr(p, "dummy_loader", None)  # FP8 weights: random values quantized (layers/fp8.py)
        if dummy_loader is not None:
            dummy_loader(gen)
        elif "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
