"""engine/sampler_graphs.py: small decode steps sample inside CUDA graphs, and draw what the eager sampler draws.

On the CPU: the per-row values a graph step stages are the ones the eager sampler uploads, whatever the mix of rows.
On the GPU: generations with the sampler graphs equal those without, and a seeded request draws the same tokens alone
(sampled in a graph) as among more rows than the graphs take (sampled eagerly)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.engine import sampler_graphs
from nvcli.engine.sampler import RowValues, SamplingBatch
from nvcli.engine.sampler_graphs import kind_of, stage_row_values

VOCAB = 1000
CPU = torch.device("cpu")
ROWS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0.6),
        SamplingParams(temperature=1e-40)]  # a temperature below 1e-5 is greedy


def staged(params: list[SamplingParams], rows: int, positions: list[int] | None = None
           ) -> tuple[np.ndarray, np.ndarray, RowValues]:
    """Stage `params` (sampling output positions 0, 1, ... unless given) into buffers of 16 rows (NaN / -1 where
    nothing was written), padded to `rows`."""
    f32, i64 = np.full((3, 16), np.nan, dtype=np.float32), np.full((2, 16), -1, dtype=np.int64)
    values = RowValues.of(params, positions or list(range(len(params))), VOCAB, random.Random(3))
    stage_row_values(f32, i64, values, rows, VOCAB)
    return f32, i64, values


@pytest.mark.parametrize("filters", [{}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05},
                                     {"top_k": 20, "top_p": 0.95}, {"top_k": 5000}])
def test_staged_values_are_the_eager_samplers(filters: dict) -> None:
    """A row with a filter beside rows without: each staged column is what SamplingBatch uploads, with top_k = vocab,
    top_p = 1, min_p = 0 where the eager path passes no tensor at all (the floor kernel's values for none)."""
    params = [*ROWS, SamplingParams(temperature=0.7, seed=11, **filters)]
    f32, i64, values = staged(params, rows=8)
    eager = SamplingBatch.build(params, list(range(len(params))), VOCAB, CPU, random.Random(3))
    n = len(params)
    assert kind_of(values) == ("filtered" if filters else "temperature")
    assert f32[0, :n].tolist() == eager.temperatures.tolist()
    assert f32[0, n:8].tolist() == [0.0] * (8 - n)  # padding rows are greedy
    assert i64[0, :n].tolist() == eager.philox_seeds.tolist()
    if filters:
        want_k = eager.top_k.tolist() if eager.top_k is not None else [VOCAB] * n
        want_p = eager.top_p.tolist() if eager.top_p is not None else [1.0] * n
        want_min_p = eager.min_p.tolist() if eager.min_p is not None else [0.0] * n
        assert i64[1, :8].tolist() == want_k + [VOCAB] * (8 - n)
        assert f32[1, :8].tolist() == want_p + [1.0] * (8 - n)
        assert f32[2, :8].tolist() == want_min_p + [0.0] * (8 - n)
    else:  # the temperature graph reads no filter column
        assert np.isnan(f32[1:]).all() and (i64[1] == -1).all()


def test_a_seeded_rows_noise_seed_is_its_own_wherever_it_sits() -> None:
    sp = SamplingParams(temperature=0.8, seed=7)
    _, alone, _ = staged([sp], rows=1, positions=[9])
    _, among, _ = staged([SamplingParams(temperature=0.5), SamplingParams(temperature=0), sp], rows=4,
                         positions=[0, 3, 9])
    assert alone[0, 0] == among[0, 2]
    _, later, _ = staged([sp], rows=1, positions=[10])
    assert later[0, 0] != alone[0, 0]  # the next position draws fresh noise


def test_an_all_greedy_step_stages_only_its_temperatures() -> None:
    f32, i64, values = staged([SamplingParams(temperature=0), SamplingParams(temperature=1e-40, top_p=0.5)], rows=4)
    assert kind_of(values) == "greedy" and values.philox is None
    assert f32[0, :4].tolist() == [0.0] * 4
    assert np.isnan(f32[0, 4:]).all() and np.isnan(f32[1:]).all() and (i64 == -1).all()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
PROMPTS = [list(range(100 + 31 * i, 100 + 31 * i + n)) for i, n in enumerate([5, 17, 40, 9, 64, 23])]
MIXED = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=1, max_tokens=20, ignore_eos=True),
         SamplingParams(temperature=1.0, top_k=7, seed=2, max_tokens=28, ignore_eos=True, logprobs=3),
         SamplingParams(temperature=1.0, top_p=0.6, seed=3, max_tokens=16, ignore_eos=True),
         SamplingParams(temperature=1.2, top_k=12, min_p=0.02, seed=4, max_tokens=24, ignore_eos=True),
         SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True)]


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=512, num_kvcache_blocks=256, **kw)


def _run(model_dir, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> tuple[list, int]:
    """Token ids and logprobs of each output, and how many steps sampled in a graph."""
    llm = _llm(model_dir)
    try:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        graphs = llm.engine.executor.runner.sampling.sampler_graphs
        return [(o.token_ids, o.logprobs) for o in outs], 0 if graphs is None else graphs.num_steps
    finally:
        llm.shutdown()


@gpu
@pytest.mark.parametrize("penalized", [False, True])
def test_graph_sampling_equals_eager_sampling(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, penalized: bool) -> None:
    """Six requests of every kind drain from 6 rows to 1 through the graph sizes; with a penalized row beside them
    (finishing early) every step with it samples eagerly and those after it in graphs."""
    model_dir = tiny_model_dir("qwen3")
    params = list(MIXED)
    if penalized:
        params[5] = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True, presence_penalty=1.5)
    with_graphs, replays = _run(model_dir, params)
    assert replays > 0
    monkeypatch.setattr(sampler_graphs, "MAX_ROWS", 0)
    without, none = _run(model_dir, params)
    assert none == 0
    assert [t for t, _ in with_graphs] == [t for t, _ in without]
    assert [len(t) for t, _ in with_graphs] == [p.max_tokens for p in params]
    for (_, a), (_, b) in zip(with_graphs, without):
        if a is None:
            assert b is None
            continue
        for pa, pb in zip(a, b):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)


@gpu
def test_a_seeded_request_draws_alike_in_a_graph_and_among_many_rows(tiny_model_dir) -> None:
    """Alone, its steps sample in a graph; among 23 others (more rows than the sampler graphs take), eagerly. float32:
    the logits agree to about 1e-6 across row counts, so the seeded draws agree."""
    model_dir = tiny_model_dir("qwen3")
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    prompt = list(range(300, 340))
    alone, replays = _run(model_dir, [sp], [prompt])
    assert replays >= 23
    others = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)] * 23
    among, _ = _run(model_dir, [sp, *others], [prompt] + [list(range(500 + i, 530 + i)) for i in range(23)])
    assert among[0][0] == alone[0][0]
