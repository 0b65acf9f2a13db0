"""SpecDecoder: speculative decoding inside the engine's step.

One engine step with speculation (LLMEngine.step)::

    spec.propose()                      # drafts for requests in decode state -> req.spec_token_ids
    sched = scheduler.schedule()        # "this request wants 1 + len(tree) tokens" (may trim drafts)
    kw = spec.execute_kwargs(sched)     # tree mask + positions when a batch holds real trees
    result = runner.execute(sched, block_tables, **kw)
    engine._launch(...); _resolve(...)  # requests without drafts: plain sampling
    spec.finish_step(sched, result)     # verify drafts, roll back KV, emit tokens, metrics

Per request with a draft tree of n nodes whose root (its last token) sits at position ``base``:
the verify step feeds the root and the nodes into slots base .. base + n (node j at slot
base + 1 + j, position base + depth(j)); the runner returns 1 + n logits rows. Verification takes
the target's final distributions (temperature, top-k/top-p, penalties, min_tokens, each node
seeing its own path as output so far) and keeps a path plus one token of the target's own, exactly
distributed as plain decoding would (``verify.py``). Then:

- KV rollback: the accepted path's KV moves to slots base + 1 .. (``kv_compaction``; nothing moves
  for chains); ``num_computed_tokens`` becomes base + 1 + len(path) and blocks entirely past it go
  back to the pool (``KVCacheManager.truncate``). Slots past it in the last kept block are garbage
  that the next steps overwrite; prefix caching hashes a block only once it is full and below
  ``num_computed_tokens``, so garbage is never published.
- Tokens are emitted one at a time through the engine's own append + stop checks, so a stop
  string, EOS or max_tokens in the middle of an accepted path ends the request right there.

Controlled by :class:`pageflash.spec.config.SpeculativeConfig`; with ``adaptive`` a
:class:`SpecController` picks each request's k per step (0 = plain decode) from measured acceptance
and step times.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from pageflash.engine.model_runner import ModelRunner, StepResult
from pageflash.engine.sampler import (SamplerOutput, SamplingBatch, SamplingRow, SeedStream, _add_logprobs, compute_probs,
                                     sample_rows_keyed)
from pageflash.engine.scheduler import SchedulerOutput
from pageflash.engine.sequence import Request
from pageflash.spec.adaptive import AdaptiveConfig, SpecController
from pageflash.spec.config import SpeculativeConfig
from pageflash.spec.metrics import SpecMetrics
from pageflash.spec.proposer import ProposalRequest, Proposer, truncate_tree
from pageflash.spec.tree import DraftTree, ExpansionConfig, flat_tree_mask, kv_compaction, positions, tree_attention_mask
from pageflash.spec.verify import TreeVerifyResult, greedy_match, verify_chains, verify_greedy, verify_trees

if TYPE_CHECKING:
    from pageflash.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class _ReqState:
    """What speculation keeps per request (``Request.spec_state``)."""

    __slots__ = ("buf", "n", "tree", "hidden", "shadow")

    def __init__(self) -> None:
        self.buf: Optional[np.ndarray] = None  # token ids, appended incrementally (n-gram lookup)
        self.n = 0
        self.tree: Optional[DraftTree] = None  # this step's draft
        self.hidden: Optional[torch.Tensor] = None  # [H] hidden state that produced the last token
        # (number of tokens it was drafted from, draft): a draft made while the request decodes
        # plainly, scored against the tokens that come (adaptive controller's observations)
        self.shadow: Optional[tuple[int, DraftTree]] = None

    def tokens(self, token_ids: list[int]) -> np.ndarray:
        """token_ids as an int64 array (a view of a growing buffer; tokens are only appended)."""
        n = len(token_ids)
        if self.buf is None or self.buf.shape[0] < n:
            buf = np.empty(max(64, 2 * n), dtype=np.int64)
            if self.buf is not None:
                buf[: self.n] = self.buf[: self.n]
            self.buf = buf
        if self.n < n:
            self.buf[self.n : n] = token_ids[self.n : n]
            self.n = n
        return self.buf[:n]


def _prune_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The nodes of depth <= max_depth (a node's descendants are deeper, so this is a tree)."""
    keep = [j for j, d in enumerate(tree.depths) if d <= max_depth]
    index = {j: i for i, j in enumerate(keep)}
    q = tree.draft_probs[keep] if tree.draft_probs is not None else None
    return DraftTree([tree.tokens[j] for j in keep], [index.get(tree.parents[j], -1) for j in keep], q)


