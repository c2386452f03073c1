"""The order in which waiting requests leave a queue: arrival (`--scheduling-policy fcfs`), or priority, then arrival
(`priority`). The scheduler's waiting sequences and the data-parallel front end's queued requests use it.

fcfs keeps a plain deque, so its per-step path is exactly what it was. priority uses `PriorityQueue`: the deque
members those callers use, over a binary heap, O(log n) per request in and out. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class PriorityQueue(Generic[T]):
    """A deque's `append`, `appendleft`, `popleft`, `[0]`, `remove`, `len` and iteration, served in the order of
    `key(item)`, lowest first. Keys must be unique among queued items ((priority, arrival number)): the heap then
    never compares two items. `appendleft` is `append`: an item given back (a preempted sequence, a request re-queued
    from a lost replica) goes to its key's place, not ahead of more urgent ones."""

    __slots__ = ("_heap", "_key")

    def __init__(self, key: Callable[[T], tuple[int, int]]) -> None:
        self._key = key
        self._heap: list[tuple[tuple[int, int], T]] = []

    def append(self, item: T) -> None:
        heapq.heappush(self._heap, (self._key(item), item))

    appendleft = append

    def popleft(self) -> T:
        if not self._heap:
            raise IndexError("pop from an empty PriorityQueue")
        return heapq.heappop(self._heap)[1]

    def __getitem__(self, index: int) -> T:
        """Only the head (index 0) is addressable: the most urgent item."""
        if index != 0 or not self._heap:
            raise IndexError(f"PriorityQueue index {index} out of range (only [0], the head, when not empty)")
        return self._heap[0][1]

    def remove(self, item: T) -> None:
        """Take `item` (that object, not an equal one) out wherever it is: O(n), as deque.remove (aborts of waiting
        requests only)."""
        for i, (_, queued) in enumerate(self._heap):
            if queued is item:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError("PriorityQueue.remove(x): x not in queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[T]:
        """The items in the order they would leave (a sorted copy: O(n log n), for inspection)."""
        return iter([item for _, item in sorted(self._heap, key=lambda entry: entry[0])])


def waiting_queue(policy: str, key: Callable[[T], tuple[int, int]]) -> deque[T] | PriorityQueue[T]:
    """An empty queue for `policy` (config.SCHEDULING_POLICIES); `key` gives an item's (priority, arrival)."""
    if policy == "fcfs":
        return deque()
    if policy == "priority":
        return PriorityQueue(key)
    raise ValueError(f"unknown scheduling policy {policy!r}")
