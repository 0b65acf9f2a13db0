"""Block manager: exact behaviours and hypothesis property tests (no leak, exact ref counts)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pageflash.engine.kv_cache import KVCacheManager


def check_invariants(kv: KVCacheManager) -> None:
    refs = Counter(b for sb in kv.seqs.values() for b in sb.block_ids[sb.released:])
    for sb in kv.seqs.values():  # blocks given back behind a sliding window: placeholders
        assert sb.block_ids[:sb.released] == [0] * sb.released
    for blk in kv.pool.blocks:
        assert blk.ref_cnt == refs.get(blk.block_id, 0), f"block {blk.block_id}: ref_cnt {blk.ref_cnt} != {refs.get(blk.block_id, 0)}"
        assert (blk.block_id in kv.pool.free_queue) == (blk.ref_cnt == 0)
    for h, bid in kv.pool.cached.items():
        assert kv.pool.blocks[bid].block_hash == h
    assert kv.pool.num_free + len(refs) == kv.pool.num_blocks


def test_allocate_on_demand_and_free_order():
    kv = KVCacheManager(8, 4)
    assert kv.allocate("a", 0, 5)  # 2 blocks
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate("a", 5, 3)  # fills block 1: no new block
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate("a", 8, 1)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free("a")
    # tail first: the last block is evicted first
    assert list(kv.pool.free_queue)[-3:] == [2, 1, 0]
    check_invariants(kv)


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(2, 4)
    assert kv.allocate("a", 0, 8)
    assert not kv.allocate("b", 0, 1)
    assert "b" not in kv.seqs
    check_invariants(kv)


def test_prefix_hit_reuses_blocks_and_survives_free():
    kv = KVCacheManager(8, 4)
    toks = list(range(10))
    assert kv.allocate("a", 0, 10)
    kv.cache_full_blocks("a", toks, 10)  # 2 full blocks published
    hits = kv.find_cached_prefix(toks + [99])
    assert hits == kv.block_ids("a")[:2]
    kv.free("a")
    # freed blocks keep their hash: a later request still hits them
    hits = kv.find_cached_prefix(toks[:8] + [7, 7])
    assert hits == [0, 1]
    assert kv.allocate("b", 8, 2, hits)
    assert kv.block_ids("b")[:2] == [0, 1]
    check_invariants(kv)


def test_last_token_never_cached():
    kv = KVCacheManager(8, 4)
    toks = list(range(8))
    kv.allocate("a", 0, 8)
    kv.cache_full_blocks("a", toks, 8)
    # the whole prompt is cached, but its last token must be computed: only block 0 is a hit
    assert kv.find_cached_prefix(toks) == [kv.block_ids("a")[0]]


def test_lru_eviction_drops_hash():
    kv = KVCacheManager(3, 2)
    kv.allocate("a", 0, 2)
    kv.cache_full_blocks("a", [1, 2], 2)
    kv.free("a")
    kv.allocate("b", 0, 6)  # needs every block, evicts the cached one
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix([1, 2, 3]) == []
    check_invariants(kv)


def test_fork_copy_on_write():
    kv = KVCacheManager(8, 4)
    kv.allocate("p", 0, 6)  # block 0 full, block 1 partial (2 tokens)
    kv.fork("p", "c", 6)
    assert kv.block_ids("c") == kv.block_ids("p")
    assert kv.pool.blocks[kv.block_ids("p")[1]].ref_cnt == 2
    assert kv.allocate("c", 6, 1)  # writes into the shared partial block: copy it
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == kv.block_ids("p")[1]
    assert kv.block_ids("c")[1] == copies[0][1]
    assert kv.block_ids("c")[0] == kv.block_ids("p")[0]  # full block still shared
    assert kv.allocate("p", 6, 1)  # parent now owns block 1 alone: no copy
    assert kv.take_pending_copies() == []
    check_invariants(kv)


def test_fork_shares_only_computed_blocks():
    """Slots claimed past the computed tokens (early-exit draft slots) stay the parent's alone."""
    kv = KVCacheManager(8, 4, locality_tokens=0)
    kv.allocate("p", 0, 6)  # 6 computed tokens: blocks 0 (full) and 1 (partial)
    kv.allocate("p", 6, 4)  # 4 draft slots: block 2 too
    assert len(kv.block_ids("p")) == 3
    kv.fork("p", "c", 6)
    assert kv.block_ids("c") == kv.block_ids("p")[:2]
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_ids("p")] == [2, 2, 1]
    assert kv.allocate("c", 6, 3)  # the child's own slots: a copy of block 1 and a fresh block
    assert set(kv.block_ids("c")[1:]).isdisjoint(kv.block_ids("p"))
    check_invariants(kv)


