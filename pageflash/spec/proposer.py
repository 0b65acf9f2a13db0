"""The Proposer interface: draft tokens for a batch of requests, before the verify step.

A proposer turns each request's tokens so far into a :class:`DraftTree` (a chain is a tree) or None
(nothing to propose this step). Deterministic proposers (n-gram lookup, greedy or top-k drafts)
return trees without draft probabilities; sampling proposers (a draft model sampling at the
request's temperature) attach, per node, the distribution the token was drawn from, which
stochastic verification needs to accept more than with one-hot q.

Proposers that need a model (a small draft model, Medusa heads, an early-exit head of the target)
get the model runner, or whatever produces their next-token distributions, through their
constructor, so ``propose`` keeps one signature. :class:`ExpansionProposer` is the shared part of
those: it grows SpecInfer expansion trees from any batched ``next_probs`` function, one call per
tree level. :class:`MergedProposer` merges several proposers' trees (SpecInfer's merge-based trees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from pageflash.spec.tree import DraftTree, ExpansionConfig, build_trees, merge_trees

if TYPE_CHECKING:
    from pageflash.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class ProposalRequest:
    """What a proposer sees of one request.

    request_id:             the engine's id (proposers with per-request state key on it).
    token_ids:              prompt + output so far (a list, or an int numpy array the engine keeps
                            per request to avoid a copy); the last token is the tree's root.
    num_speculative_tokens: the k the controller chose for this request this step (0 = do not
                            propose); trees must have at most k nodes.
    hidden_states:          optional target hidden state(s) of the last token, for proposers that
                            read them (Medusa heads: [H]; early exit: [num_layers, H]); None else.
    params:                 the request's SamplingParams, for proposers that sample their drafts at
                            the request's temperature / top-k / top-p (None: draft greedily).
    generator:              the request's own generator (a seeded request), which such draws use
                            so that its output is reproducible; None: the proposer's (or torch's).
    """

    request_id: str
    token_ids: Union[Sequence[int], np.ndarray]
    num_speculative_tokens: int
    hidden_states: Optional[torch.Tensor] = None
    params: Optional["SamplingParams"] = None
    generator: Optional[torch.Generator] = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if len(self.token_ids) == 0:
            raise ValueError("ProposalRequest.token_ids must not be empty (the last token is the root)")


class Proposer(Protocol):
    """Draft tokens for a batch; ``result[i]`` belongs to ``requests[i]``."""

    name: str

    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]: ...


class ExpansionProposer:
    """Trees from a model's next-token distributions: the shape of draft-model / EAGLE proposers.

    next_probs(requests, request_indices, paths) -> float [m, V]: the draft distribution after
    ``requests[request_indices[i]]``'s tokens followed by ``paths[i]`` (a list of draft tokens, []
    at the root); a draft model runner implements it with one batched forward per level (its KV for
    the paths is its own business). With ``sample=True`` it should return the distribution the
    draft samples from (the request's temperature applied), since that is the q verification uses.
    The tree shape comes from ``config``, cut at each request's k (levels beyond what k allows are
    dropped, and the tree is truncated to k nodes in topological order).
    """

    def __init__(
        self,
        name: str,
        next_probs: "DraftNextProbs",
        config: ExpansionConfig,
        *,
        sample: bool = False,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.name = name
        self.next_probs = next_probs
        self.config = config
        self.sample = sample
        self.generator = generator

    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        active = [i for i, r in enumerate(requests) if r.num_speculative_tokens > 0]
        out: list[Optional[DraftTree]] = [None] * len(requests)
        if not active:
            return out
        batch = [requests[i] for i in active]
        config = _trim(self.config, max(r.num_speculative_tokens for r in batch))
        trees = build_trees(
            lambda idx, paths: self.next_probs(batch, idx, paths),
            len(active),
            config,
            sample=self.sample,
            generator=self.generator,
            generators=[r.generator for r in batch],
        )
        for i, t in zip(active, trees):
            t = truncate_tree(t, requests[i].num_speculative_tokens)
            out[i] = t if len(t) else None
        return out


class DraftNextProbs(Protocol):
    """A draft model's next-token distributions for (request, draft path) pairs: float [m, V]."""

    def __call__(
        self, requests: list[ProposalRequest], request_indices: list[int], paths: list[list[int]]
    ) -> torch.Tensor: ...


class MergedProposer:
    """Runs several proposers and merges their trees per request (token-prefix dedup)."""

    def __init__(self, proposers: Sequence[Proposer], name: Optional[str] = None) -> None:
        if not proposers:
            raise ValueError("MergedProposer needs at least one proposer")
        self.proposers = list(proposers)
        self.name = name or "+".join(p.name for p in self.proposers)

    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        per = [p.propose(requests) for p in self.proposers]
        out: list[Optional[DraftTree]] = []
        for i, r in enumerate(requests):
            trees = [ts[i] for ts in per if ts[i] is not None]
            if not trees:
                out.append(None)
                continue
            merged = merge_trees(trees, max_nodes=r.num_speculative_tokens)
            out.append(merged if len(merged) else None)
        return out


def _trim(config: ExpansionConfig, max_nodes: int) -> ExpansionConfig:
    """Drop the levels no request can reach: a level is kept only if fewer than max_nodes nodes
    come before it, so a draft model is not run for nodes that truncation would discard."""
    levels, before, width = [], 0, 1
    for b in config.branching:
        if before >= max_nodes:
            break
        levels.append(b)
        width *= b
        before += width
    return ExpansionConfig(tuple(levels))


def truncate_tree(tree: DraftTree, max_nodes: int) -> DraftTree:
    """The first max_nodes nodes (a prefix of a topological order is a tree)."""
    if len(tree) <= max_nodes:
        return tree
    q = tree.draft_probs[:max_nodes] if tree.draft_probs is not None else None
    return DraftTree(tree.tokens[:max_nodes], tree.parents[:max_nodes], q)
