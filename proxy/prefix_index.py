"""Which backend holds which prefix blocks: the proxy's view of every engine's prefix cache.

Two sources, per backend URL:
  - events: the engine publishes KV events (engine/kv_events.py); each data-parallel rank's
    set of cached block hashes is rebuilt exactly from them (`apply`). Block hashes are the
    engine's chained hashes (engine.sched.block_pool.hash_block_tokens) at the block size the
    events name, so the proxy recomputes them from a request's token ids.
  - routed: for a backend without events, the blocks of every prompt the proxy sent there
    (SGLang's approximate tree), kept in LRU order up to `routed_capacity` blocks.

Threading: event loop only (the subscribers apply batches on it); no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.sched.block_pool import hash_block_tokens

DEFAULT_BLOCK_SIZE = 16  # the engine's default; events name the real one


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every full block of `tokens`, as the engine computes them."""
    hashes: list[int] = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class RankCache:
    """One engine's (data-parallel rank's) cached block hashes, rebuilt from its events."""

    block_size: int = DEFAULT_BLOCK_SIZE
    hashes: set[int] = field(default_factory=set)

    def apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            self.block_size = event.block_size
            self.hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.hashes.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.hashes.clear()


class RoutedCache:
    """Blocks the proxy sent to a backend that publishes no events: an LRU estimate."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.block_size = DEFAULT_BLOCK_SIZE
        self.hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)


class PrefixIndex:
    """`matched_tokens(url, tokens)`: how many leading tokens of a prompt the backend holds."""

    def __init__(self, routed_capacity: int = 65536) -> None:
        self.routed_capacity = routed_capacity
        self.ranks: dict[str, dict[int, RankCache]] = {}  # URL -> DP rank -> cache (events)
        self.routed: dict[str, RoutedCache] = {}  # URL -> estimate (no events)

    def has_events(self, url: str) -> bool:
        return url in self.ranks

    def expect_events(self, url: str) -> None:
        """`url` publishes events: its view comes from them, not from routing."""
        self.ranks.setdefault(url, {})

    def apply(self, url: str, rank: int, events: Sequence[KVCacheEvent]) -> None:
        cache = self.ranks.setdefault(url, {}).setdefault(rank, RankCache())
        for event in events:
            cache.apply(event)

    def forget(self, url: str, rank: int) -> None:
        """After a gap the replay could not fill: the rank's view is unknown, start empty."""
        self.ranks.setdefault(url, {})[rank] = RankCache()

    def block_size(self, url: str) -> int:
        """`url`'s KV block size as its events name it (the engine default without)."""
        ranks = self.ranks.get(url)
        return next(iter(ranks.values())).block_size if ranks else DEFAULT_BLOCK_SIZE

    def cached_hashes(self, url: str, rank: int) -> set[int]:
        return set(self.ranks.get(url, {}).get(rank, RankCache()).hashes)

    def matched_tokens(self, url: str, tokens: Sequence[int], memo: dict[int, list[int]]
                       ) -> int:
        """Leading tokens of `tokens` in `url`'s cache (best rank); `memo` caches the
        chain per block size across the backends of one request (tokenize/hash once)."""
        views = ([(c.block_size, c.hashes) for c in self.ranks[url].values()]
                 if url in self.ranks else [])
        if url not in self.ranks and url in self.routed:
            views = [(self.routed[url].block_size, self.routed[url].hashes)]
        best = 0
        for block_size, held in views:
            chain = memo.get(block_size)
            if chain is None:
                chain = memo[block_size] = chain_hashes(tokens, block_size)
            n = 0
            while n < len(chain) and chain[n] in held:
                n += 1
            best = max(best, n * block_size)
        return best

    def routed_to(self, url: str, tokens: Sequence[int], memo: dict[int, list[int]]) -> None:
        """The proxy sent `tokens` to `url`: a backend without events now likely holds them."""
        if url in self.ranks:
            return
        cache = self.routed.setdefault(url, RoutedCache(self.routed_capacity))
        chain = memo.get(cache.block_size)
        if chain is None:
            chain = memo[cache.block_size] = chain_hashes(tokens, cache.block_size)
        cache.add(chain)