def _grow_alternately(kv: KVCacheManager, steps: int) -> None:
    """Sequences a and b get one-block prompts, then one new block each, in turn, `steps` times."""
    bs = kv.block_size
    for sid in "ab":
        assert kv.allocate(sid, 0, bs)
    for i in range(1, steps + 1):
        for sid in "ab":
            assert kv.allocate(sid, i * bs, bs)
    check_invariants(kv)


def test_locality_keeps_a_sequences_runs_together():
    # run = 64 tokens / 16 per block = 4: each sequence's 4-block runs are consecutive ids
    kv = KVCacheManager(64, 16)
    _grow_alternately(kv, 7)
    assert kv.block_ids("a") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert kv.block_ids("b") == [4, 5, 6, 7, 12, 13, 14, 15]
    # the plain LRU queue interleaves them
    lru = KVCacheManager(64, 16, locality_tokens=0)
    _grow_alternately(lru, 3)
    assert lru.block_ids("a") == [0, 2, 4, 6] and lru.block_ids("b") == [1, 3, 5, 7]


def test_locality_reserves_nothing():
    # 4 blocks, run 4: a's slack (blocks 1-3) goes to the queue's tail, but b can still take all of it
    kv = KVCacheManager(4, 16)
    assert kv.allocate("a", 0, 16) and kv.block_ids("a") == [0]
    assert kv.allocate("b", 0, 48)
    assert sorted(kv.block_ids("b")) == [1, 2, 3]
    assert not kv.allocate("a", 16, 1)
    check_invariants(kv)


def test_locality_does_not_evict_cached_blocks_out_of_lru_order():
    kv = KVCacheManager(8, 4, locality_tokens=16)  # run 4
    toks = list(range(8))
    assert kv.allocate("c", 0, 8) and kv.block_ids("c") == [0, 1]  # slack 2, 3 to the queue's tail
    kv.cache_full_blocks("c", toks, 8)
    kv.free("c")  # 1, 0 to the tail, both keep their hashes
    hits = kv.find_cached_prefix(toks[:4] + [9] * 5)
    assert hits == [0]
    # d's table ends at block 0; block 1 after it is free but cached, so d starts a new run of free
    # uncached blocks instead, one that ends its 4-block run on a multiple of 4 (5, 6, 7)
    assert kv.allocate("d", 4, 5, hits)
    assert kv.block_ids("d") == [0, 5, 6]
    assert kv.find_cached_prefix(toks + [0]) == [0, 1]  # block 1's prefix is still cached
    check_invariants(kv)


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free", "preempt"]), st.integers(0, 7), st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 4), st.integers(4, 24), st.booleans(), st.sampled_from([0, 4, 8, 64]),
       st.sampled_from([None, None, 1, 3, 9]))
