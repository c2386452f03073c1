"""ModelRunner pieces that do not need a model: feeding the step in flight's tokens into the next inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nvcli.engine.model_runner import ModelRunner, StepInput


def _step(n: int, pending: list[tuple[int, int]]) -> StepInput:
    return StepInput([0] * n, list(range(n)), list(range(n)), list(range(n + 1)), [1] * n, [[0]] * n, True, pending)


def test_feed_back_identity_and_permuted_rows() -> None:
    """Async scheduling: the next step's inputs take the tokens the step in flight samples. Steady decode
    (row i continues row i) and a reshuffled batch (rows dropped, reordered, a new prompt row without a
    pending token) both land the right token in the right row and leave the other rows alone."""
    runner = SimpleNamespace(device=torch.device("cpu"), prev_tokens=torch.tensor([11, 22, 33, 44]))
    ids = torch.full((4,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(4, [(0, 0), (1, 1), (2, 2), (3, 3)]))
    assert ids.tolist() == [11, 22, 33, 44]

    ids = torch.full((3,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(3, [(0, 3), (2, 1)]))  # row 1: a new prompt, nothing pending
    assert ids.tolist() == [44, -1, 22]

    ids = torch.full((2,), -1, dtype=torch.int64)
    ModelRunner._feed_back(runner, ids, _step(2, [(0, 0), (1, 2)]))  # looks steady at first, is not
    assert ids.tolist() == [11, 33]
