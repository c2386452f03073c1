"""Which data-parallel replica serves a request.

Each replica takes requests up to a window of outstanding ones (about one and a half batches: enough that its
scheduler never runs dry between two round trips, few enough that the job's tail is not stuck queued behind a slow
replica); past it a request waits in the front end until some replica has room. Among the replicas with room a request
goes to the one with the fewest outstanding tokens (prompt plus expected output of what it holds), except that a prompt
whose prefix a replica has already seen goes back to that replica while its load stays within BALANCE_SLACK of the
lightest: its prefix cache and the shared-prefix kernel then keep paying. A prefix that every line shares (one
instruction for the whole job) spreads to every replica as the affine one fills up, and each computes it once.

Prefixes are keyed by a hash of the first block_size * 2**k tokens (k = 0, 1, ...): a prompt matches at the deepest
length it shares with an earlier one. Only full blocks are cached, so shorter prefixes never pay.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

# A replica keeps a request whose prefix it holds while its outstanding tokens are at most this much above the
# lightest replica's: (relative, absolute in tokens)
BALANCE_SLACK = (1.5, 4096)
PREFIX_KEYS_KEPT = 1 << 16  # most recently used prefix keys remembered (LRU)
DEFAULT_OUTPUT_GUESS = 256  # expected output tokens of a request without max_tokens


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the prompt's first block_size * 2**k tokens, shortest first, for every such length that leaves at
    least one token after it (the block of a prompt's last token is never a cache hit)."""
    depths, depth = [], block_size
    while depth <= len(token_ids) - 1:
        depths.append(depth)
        depth *= 2
    if not depths:
        return []
    data = array("q", token_ids[: depths[-1]]).tobytes()
    h, done, keys = xxhash.xxh64(), 0, []
    for depth in depths:
        h.update(data[done * 8 : depth * 8])
        keys.append(h.intdigest())
        done = depth
    return keys


class Router:
    def __init__(self, num_replicas: int, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self.load = [0] * num_replicas  # outstanding tokens (estimated) per replica
        self.count = [0] * num_replicas  # outstanding requests per replica
        self.alive = [True] * num_replicas
        self._holders: OrderedDict[int, list[int]] = OrderedDict()  # prefix key -> replicas that were sent it

    def pick(self, keys: list[int]) -> int | None:
        """The replica for a request with these prefix keys; None while no live replica has room."""
        room = [r for r in range(len(self.load)) if self.alive[r] and self.count[r] < self.window]
        if not room:
            return None
        lightest = min(room, key=lambda r: (self.load[r], self.count[r]))
        bound = self.load[lightest] * BALANCE_SLACK[0] + BALANCE_SLACK[1]
        for key in reversed(keys):  # deepest shared prefix first
            holders = [r for r in self._holders.get(key, ()) if r in room and self.load[r] <= bound]
            if holders:
                return min(holders, key=lambda r: self.load[r])
        return lightest

    def assign(self, replica: int, cost: int, keys: list[int]) -> None:
        self.load[replica] += cost
        self.count[replica] += 1
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = [replica]
                if len(self._holders) > PREFIX_KEYS_KEPT:
                    self._holders.popitem(last=False)
            else:
                self._holders.move_to_end(key)
                if replica not in holders:
                    holders.append(replica)

    def release(self, replica: int, cost: int) -> None:
        self.load[replica] -= cost
        self.count[replica] -= 1

    def lose(self, replica: int) -> None:
        """A replica is gone: it gets nothing more, and no prefix points at it."""
        self.alive[replica] = False
        self.load[replica] = self.count[replica] = 0
        for holders in self._holders.values():
            if replica in holders:
                holders.remove(replica)
