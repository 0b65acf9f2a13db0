"""Token trees of draft tokens (SpecInfer) and what the verify step needs from them.

A :class:`DraftTree` holds ``n`` draft nodes. Node ``j`` has a token and a parent: ``-1`` for the
children of the *root*, which is the last verified token of the request (its KV is not in the cache
yet, so the verify step feeds it as the first query). Nodes are in topological order (every parent
comes before its children); siblings are in the order the verifier tries them. A chain of ``k`` draft
tokens is the tree with ``parents = [-1, 0, 1, ..., k-2]``.

Query layout of a verify step for one request (``1 + n`` query tokens)::

    query row 0      : root (last verified token), position base_pos
    query row 1 + j  : node j, position base_pos + depth(j)

and the target's output row ``0`` predicts the children of the root, row ``1 + j`` the children of
node ``j``.

Optional ``draft_probs`` ([n, V]) carries, for each node, the distribution *its token was drawn from*
(given its parent and the siblings drawn before it). ``None`` means the tokens were chosen
deterministically (n-gram lookup, greedy or top-k drafts); verification then treats each node's q as
one-hot at its token, which is always lossless (see ``verify.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from pageflash.transfer import to_device


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Draft tokens arranged as a tree below the root (the last verified token).

    tokens:      int token id of each node, length n.
    parents:     parent node index of each node, in [-1, j) for node j (-1 = child of the root).
    draft_probs: float [n, V] or None; row j = the distribution node j's token was drawn from.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft_probs: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Accept lists and numpy ints, store plain tuples so a tree is cheap to hash/compare by value.
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"DraftTree: len(parents)={len(self.parents)} must equal len(tokens)={n}")
        for j, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if t < 0:
                raise ValueError(f"DraftTree: tokens[{j}]={t} must be >= 0")
            if not -1 <= p < j:
                raise ValueError(f"DraftTree: parents[{j}]={p} must be in [-1, {j}) (topological order)")
        if self.draft_probs is not None:
            q = self.draft_probs
            if q.dim() != 2 or q.shape[0] != n:
                raise ValueError(f"DraftTree: draft_probs must have shape [{n}, V], got {tuple(q.shape)}")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Optional[torch.Tensor] = None) -> "DraftTree":
        """A chain: node j's parent is node j - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), draft_probs)

    # -- shape --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_query_tokens(self) -> int:
        """Query tokens of its verify step: the root plus every node."""
        return 1 + len(self.tokens)

    @property
    def is_deterministic(self) -> bool:
        return self.draft_probs is None

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 1 for the children of the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        ch: dict[int, list[int]] = {-1: []}
        for j, p in enumerate(self.parents):
            ch.setdefault(p, []).append(j)
        return {p: tuple(c) for p, c in ch.items()}

    def children(self, node: int) -> tuple[int, ...]:
        """Children of ``node`` (-1 = the root), in sibling order."""
        return self._children.get(node, ())

    @cached_property
    def sibling_ranks(self) -> tuple[int, ...]:
        """Position of each node among its parent's children (0 = tried first)."""
        seen: dict[int, int] = {}
        ranks = []
        for p in self.parents:
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return tuple(ranks)

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[j] for j in self.path_to(node)]

    def query_tokens(self, root_token: int) -> list[int]:
        """The verify step's input ids: [root_token, *tokens]."""
        return [int(root_token), *self.tokens]


def chain(tokens: Sequence[int], draft_probs: Optional[torch.Tensor] = None) -> DraftTree:
    """Shorthand for :meth:`DraftTree.chain`."""
    return DraftTree.chain(tokens, draft_probs)


# -- attention inputs ---------------------------------------------------------------------------


