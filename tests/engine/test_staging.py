"""Graph inputs staged in two pinned buffers used in turn (engine/staging.py): a buffer is refilled only once the
device has copied its previous contents, however far the host runs ahead. Start-up replays graphs back to back with
no step's results awaited in between; a refill before its copy ran fed one graph another step's rows (an 8B start-up
failed with an out-of-range row index)."""

import pytest
import torch

from nvcli.engine.staging import PinnedTurns, StagingLayout


def test_the_two_buffers_alternate():
    turns = PinnedTurns(64, torch.device("cpu"))
    assert [turns.next() for _ in range(5)] == [0, 1, 0, 1, 0]
    assert turns.blobs[0].data_ptr() != turns.blobs[1].data_ptr()


def test_an_upload_copies_the_staged_rows_on_the_cpu():
    layout = StagingLayout([("ids", torch.int64, (2, 8)), ("lens", torch.int32, (8,))], torch.device("cpu"))
    stage = layout.next_stage()
    layout.host[stage]["ids"][0, :3] = [5, 6, 7]
    layout.host[stage]["lens"][:2] = [9, 4]
    layout.upload(stage, [("ids", (slice(0, 1), slice(0, 3))), ("lens", (slice(0, 2),))])
    assert layout.dev["ids"][0, :3].tolist() == [5, 6, 7] and layout.dev["lens"][:2].tolist() == [9, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the hazard is an asynchronous copy")
@pytest.mark.parametrize("prefix", [False, True])
def test_a_buffer_is_refilled_only_after_the_device_copied_it(prefix):
    layout = StagingLayout([("rows", torch.int64, (16,))], torch.device("cuda"))
    seen = []
    for step in range(8):
        stage = layout.next_stage()
        layout.host[stage]["rows"][:] = step
        torch.cuda._sleep(20_000_000)  # the device lags far behind the host, as at start-up
        if prefix:
            layout.upload_prefix(stage, layout.end_of("rows", 16))
        else:
            layout.upload(stage, [("rows", (slice(0, 16),))])
        seen.append(layout.dev["rows"].clone())
    assert [t.tolist() for t in seen] == [[step] * 16 for step in range(8)]
