"""Model-based drafts: a small draft model with its own paged KV cache, or the target's own first L
layers (early exit). Both grow SpecInfer expansion trees (a chain is the tree [1, 1, ...]) from one
batched forward per tree level.

Forwards go through ``ModelRunner.execute`` with :class:`Feed` items that quack like scheduled
requests (``ModelRunner.prepare`` reads ``num_computed_tokens``, ``token_ids[c:c+n]``,
``spec_token_ids`` and ``num_tokens``), so drafting reuses the runner's batching, attention backend
and tree masks.

Tree levels. Level 0 feeds the root (the request's last token) and returns the draft's distribution
for the root's children. For a chain, level d >= 1 feeds the single node of depth d at slot
``base + d`` (causal: the earlier nodes are in the cache). For a wider tree, level d feeds the root
and every node on a path to the frontier again, laid out as in the verify step (node j at slot
``base + 1 + j``, position ``base + depth(j)``) under the tree mask; trees are small, so recomputing
them costs little next to one more memory-bound forward.

Draft model KV (its own pool, keyed by the target's request ids). ``computed[rid]`` counts the
leading tokens of the request whose draft KV is right. A drafting round computes the missing tokens
and the root in its level-0 forward (chunked to the token budget when far behind, e.g. the prompt),
then leaves ``computed = base + 1``: the draft tokens' KV is scratch, and whatever the target accepts
is fed again in the next round's level-0 forward, which runs anyway. Full blocks of true tokens are
published to the draft pool's prefix cache, so parallel-sampling siblings and repeated prompts skip
the draft prefill. When the draft pool is full, the draft KV of requests not drafting this step is
dropped (least recently used first); a request that still does not fit gets no draft this step.

Early exit KV (the target's cache, layers < L). Drafting writes layers 0..L-1 of the root and the
draft nodes into the target's own slots ``base ..``, which the scheduler then gives to this request's
verify step (the drafter allocates them first). That is safe because the verify pass writes every
layer's K/V of every query slot before any attention reads it, so the draft's values are always
overwritten; they are even equal, for the root and the accepted tokens, since the target's first L
layers see the same tokens at the same positions over the same context. Slots past what the verify
step keeps are beyond ``num_computed_tokens`` and are garbage like any rejected slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from pageflash.engine.kv_cache import KVCacheManager
from pageflash.engine.model_runner import ModelRunner, StepResult
from pageflash.engine.sampler import SamplingBatch, SamplingRow, compute_probs
from pageflash.engine.scheduler import ScheduledSeq, SchedulerOutput
from pageflash.spec.proposer import ProposalRequest, _trim, truncate_tree
from pageflash.spec.tree import (
    DraftTree,
    ExpansionConfig,
    build_trees,
    flat_tree_mask,
    merge_trees,
    positions,
    tree_attention_mask,
)

# -- feeding a runner ---------------------------------------------------------------------------


class _Window:
    """token_ids of a Feed: slicing [start:start + n] returns the fed tokens."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start : s.stop - self.start]


@dataclass
class Feed:
    """Tokens to run through a model at known slots, shaped like a scheduled request.

    tokens: fed causally at positions (and slot indices) start, start + 1, ...
    tree:   optional draft nodes after the tokens (then tokens must be [root]): node j at slot
            start + 1 + j, position start + depth(j), under the tree mask.
    logits: whether the last token's row (and the tree's rows) are wanted.
    """

    start: int
    tokens: list[int]
    tree: Optional[DraftTree] = None
    logits: bool = True

    # a feed has no id, prompt, pooling or token still in flight (what the engine's Request adds;
    # SchedulerOutput.is_decode and tensor parallelism's compact_schedule read these)
    request_id = ""
    num_prompt_tokens = 0
    pooling = None
    num_pending = 0
    pending_row = 0

    # what ModelRunner.prepare reads
    @property
    def num_computed_tokens(self) -> int:
        return self.start

    @property
    def token_ids(self) -> _Window:
        return _Window(self.start, self.tokens)

    @property
    def spec_token_ids(self) -> list[int]:
        return list(self.tree.tokens) if self.tree is not None else []

    @property
    def num_tokens(self) -> int:
        return self.start + len(self.tokens) + (0 if self.logits else 1)

    @property
    def num_query(self) -> int:
        return len(self.tokens) + (len(self.tree) if self.tree is not None else 0)


