"""Continuous batching by token counts, with no prefill or decode phase.

Each request has num_tokens (prompt + output so far, plus any draft tokens to verify) and
num_computed_tokens (KV already in the cache); a step gives each scheduled request some of the
difference. That one rule covers prefill, chunked prefill, prefix-cache hits, decode, recompute after
preemption and speculative draft tokens alike.

Policy per step, under a token budget (max_num_batched_tokens) and at most max_num_seqs requests:
1. Running requests first, in arrival order, so decodes never starve behind prefills. When the pool
   cannot hold a request's new tokens, the most recently admitted running request is preempted: its
   blocks are freed and it goes back to the head of the queue to be recomputed later.
   A request whose sampled token is still in flight (async scheduling) is scheduled as if that
   token were known, unless it is sure to finish by length with it.
2. Then waiting requests, first come first served, each starting from its longest prefix-cache hit;
   a prompt larger than the remaining budget is chunked. Nothing is admitted in a step that preempted.
   A request under a LoRA adapter needs the adapter in a device slot (lora/manager.py): while every
   slot is held by running requests of other adapters it waits, and the requests behind it may go first.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Optional

from pageflash.engine.kv_cache import KVCacheManager
from pageflash.engine.sequence import Request, Status


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # tokens computed this step, draft tokens included
    num_spec_tokens: int  # how many of them are draft tokens (at the end)

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (so logits are needed)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens >= r.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    preempted: list[Request] = field(default_factory=list)
    # LoRA adapters to copy into device slots before this step runs: (slot, LoRAAdapter)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @functools.cached_property
    def is_decode(self) -> bool:
        """Every seq computes one token, the last it lacks, to sample from: no prefill chunk, no draft,
        no embedding request (a one-token tail of a cached prompt: its hidden state is read, which the
        decode graphs do not keep). Computed once: the runner and the speculative decoder both ask."""
        return all(s.num_new_tokens == 1 and s.samples and s.request.pooling is None for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        lora_slots: Optional[Any] = None,
        long_rope_after: Optional[int] = None,
    ) -> None:
        """lora_slots: a lora.manager.AdapterSlots when LoRA is on (the running requests' adapters hold
        slots; a waiting one is admitted when its adapter has or can get one).

        long_rope_after: LongRoPE models' ModelConfig.rope_long_after. A request longer than that many
        tokens has its KV computed with the long factors, a shorter one with the short ones: the two
        live in separate prefix-cache chains (salts), a request that grows past it is recomputed from
        its first token (from the long chain's cached blocks) in the step that crosses, and a shorter
        request's draft tokens stop before that position (their logits would be the long factors')."""
        self.kv = kv
        self.lora_slots = lora_slots
        self.long_rope_after = long_rope_after
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request, after: Request) -> None:
        """Insert a forked sibling right after its parent (it already owns blocks)."""
        req.status = Status.RUNNING
        self.running.insert(self.running.index(after) + 1, req)
        if req.lora is not None:  # the parent's adapter, loaded: one more reference to its slot
            req.lora_slot, _ = self.lora_slots.acquire(req.lora)

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
            self._release_lora(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.FINISHED

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = 0

    # -- the step ---------------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self._release_lora(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _ends_by_length(self, req: Request) -> bool:
        """Whether the request finishes by length once its tokens in flight are known."""
        m = req.params.max_tokens
        return req.num_tokens >= self.max_model_len or (
            m is not None and req.num_output_tokens + req.num_pending >= m
        )

    def _salt(self, req: Request) -> Hashable:
        """The prefix-cache chain of the request's KV: its LoRA adapter's (Request.prefix_salt) and,
        with LongRoPE, whether it is long -- (adapter, long); None for the base model without LongRoPE."""
        long = None if self.long_rope_after is None else req.num_tokens > self.long_rope_after
        return None if long is None and req.prefix_salt is None else (req.prefix_salt, long)

    def _prefix_hits(self, req: Request, salt: Hashable) -> list[int]:
        """The request's cached prefix blocks in its chain (none for a request that wants its prompt
        logprobs: its prompt is computed whole)."""
        return [] if req.needs_prompt_logprobs else self.kv.find_cached_prefix(req.token_ids, salt)

    def _restart_long(self, req: Request, salt: Hashable) -> list[int]:
        """LongRoPE: a running request computed with the short factors that is now longer than the
        original context starts over (its blocks freed, its drafts dropped) from its longest
        prefix-cache hit among long KV (salt: its chain), as transformers' Phi-3 recomputes its
        cache there. Returns the hits (for allocate; the prefix-cache statistics count them once
        it is scheduled, as an admission's)."""
        self.kv.free(req.request_id)
        req.spec_token_ids = []
        hits = self._prefix_hits(req, salt)
        req.num_computed_tokens = len(hits) * self.kv.block_size
        return hits

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        # Forked siblings of an n > 1 request may leave more running requests than max_num_seqs:
        # those past it wait (in order) for earlier ones to finish; a step never exceeds it.
        while i < len(self.running) and budget > 0 and len(out.seqs) < self.max_num_seqs:
            req = self.running[i]
            if req.num_pending and self._ends_by_length(req):
                i += 1  # its token in flight is its last: nothing more to compute
                continue
            # (a running request's chain is its blocks'; only LongRoPE may change it, restarting it)
            salt, hits, restarted = None, [], False
            if self.long_rope_after is not None:
                salt = self._salt(req)
                if salt != self.kv.salt(req.request_id):
                    hits, restarted = self._restart_long(req, salt), True
            num_spec = len(req.spec_token_ids)
            want = req.num_tokens + num_spec - req.num_computed_tokens
            # Never past the context: draft tokens beyond max_model_len are dropped.
            want = min(want, self.max_model_len - req.num_computed_tokens)
            if salt is not None and not salt[1]:  # (LongRoPE, short: drafts stop before the long factors)
                want = min(want, self.long_rope_after - req.num_computed_tokens)
            n = min(want, budget)
            spec = max(0, n - (req.num_tokens - req.num_computed_tokens))
            if spec < num_spec:
                req.spec_token_ids = req.spec_token_ids[:spec]
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not self.kv.allocate(req.request_id, req.num_computed_tokens, n, hits, salt):
                if spec:  # drafts never cost a preemption: drop them first
                    n, spec, req.spec_token_ids = n - spec, 0, []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            if restarted:
                self.kv.prefix_queries += req.num_tokens
                self.kv.prefix_hits += req.num_computed_tokens
            out.seqs.append(ScheduledSeq(req, n, spec))
            budget -= n
            i += 1

        skipped: list[Request] = []  # waiting for a LoRA slot: they keep their place in the queue
        while self.waiting and budget > 0 and not out.preempted:
            req = self.waiting[0]
            slots = 1 if req.forked else req.params.n
            if self.running and len(self.running) + slots > self.max_num_seqs:
                break
            if req.lora is not None and not self.lora_slots.can_acquire(req.lora):
                skipped.append(self.waiting.popleft())
                continue
            salt = self._salt(req)
            hits = self._prefix_hits(req, salt)
            computed = len(hits) * self.kv.block_size
            n = min(req.num_tokens - computed, budget)
            if not self.kv.allocate(req.request_id, computed, n, hits, salt):
                break
            self.kv.prefix_queries += req.num_tokens
            self.kv.prefix_hits += computed
            self.waiting.popleft()
            if req.lora is not None:
                req.lora_slot, load = self.lora_slots.acquire(req.lora)
                if load:
                    out.lora_loads.append((req.lora_slot, req.lora))
            req.num_computed_tokens = computed
            if req.num_cached_tokens is None:  # (a recompute after preemption does not count again)
                req.num_cached_tokens = computed
            req.status = Status.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, n, 0))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        out.block_copies = self.kv.take_pending_copies()
        return out

    def stats(self) -> dict[str, float]:
        pool = self.kv.pool
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv.usage,
            "num_free_blocks": pool.num_free,
            "num_total_blocks": pool.num_blocks,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_preemptions": self.num_preemptions,
        }

