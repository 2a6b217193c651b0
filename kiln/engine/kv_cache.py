"""The KV block pool and the prefix cache. Plain Python, no torch: unit-tested in milliseconds.

The KV cache is `num_blocks` fixed-size blocks of `block_size` token slots each. A request owns an
ordered list of block ids (its block table); token i of the request lives in slot
`block_ids[i // block_size] * block_size + i % block_size`.

    request tokens: [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..]     block_size = 4
    block table   :     [  7    ,      2     ,     5      ]
    slots         :   28 29 30 31   8  9 10 11  20 21

Prefix caching (vLLM v1's scheme): a *full* block is named by a chained hash
`hash(parent_hash, block token ids, extra keys)`, so equal hashes mean equal prefixes. Blocks are
ref-counted; a block whose count drops to 0 goes to the tail of the free queue but keeps its hash,
so a later request with the same prefix can take it back (O(1) removal from the middle of the
queue). New blocks are popped from the head, so the least recently freed cached block is evicted
first (LRU). A hit is verified against the block's stored token ids: a hash collision never
reuses a wrong block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kiln.engine.request import Request

HashFn = Callable[[int | None, tuple[int, ...], tuple], int]


def default_block_hash(parent: int | None, token_ids: tuple[int, ...], extra: tuple) -> int:
    return hash((parent, token_ids, extra))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # set with block_hash; verifies cache hits
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: popleft, append and remove are O(1)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVBlock) -> None:
        assert not b.in_free_queue
        b.prev, b.next = self.tail, None
        if self.tail is None:
            self.head = b
        else:
            self.tail.next = b
        self.tail = b
        b.in_free_queue = True
        self.size += 1

    def popleft(self) -> KVBlock:
        b = self.head
        if b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        assert b.in_free_queue
        if b.prev is None:
            self.head = b.next
        else:
            b.prev.next = b.next
        if b.next is None:
            self.tail = b.prev
        else:
            b.next.prev = b.prev
        b.prev = b.next = None
        b.in_free_queue = False
        self.size -= 1

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding it
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.free_queue.size / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing

    def _extra_keys(self, req: Request) -> tuple:
        return (req.cache_salt,) if req.cache_salt else ()

    def update_block_hashes(self, req: Request) -> None:
        """Extends `req.block_hashes` to cover every full block of its tokens."""
        bs = self.block_size
        n_full = req.num_tokens // bs
        extra = self._extra_keys(req)
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            tokens = tuple(req.token_ids_slice(i * bs, (i + 1) * bs))
            req.block_hashes.append(self.hash_fn(parent, tokens, extra))

    # ------------------------------------------------------------------ prefix lookup

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached blocks matching the request's leading full blocks.

        At least one token is always left to compute (its logits are needed), so a prompt that
        is all cached gives back its last block.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        bs = self.block_size
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            b = self.cached.get(h)
            # Verify the tokens: equal hashes of different blocks must not share KV.
            if b is None or b.token_ids != tuple(req.token_ids_slice(i * bs, (i + 1) * bs)):
                break
            hits.append(b)
        return hits

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # ------------------------------------------------------------------ allocation

    def allocate(self, req: Request, num_new_tokens: int,
                 cached_prefix: Sequence[KVBlock] = ()) -> bool:
        """Gives `req` blocks for `num_computed_tokens + num_new_tokens` tokens.

        `cached_prefix` are prefix-cache hits to take (first schedule only). Returns False, and
        changes nothing, when there are not enough free blocks.
        """
        need_total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        # Cached blocks sitting in the free queue are free blocks we take back, not new ones.
        reclaimed = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        num_new = need_total - len(req.block_ids) - len(cached_prefix)
        if num_new > self.free_queue.size - reclaimed:
            return False
        for b in cached_prefix:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            req.block_ids.append(b.block_id)
        for _ in range(max(num_new, 0)):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            req.block_ids.append(b.block_id)
        return True

    def _evict(self, b: KVBlock) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = None
            b.token_ids = None

    def cache_full_blocks(self, req: Request) -> None:
        """Publishes the request's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        bs = self.block_size
        n_full = min(req.num_computed_tokens // bs, len(req.block_hashes))
        for i in range(n_full):
            b = self.blocks[req.block_ids[i]]
            if b.block_hash is not None:
                continue  # already published (shared prefix or an earlier step)
            h = req.block_hashes[i]
            if h in self.cached:
                continue  # another block holds this content; keep one copy findable
            b.block_hash = h
            b.token_ids = tuple(req.token_ids_slice(i * bs, (i + 1) * bs))
            self.cached[h] = b

    def free(self, req: Request) -> None:
        """Drops the request's references. Tail blocks go first into the free queue, so they
        are evicted before the shared head of the prefix."""
        for bid in reversed(req.block_ids):
            b = self.blocks[bid]
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {bid} freed twice"
            if b.ref_cnt == 0:
                self.free_queue.append(b)
        req.block_ids = []

    def reset_prefix_cache(self) -> None:
        for b in list(self.cached.values()):
            self._evict(b)

    # ------------------------------------------------------------------ invariants

    def check_integrity(self, requests: Sequence[Request] = ()) -> None:
        """Raises AssertionError if any invariant is broken. Tests call this after every step."""
        refs = [0] * self.num_blocks
        for r in requests:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} repeats a block"
            for bid in r.block_ids:
                refs[bid] += 1
        free = list(self.free_queue)
        assert len(free) == self.free_queue.size, "free queue size is wrong"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free queue"
        for b in self.blocks:
            if requests:
                assert b.ref_cnt == refs[b.block_id], (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} holders")
            assert b.ref_cnt >= 0
            assert b.in_free_queue == (b.ref_cnt == 0), f"block {b.block_id} free-queue mismatch"
        for h, b in self.cached.items():
            assert b.block_hash == h and b.token_ids is not None, "cache map out of sync"
        for b in self.blocks:
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"block {b.block_id} hash not mapped"