def run_feeds(
    runner: ModelRunner,
    feeds: Sequence[Feed],
    block_tables: list[list[int]],
    num_layers: Optional[int] = None,
) -> StepResult:
    """One forward over the feeds; rows as in ModelRunner.execute (1 + len(tree) rows per feed
    with logits, 0 without)."""
    seqs = [ScheduledSeq(f, f.num_query, len(f.tree) if f.tree is not None else 0) for f in feeds]  # type: ignore[arg-type]
    kwargs: dict = {}
    if any(f.tree is not None and not f.tree.is_chain for f in feeds):
        if any(f.tree is not None and len(f.tokens) != 1 for f in feeds):
            raise ValueError("run_feeds: a feed with a tree must feed exactly its root")
        masks, pos = [], []
        for f in feeds:
            if f.tree is None:
                masks.append(None)
                pos.extend(range(f.start, f.start + f.num_query))
            else:
                masks.append(tree_attention_mask(f.tree))
                pos.extend(positions(f.tree, f.start).tolist())
        kwargs["tree_mask"] = flat_tree_mask(masks, [f.num_query for f in feeds], runner.device)
        kwargs["positions_override"] = pos
    return runner.execute(SchedulerOutput(seqs=seqs), block_tables, num_layers=num_layers, **kwargs)


# -- the drafter --------------------------------------------------------------------------------


@dataclass
class _Level:
    """Bookkeeping of one propose() call for one sampling group."""

    requests: list[ProposalRequest]
    bases: list[int]
    start: list[int]  # level-0 feed start per request (the draft model's catch-up point)
    nodes: list[int] = field(default_factory=list)  # draft nodes created so far per request


