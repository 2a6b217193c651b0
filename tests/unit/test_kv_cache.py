"""Block manager: allocation, prefix-cache hits, LRU eviction, collisions, session pins.

Plain Python (no model): every test calls `check_integrity()` after every operation.
"""

from __future__ import annotations

import random

import pytest

from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.request import Request
from kiln.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


class Pool:
    """A KVCacheManager plus the requests holding blocks, checked after every operation."""

    def __init__(self, num_blocks: int = 8, **kw) -> None:
        self.kv = KVCacheManager(num_blocks, BS, **kw)
        self.live: dict[str, Request] = {}
        self.check()

    def check(self) -> None:
        self.kv.check_integrity(list(self.live.values()))

    def admit(self, r: Request, num_tokens: int | None = None) -> list:
        """First schedule of `r`: takes its cached prefix and blocks for the rest."""
        hits = self.kv.find_cached_prefix(r)
        r.num_computed_tokens = len(hits) * BS
        n = (r.num_tokens if num_tokens is None else num_tokens) - r.num_computed_tokens
        ok = self.kv.allocate(r, n, hits)
        if ok:
            self.live[r.request_id] = r
        else:
            r.num_computed_tokens = 0
        self.check()
        return hits if ok else None

    def compute(self, r: Request, upto: int | None = None) -> None:
        """The model computed `r`'s tokens up to `upto`: publish its full blocks."""
        r.num_computed_tokens = r.num_tokens if upto is None else upto
        self.kv.cache_full_blocks(r)
        self.check()

    def run(self, r: Request) -> list:
        hits = self.admit(r)
        assert hits is not None, "no room"
        self.compute(r)
        return hits

    def free(self, r: Request) -> None:
        self.kv.free(r)
        self.live.pop(r.request_id, None)
        self.check()


def test_allocate_gives_distinct_blocks_and_free_returns_them():
    p = Pool(8)
    a = req("a", range(10))  # 3 blocks
    assert p.admit(a) == []
    assert len(a.block_ids) == 3 and p.kv.num_free_blocks == 5
    b = req("b", range(100, 105))  # 2 blocks
    p.admit(b)
    assert not set(a.block_ids) & set(b.block_ids)
    assert p.kv.usage == pytest.approx(5 / 8)
    p.free(a)
    p.free(b)
    assert p.kv.num_free_blocks == 8 and p.kv.usage == 0.0


def test_allocation_grows_block_by_block_and_refuses_without_changes():
    p = Pool(3)
    a = req("a", range(4))
    p.admit(a)
    assert len(a.block_ids) == 1
    p.compute(a)
    a.output_token_ids.append(7)  # 5th token: a second block is needed
    assert p.kv.allocate(a, 1) and len(a.block_ids) == 2
    p.check()
    b = req("b", range(50, 58))  # needs 2 blocks, 1 free
    assert p.admit(b) is None
    assert b.block_ids == [] and p.kv.num_free_blocks == 1


def test_shared_prefix_hits_and_the_last_token_is_always_computed():
    p = Pool(10)
    a = req("a", range(12))  # 3 full blocks
    assert p.run(a) == []
    assert len(p.kv.cached) == 3
    b = req("b", list(range(8)) + [90, 91, 92])  # shares 2 blocks
    hits = p.admit(b)
    assert [h.block_id for h in hits] == a.block_ids[:2]
    assert b.num_computed_tokens == 8 and p.kv.blocks[a.block_ids[0]].ref_cnt == 2
    # A prompt that is entirely cached still computes its last token: the last block is not
    # taken from the cache.
    c = req("c", range(12))
    hits = p.admit(c)
    assert len(hits) == 2 and c.num_computed_tokens == 8


def test_freed_cached_blocks_are_reused_and_counted_as_free():
    p = Pool(4)
    a = req("a", range(16))  # every block
    p.run(a)
    a_blocks = list(a.block_ids)
    p.free(a)
    assert p.kv.num_free_blocks == 4 and len(p.kv.cached) == 4
    # 3 hits come back from the free queue, and the 4th block must not be counted twice.
    b = req("b", list(range(12)) + [99, 98, 97, 96])
    hits = p.admit(b)
    assert [h.block_id for h in hits] == a_blocks[:3]
    assert p.kv.num_free_blocks == 0
    p.compute(b)
    assert p.kv.blocks[b.block_ids[3]].token_ids == (99, 98, 97, 96)
    # The block that held a's 4th block was reused: a's tail is gone from the cache.
    assert len(p.kv.cached) == 4 and len(p.kv.find_cached_prefix(req("x", range(16)))) == 3


