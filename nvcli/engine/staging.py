"""Static device inputs of CUDA graphs and their pinned host staging copies, from one declared layout.

A layout is a list of fields (name, dtype, shape). They are laid out one after another (16-byte aligned) in one
device byte buffer, and the same way in two pinned host buffers used in turn (PinnedTurns): with async scheduling
step N+1 is staged while step N's copies may still be queued on the device. A buffer is refilled only once the device
has read its previous upload (an event per buffer): in a job that wait is already over, since step N-1 has completed
by then, but start-up replays graphs back to back, and a buffer refilled before its copy ran fed the graph another
step's rows. The host fills numpy views of a staging buffer, then uploads either one prefix of it (a small
step: one copy, whose latency a one-token step pays in full) or the parts in use, field by field.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

FieldSpec = tuple[str, torch.dtype, tuple[int, ...]]
ALIGN = 16


class PinnedTurns:
    """Two host buffers of `size` bytes (pinned on a GPU) used in turn; next() hands one out only once the device
    has run the copies that read it last (uploaded() marks them, on the current stream)."""

    def __init__(self, size: int, device: torch.device) -> None:
        gpu = device.type == "cuda"
        self.blobs = [torch.zeros(size, dtype=torch.uint8, pin_memory=gpu) for _ in range(2)]
        self.read = [torch.cuda.Event() for _ in range(2)] if gpu else None
        self.turn = 0

    def next(self) -> int:
        i = self.turn % 2
        self.turn += 1
        if self.read is not None:
            self.read[i].synchronize()  # returns at once where never recorded, or where the copy already ran
        return i

    def uploaded(self, i: int) -> None:
        """The copies reading buffer `i` are enqueued on the current stream."""
        if self.read is not None:
            self.read[i].record()


class StagingLayout:
    def __init__(self, fields: Sequence[FieldSpec], device: torch.device) -> None:
        self.fields = list(fields)
        self.shapes = {name: shape for name, _, shape in self.fields}
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, dtype, shape in self.fields:
            size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
            self.offsets[name] = (at, at + size)
            at = -(-(at + size) // ALIGN) * ALIGN
        self.size = at
        self.blob = torch.zeros(self.size, dtype=torch.uint8, device=device)
        self.dev = self._views(self.blob)
        self.turns = PinnedTurns(self.size, device)
        self.stage_blobs = self.turns.blobs
        self.stages = [self._views(blob) for blob in self.stage_blobs]
        self.host = [{name: t.numpy() for name, t in stage.items()} for stage in self.stages]

    def _views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, dtype, shape in self.fields:
            a, b = self.offsets[name]
            views[name] = blob[a:b].view(dtype).view(shape)
        return views

    def next_stage(self) -> int:
        """The staging buffer a new step fills (the two alternate), once the device has read its last upload."""
        return self.turns.next()

    def end_of(self, name: str, rows: int) -> int:
        """The byte offset just past the first `rows` rows of field `name` (a prefix upload's end)."""
        a, b = self.offsets[name]
        return a + (b - a) // max(1, self.shapes[name][0]) * rows

    def upload_prefix(self, stage: int, end: int) -> None:
        self.blob[:end].copy_(self.stage_blobs[stage][:end], non_blocking=True)
        self.turns.uploaded(stage)

    def upload(self, stage: int, parts: Sequence[tuple[str, tuple[slice, ...]]]) -> None:
        """Copy the given slices of fields from staging buffer `stage` to the device, one copy each."""
        src = self.stages[stage]
        for name, index in parts:
            self.dev[name][index].copy_(src[name][index], non_blocking=True)
        self.turns.uploaded(stage)
