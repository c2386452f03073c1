"""Fused inverse-CDF sampler: greedy rows are argmax, samples follow softmax(logits / T), seeds are per row."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE


def sample(logits: torch.Tensor, temps: list[float], seeds: list[int], chunk: int = 4096) -> torch.Tensor:
    from nvcli.kernels.sampling import sample_triton

    return sample_triton(
        logits.to(DEVICE), torch.tensor(temps, dtype=torch.float32, device=DEVICE),
        torch.tensor(seeds, dtype=torch.int64, device=DEVICE), chunk=chunk,
    ).cpu()


def test_greedy_rows_are_argmax_across_chunks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 10_000)
    logits[2, 9_999] = 50.0  # max in the last, partial chunk
    logits[3, :] = 1.0  # all tied: the first index wins, as with torch.argmax
    out = sample(logits, [0.0] * 4, [1, 2, 3, 4])
    assert out.tolist() == logits.argmax(dim=1).tolist()


def test_samples_follow_the_tempered_softmax() -> None:
    n = 300
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    logits = base.repeat(n, 1)
    out = sample(logits, [0.7] * n, list(range(1, n + 1)), chunk=16)
    freq = torch.bincount(out, minlength=5).float() / n
    expected = torch.softmax(base / 0.7, dim=0)
    # ~3 standard deviations at n=300; T=1 instead of 0.7, or greedy, would be off by more than 0.1
    assert (freq - expected).abs().max() < 0.09, (freq, expected)


def test_a_seeded_row_draws_the_same_token_wherever_it_sits() -> None:
    torch.manual_seed(1)
    row = torch.randn(1, 3000)
    alone = sample(row, [1.0], [42])
    crowd = torch.cat([torch.randn(3, 3000), row, torch.randn(2, 3000)])
    mixed = sample(crowd, [1.0, 0.0, 0.5, 1.0, 1.0, 0.0], [7, 8, 9, 42, 10, 11])
    assert mixed[3] == alone[0]
    draws = {int(sample(row, [1.0], [s])[0]) for s in range(20)}
    assert len(draws) > 1  # the seed matters


def test_tokens_of_zero_probability_are_never_drawn() -> None:
    n, vocab = 200, 40  # chunks of 16: the last one holds 8 columns and 8 past the vocabulary
    torch.manual_seed(2)
    logits = torch.randn(n, vocab)
    logits[:, 39] = 6.0  # most mass next to the columns past the vocabulary
    logits[:, 0] = float("-inf")
    logits[:, 16:32] = float("-inf")  # a whole chunk without weight
    logits[:, 38] = float("-inf")
    logits[1::2, 39] = float("-inf")  # odd rows: the mass in the first chunk, the last column barred
    temps = [0.3 + 0.7 * (i % 3) for i in range(n)]
    out = sample(logits, temps, list(range(n)), chunk=16)
    assert ((out >= 0) & (out < vocab)).all(), out
    drawn = logits.gather(1, out.unsqueeze(1)).squeeze(1)
    assert torch.isfinite(drawn).all(), out[~torch.isfinite(drawn)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy meets -inf - -inf
def test_a_row_without_finite_logits_gets_a_column_not_a_crash() -> None:
    logits = torch.full((2, 40), float("-inf"))
    out = sample(logits, [1.0, 0.0], [1, 2], chunk=16)
    assert ((out >= 0) & (out < 40)).all(), out


def test_samples_follow_the_tempered_softmax_across_chunks() -> None:
    n, t = 200, 0.7
    # three chunks of 16: the mass split between many equal tokens (chunk 0) and one hot token (chunk 1),
    # so that chunk weights without the chunk's sum, or without its max, and a temperature of 1, 0.49 or
    # 0.7 * ln 2 each move some token's frequency by more than 0.2
    base = torch.full((48,), -3.0)
    base[:16] = 1.0
    base[20] = 3.0
    base[[34, 41]] = 0.0
    base[46] = 1.0
    out = sample(base.repeat(n, 1), [t] * n, list(range(1000, 1000 + n)), chunk=16)
    freq = torch.bincount(out, minlength=48).float() / n
    expected = torch.softmax(base / t, dim=0)
    # 0.11 is about 3 standard deviations of a frequency near 1/2 at n = 200
    assert (freq - expected).abs().max() < 0.11, (freq, expected)
    chunk_freq, chunk_expected = freq.view(3, 16).sum(1), expected.view(3, 16).sum(1)
    assert (chunk_freq - chunk_expected).abs().max() < 0.11, (chunk_freq, chunk_expected)


def test_mass_in_the_first_or_the_last_chunk() -> None:
    n, vocab, t = 100, 40, 1.0  # the last chunk of 16 is partial: columns 32..39
    edge = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, 2.0])  # distinct weights inside the edge chunk
    last = torch.zeros(vocab)
    last[32:] = edge
    first = torch.zeros(vocab)
    first[:8] = edge
    logits = torch.cat([last.repeat(n, 1), first.repeat(n, 1)])
    out = sample(logits, [t] * (2 * n), list(range(2 * n)), chunk=16)
    assert (out < vocab).all()
    for rows, row_logits in ((out[:n], last), (out[n:], first)):
        freq = torch.bincount(rows, minlength=vocab).float() / n
        expected = torch.softmax(row_logits / t, dim=0)
        # ~3 standard deviations at n=100 for the largest probability (~0.3)
        assert (freq - expected).abs().max() < 0.14, (freq, expected)


def test_greedy_rows_among_sampled_rows_are_argmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(16, 100)  # 7 chunks of 16, the last one partial
    logits[0, 99] = 40.0  # max in the partial last chunk
    logits[2, [20, 33, 70]] = 30.0  # ties across chunks: the first index wins
    logits[1::2, 5] = 100.0  # the sampled rows' mass sits elsewhere
    temps = [0.0, 1.0] * 8
    out = sample(logits, temps, list(range(16)), chunk=16)
    assert out[::2].tolist() == logits[::2].argmax(dim=1).tolist()
    assert (out[1::2] == 5).all()


def _engine_sample(monkeypatch, logits: torch.Tensor, params: list, positions: list[int] | None = None,
                   banned=None, penalties=None) -> list[int]:
    """The engine's sampler as it runs on the GPU: the fused kernel, filters applied as -inf before it."""
    import random

    from nvcli.engine import sampler

    monkeypatch.setattr(sampler, "use_triton", lambda t: True)
    batch = sampler.SamplingBatch.build(params, positions or [5] * len(params), logits.shape[1], torch.device(DEVICE),
                                        random.Random(0), banned, penalties)
    return sampler.sample(logits.to(DEVICE), batch).cpu().tolist()


