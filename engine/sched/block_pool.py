"""The pool of KV-cache blocks: allocation, reference counts and the prefix cache.

Invariants (engine-core thread only; nothing here is thread-safe):
- Every block is either in use (`ref_cnt > 0`) or in the free queue (`ref_cnt == 0`), never
  both. `get_num_free_blocks()` counts the free queue, cached blocks included.
- The free queue is ordered by eviction preference: its head is taken first. A freed block
  that holds a cached prefix goes to the tail (least recently freed is evicted first); a
  freed block without a hash goes to the head, because reusing it evicts nothing.
- A block is in the cached map iff it carries a hash; the map holds at most one block per
  hash. Allocating a cached free block removes its map entry (eviction).
- A lookup returns a block only if its stored token ids and parent hash equal the caller's:
  a hash collision can make a lookup miss, never return a block holding other tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

BlockHash = int
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]


class CacheEventSink(Protocol):
    """Told, on the engine-core thread, each time a block gains or loses its hash
    (engine/kv_events.KVEventRecorder publishes them)."""

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: tuple[int, ...]) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...

    def cleared(self) -> None: ...


_ROOT = 0x5EED  # the parent of a prompt's first block: hash(None) differs between processes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: depends on every token of the prefix it ends. The
    same in every process (int tuples hash alike everywhere), so KV events name blocks a
    router can recompute from token ids."""
    return hash((_ROOT if parent_hash is None else parent_hash, tuple(token_ids)))


@dataclass(eq=False)
class KVBlock:
    """One block of `block_size` token slots. Identity is `block_id` (0..num_blocks-1)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None  # only meaningful while block_hash is set
    token_ids: tuple[int, ...] = ()  # the tokens the cached KV was computed from

    def reset_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockPool:
    """Owns every `KVBlock`. Callers pair a check with an act: `can_allocate` / `allocate`."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.events: CacheEventSink | None = None  # KV events (--kv-events-config), else None

    # ---- accounting -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1). Free cached blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    # ---- allocation ---------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_cnt 1."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(
                f"allocate({num_blocks}) with only {len(self._free)} free blocks"
            )
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (earlier = evicted sooner)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # ---- prefix cache -------------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> KVBlock | None:
        """The cached block holding exactly `token_ids` after the prefix `parent_hash` ends."""
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash:
            return None
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
        token_ids: Sequence[int],
    ) -> bool:
        """Make a full, computed, in-use block findable. False if the hash is already taken.

        A taken hash means another block holds the same prefix (two requests computed it in
        the same window) or a genuine collision; either way the existing entry stays.
        """
        if not self.enable_caching or block_hash in self._cached:
            return False
        if block.ref_cnt <= 0 or block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} cannot be cached in its state")
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, block.token_ids)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only allowed while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.reset_hash()
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.reset_hash()