def _verified_by_sampling(req: Request) -> bool:
    """Whether req's drafts go through verification against processed distributions (it samples, or
    its logits are processed: penalties, min_tokens, allowed_token_ids) rather than the greedy walk
    over the raw argmax."""
    return not req.params.greedy or req.params.changes_logits(req.num_output_tokens)


def _state(req: Request) -> _ReqState:
    if req.spec_state is None:
        req.spec_state = _ReqState()
    return req.spec_state


class SpecDecoder:
    """Speculative decoding for one LLMEngine: proposer, verification, KV rollback, metrics.

    With the adaptive controller and a proposer that drafts on the host for free (n-gram), requests
    that decode plainly get shadow drafts at batches of up to SHADOW_MAX_BATCH: drafted from their
    history, never verified, scored against the tokens that then come (``verify.greedy_match``) and
    reported to the controller as acceptance observations. So the controller sees each request's
    acceptance, and the moment a request starts quoting its prompt, without spending verify steps
    on probes. Larger batches leave it to probes (the host is what limits their steps).
    """

    SHADOW_MAX_BATCH = 8

    def __init__(self, engine: "LLMEngine", config: SpeculativeConfig) -> None:
        self.engine = engine
        self.config = config
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.enabled = True  # benchmarks flip this for a plain-decoding baseline in the same engine
        self.needs_hidden = config.method == "medusa"
        self.is_tree = config.tree is not None
        self.metrics = SpecMetrics()
        self.ctrl: Optional[SpecController] = None
        if config.adaptive:
            self.ctrl = SpecController(AdaptiveConfig(k_max=self.k, probe_k=min(2, self.k)))
        self.draft_runner: Optional[ModelRunner] = None
        self.draft_kv = None
        self.proposer: Proposer
        self._medusa = None
        self._outcome_t0 = 0.0
        self._emitted0 = 0
        self._step_decode_only = False
        self._step_sampled = False  # the last verification took the rejection-sampling path
        self._planned: Optional[tuple] = None  # (plan,) decided by plain_step_ahead for propose()
        self._drafted: list[Request] = []  # requests given drafts by the last propose()
        self._shadow_drafts = False  # set by bind(), once the proposer exists
        self._load()

    @property
    def name(self) -> str:
        return self.method

    @property
    def max_draft_nodes(self) -> int:
        """The most draft tokens one request verifies in a step (chain length or tree size)."""
        return self.k

    # -- construction (models now, KV once the engine has sized its pool) ------------------------
    def _load(self) -> None:
        eng, c = self.engine, self.config
        mc = eng.model_config
        if c.method == "early_exit" and not 1 <= c.num_layers <= mc.num_hidden_layers:
            raise ValueError(f"speculative_config: num_layers={c.num_layers} must be in [1, {mc.num_hidden_layers}] "
                             f"(the target's layer count)")
        if c.method == "draft_model":
            from pageflash.engine.engine import _DTYPES
            from pageflash.model.loader import load_config, resolve_model

            src = resolve_model(c.model, c.draft_load_format)
            dcfg = load_config(src)
            if dcfg.vocab_size > mc.vocab_size:
                raise ValueError(f"speculative_config: the draft model's vocabulary ({dcfg.vocab_size}) is larger "
                                 f"than the target's ({mc.vocab_size}); they must share a tokenizer")
            dtype = eng.dtype if c.draft_dtype == "auto" else _DTYPES[c.draft_dtype]
            self.draft_runner = ModelRunner(
                dcfg, src, eng.device, dtype, eng.config.block_size, eng.max_model_len,
                eng.config.attention_backend, eng.config.seed, c.quantization, eng.config.kv_cache_dtype,
            )
        elif c.method == "medusa":
            from pageflash.spec.medusa import load_heads

            heads = load_heads(c.medusa_path, eng.device, eng.dtype)
            hc = heads.config
            if hc.hidden_size != mc.hidden_size or hc.vocab_size != mc.vocab_size:
                raise ValueError(
                    f"speculative_config: Medusa heads in {c.medusa_path!r} are for hidden size {hc.hidden_size} and "
                    f"vocabulary {hc.vocab_size}, the target has {mc.hidden_size} and {mc.vocab_size}"
                )
            if c.expansion is None and c.num_speculative_tokens > hc.num_heads:  # (a chain: one token a head)
                raise ValueError(
                    f"speculative_config: num_speculative_tokens={c.num_speculative_tokens} but the Medusa file "
                    f"{c.medusa_path!r} has only {hc.num_heads} heads (one draft token each)"
                )
            self._medusa = heads

    def target_kv_share(self, num_blocks: int) -> int:
        """Blocks the target keeps of an auto-sized KV budget of num_blocks target blocks, the rest
        going to the draft model's cache (which gets as many blocks, unless draft_num_kv_blocks)."""
        if self.draft_runner is None:
            return num_blocks
        bt = self.engine.runner.kv_bytes_per_block()
        bd = self.draft_runner.kv_bytes_per_block()
        if self.config.draft_num_kv_blocks is not None:
            return max(1, (num_blocks * bt - self.config.draft_num_kv_blocks * bd) // bt)
        return max(1, num_blocks * bt // (bt + bd))

    def bind(self, num_blocks: int) -> None:
        """Called by the engine once its KV pool exists: allocate the draft's, build the proposer."""
        from pageflash.engine.kv_cache import KVCacheManager
        from pageflash.spec.draft import ModelDraftProposer
        from pageflash.spec.ngram import NgramProposer, NgramTreeProposer

        eng, c = self.engine, self.config
        chain = ExpansionConfig((1,) * self.k)
        if c.method == "ngram":
            if c.tree is None:
                self.proposer = NgramProposer(c.prompt_lookup_max, c.prompt_lookup_min, self.k)
            else:
                self.proposer = NgramTreeProposer(c.prompt_lookup_max, c.prompt_lookup_min, self.k, c.tree[0])
        elif c.method == "draft_model":
            nb = c.draft_num_kv_blocks or num_blocks
            self.draft_runner.allocate_kv_cache(nb)
            self.draft_kv = KVCacheManager(nb, eng.config.block_size, eng.config.enable_prefix_caching,
                                           window=self.draft_runner.cfg.kv_window)
            self.proposer = ModelDraftProposer(
                "draft_model", self.draft_runner, self.draft_kv, c.expansion or chain, owns_kv=True,
                max_batch_tokens=eng.max_num_batched_tokens, vocab_size=eng.vocab_size,
            )
        elif c.method == "early_exit":
            self.proposer = ModelDraftProposer(
                "early_exit", eng.runner, eng.kv, c.expansion or chain, owns_kv=False, num_layers=c.num_layers,
                max_batch_tokens=eng.max_num_batched_tokens, vocab_size=eng.vocab_size,
            )
        else:
            from pageflash.spec.medusa import MedusaProposer

            w = eng.runner.model.head_weight
            self.proposer = MedusaProposer(self._medusa, w, c.expansion)
        # drafting from history costs this proposer no device work: watch plain requests with it
        self._shadow_drafts = self.ctrl is not None and getattr(self.proposer, "drafts_on_host", False)
        if not eng.config.enforce_eager:
            self._enable_graphs()

    def _enable_graphs(self) -> None:
        """CUDA graphs for verify and draft steps (ModelRunner.StepGraphs): the target's verify step
        of 1 + k tokens per sequence is captured now for every batch bucket, like plain decode steps;
        other shapes (fewer drafts, draft steps) are captured when they recur."""
        eng = self.engine
        max_batch = min(eng.config.max_num_seqs, 256)
        sizes = [1 + self.max_draft_nodes]
        if self.ctrl is not None and not self.is_tree:  # the adaptive controller's probes
            sizes.append(1 + self.ctrl.config.probe_k)
        for r in {id(x): x for x in (eng.runner, self.draft_runner) if x is not None}.values():
            if r.step_graphs is None:
                r.enable_step_graphs(max_batch)
            if r.step_graphs is not None:
                for q in sizes:
                    r.step_graphs.add_query_size(q)
        sg = eng.runner.step_graphs
        if sg is not None:
            for q in sizes:
                sg.capture_all(q)

    # -- lifecycle -----------------------------------------------------------------------------
    def remove_request(self, req: Request) -> None:
        """A request finished or was aborted."""
        if self.ctrl is not None:
            self.ctrl.remove_request(req.request_id)
        rm = getattr(self.proposer, "remove_request", None)
        if rm is not None:
            rm(req.request_id)
        req.spec_state = None

    # -- before scheduling ---------------------------------------------------------------------
    @property
    def may_overlap_plain_steps(self) -> bool:
        """Whether steps without drafts can be known as such before the previous step's tokens are
        (so the engine may overlap them, async scheduling): speculation switched off, or decided by
        the adaptive controller's token-free pre-check. Not Medusa, whose heads read every step's
        hidden states."""
        return not self.needs_hidden and (self.ctrl is not None or not self.enabled)

    def plain_step_ahead(self) -> bool:
        """Called by the engine before anything else in a step: True when this step will carry no
        drafts for anyone, decided without the newest tokens (which may still be on the device: the
        controller needs only counts and its own estimates). The plan is kept for propose(), which
        must follow in the same step."""
        self._planned = None
        if not self.may_overlap_plain_steps:
            return False
        if not self.enabled:
            return True
        plan = self._plan()
        self._planned = (plan,)
        return plan is None

    def _decode_ready(self) -> list[Request]:
        """Running requests in decode state: only their last token lacks KV (it may be in flight).
        Not an n > 1 request before its fork: its last prompt token is still prefill, which forks
        the siblings when it samples (LLMEngine._fork_if_needed); a verify step would skip that.
        Not a structured-outputs request: its grammar masks one token at a time (engine.structured)."""
        sched = self.engine.scheduler  # only the first max_num_seqs running can be scheduled
        return [r for r in sched.running[: sched.max_num_seqs]
                if r.num_computed_tokens == r.num_tokens - 1 and r.forked and r.grammar is None]

    def _plan(self) -> Optional[dict[str, tuple[int, int]]]:
        """request id -> (draft nodes k, depth cap) for the decode-ready requests that get drafts
        this step; None when none does. Counts include a token still in flight (async scheduling).
        While the controller keeps speculation off, a step costs it one counter update: its
        pre-check counts every running request (at most a few still prefilling), and the requests
        themselves are not looked at."""
        running = self.engine.scheduler.running
        if not running:
            return None
        shadows = self._shadow_drafts and len(running) <= self.SHADOW_MAX_BATCH
        prechecked = self.ctrl is not None and not shadows
        if prechecked and self.ctrl.skip_step(self.name, len(running)):
            return None
        cands = self._decode_ready()
        if not cands:
            return None
        if shadows:
            self._score_shadows(cands)
        plan = self._choose(cands, prechecked)
        if shadows:
            self._new_shadows([r for r in cands if plan is None or r.request_id not in plan])
        return plan

    def _score_shadows(self, cands: list[Request]) -> None:
        """Score the shadow drafts whose outcome the newest known tokens decide (a miss seen, or
        every depth known), as acceptance observations of the controller."""
        for r in cands:
            st = r.spec_state
            if st is None or st.shadow is None:
                continue
            start, tree = st.shadow
            depth = tree.max_depth
            known = r.token_ids[start : start + depth]
            if not known:
                continue
            a = greedy_match(tree, known)
            if a < len(known) or a == depth:
                st.shadow = None
                self.ctrl.observe_acceptance(self.name, r.request_id, depth, a)

    def _new_shadows(self, reqs: list[Request]) -> None:
        """Shadow drafts for requests without one, from the tokens known now (a token still in
        flight is not: the draft is scored from that token on)."""
        need = [r for r in reqs if r.spec_state is None or r.spec_state.shadow is None]
        if not need:
            return
        preqs = [ProposalRequest(r.request_id, _state(r).tokens(r.token_ids), self.k, None, r.params) for r in need]
        for r, tree in zip(need, self.proposer.propose(preqs)):
            if tree is not None and len(tree):
                r.spec_state.shadow = (len(r.token_ids), tree)

    def _choose(self, cands: list[Request], prechecked: bool = False) -> Optional[dict[str, tuple[int, int]]]:
        eng = self.engine
        if self.ctrl is not None and not prechecked and self.ctrl.skip_step(self.name, len(cands)):
            return None  # speculation off this step: no per-request work at all
        caps, depth_caps = [], []
        for r in cands:
            p = r.params
            n_out = r.num_output_tokens + r.num_pending
            left = (p.max_tokens - n_out) if p.max_tokens is not None else self.k + 1
            # Emitting depth + 1 tokens should not pass max_tokens; every node needs a slot in the context.
            depth_caps.append(max(0, left - 1))
            nodes = min(self.k, eng.max_model_len - r.num_tokens)
            caps.append(max(0, nodes if self.is_tree else min(nodes, left - 1)))
        if self.ctrl is not None:
            # verification by rejection sampling costs more than greedy's: priced apart
            sampled = any(_verified_by_sampling(r) for r in cands)
            ks = self.ctrl.choose([r.request_id for r in cands], self.name, caps, prechecked=True, sampled=sampled)
        else:
            ks = caps
        plan = {r.request_id: (k, d) for r, k, d in zip(cands, ks, depth_caps) if k > 0 and d > 0}
        return plan or None

    def propose(self) -> None:
        """Draft for every running request in decode state (only its last token lacks KV)."""
        eng = self.engine
        self._outcome_t0 = time.perf_counter()  # the whole step, for the controller's calibration
        self._emitted0 = eng.generation_tokens_total
        # last step's drafts are spent (verified or dropped); only requests that had some are reset
        for r in self._drafted:
            r.spec_token_ids = []
            if r.spec_state is not None:
                r.spec_state.tree = None
        self._drafted = []
        if not self.enabled:
            return
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] is None:
            return  # planned ahead: no drafts this step (the common case while adaptive keeps it off)
        plan = planned[0] if planned is not None else self._plan()
        if plan is None:
            return
        cands = self._decode_ready()
        # (planned ahead: requests that finished since are no longer running)
        asked = [(r, *plan[r.request_id]) for r in cands if r.request_id in plan]
        if not asked:
            return
        preqs = []
        for r, k, _ in asked:
            st = _state(r)
            preqs.append(ProposalRequest(r.request_id, st.tokens(r.token_ids), k, st.hidden, r.params,
                                         r.generator_at(r.num_output_tokens, SeedStream.DRAFT)))
        t0 = time.perf_counter()
        trees = self.proposer.propose(preqs)
        if self.ctrl is not None:
            self.ctrl.observe_propose(self.name, len(preqs), time.perf_counter() - t0)
        for (r, _, depth_cap), tree in zip(asked, trees):
            if tree is not None and tree.max_depth > depth_cap:
                tree = _prune_depth(tree, depth_cap)
            if tree is None or len(tree) == 0:
                self.metrics.record_no_draft(self.name)
                continue
            r.spec_state.tree = tree
            r.spec_state.shadow = None  # the real draft's outcome is observed instead
            r.spec_token_ids = list(tree.tokens)
            self._drafted.append(r)

    # -- the forward ---------------------------------------------------------------------------
    def execute_kwargs(self, sched: SchedulerOutput) -> dict[str, Any]:
        """Extra ModelRunner.execute arguments for this step (tree mask and positions)."""
        kw: dict[str, Any] = {"need_hidden": True} if self.needs_hidden else {}
        if not self._drafted:  # no drafts this step: only whether the controller learns from it
            self._step_decode_only = self.ctrl is not None and sched.is_decode
            return kw
        self._step_decode_only = all(s.num_new_tokens - s.num_spec_tokens == 1 and s.samples for s in sched.seqs)
        trees = False
        for s in sched.seqs:
            if s.num_spec_tokens:
                st = s.request.spec_state
                st.tree = truncate_tree(st.tree, s.num_spec_tokens)  # the scheduler may trim drafts
                trees = trees or not st.tree.is_chain
        if trees:
            masks, pos, qlens = [], [], []
            for s in sched.seqs:
                c, q = s.request.num_computed_tokens, s.num_new_tokens
                qlens.append(q)
                if s.num_spec_tokens:
                    t = s.request.spec_state.tree
                    masks.append(tree_attention_mask(t))
                    pos.extend(positions(t, c).tolist())
                else:
                    masks.append(None)
                    pos.extend(range(c, c + q))
            kw["tree_mask"] = flat_tree_mask(masks, qlens, self.engine.device)
            kw["positions_override"] = pos
        return kw

    # -- after the forward ---------------------------------------------------------------------
    def finish_step(self, sched: SchedulerOutput, result: StepResult) -> list[str]:
        """Verify this step's drafts and emit their tokens; returns the touched group ids."""
        spec = [(i, s) for i, s in enumerate(sched.seqs) if s.num_spec_tokens > 0] if self._drafted else []
        if self.needs_hidden and result.hidden is not None:
            # requests keep rows of it across steps; a graph-replayed step's hidden is a view of a
            # buffer the next step overwrites
            result.hidden = result.hidden.clone()
            for (start, count), s in zip(result.rows, sched.seqs):
                if count and not s.num_spec_tokens and not s.request.is_finished:
                    _state(s.request).hidden = result.hidden[start]
        touched = self._verify(spec, result) if spec else []
        if self.ctrl is not None and self._step_decode_only:
            # Whole steps, drafting to processed outputs, on both sides: a plain step overlapped
            # with the GPU (async scheduling) lasts about its period, a speculative one waits for
            # its forward; the forward alone would price the first at its launch only.
            now = time.perf_counter()
            n_seqs = len(sched.seqs)
            n_tokens = sched.num_tokens if spec else n_seqs
            sampled = bool(spec) and self._step_sampled
            self.ctrl.observe_step(n_seqs, n_tokens, now - self._outcome_t0, sampled)
            self.ctrl.observe_outcome(
                self.name, n_seqs, self.engine.generation_tokens_total - self._emitted0,
                now - self._outcome_t0, speculated=n_tokens > n_seqs, sampled=sampled,
            )
        return touched

    def _verify(self, spec: list, result: StepResult) -> list[str]:
        eng = self.engine
        reqs: list[Request] = [s.request for _, s in spec]
        trees: list[DraftTree] = [r.spec_state.tree for r in reqs]
        starts: list[int] = []  # each request's root row in result.logits / result.hidden (its rows follow)
        for (i, s), t in zip(spec, trees):
            start, count = result.rows[i]
            assert count == 1 + len(t), f"verify rows {count} != 1 + {len(t)} drafts"
            starts.append(start)
        self._step_sampled = any(_verified_by_sampling(r) for r in reqs)
        if not self._step_sampled:
            # Plain greedy: only the target's argmax matters. One argmax over the step's rows and one
            # read, then the walk on the host (no row gather, no per-step verification kernels).
            res = verify_greedy(trees, result.logits.argmax(-1).tolist(), starts)
        else:
            greedy = [r.params.greedy for r in reqs]
            # whether the target's distribution at a node depends on the draft tokens before it
            # (penalties; min_tokens masking EOS / stop ids at some nodes but maybe not others)
            ctxs = [r.params.reads_outputs(r.num_output_tokens) for r in reqs]
            rows = [j for st, t in zip(starts, trees) for j in range(st, st + 1 + len(t))]
            logits = result.logits[torch.tensor(rows, device=result.logits.device)]
            res = self._verify_sampled(reqs, trees, logits, greedy, ctxs)
        paths = [v.path for v in res]
        emitted = [v.tokens for v in res]

        self._compact_kv(reqs, paths)
        lps = self._logprobs(reqs, paths, emitted, starts, result.logits)

        now = time.monotonic()
        touched: dict[str, None] = {}
        for b, (r, t, path, toks) in enumerate(zip(reqs, trees, paths, emitted)):
            if self.ctrl is not None:  # (before the tokens: a request they finish is forgotten by the controller)
                self.ctrl.observe_acceptance(self.name, r.request_id, t.max_depth, len(path))
            base = r.num_computed_tokens
            n_emit = 0
            for i, tok in enumerate(toks):
                r.num_computed_tokens = base + 1 + i  # the token before tok now has its KV
                eng._append_token(r, tok, None if lps[b] is None else lps[b][i], now)
                n_emit += 1
                if r.finish_reason is not None:
                    break
            if not r.is_finished:
                eng.kv.truncate(r.request_id, r.num_computed_tokens)
                if self.needs_hidden and result.hidden is not None:
                    last = 0 if not path else 1 + path[-1]
                    r.spec_state.hidden = result.hidden[starts[b] + last]
            touched[r.group_id] = None
            self.metrics.record(self.name, len(t), len(path), n_emit)
            r.metrics.spec_accepted.append(len(path))
        return list(touched)

    def _verify_sampled(self, reqs: list[Request], trees: list[DraftTree], logits: torch.Tensor,
                        greedy: list[bool], ctxs: list[bool]) -> list[TreeVerifyResult]:
        """Verification against the distributions the requests sample from (temperature, top-k/p,
        penalties, min_tokens; greedy rows take the argmax of theirs): rejection sampling on the
        device, one read (seeded requests with deterministic drafts: the keyed samples below).
        logits: the requests' rows, gathered."""
        eng = self.engine
        # The target's distribution at every query row; a node sees its own path as outputs so far.
        # (no generators: these rows only give distributions; the draws below take theirs by position)
        srows: list[SamplingRow] = []
        for r, t, ctx in zip(reqs, trees, ctxs):
            outs = r.output_token_ids
            row = SamplingRow(r.params, r.prompt_token_ids, outs, None, bad_words=r.bad_words)
            srows.append(row)
            for j in range(len(t)):
                srows.append(SamplingRow(r.params, r.prompt_token_ids, outs + t.path_tokens(j), None,
                                         bad_words=r.bad_words) if ctx else row)
        batch = SamplingBatch.build(srows, eng.vocab_size, logits.device, eos_token_ids=sorted(eng.eos_token_ids))
        probs = compute_probs(logits, batch)
        # A seeded request's deterministic drafts (n-gram, Medusa, early exit's argmax): the token
        # at every query row is sampled as plain decoding samples that position (its generator for
        # the position, the same distribution), and the drafts that match it are kept -- the greedy
        # walk over those samples. Lossless (a one-hot draft is kept with probability p(draft), a
        # rejection emits a sample of p without it), and the request's tokens are plain decoding's
        # whatever was drafted: they do not depend on the batch, the adaptive controller's timing, or
        # whether the step speculated.
        offsets = np.cumsum([0] + [t.num_query_tokens for t in trees]).tolist()
        keyed = [b for b, (r, t, g) in enumerate(zip(reqs, trees, greedy))
                 if r.seeds is not None and not g and t.is_deterministic]
        out: list[Optional[TreeVerifyResult]] = [None] * len(reqs)
        if keyed:
            rows = [offsets[b] + i for b in keyed for i in range(trees[b].num_query_tokens)]
            gens = [reqs[b].generator_at(reqs[b].num_output_tokens + d) for b in keyed
                    for d in (0,) + trees[b].depths]
            picked = sample_rows_keyed(probs[torch.tensor(rows, device=probs.device)], gens).tolist()
            firsts = np.cumsum([0] + [trees[b].num_query_tokens for b in keyed]).tolist()
            for b, v in zip(keyed, verify_greedy([trees[b] for b in keyed], picked, firsts)):
                out[b] = v
        rest = [b for b in range(len(reqs)) if out[b] is None]
        if not rest:
            return out
        if len(rest) < len(reqs):
            rows = [offsets[b] + i for b in rest for i in range(trees[b].num_query_tokens)]
            probs = probs[torch.tensor(rows, device=probs.device)]
        sub_reqs, sub_trees, sub_greedy = [reqs[b] for b in rest], [trees[b] for b in rest], [greedy[b] for b in rest]
        gens = [r.generator_at(r.num_output_tokens, SeedStream.VERIFY) for r in sub_reqs]
        if all(t.is_chain for t in sub_trees):
            res = verify_chains([list(t.tokens) for t in sub_trees], probs, [t.draft_probs for t in sub_trees],
                                greedy=sub_greedy, generators=gens)
            res = [TreeVerifyResult(path=list(range(len(e) - 1)), tokens=e) for e in res.to_lists()]
        else:
            res = verify_trees(sub_trees, probs, greedy=sub_greedy, generators=gens)
        for b, v in zip(rest, res):
            out[b] = v
        return out

    def _compact_kv(self, reqs: list[Request], paths: list[list[int]]) -> None:
        """Move accepted tree nodes' KV next to the root (query row 1 + path[i] -> row 1 + i)."""
        bs = self.engine.config.block_size
        src_slots: list[int] = []
        dst_slots: list[int] = []
        for r, path in zip(reqs, paths):
            src, dst = kv_compaction(path)
            if not src:
                continue
            base = r.num_computed_tokens
            table = self.engine.kv.block_ids(r.request_id)
            for rows, slots in ((src, src_slots), (dst, dst_slots)):
                for row in rows:
                    blk, off = divmod(base + row, bs)
                    slots.append(table[blk] * bs + off)
        self.engine.runner.move_kv_slots(src_slots, dst_slots)

    def _logprobs(self, reqs, paths, emitted, starts, logits) -> list[Optional[list[tuple]]]:
        """Raw logprobs of every emitted token (and the top ones), for requests that asked.
        logits: the step's rows; request b's root row is starts[b], its node j's is starts[b] + 1 + j."""
        want = [r.params.logprobs is not None for r in reqs]
        out: list[Optional[list[tuple]]] = [None] * len(reqs)
        if not any(want):
            return out
        rows, toks, owners = [], [], []
        for b, (r, path, em) in enumerate(zip(reqs, paths, emitted)):
            if not want[b]:
                continue
            for i, tok in enumerate(em):
                rows.append(starts[b] + (0 if i == 0 else 1 + path[i - 1]))
                toks.append(tok)
                owners.append(b)
        k = max(r.params.logprobs for r, w in zip(reqs, want) if w)
        so = SamplerOutput(token_ids=torch.tensor(toks, device=logits.device))
        _add_logprobs(so, logits[torch.tensor(rows, device=logits.device)], k)
        lp, ids, rank = so.logprobs.tolist(), so.logprob_token_ids.tolist(), so.sampled_ranks.tolist()
        for j, b in enumerate(owners):
            if out[b] is None:
                out[b] = []
            out[b].append((lp[j], ids[j], rank[j]))
        return out

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.metrics.as_dict()