def test_random_operation_sequences_keep_invariants(seq, block_size, num_blocks, caching, locality, window):
    kv = KVCacheManager(num_blocks, block_size, caching, locality_tokens=locality, window=window)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    counter = 0
    for op, k, n in seq:
        live = sorted(tokens)
        if op == "new":
            sid = f"s{counter}"
            counter += 1
            toks = [k % 3] * (n + 1)  # few distinct tokens: many prefix hits
            hits = kv.find_cached_prefix(toks)
            c = len(hits) * block_size
            if kv.allocate(sid, c, len(toks) - c, hits):
                tokens[sid], computed[sid] = toks, len(toks)
                kv.cache_full_blocks(sid, toks, len(toks))
        elif not live:
            continue
        else:
            sid = live[k % len(live)]
            if op == "append":
                if kv.allocate(sid, computed[sid], n):
                    tokens[sid] += [k] * n
                    computed[sid] += n
                    kv.cache_full_blocks(sid, tokens[sid], computed[sid])
            elif op == "fork":
                child = f"s{counter}"
                counter += 1
                kv.fork(sid, child, computed[sid])
                tokens[child], computed[child] = list(tokens[sid]), computed[sid]
            elif op in ("free", "preempt"):
                kv.free(sid)
                del tokens[sid], computed[sid]
        kv.take_pending_copies()
        check_invariants(kv)
        # no block is handed to two sequences unless it is shared on purpose (ref_cnt counts it)
        for sid in tokens:
            assert len(kv.block_ids(sid)) == kv.blocks_needed(computed[sid])
            if window is not None:  # nothing the next token's window sees was given back
                assert kv.seqs[sid].released * block_size <= max(0, computed[sid] - window + 1)
    for sid in list(tokens):
        kv.free(sid)
    check_invariants(kv)
    assert kv.pool.num_free == num_blocks


def test_sliding_window_gives_back_blocks_behind_the_window():
    """window 6, blocks of 4: before computing token p the blocks wholly before p - 5 go back to the
    pool (hash kept: a prefix hit revives them); a sequence then holds ~window + step tokens."""
    kv = KVCacheManager(16, 4, window=6)
    toks = list(range(40))
    assert kv.allocate("a", 0, 10)  # tokens 0-9: blocks 0, 1, 2
    kv.cache_full_blocks("a", toks, 10)
    assert kv.allocate("a", 10, 1)  # token 10 sees 5..10: block 0 (0-3) goes
    assert kv.block_ids("a")[0] == 0 and kv.seqs["a"].released == 1 and kv.pool.num_free == 14
    assert kv.pool.blocks[0].ref_cnt == 0 and 0 in kv.pool.free_queue
    for p in range(11, 30):
        assert kv.allocate("a", p, 1)
        kv.cache_full_blocks("a", toks, p + 1)
        assert len(kv.block_ids("a")) - kv.seqs["a"].released <= 3  # (6 + 1) tokens span <= 3 blocks
    assert kv.seqs["a"].released == (29 - 6 + 1) // 4
    check_invariants(kv)
    # a prefix hit on the released blocks revives them for another sequence (still cached)
    hits = kv.find_cached_prefix(toks[:13])
    assert len(hits) == 3
    assert kv.allocate("b", 12, 1, hits)  # b's token 12 sees 7..12: its block 0 and block 1 go again
    assert kv.seqs["b"].released == 1
    check_invariants(kv)
    kv.fork("a", "c", 30)
    assert kv.seqs["c"].released == kv.seqs["a"].released
    check_invariants(kv)
    for sid in ("a", "b", "c"):
        kv.free(sid)
    check_invariants(kv)
    assert kv.pool.num_free == 16


def test_blocks_held_max():
    from pageflash.engine.kv_cache import blocks_held_max

    assert blocks_held_max(16, None, 4096, 512) == 256
    assert blocks_held_max(16, 1024, 4096, 512) == 96 + 2
    assert blocks_held_max(16, 4096, 1024, 512) == 64  # never more than the context


def test_reset_cache_forgets_free_blocks_only():
    from pageflash.engine.kv_cache import KVCacheManager

    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    a, b = list(range(12)), list(range(100, 112))
    for sid, toks in (("a", a), ("b", b)):
        assert kv.allocate(sid, 0, len(toks))
        kv.cache_full_blocks(sid, toks, len(toks))
    kv.free("a")
    assert len(kv.find_cached_prefix(a + [1])) == 3 and len(kv.find_cached_prefix(b + [1])) == 3
    assert kv.pool.reset_cache() == 3  # a's three free blocks; b still holds its own
    assert kv.find_cached_prefix(a + [1]) == [] and len(kv.find_cached_prefix(b + [1])) == 3
    kv.free("b")
    assert kv.pool.num_free == 16