class ModelDraftProposer:
    """Drafts from a model's next-token distributions (draft model or early exit).

    runner / kv:   where the draft runs and whose block tables it uses. For a draft model its own
                   ModelRunner and KVCacheManager; for early exit the target's, with num_layers = L.
    owns_kv:       True for a draft model (the drafter keeps its KV in sync); False for early exit
                   (the target's cache already holds the context; the drafter only claims the
                   slots it writes).
    config:        SpecInfer expansion (branching per level); [1] * k for a chain.
    max_batch_tokens: token budget of one catch-up forward (the engine's max_num_batched_tokens).
    vocab_size:    the target's vocabulary; a smaller draft vocabulary is padded with zeros, and the
                   target's ids past its end are fed to the draft as id 0 (_draft_ids).

    Requests whose params are greedy get the top-b tokens of the draft per node (no probabilities:
    one-hot q). The others sample their children without replacement from the draft's distribution
    at the request's temperature / top-k / top-p and attach it as q, which stochastic verification
    needs to stay lossless while accepting as much as the draft allows.
    """

    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        kv: KVCacheManager,
        config: ExpansionConfig,
        *,
        owns_kv: bool,
        num_layers: Optional[int] = None,
        max_batch_tokens: int = 2048,
        vocab_size: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.kv = kv
        self.config = config
        self.owns_kv = owns_kv
        self.num_layers = num_layers
        self.max_batch_tokens = max_batch_tokens
        self.vocab_size = vocab_size or runner.cfg.vocab_size
        self.draft_vocab = runner.cfg.vocab_size
        self.generator = generator
        self.is_chain = all(b == 1 for b in config.branching)
        self.computed: dict[str, int] = {}  # draft model: leading tokens with valid draft KV
        self.last_used: dict[str, int] = {}
        self._step = 0
        self.forward_seconds = 0.0

    # -- request lifecycle ----------------------------------------------------------------------
    def remove_request(self, request_id: str) -> None:
        """The target request finished: drop its draft KV (draft model)."""
        if self.owns_kv:
            self.kv.free(request_id)
            self.computed.pop(request_id, None)
        self.last_used.pop(request_id, None)

    def _evict_for(self, active: set[str]) -> bool:
        """Free the draft KV of the least recently used request not drafting now."""
        idle = [r for r in self.computed if r not in active]
        if not idle:
            return False
        victim = min(idle, key=lambda r: self.last_used.get(r, -1))
        self.kv.free(victim)
        del self.computed[victim]
        return True

    def _claim(self, req: ProposalRequest, base: int, nodes: int, active: set[str]) -> Optional[int]:
        """Allocate the slots this round writes; returns the level-0 feed start or None (no room)."""
        rid = req.request_id
        end = base + 1 + nodes  # slots base .. base + nodes
        if not self.owns_kv:
            # The target's pool: leave a block per drafting request for the real tokens, so that
            # drafts never push the scheduler into preempting anyone.
            need = self.kv.blocks_needed(end) - len(self.kv.block_ids(rid))
            if need > 0 and self.kv.num_free_blocks - need < len(active):
                return None
            if not self.kv.allocate(rid, base, end - base):
                return None
            return base
        computed = self.computed.get(rid)
        if computed is not None and computed > base:
            computed = base  # cannot happen with append-only tokens; be safe
        hits: list[int] = []
        if computed is None:
            tokens = req.token_ids[: base + 1]
            hits = self.kv.find_cached_prefix(tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens))
            computed = len(hits) * self.kv.block_size
        else:
            self.kv.truncate(rid, computed)  # the last round's draft slots are scratch
        while not self.kv.allocate(rid, computed, end - computed, hits):
            if not self._evict_for(active):
                return None  # allocate changed nothing; any earlier draft KV of rid stays valid
        self.computed[rid] = computed
        return computed

    # -- proposing ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        self._step += 1
        out: list[Optional[DraftTree]] = [None] * len(requests)
        active = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0]
        if not active:
            return out
        t0 = time.perf_counter()
        config = _trim(self.config, max(requests[i].num_speculative_tokens for i in active))
        ids = {requests[i].request_id for i in active}
        claimed: list[tuple[int, int, int]] = []  # (request index, base, level-0 start)
        for i in active:
            r = requests[i]
            base = len(r.token_ids) - 1
            nodes = min(r.num_speculative_tokens, config.num_nodes)  # _next_probs never feeds past k
            start = self._claim(r, base, nodes, ids)
            if start is not None:
                claimed.append((i, base, start))
                self.last_used[r.request_id] = self._step
        if not self.owns_kv:
            self.runner.copy_blocks(self.kv.take_pending_copies())  # copy-on-write before we write
        self._catch_up([(requests[i], b, s) for i, b, s in claimed])
        # Greedy requests draft top-b; sampling requests draw at their own temperature.
        groups = [
            [c for c in claimed if _greedy(requests[c[0]])],
            [c for c in claimed if not _greedy(requests[c[0]])],
        ]
        for sample, group in zip((False, True), groups):
            if not group:
                continue
            batch = [requests[i] for i, _, _ in group]
            bases = [b for _, b, _ in group]
            starts = [self.computed.get(r.request_id, b) if self.owns_kv else b for r, b in zip(batch, bases)]
            level = _Level(batch, bases, starts, [0] * len(batch))
            trees = build_trees(
                lambda idx, paths, lv=level, s=sample: self._next_probs(lv, idx, paths, s),
                len(batch), config, sample=sample, generator=self.generator,
                generators=[r.generator for r in batch],
            )
            for (i, base, _), t in zip(group, trees):
                t = truncate_tree(t, requests[i].num_speculative_tokens)
                out[i] = t if len(t) else None
                if self.owns_kv:
                    rid = requests[i].request_id
                    self.computed[rid] = base + 1  # root computed; the drafts' KV is scratch
                    filled = (base + 1) // self.kv.block_size > len(self.kv.seqs[rid].hashes)
                    if filled and self.kv.pool.enable_caching:
                        self.kv.cache_full_blocks(rid, _as_list(requests[i].token_ids[: base + 1]), base + 1)
        self.forward_seconds += time.perf_counter() - t0
        return out

    def _draft_ids(self, ids: list[int]) -> list[int]:
        """Token ids as the draft model takes them. A draft vocabulary smaller than the target's has no
        embedding row for the target's ids past its end (a prompt's, or ones the target generated); they
        go in as id 0. The draft then proposes from a context it sees slightly wrong, and verification
        judges those proposals as any other, so the output stays the target's."""
        dv = self.draft_vocab
        return ids if dv >= self.vocab_size else [t if t < dv else 0 for t in ids]

    def _catch_up(self, claimed: list[tuple[ProposalRequest, int, int]]) -> None:
        """Draft model: compute missing tokens in budget-sized chunks until each request's remaining
        catch-up (with the root) fits into its level-0 forward."""
        if not self.owns_kv:
            return
        budget = self.max_batch_tokens
        while True:
            feeds, tables, total = [], [], 0
            for r, base, _ in claimed:
                c = self.computed[r.request_id]
                missing = base + 1 - c
                if missing <= max(1, budget // max(1, len(claimed))):
                    continue
                n = min(missing - 1, budget - total)
                if n <= 0:
                    break
                feeds.append(Feed(c, self._draft_ids(_as_list(r.token_ids[c : c + n])), logits=False))
                tables.append(self.kv.block_ids(r.request_id))
                self.computed[r.request_id] = c + n
                total += n
            if not feeds:
                return
            run_feeds(self.runner, feeds, tables, self.num_layers)

    def _next_probs(self, lv: _Level, idx: list[int], paths: list[list[int]], sample: bool) -> torch.Tensor:
        """Draft distributions [len(idx), V] after request lv.requests[idx[i]]'s tokens + paths[i]."""
        feeds: list[Feed] = []
        tables: list[list[int]] = []
        by_req: dict[int, list[int]] = {}
        for m, b in enumerate(idx):
            by_req.setdefault(b, []).append(m)
        pick_of: list = [None] * len(idx)  # per path: (feed index, row within the feed's rows) or None
        for b, ms in by_req.items():
            r, base = lv.requests[b], lv.bases[b]
            rid = r.request_id
            tables_b = self.kv.block_ids(rid)
            depth = len(paths[ms[0]])
            if depth:
                lv.nodes[b] += len(ms)  # the frontier is every node of the last level
                if lv.nodes[b] >= r.num_speculative_tokens:
                    continue  # children would fall past this request's k: no forward, no children
            if depth == 0:  # level 0: catch-up remainder and the root
                start = lv.start[b]
                feeds.append(Feed(start, self._draft_ids(_as_list(r.token_ids[start : base + 1]))))
                tables.append(tables_b)
                for m in ms:
                    pick_of[m] = (len(feeds) - 1, 0)
            elif self.is_chain:  # one node at the next slot, earlier nodes already in the cache
                (m,) = ms
                feeds.append(Feed(base + depth, [paths[m][-1]]))
                tables.append(tables_b)
                pick_of[m] = (len(feeds) - 1, 0)
            else:  # the root and every node on the frontier's paths, under the tree mask
                trie = merge_trees([DraftTree.chain(paths[m]) for m in ms])
                ends = [_node_of(trie, paths[m]) for m in ms]
                (root,) = self._draft_ids([int(r.token_ids[base])])
                feeds.append(Feed(base, [root], tree=trie))
                tables.append(tables_b)
                for m, e in zip(ms, ends):
                    pick_of[m] = (len(feeds) - 1, 1 + e)
        if not feeds:
            return torch.zeros(len(idx), self.vocab_size, device=self.runner.device)
        res = run_feeds(self.runner, feeds, tables, self.num_layers)
        live = [m for m, p in enumerate(pick_of) if p is not None]
        rows = [res.rows[pick_of[m][0]][0] + pick_of[m][1] for m in live]
        logits = res.logits[torch.tensor(rows, device=res.logits.device)]
        if logits.shape[1] < self.vocab_size:  # draft vocabulary smaller than the target's
            pad = logits.new_full((logits.shape[0], self.vocab_size - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], 1)
        if not sample:
            probs = torch.softmax(logits, -1)
        else:
            srows = [SamplingRow(lv.requests[idx[m]].params, (), (), None) for m in live]
            probs = compute_probs(logits, SamplingBatch.build(srows, self.vocab_size, logits.device))
        if len(live) == len(idx):
            return probs
        out = probs.new_zeros(len(idx), self.vocab_size)  # all-zero rows get no children
        out[torch.tensor(live, device=probs.device)] = probs
        return out


def _greedy(r: ProposalRequest) -> bool:
    return r.params is None or r.params.greedy


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


def _node_of(tree: DraftTree, path: list[int]) -> int:
    """Index of the node reached by following path's tokens from the root."""
    node = -1
    for t in path:
        node = next(c for c in tree.children(node) if tree.tokens[c] == t)
    return node