def test_a_seeded_row_draws_the_same_whatever_filters_its_neighbours_use(monkeypatch) -> None:
    """DESIGN: a seed gives the same tokens whatever else is in the batch. On the GPU a neighbour with top-p or
    top-k used to switch the whole batch to torch noise, and the seeded row drew another token."""
    from nvcli.sampling_params import SamplingParams as SP

    torch.manual_seed(1)
    row, other = torch.randn(1, 64) * 2, torch.randn(1, 64) * 2
    seeded = [SP(temperature=1.0, seed=s) for s in range(12)]
    alone = [_engine_sample(monkeypatch, row, [sp])[0] for sp in seeded]
    assert len(set(alone)) > 1  # the seeds matter
    for neighbour in (SP(temperature=1.0), SP(temperature=1.0, top_p=0.5), SP(temperature=1.0, top_k=3),
                      SP(temperature=0.7, min_p=0.3), SP(temperature=0.0, top_k=2)):
        beside = [_engine_sample(monkeypatch, torch.cat([other, row]), [neighbour, sp])[1] for sp in seeded]
        assert beside == alone, neighbour


def test_filters_before_the_fused_kernel_keep_their_tokens(monkeypatch) -> None:
    from nvcli.sampling_params import SamplingParams as SP

    logits = torch.full((1, 64), -4.0)
    logits[0, [3, 7, 1]] = torch.tensor([2.0, 1.5, 1.0])
    def drawn(**kw) -> set[int]:
        return {_engine_sample(monkeypatch, logits, [SP(temperature=1.0, seed=s, **kw)])[0] for s in range(20)}
    assert drawn(top_k=2) == {3, 7}
    assert drawn(top_k=1) == drawn(top_p=1e-300) == {3}
    assert drawn(min_p=0.5) == {3, 7}  # e^-0.5 = 0.61 >= 0.5 > e^-1 = 0.37