def tree_attention_mask(tree: DraftTree, device: torch.device | str | None = None) -> torch.Tensor:
    """Topology-aware mask among the verify step's query tokens: bool [1 + n, 1 + n].

    Row/column 0 is the root; row 1 + j may attend to column 1 + i iff node i is node j itself or one
    of its ancestors (the root included). The KV already in the cache is visible to every row and is
    not part of this mask.
    """
    n = len(tree)
    m = np.zeros((n + 1, n + 1), dtype=bool)
    m[0, 0] = True
    # Topological order: the parent's row is final when we copy it.
    for j, p in enumerate(tree.parents):
        m[j + 1] = m[p + 1]
        m[j + 1, j + 1] = True
    return to_device(torch.from_numpy(m), device)


def positions(tree: DraftTree, base_pos: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions of the verify step's query tokens: int64 [1 + n], root at ``base_pos``.

    ``base_pos`` is the root's position (= number of tokens before it in the sequence). Node j sits at
    ``base_pos + depth(j)``: siblings share a position because they are alternatives for one slot.
    """
    return torch.tensor([base_pos, *(base_pos + d for d in tree.depths)], dtype=torch.long, device=device)


def flat_tree_mask(
    masks: Sequence[Optional[torch.Tensor]],
    query_lens: Sequence[int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Stack per-sequence masks into ``AttentionMetadata.tree_mask``: bool [sum(query_lens), max_q].

    masks[i]: bool [q_i, q_i] for a tree sequence, or None for an ordinary one (prefill chunk, plain
    decode), which gets the causal mask. Columns past q_i are False.
    """
    if len(masks) != len(query_lens):
        raise ValueError(f"flat_tree_mask: {len(masks)} masks for {len(query_lens)} sequences")
    max_q = max(query_lens, default=0)
    out = torch.zeros(sum(query_lens), max_q, dtype=torch.bool)
    row = 0
    for m, q in zip(masks, query_lens):
        if m is None:
            out[row : row + q, :q] = torch.ones(q, q, dtype=torch.bool).tril()
        else:
            if tuple(m.shape) != (q, q):
                raise ValueError(f"flat_tree_mask: mask of shape {tuple(m.shape)} for query_len {q}")
            out[row : row + q, :q] = m.cpu()
        row += q
    return to_device(out, device)


def kv_compaction(path: Sequence[int]) -> tuple[list[int], list[int]]:
    """Query rows whose KV must move so that the accepted path is contiguous after the root.

    After verification the cache must hold root, path[0], path[1], ... in consecutive slots, i.e. node
    ``path[i]`` (query row ``1 + path[i]``) belongs in query row ``1 + i``'s slot. Returns
    ``(src_rows, dst_rows)`` for the rows that differ (empty when the path is a prefix of the node
    order, e.g. always for chains). Because ``path`` is strictly increasing and ``path[i] >= i``, no
    destination is a later source, so copying all at once (gather then scatter) is safe.
    """
    src, dst = [], []
    for i, node in enumerate(path):
        if node != i:
            src.append(1 + node)
            dst.append(1 + i)
    return src, dst


# -- construction: static expansion (SpecInfer) ---------------------------------------------------


@dataclass(frozen=True)
class ExpansionConfig:
    """SpecInfer's static expansion: every node at depth d (the root is depth 0) gets branching[d] children.

    [2, 2, 1] makes 2 + 4 + 4 = 10 nodes of depth <= 3; [1] * k is a chain of k.
    """

    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        if not self.branching:
            raise ValueError("ExpansionConfig.branching must have at least one level")
        for d, b in enumerate(self.branching):
            if b < 1:
                raise ValueError(f"ExpansionConfig.branching[{d}]={b} must be >= 1")

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def num_nodes(self) -> int:
        """Nodes of a full tree: sum over levels of the product of branchings so far."""
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total


def tree_from_level_candidates(candidates: Sequence[Sequence[int]], config: ExpansionConfig) -> DraftTree:
    """Medusa-style tree: every node at depth d gets children ``candidates[d][:branching[d]]``.

    candidates[d] is a ranked list of tokens for position d + 1 after the root, independent of the
    parent (one Medusa head per position). Deterministic: draft_probs is None. Stops at the shorter of
    ``candidates`` and ``config.branching``.
    """
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [-1]
    for d in range(min(len(candidates), config.depth)):
        level = list(candidates[d])[: config.branching[d]]
        nxt = []
        for p in frontier:
            for t in level:
                parents.append(p)
                tokens.append(int(t))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tuple(tokens), tuple(parents))