def test_eviction_is_lru_and_tail_first():
    p = Pool(6)
    a = req("a", range(8))  # 2 blocks
    b = req("b", range(100, 108))  # 2 blocks
    p.run(a)
    p.run(b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    p.free(a)  # freed first: evicted first
    p.free(b)
    queue = [blk.block_id for blk in p.kv.free_queue]
    # 2 never-used blocks, then a (tail first), then b (tail first).
    assert queue[2:] == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    c = req("c", range(200, 212))  # 3 new blocks: the 2 unused ones, then a's tail
    p.run(c)
    assert len(p.kv.find_cached_prefix(req("a2", list(range(8)) + [1]))) == 1  # a's head only
    assert len(p.kv.find_cached_prefix(req("b2", list(range(100, 108)) + [1]))) == 2


def test_taking_a_cached_block_back_moves_it_out_of_the_lru_order():
    p = Pool(4)
    a = req("a", range(8))
    p.run(a)
    a_blocks = list(a.block_ids)
    p.free(a)
    assert [blk.block_id for blk in p.kv.free_queue][:2] not in (a_blocks, a_blocks[::-1])
    again = req("a-again", list(range(8)) + [5])
    hits = p.admit(again)
    assert [h.block_id for h in hits] == a_blocks
    p.free(again)
    # Freed again after the 2 never-used blocks: a's blocks are now the newest, evicted last.
    queue = [blk.block_id for blk in p.kv.free_queue]
    assert set(queue[-3:]) >= set(a_blocks) and set(queue[:1]).isdisjoint(a_blocks)


def test_disabled_prefix_caching_never_hits():
    p = Pool(8, enable_prefix_caching=False)
    a = req("a", range(12))
    p.run(a)
    assert p.admit(req("b", range(12))) == [] and not p.kv.cached


def test_cache_salt_isolates_and_same_salt_shares():
    for hash_fn in (None, lambda parent, tokens, extra: 0):  # salts are verified, not hashed only
        kw = {"hash_fn": hash_fn} if hash_fn else {}
        p = Pool(16, **kw)
        p.run(req("a", range(12), salt="alice"))
        assert p.admit(req("b", list(range(12)) + [1], salt="bob")) == []
        assert p.admit(req("c", list(range(12)) + [1])) == []
        assert len(p.admit(req("d", list(range(12)) + [1], salt="alice"))) >= 1


def test_forced_hash_collision_with_same_tokens_at_another_position_is_not_reused():
    # Every block hashes equal. b's second block holds the same tokens as a's first block, but
    # at another position (its KV differs): it must not be served from a's block.
    p = Pool(8, hash_fn=lambda parent, tokens, extra: 42)
    x = [1, 2, 3, 4]
    a = req("a", x + [9])
    p.run(a)
    b = req("b", x + x + [9])
    hits = p.admit(b)
    assert [h.block_id for h in hits] == [a.block_ids[0]]  # block 0 only, not block 0 twice
    assert len(set(b.block_ids)) == len(b.block_ids)
    c = req("c", [7, 7, 7, 7] + x + [9])  # different first block: nothing at all
    assert p.admit(c) == []


@pytest.mark.parametrize("modulus", [1, 3, 1 << 61])
def test_random_workload_never_reuses_a_wrong_block(modulus):
    """A shadow map records the true prefix each block holds; every hit must match it, whatever
    the hash collisions (modulus 1: all blocks collide)."""
    rng = random.Random(modulus)
    p = Pool(24, hash_fn=lambda parent, tokens, extra: hash((parent, tokens, extra)) % modulus)
    truth: dict[int, tuple] = {}  # block id -> (salt, tokens from position 0 to its end)
    base = [rng.randrange(3) for _ in range(40)]
    for step in range(300):
        live = list(p.live.values())
        if live and (rng.random() < 0.4 or p.kv.num_free_blocks < 6):
            p.free(rng.choice(live))
            continue
        cut = rng.randrange(0, 40)
        tokens = base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        salt = rng.choice([None, None, "s"])
        r = req(f"r{step}", tokens, salt)
        hits = p.admit(r)
        if hits is None:
            continue
        for i, h in enumerate(hits):
            assert truth[h.block_id] == (salt, tuple(tokens[:(i + 1) * BS])), "wrong reuse"
        upto = rng.randrange(r.num_computed_tokens, r.num_tokens + 1)
        p.compute(r, upto)
        for i in range(upto // BS):
            bid = r.block_ids[i]
            if i >= len(hits):  # computed by r itself
                truth[bid] = (salt, tuple(tokens[:(i + 1) * BS]))


def test_reset_prefix_cache_forgets_every_block():
    p = Pool(8)
    a = req("a", range(12))
    p.run(a)
    p.kv.reset_prefix_cache()
    p.check()
    assert not p.kv.cached and p.admit(req("b", range(12))) == []


# --------------------------------------------------------------------------- session pins


def session_pool(num_blocks: int = 12, **kw) -> Pool:
    return Pool(num_blocks, session_max_entries=kw.pop("entries", 4),
                session_max_tokens=kw.pop("tokens", None), **kw)


def finish_turn(p: Pool, r: Request, session: str) -> None:
    p.kv.sessions.remember(session, r)
    p.free(r)


def test_session_pins_survive_traffic_that_evicts_unpinned_blocks():
    p = session_pool(12)
    turn1 = req("t1", range(8))
    p.run(turn1)
    finish_turn(p, turn1, "conv")
    assert p.kv.sessions.num_pinned_blocks == 2 and p.kv.num_free_blocks == 10
    other = req("o", range(500, 540))  # all 10 unpinned blocks: evicts every other cached block
    p.run(other)
    p.free(other)
    turn2 = req("t2", list(range(8)) + [60, 61, 62])
    assert len(p.admit(turn2)) == 2
    # Without the pin the same traffic evicts it.
    q = Pool(12)
    t1 = req("t1", range(8))
    q.run(t1)
    q.free(t1)
    o = req("o", range(500, 548))
    q.run(o)
    q.free(o)
    assert q.admit(req("t2", list(range(8)) + [60])) == []


def test_session_lru_entry_and_token_limits():
    p = session_pool(32, entries=2, tokens=16)  # 2 sessions, 4 blocks in all
    for name, base in (("s1", 0), ("s2", 100), ("s3", 200)):
        r = req(name, range(base, base + 8))
        p.run(r)
        finish_turn(p, r, name)
    sessions = p.kv.sessions
    assert list(sessions.entries) == ["s2", "s3"]  # s1 was the least recently used
    sessions.touch("s2")  # a new turn of s2 arrives
    r = req("s4", range(300, 312))  # 3 blocks: 2 + 3 > 4 tokens' worth
    p.run(r)
    finish_turn(p, r, "s4")
    assert list(sessions.entries) == ["s4"] and sessions.num_pinned_blocks == 3
    big = req("s5", range(400, 424))  # 6 blocks: only the first 4 are pinned
    p.run(big)
    finish_turn(p, big, "s5")
    assert sessions.num_pinned_blocks == 4 and list(sessions.entries) == ["s5"]


def test_next_turn_repins_and_releases_the_old_turn():
    p = session_pool(16)
    t1 = req("t1", range(8))
    p.run(t1)
    finish_turn(p, t1, "c")
    t2 = req("t2", list(range(8)) + list(range(20, 28)) + [1])
    assert len(p.admit(t2)) == 2
    p.compute(t2)
    finish_turn(p, t2, "c")
    assert p.kv.sessions.num_pinned_blocks == 4
    assert {b.ref_cnt for b in p.kv.sessions.entries["c"]} == {1}


def test_pins_are_released_when_the_pool_needs_blocks():
    p = session_pool(6, tokens=24)
    for name, base in (("s1", 0), ("s2", 100)):
        r = req(name, range(base, base + 12))  # 3 blocks each: every block pinned
        p.run(r)
        finish_turn(p, r, name)
    assert p.kv.num_free_blocks == 0
    big = req("big", range(900, 916))  # 4 blocks: s1 (LRU) then s2 must let go
    assert p.admit(big) == []
    assert p.kv.sessions.stats.released == 2 and len(p.kv.sessions) == 0
    small = session_pool(6, tokens=24)
    r = req("s1", range(12))
    small.run(r)
    finish_turn(small, r, "s1")
    assert small.admit(req("n", range(900, 912))) == []  # fits without touching the pin
    assert len(small.kv.sessions) == 1


def test_session_cache_needs_prefix_caching():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, session_max_entries=4)
    assert kv.sessions is None
