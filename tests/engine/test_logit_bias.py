"""logit_bias (OpenAI / vLLM): added to the logits before the penalties, in a float32 copy that leaves the other rows'
draws and every row's logprobs as they were; end to end against HF generate."""

from __future__ import annotations

import pytest
import torch

from nvcli import LLM, SamplingParams
from nvcli.engine.penalties import PenaltySlots
from nvcli.engine.sampler import SamplingBatch, logprob_rows, sample, sampled_token_logprobs
from nvcli.engine.sequence import Sequence

CPU = torch.device("cpu")
VOCAB = 64


def logits_bf16(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 2).bfloat16()  # [rows, vocab]: the model's dtype, not float32


def draw(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> list[int]:
    batch = SamplingBatch.build(params, [3] * len(params), VOCAB, CPU, **kwargs)
    return sample(logits, batch, torch.Generator().manual_seed(0)).tolist()


# ---------------------------------------------------------------------------- the sampler


def test_plus_100_picks_the_token_and_minus_100_removes_the_argmax() -> None:
    logits = logits_bf16(3)
    order = logits.float().argsort(dim=1, descending=True)
    target = order[0, -1].item()  # row 0's least likely token
    top, second = order[1, 0].item(), order[1, 1].item()
    params = [SamplingParams(temperature=0.0, logit_bias={target: 100}),
              SamplingParams(temperature=0.0, logit_bias={top: -100}),
              SamplingParams(temperature=0.0)]
    assert draw(logits, params) == [target, second, order[2, 0].item()]
    assert draw(logits, [SamplingParams(temperature=0.0)] * 3) == order[:, 0].tolist()  # the bias is what changed it


def test_rows_without_a_bias_draw_what_they_draw_alone() -> None:
    """Greedy and seeded rows (some with top-k / penalties) beside biased rows: the tokens they draw alone."""
    logits = logits_bf16(5, seed=1)
    argmax = logits.float().argmax(dim=1).tolist()
    for seed in range(12):
        plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=seed),
                 SamplingParams(temperature=0.8, seed=seed + 100, top_k=5)]
        biased = [SamplingParams(temperature=1.0, seed=seed, logit_bias={argmax[1]: 100, 3: -5.5}),
                  SamplingParams(temperature=0.0, logit_bias={argmax[3]: -100})]
        alone = [draw(logits[[0, 2, 4]][i : i + 1], [sp])[0] for i, sp in enumerate(plain)]
        together = draw(logits, [plain[0], biased[0], plain[1], biased[1], plain[2]])
        assert [together[i] for i in (0, 2, 4)] == alone, seed
        assert together[1] == argmax[1] and together[3] != argmax[3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_callers_logits_and_the_logprobs_stay_raw(dtype: torch.dtype) -> None:
    """The bias changes what is drawn, not the logits the caller keeps (float32 ones too, which a conversion without
    a copy would alias): logprobs are the model's (vLLM's raw_logprobs), so a token forced by +100 has its raw logprob
    and rank."""
    logits = logits_bf16(2, seed=2).to(dtype)
    before = logits.clone()
    target = logits[0].float().argmin().item()
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={target: 100}), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [0, 0], VOCAB, CPU)
    tokens = sample(logits, batch)
    assert tokens[0].item() == target and torch.equal(logits, before)
    rows, ks = logprob_rows(batch.num_logprobs)
    assert rows == [0] and ks == [2]
    entry = sampled_token_logprobs(logits, tokens, rows, ks).flat(ks)[0]
    raw = torch.log_softmax(logits[0].float(), dim=-1)
    assert entry[target].logprob == pytest.approx(raw[target].item(), abs=1e-6)
    assert entry[target].rank == VOCAB  # the least likely token of the raw logits
    assert max(entry.values(), key=lambda lp: lp.logprob).logprob == pytest.approx(raw.max().item(), abs=1e-6)


def test_the_bias_comes_before_the_repetition_penalty_and_min_tokens_bans_stay() -> None:
    """vLLM V1 adds the bias, then penalizes: token 5 (logit -1, in the prompt) with bias +2 and repetition 2 is
    (-1 + 2) / 2 = 0.5 > 0.25 (token 9); penalized first it would be -1 * 2 + 2 = 0 < 0.25. A banned token
    (min_tokens) stays banned whatever its bias."""
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 5], logits[:, 9] = -1.0, 0.25
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={5: 2.0}),
              SamplingParams(temperature=0.0, logit_bias={5: 100.0})]
    seqs = [Sequence([5, 1], p, block_size=16) for p in params]
    penalties = PenaltySlots(CPU).prepare(seqs, [1, 1], VOCAB)
    assert draw(logits, params, penalties=penalties) == [5, 5]
    assert draw(logits, params, penalties=penalties, banned=[(1, (5,))]) == [5, 9]