# next_probs(request_indices, paths) -> float [m, V]: the proposer's next-token distribution after the
# root followed by each path (paths[i] is a list of draft tokens, [] for the root).
NextProbsFn = Callable[[list[int], list[list[int]]], torch.Tensor]


def build_trees(
    next_probs: NextProbsFn,
    num_requests: int,
    config: ExpansionConfig,
    *,
    sample: bool = False,
    generator: Optional[torch.Generator] = None,
    generators: Optional[Sequence[Optional[torch.Generator]]] = None,
) -> list[DraftTree]:
    """Expansion-based construction for a batch of requests, one ``next_probs`` call per level.

    sample=False: each frontier node gets the top-branching[d] tokens of its distribution
    (deterministic, draft_probs None). sample=True: children are drawn from the distribution
    *without replacement*; node j then records the conditional distribution it was drawn from
    (q with the earlier siblings removed, renormalized), which keeps stochastic verification lossless
    and avoids duplicate siblings. Nodes with fewer than branching[d] tokens of nonzero probability
    get fewer children. Level order is topological. generators[r]: request r's own generator
    (seeded requests), used for its draws instead of ``generator``.
    """
    toks: list[list[int]] = [[] for _ in range(num_requests)]
    pars: list[list[int]] = [[] for _ in range(num_requests)]
    qrows: list[list[int]] = [[] for _ in range(num_requests)]  # rows into cat(level_conds)
    level_conds: list[torch.Tensor] = []
    qbase = 0
    paths: list[list[list[int]]] = [[] for _ in range(num_requests)]  # token path of each node
    frontier: list[tuple[int, int]] = [(r, -1) for r in range(num_requests)]  # (request, node)
    for d in range(config.depth):
        if not frontier:
            break
        reqs = [r for r, _ in frontier]
        fpaths = [paths[r][j] if j >= 0 else [] for r, j in frontier]
        q = next_probs(reqs, fpaths).float()  # [m, V]
        if q.shape[0] != len(frontier):
            raise ValueError(f"next_probs returned {q.shape[0]} rows for {len(frontier)} paths")
        b = min(config.branching[d], q.shape[1])
        if sample:
            gens = [generators[r] for r in reqs] if generators is not None else None
            chosen, cond = _sample_without_replacement(q, b, generator, gens)  # [m, b], [m, b, V]
            valid = torch.gather(cond, 2, chosen[:, :, None]).squeeze(2) > 0
            level_conds.append(cond.flatten(0, 1))
        else:
            chosen = torch.topk(q, b, dim=-1).indices
            valid = torch.gather(q, 1, chosen) > 0
        # Tokens of zero probability are never proposed (a row ran out of support).
        chosen_l, valid_l = chosen.tolist(), valid.tolist()
        nxt: list[tuple[int, int]] = []
        for i, (r, j) in enumerate(frontier):
            for c in range(b):
                if not valid_l[i][c]:
                    continue
                t = chosen_l[i][c]
                pars[r].append(j)
                toks[r].append(t)
                paths[r].append(fpaths[i] + [t])
                qrows[r].append(qbase + i * b + c)
                nxt.append((r, len(toks[r]) - 1))
        qbase += len(frontier) * b
        frontier = nxt
    all_q = torch.cat(level_conds) if sample and level_conds else None
    trees = []
    for r in range(num_requests):
        probs = None
        if all_q is not None and qrows[r]:
            probs = all_q[torch.tensor(qrows[r], dtype=torch.long, device=all_q.device)]
        trees.append(DraftTree(tuple(toks[r]), tuple(pars[r]), probs))
    return trees


