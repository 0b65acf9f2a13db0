"""Paged KV-cache bookkeeping on the host: block pool, prefix-cache hash map, per-sequence block tables.

Blocks hold `block_size` tokens. A sequence's block table grows on demand. Full blocks get a hash
chained over their whole prefix (hash(parent_hash, tokens)), so equal prefixes map to the same block
and can be shared between requests with reference counts. A block whose count drops to zero goes to
the tail of the free queue but keeps its hash until it is handed out again (LRU eviction), so a later
request can still hit it. A salt (any hashable; None: none) stands in for the first block's parent,
so that requests whose equal tokens get different KV -- under different LoRA adapters (or the base
model), or LongRoPE's sequences longer than the original context, which rotate with other factors
(ModelConfig.rope_long_after) -- never share blocks (Scheduler._salt). A sequence
forked for parallel sampling shares the blocks of its computed tokens; the shared partial last block is copied on write (the copy is recorded here and performed by the model runner).

Sliding-window models (every layer attends to the last ``window`` tokens only): a sequence's blocks
that lie wholly before the window of its next token are released as it advances -- they go back to
the pool (keeping their hash, so prefix hits can still revive them) and their entries in the table
become 0, a placeholder no kernel reads -- so a sequence holds about window + chunk tokens of KV
whatever its length.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


def hash_block(parent_hash: Optional[int], tokens: Sequence[int]) -> int:
    return hash((parent_hash, tuple(tokens)))


def _first_parent(salt: Hashable) -> Optional[int]:
    """The parent hash of a chain's first block: None, or the salt's (tagged, so that it is never
    an int another chain's block hash could equal by design)."""
    return None if salt is None else hash(("salt", salt))


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None


class BlockPool:
    """All physical blocks, their reference counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, run: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if run < 1:
            raise ValueError(f"run must be >= 1, got {run}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.run = run  # locality: see allocate
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. Cached-but-free blocks stay here (evictable).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int, after: Optional[int] = None, held: int = 0) -> list[int]:
        """n fresh blocks (ref_cnt 1). Evicts the least recently freed, dropping their hashes.

        With run > 1 (locality for the decode kernel, whose tiles read `run` consecutive blocks of a
        table at once): each block after the first prefers the id after the previous one (`after`: the
        table's current last block), if that block is free and holds no cached prefix, so that a
        sequence's blocks lie side by side; failing that, a block near the queue's head followed by
        enough free blocks to end the table's current run (`_run_start`), before the head itself; and
        the free blocks after the last one taken, up to the end of the table's current run of `run`
        (`held`: the table's length before this call), move to the queue's tail, where other sequences take them last, so that this one can grow into them.
        Nothing is reserved: they stay free and allocatable. Cached free blocks are neither taken nor
        moved out of their LRU order. run == 1: the plain LRU queue (H100 decode over the resulting
        layouts: docs/KERNELS.md, run 24)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free_queue)}")
        out = []
        nxt = after + 1 if after is not None and self.run > 1 else -1
        for _ in range(n):
            if self._free_uncached(nxt):
                bid = nxt
                del self.free_queue[bid]
            elif self.run > 1 and (c := self._run_start(self.run - (held + len(out)) % self.run)) is not None:
                bid = c
                del self.free_queue[bid]
            else:
                bid, _ = self.free_queue.popitem(last=False)
            if self.run > 1:
                nxt = bid + 1
            b = self.blocks[bid]
            assert b.ref_cnt == 0, f"block {bid} in free queue with ref_cnt {b.ref_cnt}"
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) == bid:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(bid)
        if self.run > 1 and out:
            nxt = out[-1] + 1
            for _ in range((-(held + n)) % self.run):
                if not self._free_uncached(nxt):
                    break  # a cached block keeps its LRU place: this sequence would not grow into it
                self.free_queue.move_to_end(nxt)
                nxt += 1
        return out

    def _free_uncached(self, bid: int) -> bool:
        return 0 <= bid < self.num_blocks and bid in self.free_queue and self.blocks[bid].block_hash is None

    def _run_start(self, length: int, scan: int = 16) -> Optional[int]:
        """Among the first `scan` blocks of the free queue, the first uncached one followed by length - 1
        free uncached blocks (a run to grow into), preferring one whose run ends on a multiple of
        `run` (so that it does not straddle two 2 MB pages of the cache); None if there is none."""
        fq, blocks, other = self.free_queue, self.blocks, None  # _free_uncached inlined: a scheduler hot path
        for bid in itertools.islice(fq, scan):
            end = bid + length
            if end > self.num_blocks or (other is not None and end % self.run):
                continue
            for i in range(bid, end):
                if i not in fq or blocks[i].block_hash is not None:
                    break
            else:
                if end % self.run == 0:
                    return bid
                other = bid
        return other

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each block (prefix hit or fork); revives cached free blocks."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                del self.free_queue[bid]
            b.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each; blocks reaching zero join the free queue's tail in this order."""
        for bid in block_ids:
            b = self.blocks[bid]
            assert b.ref_cnt > 0, f"double free of block {bid}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[bid] = None

    def reset_cache(self) -> int:
        """Forget the hashes of every free block (in-use blocks keep theirs); returns how many."""
        n = 0
        for bid in self.free_queue:
            b = self.blocks[bid]
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) == bid:
                    del self.cached[b.block_hash]
                b.block_hash = None
                n += 1
        return n

    def lookup(self, block_hash: int) -> Optional[int]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block_id: int, block_hash: int) -> None:
        """Publish a full, computed block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching:
            return
        b = self.blocks[block_id]
        if b.block_hash is None and block_hash not in self.cached:
            b.block_hash = block_hash
            self.cached[block_hash] = block_id


def blocks_held_max(block_size: int, window: Optional[int], max_model_len: int, max_step_tokens: int) -> int:
    """The most blocks one sequence holds at once: its whole context, or with a sliding window (see
    the module doc) the window plus one step's tokens and the partial blocks at either end."""
    full = -(-max_model_len // block_size)
    if window is None:
        return full
    return min(full, -(-(window + max_step_tokens) // block_size) + 2)


@dataclass
class SeqBlocks:
    """One sequence's block table and the hashes of its full, computed blocks (a prefix of the table);
    its first ``released`` entries are placeholders (blocks behind a sliding window, given back)."""

    block_ids: list[int]
    hashes: list[int]
    released: int = 0
    salt: Hashable = None  # its prefix-cache chain's (KVCacheManager.find_cached_prefix)


class KVCacheManager:
    """Hands the scheduler allocations per sequence id; hides the pool.

    Invariants (checked by tests): every block id is either in the free queue with ref_cnt 0 or
    referenced by exactly ref_cnt sequence tables; a block in the hash map holds the tokens hashed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 locality_tokens: int = 64, window: Optional[int] = None) -> None:
        """locality_tokens: keep runs of this many tokens of a sequence in consecutive blocks where the
        pool allows (BlockPool.allocate's `run`; the decode kernel's 64-key tiles); 0 turns it off.
        window: the model's attention window when every layer slides (blocks behind it are released)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_prefix_caching, run=max(1, locality_tokens // block_size))
        self.seqs: dict[str, SeqBlocks] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, for the runner
        self.prefix_queries = 0  # prompt tokens of admitted requests (counted by the scheduler)
        self.prefix_hits = 0  # of which were served from the prefix cache

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        return self.seqs[seq_id].block_ids

    def salt(self, seq_id: str) -> Hashable:
        """The prefix-cache salt a sequence holding blocks was allocated with (None: none, or no blocks)."""
        sb = self.seqs.get(seq_id)
        return None if sb is None else sb.salt

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _behind_window(self, num_computed: int) -> int:
        """How many leading blocks no query from token num_computed on can see (sliding window: the
        window of token p starts at p - window + 1); 0 without a window."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def _release(self, sb: SeqBlocks, num_computed: int) -> None:
        """Give back the blocks behind the window of token num_computed."""
        upto = min(self._behind_window(num_computed), len(sb.block_ids))
        if upto > sb.released:
            drop = sb.block_ids[sb.released:upto]
            sb.block_ids[sb.released:upto] = [0] * len(drop)
            sb.released = upto
            self.pool.free(drop)

    # -- prefix cache -----------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], salt: Hashable = None) -> list[int]:
        """Block ids of the longest cached chain of full blocks within token_ids[:-1], among the
        chains of this salt (give allocate the same).

        The last token is never served from cache: its logits are needed, so at least one token is
        computed.
        """
        if not self.pool.enable_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = _first_parent(salt)
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
            parent = h
        return hits

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the blocks that became full and computed (token_ids: the sequence's tokens)."""
        sb = self.seqs.get(seq_id)
        if not self.pool.enable_caching or sb is None:  # None: preempted while its last token was in flight
            return
        bs = self.block_size
        parent = sb.hashes[-1] if sb.hashes else _first_parent(sb.salt)
        for i in range(len(sb.hashes), min(num_computed, len(token_ids)) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            if i >= sb.released:  # (a block released before it was published is gone; the chain goes on)
                self.pool.cache(sb.block_ids[i], h)
            sb.hashes.append(h)
            parent = h

    # -- allocation -------------------------------------------------------------------------------
    def can_allocate(self, seq_id: str, num_computed: int, num_new: int, cached_blocks: Sequence[int] = ()) -> bool:
        return self._blocks_to_add(seq_id, num_computed, num_new, cached_blocks) is not None

    def _blocks_to_add(self, seq_id, num_computed, num_new, cached_blocks) -> Optional[int]:
        sb = self.seqs.get(seq_id)
        have = len(sb.block_ids) if sb else len(cached_blocks)
        need = max(0, self.blocks_needed(num_computed + num_new) - have)
        # Copy-on-write: new tokens land in a shared partial block.
        if sb and num_new > 0 and num_computed % self.block_size:
            last = sb.block_ids[num_computed // self.block_size]
            if self.pool.blocks[last].ref_cnt > 1:
                need += 1
        # Cached hits that sit in the free queue stop being allocatable once we take them (not those
        # behind a sliding window, which the new sequence never takes).
        behind = self._behind_window(num_computed) if sb is None else 0
        revived = sum(1 for b in cached_blocks[behind:] if self.pool.blocks[b].ref_cnt == 0)
        return need if need + revived <= self.pool.num_free else None

    def allocate(self, seq_id: str, num_computed: int, num_new: int, cached_blocks: Sequence[int] = (),
                 salt: Hashable = None) -> bool:
        """Make room for tokens [num_computed, num_computed + num_new) of seq_id.

        cached_blocks: prefix-cache hits for a new sequence (from find_cached_prefix); salt: a new
        sequence's prefix-cache chain (find_cached_prefix's; its full blocks are published there). Returns False
        when the pool has too few free blocks, changing nothing but the release of blocks behind a
        sliding window (which no later step reads).
        """
        sb = self.seqs.get(seq_id)
        if sb is not None:
            self._release(sb, num_computed)
        need = self._blocks_to_add(seq_id, num_computed, num_new, cached_blocks)
        if need is None:
            return False
        if sb is None:
            # hits behind the window are not taken: placeholders in the table, their hashes kept
            behind = min(self._behind_window(num_computed), len(cached_blocks))
            self.pool.touch(cached_blocks[behind:])
            hashes = [self.pool.blocks[b].block_hash for b in cached_blocks]
            table = [0] * behind + list(cached_blocks[behind:])
            sb = self.seqs[seq_id] = SeqBlocks(table, hashes, behind, salt)  # type: ignore[arg-type]
        if num_new > 0 and num_computed % self.block_size:
            idx = num_computed // self.block_size
            old = sb.block_ids[idx]
            if self.pool.blocks[old].ref_cnt > 1:
                (new,) = self.pool.allocate(1)
                self.pending_copies.append((old, new))
                self.pool.free([old])
                sb.block_ids[idx] = new
                need -= 1
        if need > 0:
            held = len(sb.block_ids)
            sb.block_ids.extend(self.pool.allocate(need, sb.block_ids[-1] if held else None, held))
        return True

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks; its tail is freed first so it is evicted first."""
        sb = self.seqs.pop(seq_id, None)
        if sb is not None:
            self.pool.free(list(reversed(sb.block_ids[sb.released:])))

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> None:
        """child shares the blocks of parent that cover its first num_computed tokens (parallel
        sampling); writes into a shared block copy it. Blocks past them (slots the parent claimed for
        tokens not computed yet, e.g. early-exit draft slots) stay the parent's alone: sharing them
        would let both write the same slots, since copy-on-write only checks the block being
        written from num_computed on."""
        sb = self.seqs[parent_id]
        keep = sb.block_ids[: self.blocks_needed(num_computed)]
        self.pool.touch(keep[sb.released:])
        self.seqs[child_id] = SeqBlocks(keep, sb.hashes[: num_computed // self.block_size],
                                        min(sb.released, len(keep)), sb.salt)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep only the blocks covering num_tokens (speculative rollback of rejected slots)."""
        sb = self.seqs[seq_id]
        keep = self.blocks_needed(num_tokens)
        if keep < len(sb.block_ids):
            drop = sb.block_ids[keep:]
            del sb.block_ids[keep:]
            self.pool.free(list(reversed(drop)))
        del sb.hashes[num_tokens // self.block_size :]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out
