"""The KV block pool, the prefix cache and the session cache. Plain Python, no torch: unit-tested
in milliseconds.

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
first (LRU).

A hit is verified, not trusted to the hash: the block's stored token ids and extra keys must
equal the request's, and its stored parent serial must be the serial of the block matched just
before it. Serials are unique for the life of the manager (a re-published block gets a new
one), so by induction a verified run of blocks holds exactly the request's prefix: a hash
collision never reuses a wrong block, not even one with the same tokens at another position.

    published block: hash h_i, tokens, extra, serial s_i, parent_serial s_(i-1)
    lookup of block i: cached[h_i] has tokens == mine, extra == mine, parent_serial == s_(i-1)

The session cache pins (holds one reference on) the verified prefix blocks of a finished
conversation turn, so the next turn finds them even after other traffic cycled the free queue.
Pins are released LRU by session when the limits are passed, and whenever an allocation finds
too few free blocks: pinned blocks never make the pool refuse work that would fit without them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
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
    # Prefix-cache identity, all set together when published and cleared on eviction.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    extra: tuple = ()
    serial: int | None = None  # unique per publication
    parent_serial: int | None = None  # serial of the block before it in the chain (None: first)
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


@dataclass
class SessionStats:
    stored: int = 0  # turns whose prefix was pinned
    evicted: int = 0  # sessions dropped by the entry / token limits
    released: int = 0  # sessions dropped because the pool needed their blocks


class SessionCache:
    """session id -> pinned prefix blocks of its last finished turn; LRU over sessions.

    Limits: at most `max_entries` sessions and `max_tokens` pinned tokens in all (a turn longer
    than that pins only its first `max_tokens` tokens: the prefix is what the next turn reuses).
    """

    def __init__(self, kv: KVCacheManager, max_entries: int, max_tokens: int) -> None:
        if max_entries < 1 or max_tokens < 1:
            raise ValueError("session cache limits must be positive")
        self.kv = kv
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, list[KVBlock]] = OrderedDict()
        self.num_pinned_blocks = 0
        self.stats = SessionStats()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_pinned_tokens(self) -> int:
        return self.num_pinned_blocks * self.kv.block_size

    def touch(self, session_id: str) -> None:
        """A new turn arrived: its session is the most recently used."""
        if session_id in self.entries:
            self.entries.move_to_end(session_id)

    def remember(self, session_id: str, req: Request) -> None:
        """Pins the verified prefix blocks of `req` (call before the request frees its blocks)."""
        blocks = self.kv.chain_blocks(req)[: self.max_tokens // self.kv.block_size]
        for b in blocks:  # pin the new turn first: the old one usually shares its head
            self.kv.pin(b)
        self.num_pinned_blocks += len(blocks)
        self.drop(session_id)
        self.entries[session_id] = blocks
        self.stats.stored += 1
        while (len(self.entries) > self.max_entries
               or self.num_pinned_tokens > self.max_tokens):
            self._pop_lru()
            self.stats.evicted += 1

    def drop(self, session_id: str) -> bool:
        blocks = self.entries.pop(session_id, None)
        if blocks is None:
            return False
        self._unpin(blocks)
        return True

    def release_lru(self) -> bool:
        """Unpins the least recently used session (the pool needs blocks). False if none."""
        if not self.entries:
            return False
        self._pop_lru()
        self.stats.released += 1
        return True

    def clear(self) -> None:
        while self.entries:
            self._pop_lru()

    def _pop_lru(self) -> None:
        _, blocks = self.entries.popitem(last=False)
        self._unpin(blocks)

    def _unpin(self, blocks: list[KVBlock]) -> None:
        # Tail first, as `KVCacheManager.free` does: the shared head is evicted last.
        for b in reversed(blocks):
            self.kv.unpin(b)
        self.num_pinned_blocks -= len(blocks)

    def pin_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for blocks in self.entries.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        return counts


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash, session_max_entries: int = 0,
                 session_max_tokens: int | None = None) -> None:
        """`session_max_entries` > 0 turns the session cache on (it needs prefix caching);
        `session_max_tokens` defaults to half of the pool."""
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
        self._serials = itertools.count()
        self.sessions: SessionCache | None = None
        if session_max_entries and enable_prefix_caching:
            max_tokens = session_max_tokens or max(num_blocks * block_size // 2, block_size)
            self.sessions = SessionCache(self, session_max_entries, max_tokens)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests or sessions (cached-but-free blocks count as
        free)."""
        return 1.0 - self.free_queue.size / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing

    def _extra_keys(self, req: Request) -> tuple:
        # An adapter's KV differs from the base's for the same tokens: never shared.
        salt = (req.cache_salt,) if req.cache_salt else ()
        return (*salt, ("lora", req.lora_id)) if req.lora_id else salt

    def update_block_hashes(self, req: Request) -> None:
        """Extends `req.block_hashes` to cover every full block of its tokens."""
        bs = self.block_size
        n_full = req.num_tokens // bs
        if len(req.block_hashes) >= n_full:
            return
        extra = self._extra_keys(req)
        tokens = req.all_token_ids
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]),
                                                 extra))

    @staticmethod
    def _matches(b: KVBlock, parent_serial: int | None, token_ids: tuple[int, ...],
                 extra: tuple) -> bool:
        return (b.parent_serial == parent_serial and b.token_ids == token_ids
                and b.extra == extra)

    # ------------------------------------------------------------------ prefix lookup

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached blocks holding the request's leading full blocks (verified).

        At least one token is always left to compute (its logits are needed), so a prompt that
        is all cached gives back its last block.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        if not max_blocks:
            return hits
        bs = self.block_size
        extra = self._extra_keys(req)
        tokens = req.all_token_ids
        parent: int | None = None
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            b = self.cached.get(h)
            if b is None or not self._matches(b, parent, tuple(tokens[i * bs:(i + 1) * bs]),
                                              extra):
                break
            hits.append(b)
            parent = b.serial
        return hits

    def chain_blocks(self, req: Request) -> list[KVBlock]:
        """The cached blocks that hold the request's computed prefix, as a later lookup of the
        same tokens would find them (its own blocks, or the copies published before them)."""
        out: list[KVBlock] = []
        for i, s in enumerate(req.cached_chain):
            b = self.cached.get(req.block_hashes[i]) if s is not None else None
            if b is None or b.serial != s:
                break
            out.append(b)
        return out

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # ------------------------------------------------------------------ allocation

    def allocate(self, req: Request, num_new_tokens: int,
                 cached_prefix: Sequence[KVBlock] = ()) -> bool:
        """Gives `req` blocks for `num_computed_tokens + num_new_tokens` tokens.

        `cached_prefix` are prefix-cache hits to take (first schedule only). Returns False, and
        changes nothing but session pins, when there are not enough free blocks even after
        releasing every pinned session.
        """
        need_total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        num_new = need_total - len(req.block_ids) - len(cached_prefix)

        def available() -> int:
            # Cached blocks sitting in the free queue are free blocks we take back, not new ones.
            return self.free_queue.size - sum(1 for b in cached_prefix if b.ref_cnt == 0)

        while num_new > available():
            if self.sessions is None or not self.sessions.release_lru():
                return False
        if cached_prefix:
            assert not req.block_ids and not req.cached_chain, "hits are taken at first schedule"
        for b in cached_prefix:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            req.block_ids.append(b.block_id)
            req.cached_chain.append(b.serial)
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
            b.extra = ()
            b.serial = b.parent_serial = None

    def cache_full_blocks(self, req: Request) -> None:
        """Publishes the request's computed full blocks in the prefix cache.

        `req.cached_chain` records, block by block, the serial of the cached block that holds
        that prefix (the request's own, or an equal copy published before). A block whose hash
        is taken by different content (a collision) ends the chain: nothing after it can be
        found safely, so nothing after it is published.
        """
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        bs = self.block_size
        n_full = min(req.num_computed_tokens // bs, len(req.block_hashes))
        chain = req.cached_chain
        if len(chain) >= n_full or (chain and chain[-1] is None):
            return
        extra = self._extra_keys(req)
        tokens = req.all_token_ids
        while len(chain) < n_full:
            i = len(chain)
            parent = chain[-1] if i else None
            h = req.block_hashes[i]
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            other = self.cached.get(h)
            if other is None:
                b = self.blocks[req.block_ids[i]]
                assert b.block_hash is None, f"block {b.block_id} is published twice"
                b.block_hash, b.token_ids, b.extra = h, block_tokens, extra
                b.serial, b.parent_serial = next(self._serials), parent
                self.cached[h] = b
                chain.append(b.serial)
            elif self._matches(other, parent, block_tokens, extra):
                chain.append(other.serial)  # the same prefix is cached already: keep one copy
            else:
                chain.append(None)  # hash collision: stop publishing this request
                return

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
        req.cached_chain = []

    def trim(self, req: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past the first `blocks_needed(num_tokens)`: the
        slots rejected draft tokens were written to (speculative decoding). Those blocks lie past
        the computed tokens, so none of them was published in the prefix cache."""
        keep = self.blocks_needed(num_tokens)
        while len(req.block_ids) > keep:
            b = self.blocks[req.block_ids.pop()]
            assert b.block_hash is None and b.ref_cnt == 1, f"block {b.block_id} is shared"
            b.ref_cnt = 0
            self.free_queue.append(b)

    def pin(self, b: KVBlock) -> None:
        if b.ref_cnt == 0:
            self.free_queue.remove(b)
        b.ref_cnt += 1

    def unpin(self, b: KVBlock) -> None:
        b.ref_cnt -= 1
        assert b.ref_cnt >= 0, f"block {b.block_id} unpinned twice"
        if b.ref_cnt == 0:
            self.free_queue.append(b)

    def reset_prefix_cache(self) -> None:
        if self.sessions is not None:
            self.sessions.clear()
        for b in list(self.cached.values()):
            self._evict(b)

    # ------------------------------------------------------------------ invariants

    def check_integrity(self, requests: Sequence[Request] | None = None) -> None:
        """Raises AssertionError if any invariant is broken. Tests call this after every step.

        With `requests` (every request holding blocks), each block's ref count must equal its
        holders: those requests plus session pins.
        """
        pins = self.sessions.pin_counts() if self.sessions is not None else {}
        if requests is not None:
            refs = [0] * self.num_blocks
            for r in requests:
                assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} repeats a block"
                for bid in r.block_ids:
                    refs[bid] += 1
            for bid, n in pins.items():
                refs[bid] += n
            for b in self.blocks:
                assert b.ref_cnt == refs[b.block_id], (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} holders")
        free = list(self.free_queue)
        assert len(free) == self.free_queue.size, "free queue size is wrong"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free queue"
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert b.in_free_queue == (b.ref_cnt == 0), f"block {b.block_id} free-queue mismatch"
            assert b.ref_cnt >= pins.get(b.block_id, 0), f"block {b.block_id} pinned but free"
        serials = set()
        for h, b in self.cached.items():
            assert b.block_hash == h and b.token_ids is not None, "cache map out of sync"
            assert len(b.token_ids) == self.block_size, "a partial block is cached"
            assert b.serial is not None and b.serial not in serials, "serials are not unique"
            serials.add(b.serial)
        for b in self.blocks:
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"block {b.block_id} hash not mapped"
            else:
                assert b.serial is None and b.token_ids is None, f"block {b.block_id} half-evicted"
        if self.sessions is not None:
            assert self.sessions.num_pinned_blocks == sum(pins.values()), "pin count drifted"
            assert len(self.sessions) <= self.sessions.max_entries
            assert self.sessions.num_pinned_tokens <= self.sessions.max_tokens
