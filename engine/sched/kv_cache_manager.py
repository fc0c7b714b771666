"""Per-request block tables on top of the block pool, and the prefix-cache policy.

Invariants (engine-core thread only):
- A request's block table covers slots for every token it has computed or is computing
  this step; blocks are only ever appended while the request holds them.
- The first `num_cached_blocks(request)` blocks of a table have been offered to the prefix
  cache. A block is offered only once its KV is really in memory: the scheduler calls
  `cache_blocks` after the step that computed it (or after a KV transfer landed), never at
  allocation time, so no request can hit a block another request is still computing.
- A prefix hit never covers a request's last token: the model must run on at least one
  token to produce logits for the next one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.sched.block_pool import BlockPool, HashFn, KVBlock, hash_block_tokens
from engine.sched.request import Request

logger = logging.getLogger(__name__)


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens: `queries` looked up, `hits` found in the cache."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the blocks of each request (keyed by request id)."""

    def __init__(
        self, block_size: int, num_blocks: int, enable_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}

    # ---- accounting -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_cached_blocks(self, request_id: str) -> int:
        return self._num_cached.get(request_id, 0)

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    # ---- prefix cache -----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's tokens, in full blocks.

        Returns (blocks, num_computed_tokens). The walk starts at the first block and stops
        at the first miss; each hit's own tokens and parent hash are compared, so a wrong
        hit would need two different prefixes with equal chained hashes, not merely two
        blocks with equal hashes. Pure lookup: nothing is reserved until the blocks are
        passed to `allocate_slots`, which must happen in the same scheduling pass (a later
        allocation may evict them otherwise).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # prompt logprobs come from the prefill's own rows (engine/runner/
            # prompt_logprobs.py): a cached block is recomputed, never skipped
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[KVBlock] = []
        parent = None
        for i in range(max_blocks):
            block_hash = request.block_hashes[i]
            block = self.block_pool.get_cached_block(
                block_hash, parent, tokens[i * bs:(i + 1) * bs]
            )
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * bs

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache."""
        rid = request.request_id
        if not self.enable_caching or rid not in self._req_blocks:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self._req_blocks[rid]
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, num_full):
            parent = request.block_hashes[i - 1] if i > 0 else None
            self.block_pool.cache_block(
                blocks[i], request.block_hashes[i], parent, tokens[i * bs:(i + 1) * bs]
            )
        self._num_cached[rid] = num_full

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            logger.info("prefix cache reset")
        return ok

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(self.hash_fn(parent, tokens[i * bs:(i + 1) * bs]))

    # ---- allocation -------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVBlock] | None = None,
        num_external_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to hold every token up to this step's end.

        Slots are needed for `request.num_computed_tokens` + the prefix hit
        (`num_new_computed_tokens`, held by `new_computed_blocks`) + tokens a connector
        provides (`num_external_tokens`) + `num_new_tokens` computed this step.
        Returns the ids of the blocks newly taken from the pool (prefix-hit blocks are
        appended to the table but not listed), or None — with nothing changed — when the
        pool cannot supply them.
        """
        rid = request.request_id
        hit = new_computed_blocks or []
        held = self._req_blocks.get(rid, [])
        if hit and held:
            raise RuntimeError(f"request {rid}: prefix hit passed for a request with blocks")
        total = (request.num_computed_tokens + num_new_computed_tokens + num_external_tokens
                 + num_new_tokens)
        num_to_allocate = max(0, self.num_blocks_for(total) - len(held) - len(hit))
        # Touching a free hit block takes it out of the free queue.
        num_reusable = sum(1 for b in hit if b.ref_cnt == 0)
        if not self.block_pool.can_allocate(num_to_allocate + num_reusable):
            return None
        self.block_pool.touch(hit)
        new_blocks = self.block_pool.allocate(num_to_allocate)
        table = self._req_blocks.setdefault(rid, [])
        if hit:
            table.extend(hit)
            self._num_cached[rid] = len(hit)
        table.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first so tails are evicted first."""
        self.free_blocks(self.detach(request))

    def detach(self, request: Request) -> list[KVBlock]:
        """Take every block out of the request's table without freeing it (the caller frees
        them with `free_blocks`); the request then holds none, as a fresh one."""
        self._num_cached.pop(request.request_id, None)
        return self._req_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Release blocks `detach` took (a table's order: tail first, so tails go first)."""
        self.block_pool.free(reversed(blocks))
