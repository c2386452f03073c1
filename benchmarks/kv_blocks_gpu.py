"""How many KV blocks start-up gives the DESIGN setup (dummy Qwen3-0.6B, max_num_seqs 256, 16,384 tokens per step,
--gpu-memory-utilization 0.9), and what the profile run's worst-case step leaves it.

    PYTHONPATH=. python3 benchmarks/kv_blocks_gpu.py
"""

from __future__ import annotations

import tempfile

import torch

from nvcli import LLM
from nvcli.models.presets import preset_dir


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(preset_dir("qwen3-0.6b", tmp)), load_format="dummy", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=16384)
        blocks = llm.engine.executor.num_kvcache_blocks
        print(f"## KV blocks: {blocks:,} of 16 tokens ({blocks * 16:,} tokens), "
              f"{torch.cuda.get_device_name()}")
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