def build_tree(
    next_probs: Callable[[list[list[int]]], torch.Tensor],
    config: ExpansionConfig,
    *,
    sample: bool = False,
    generator: Optional[torch.Generator] = None,
) -> DraftTree:
    """:func:`build_trees` for one request; ``next_probs(paths) -> [m, V]``."""
    return build_trees(lambda _r, p: next_probs(p), 1, config, sample=sample, generator=generator)[0]


def _sample_without_replacement(
    q: torch.Tensor, b: int, generator: Optional[torch.Generator],
    gens: Optional[Sequence[Optional[torch.Generator]]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw b tokens per row of q ([m, V]) without replacement (row i from gens[i] where set).

    Returns (tokens int64 [m, b], cond float [m, b, V]) with cond[:, c] the normalized distribution
    draw c came from. Rows that run out of support draw a zero-probability token (caller drops it).
    """
    cur = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    toks, conds = [], []
    for _ in range(b):
        conds.append(cur)
        t = sample_from_weights(cur, generator, gens)
        toks.append(t)
        cur = cur.scatter(1, t[:, None], 0.0)
        cur = cur / cur.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.stack(toks, 1), torch.stack(conds, 1)


def sample_from_weights(w: torch.Tensor, generator: Optional[torch.Generator] = None,
                        gens: Optional[Sequence[Optional[torch.Generator]]] = None) -> torch.Tensor:
    """One index per row of nonnegative weights w ([m, V]), proportional to w: int64 [m]. Row i
    draws from gens[i] where that is set, the others from ``generator``.

    Exponential-race sampling (argmax of w / E, E ~ Exp(1)) needs no normalization and no host sync.
    """
    e = torch.empty_like(w, dtype=torch.float32)
    own = [(i, g) for i, g in enumerate(gens or ()) if g is not None]
    if len(own) < w.shape[0]:
        e.exponential_(1.0, generator=generator)
    for i, g in own:
        e[i].exponential_(1.0, generator=g)
    return torch.argmax(w.float() / e, dim=-1)


# -- merging several proposers' trees (SpecInfer's merge-based construction) ----------------------


def merge_trees(trees: Sequence[DraftTree], max_nodes: Optional[int] = None) -> DraftTree:
    """Union of several trees, deduplicated by token prefix (a trie over token paths).

    Nodes of trees[0] come first in their order, then the new nodes of trees[1], and so on, so the
    result is topological and each tree's siblings keep their relative order. A node that several
    trees share keeps the draft distribution of its first occurrence. If any tree carries draft
    probs, deterministic trees' nodes get one-hot rows. This stays lossless under stochastic
    verification because which tokens are merged depends only on draft tokens, never on the
    target's randomness. ``max_nodes`` truncates (keeping topological order) when given.
    """
    if not trees:
        return DraftTree((), ())
    vocab = next((t.draft_probs.shape[1] for t in trees if t.draft_probs is not None), None)
    ref = next((t.draft_probs for t in trees if t.draft_probs is not None), None)
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    for tree in trees:
        if tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab:
            raise ValueError("merge_trees: trees have draft_probs of different vocab sizes")
        local: list[int] = []
        for j, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
            mp = -1 if p < 0 else local[p]
            if mp is None:  # parent was cut by max_nodes
                local.append(None)  # type: ignore[arg-type]
                continue
            key = (mp, t)
            if key not in index:
                if max_nodes is not None and len(tokens) >= max_nodes:
                    local.append(None)  # type: ignore[arg-type]
                    continue
                index[key] = len(tokens)
                tokens.append(t)
                parents.append(mp)
                if vocab is not None:
                    if tree.draft_probs is not None:
                        rows.append(tree.draft_probs[j].float())
                    else:
                        rows.append(torch.nn.functional.one_hot(torch.tensor(t), vocab).float().to(ref.device))
            local.append(index[key])
    probs = torch.stack(rows) if rows else (None if vocab is None else torch.zeros(0, vocab))
    return DraftTree(tuple(tokens), tuple(parents), probs)