def test_banned_tokens_are_never_drawn_even_greedy(monkeypatch) -> None:
    """min_tokens: a row's EOS / stop ids are -inf until it has enough tokens (the engine passes them as banned)."""
    from nvcli.sampling_params import SamplingParams as SP

    logits = torch.zeros(2, 64)
    logits[:, 5] = 9.0  # the "EOS": by far the likeliest
    out = _engine_sample(monkeypatch, logits, [SP(temperature=0.0), SP(temperature=1.0, seed=3)],
                         banned=[(0, (5,)), (1, (5, 6))])
    assert 5 not in out and out[1] != 6


def test_penalized_neighbours_leave_the_fused_draws_of_other_rows_unchanged(monkeypatch) -> None:
    """A penalized row sends its whole batch to the fused kernel as a float32 copy of the logits: the other rows
    (bf16 here) convert exactly, so a seeded row draws what it draws beside no penalty and a greedy row its argmax;
    the penalized row draws from its penalized logits."""
    from nvcli.engine.penalties import PenaltySlots
    from nvcli.engine.sequence import Sequence
    from nvcli.sampling_params import SamplingParams as SP

    torch.manual_seed(4)
    logits = (torch.randn(3, 64) * 2).bfloat16()
    top = logits[0].float().argmax().item()
    drawn = []
    for seed in range(12):
        sp = SP(temperature=1.0, seed=seed)
        params = [SP(temperature=0.0, frequency_penalty=2.0), SP(temperature=0.0), sp]
        seqs = [Sequence([1, 2], p, block_size=16) for p in params]
        seqs[0].append_token(top)
        seqs[0].append_token(top)  # generated twice: 4 below its logit, which was the row's largest
        penalties = PenaltySlots(torch.device(DEVICE)).prepare(seqs, [4, 2, 2], logits.shape[1])
        with_penalty = _engine_sample(monkeypatch, logits, params, penalties=penalties)
        without = _engine_sample(monkeypatch, logits, [SP(temperature=0.0), SP(temperature=0.0), sp])
        assert with_penalty[1:] == without[1:]
        assert without[0] == top != with_penalty[0]
        penalized = logits[0].float().clone()
        penalized[top] -= 4.0
        assert with_penalty[0] == penalized.argmax().item()
        drawn.append(without[2])
    assert len(set(drawn)) > 1  # the seeds matter


def test_logit_bias_in_front_of_the_fused_kernel(monkeypatch) -> None:
    """A biased row sends its batch to the fused kernel as a float32 copy with the bias added: +100 makes a greedy
    row pick its token, -100 takes a seeded row's favourite away, and the unbiased rows (bf16) draw what they draw
    with no biased neighbour."""
    from nvcli.sampling_params import SamplingParams as SP

    torch.manual_seed(5)
    logits = (torch.randn(4, 64) * 2).bfloat16()
    logits[2, 9] = 20.0  # row 2's favourite, by far
    low = logits[0].float().argmin().item()
    drawn = []
    for seed in range(12):
        plain = [SP(temperature=0.0), SP(temperature=1.0, seed=seed)]
        biased = [SP(temperature=0.0, logit_bias={low: 100}), SP(temperature=1.0, seed=seed + 50, logit_bias={9: -100})]
        with_bias = _engine_sample(monkeypatch, logits, [biased[0], plain[0], biased[1], plain[1]])
        without = _engine_sample(monkeypatch, logits, [SP(temperature=0.0), plain[0], SP(temperature=1.0), plain[1]])
        assert with_bias[1] == without[1] == logits[1].float().argmax().item()
        assert with_bias[3] == without[3]
        assert with_bias[0] == low and with_bias[2] != 9 and without[2] == 9
        drawn.append(without[3])
    assert len(set(drawn)) > 1  # the seeds matter