def test_the_bias_uploads_row_token_pairs_once() -> None:
    params = [SamplingParams(), SamplingParams(logit_bias={7: 1.5, 2: -3}), SamplingParams(logit_bias={}),
              SamplingParams(logit_bias={7: 0.25})]
    batch = SamplingBatch.build(params, [0] * 4, VOCAB, CPU)
    assert batch.bias_index is not None and batch.bias_values is not None
    assert [t.tolist() for t in batch.bias_index] == [[1, 1, 3], [7, 2, 7]]
    assert batch.bias_values.tolist() == [1.5, -3.0, 0.25] and batch.bias_values.dtype == torch.float32
    none = SamplingBatch.build(params[:1] + params[2:3], [0] * 2, VOCAB, CPU)
    assert none.bias_index is None and none.bias_values is None  # no copy of the logits either


# ---------------------------------------------------------------------------- end to end, against HF

MAX_TOKENS = 16
PROMPTS = [list(range(1000, 1005)), list(range(2000, 2040)), list(range(3000, 3023))]
_hf: dict[tuple, list[int]] = {}


class AddBias:
    """logit_bias as an HF logits processor (the sampler's own float32 addition)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids, self.values = torch.tensor(list(bias)), torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values
        return scores


def hf_greedy(model_dir, prompt: list[int], bias: dict[int, float] | None = None, repetition: float = 1.0,
              own: bool = True) -> list[int]:
    """HF greedy tokens: the bias through HF's own sequence_bias (`own`), or AddBias then HF's repetition penalty
    (vLLM's order; generate(repetition_penalty=...) would run the penalty first)."""
    key = (str(model_dir), tuple(prompt), tuple(sorted((bias or {}).items())), repetition, own)
    if key not in _hf:
        from transformers import AutoModelForCausalLM, LogitsProcessorList
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        kwargs: dict = {}
        if bias and own:
            kwargs["sequence_bias"] = {(t,): b for t, b in bias.items()}
        elif bias:
            kwargs["logits_processor"] = LogitsProcessorList([AddBias(bias), RepetitionPenaltyLogitsProcessor(repetition)])
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, **kwargs)
        _hf[key] = out[0, len(prompt):].tolist()
    return _hf[key]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_logit_bias_matches_hf_generate(tiny_model_dir, async_scheduling: bool) -> None:
    """Token for token against HF generate: a bias through HF's sequence_bias, a bias with repetition_penalty through
    HF processors in vLLM's order, beside an unbiased request that gives its own greedy tokens; logprobs are raw."""
    model_dir = tiny_model_dir("qwen3")
    plain = [hf_greedy(model_dir, p) for p in PROMPTS]
    # remove the first token the model would pick, push down a later one, lift three tokens by a little
    bias0 = {plain[0][0]: -100.0, plain[0][4]: -2.5, 62659: 1.0, 75582: 0.5, 9848: 1.5}
    bias2 = {plain[2][1]: -100.0, plain[2][0]: 0.75, 104401: 2.0}
    expected0 = hf_greedy(model_dir, PROMPTS[0], bias0)
    expected2 = hf_greedy(model_dir, PROMPTS[2], bias2, repetition=1.3, own=False)
    assert expected0 != plain[0] and expected2 != plain[2]  # the biases matter

    llm = LLM(str(model_dir), device="cpu", max_model_len=256, num_kvcache_blocks=128,
              async_scheduling=async_scheduling)
    outs = llm.generate(PROMPTS, [greedy(logit_bias=bias0, logprobs=0), greedy(),
                                  greedy(logit_bias=bias2, repetition_penalty=1.3)])
    assert [o.outputs[0].token_ids for o in outs] == [expected0, plain[1], expected2]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = outs[0].outputs[0].token_ids
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([PROMPTS[0] + ids])).logits[0, len(PROMPTS[0]) - 1 : -1], -1)
    for i, (tok, entry) in enumerate(zip(ids, outs[0].outputs[0].logprobs)):
        assert entry[tok].logprob == pytest.approx(raw[i, tok].item(), abs=1e-4)
    assert outs[0].outputs[0].logprobs[0][ids[0]].rank > 1  # the first token is not the raw argmax (biased away)


def test_every_completion_of_n_carries_the_bias_and_bad_ids_are_refused(tiny_model_dir) -> None:
    """n > 1 completions get their parent's params, bias included; a token id past the vocabulary is the request's
    error when it is added, and the engine serves the next request as before."""
    llm = LLM(str(tiny_model_dir("qwen3")), device="cpu", max_model_len=256, num_kvcache_blocks=128)
    vocab = llm.engine.model_config.vocab_size
    sp = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    out = llm.generate([PROMPTS[0]], sp)[0]
    assert [o.token_ids for o in out.outputs] == [[77] * 6] * 3
    for bad, named in (({vocab: 1.0}, vocab), ({5: 1.0, vocab + 10: -1.0}, vocab + 10)):
        with pytest.raises(ValueError, match=rf"logit_bias: token id\(s\) {named} are outside the vocabulary \[0, {vocab}\)"):
            llm.generate([PROMPTS[1]], greedy(logit_bias=bad))
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPTS[1]], greedy(logit_bias={vocab - 1: 100}))[0].outputs[0].token_ids == [vocab - 1] * 16
