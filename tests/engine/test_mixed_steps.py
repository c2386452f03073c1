"""Steps that carry prompt chunks beside one-token rows, on the CPU machine: the GPU path's split attention (decode
kernel for the one-token rows, prefill kernel for the chunks) and the mixed CUDA graphs' input staging, checked
through the Triton interpreter. A mixed graph's replay is stood in for by running the forward it captured on its
static buffers, so everything but the capture itself runs: the staged ids, positions, slots, the decode rows' and
prompt chunks' lengths, tables and query starts, the padding rows, and the gather of each sequence's last row.
(tests/engine/test_cuda_graphs.py replays real graphs on a GPU.)

The check runs in a subprocess: TRITON_INTERPRET must be set before the kernels are imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest


def _minor(package: str) -> tuple[int, int]:
    major, minor = version(package).split(".")[:2]
    return int(major), int(minor)


# Triton 3.6's interpreter breaks on loops over a runtime bound with numpy >= 2.4 (scripts/constraints-cpu.txt
# pins numpy below it; the GPU machine's python has numpy 2.5, where tests/engine/test_cuda_graphs.py covers this path).
# Versions from the metadata: importing triton here, before tests/kernels/conftest.py switches the interpreter on,
# would leave the kernel modules compiled for a GPU.
pytestmark = pytest.mark.skipif(
    _minor("numpy") >= (2, 4) and _minor("triton") < (3, 7),
    reason=f"Triton {version('triton')}'s interpreter fails with numpy {version('numpy')} (needs numpy < 2.4)")

SCRIPT = textwrap.dedent('''
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    _zeros = torch.zeros
    def zeros(*a, **k):  # pinned staging buffers: plain memory without a GPU
        k.pop("pin_memory", None)
        return _zeros(*a, **k)
    torch.zeros = zeros
    torch.cuda.synchronize = lambda *a, **k: None
    from nvcli import LLM, SamplingParams
    from nvcli.engine import startup
    from nvcli.engine.cuda_graphs import CudaGraphs, Graph

    model_dir, modes = sys.argv[1], sys.argv[2:]
    prompts = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate([5, 17, 33, 64, 100, 250])]
    params = [SamplingParams(temperature=0, max_tokens=8 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    common = dict(device="cpu", max_model_len=512, max_num_seqs=2, max_num_batched_tokens=256, num_kvcache_blocks=256)
    cpu = LLM(model_dir, **common)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    cpu.shutdown()

    def run(mode):  # a fresh engine per mode
        llm = LLM(model_dir, **common)
        r = llm.engine.executor.runner
        r.attention.split_mixed = True  # the GPU's plan, on CPU tensors through the interpreter
        replays = {}
        if mode == "graphs":
            g = CudaGraphs(r.model, r.attention, r.device, 2, 256, shared_prefix=False, logits_max_rows=0)
            g.few_chunks = 1  # one-chunk steps replay the few-chunks graphs, two-chunk steps the full ones
            g.make_inputs()

            class StandInGraph:  # replay = the captured forward on the static inputs, into the graph's outputs
                def __init__(self, key):
                    self.key = key

                def replay(self):
                    name = f"{self.key.tokens}x{self.key.chunks}"
                    replays[name] = replays.get(name, 0) + 1
                    for out, new in zip(g.graphs[self.key].outputs, g.forward(self.key)):
                        if out is not None:
                            out.copy_(new)

            for key in g.keys():  # decode graphs of 1 and 2 rows, mixed graphs of 64-256 tokens at 1 and 2 chunks
                outputs = tuple(None if x is None else x.clone() for x in g.forward(key))
                g.graphs[key] = Graph(StandInGraph(key), outputs, None)
            r.cuda_graphs = g
            startup.warm_up_kernels(r)  # its 18-sequence step exceeds the graphs' capacity (2 sequences): eager
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        return {"replays": replays, "got": got}

    print(json.dumps({"want": want, **{mode: run(mode) for mode in modes}}))
''')


MODES = ["graphs", "eager"]


@pytest.fixture(scope="module")
def results(tiny_model_dir) -> dict:
    """Both modes in one interpreter process, beside one reference run (a process start and a reference fewer)."""
    model_dir = tiny_model_dir("qwen3")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), *MODES], capture_output=True, text=True,
                          cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_split_steps_give_the_reference_tokens(results: dict, mode: str) -> None:
    """Two slots for six requests, so new prompts join running decodes: with the split attention, replayed from
    (stand-in) mixed graphs or run eagerly, greedy tokens equal the torch reference path's. Steps with one prompt
    chunk replay the graphs captured for fewer chunks (a smaller prefill grid), steps with two the full ones."""
    result = results[mode]
    chunks = {}
    for name, n in result["replays"].items():
        chunks[int(name.split("x")[1])] = chunks.get(int(name.split("x")[1]), 0) + n
    assert bool(chunks) == (mode == "graphs")
    if mode == "graphs":  # decode graphs, and mixed graphs of one and of two chunks, all replayed
        assert chunks.get(0, 0) > 0 and chunks.get(1, 0) > 0 and chunks.get(2, 0) > 0, result["replays"]
    assert result["got"] == results["want"]
