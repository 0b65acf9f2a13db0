"""Verification of draft tokens against the target model's outputs: pure functions.

Inputs are the target's per-query-token outputs of one verify step, in the runner's flat layout:
request b contributes ``1 + n_b`` rows (root, then its draft nodes; see ``tree.py``), and row ``i``
is the target's distribution for the token *after* query token ``i``.

``target_probs`` must be the distribution the engine would sample from (after temperature, top-k,
top-p, penalties), rows summing to 1. Rows of greedy requests are only argmax'ed, so raw logits are
fine there.

Stochastic verification is lossless: the emitted tokens are distributed exactly as if sampled from
the target one at a time. For a node whose token x was drawn from q, SpecInfer's multi-step
speculative sampling tries the children of the current node in order: accept child x with
probability min(1, p(x) / q(x)); on rejection replace p by norm(max(0, p - q)) and try the next
sibling; if every child is rejected, sample from the remaining p. Each round emits exactly p given
any history, as long as x ~ q given the history, so this holds for i.i.d. children, children drawn
without replacement (q = the conditional distribution), and deterministic children (q = one-hot at
x: accept with p(x), else zero x out of p). With one child per node this is Leviathan et al. /
Chen et al.'s rejection sampling over a chain, and the bonus token after a fully accepted path is
a plain sample from p at the last node.

Randomness is drawn for every row up front and the host reads the outcome once, so a batch costs a
single device-to-host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from pageflash.transfer import to_device
from pageflash.spec.tree import DraftTree

Generators = Optional[Sequence[Optional[torch.Generator]]]


# -- chains -------------------------------------------------------------------------------------


def verify_greedy_chain(draft: torch.Tensor, target_argmax: torch.Tensor) -> list[int]:
    """Greedy verification of one chain.

    draft: int [k]; target_argmax: int [k + 1] (the target's argmax after the root and after each
    draft token). Returns the accepted draft prefix followed by the target's token at the first
    mismatch (or the bonus token when all k match): 1..k+1 tokens.
    """
    d, a = draft.tolist(), target_argmax.tolist()
    if len(a) != len(d) + 1:
        raise ValueError(f"verify_greedy_chain: target_argmax has {len(a)} entries, expected {len(d) + 1}")
    n = 0
    while n < len(d) and d[n] == a[n]:
        n += 1
    return d[:n] + [a[n]]


def verify_stochastic_chain(
    draft: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> list[int]:
    """Rejection-sampling verification of one chain (Leviathan et al. 2023, Chen et al. 2023).

    draft: int [k]; draft_probs: float [k, V], row i = q the token i was drawn from, or None for a
    deterministic draft (one-hot q); target_probs: float [k + 1, V]. Returns 1..k+1 tokens.
    """
    out = verify_chains([draft], target_probs, [draft_probs], generators=[generator])
    return out.to_lists()[0]


@dataclass
class ChainVerifyOutput:
    """Result of :func:`verify_chains` (tensors on the target's device).

    tokens:       int64 [B, K + 1], emitted tokens left-aligned, -1 after them (K = max k_b).
    num_accepted: int64 [B], accepted draft tokens; request b emits num_accepted[b] + 1 tokens.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def to_lists(self) -> list[list[int]]:
        """Emitted tokens per request (one host sync)."""
        rows = torch.cat([self.num_accepted[:, None], self.tokens], 1).tolist()
        return [r[1 : r[0] + 2] for r in rows]


def verify_chains(
    drafts: Sequence[Union[torch.Tensor, Sequence[int]]],
    target_probs: torch.Tensor,
    draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None,
    *,
    greedy: Union[bool, Sequence[bool]] = False,
    generators: Generators = None,
    generator: Optional[torch.Generator] = None,
) -> ChainVerifyOutput:
    """Verify a batch of chains of different lengths in a few batched ops, with no host sync.

    drafts[b]:       int [k_b] draft tokens (k_b may be 0: then one token is sampled from p).
    target_probs:    float [sum_b (k_b + 1), V], flat: request b's rows follow request b-1's.
    draft_probs[b]:  float [k_b, V] or None (deterministic draft); None for all = all deterministic.
    greedy:          per request (or one bool): verify against the argmax instead of sampling.
    generators[b]:   per-request generator (seeded requests) or None to use ``generator``
                     (the batch's, or torch's default). Must live on target_probs' device.
    """
    dev = target_probs.device
    bsz = len(drafts)
    ks = [len(d) for d in drafts]
    kmax = max(ks, default=0)
    if target_probs.shape[0] != sum(ks) + bsz:
        raise ValueError(f"verify_chains: target_probs has {target_probs.shape[0]} rows, expected {sum(ks) + bsz}")
    if draft_probs is None:
        draft_probs = [None] * bsz
    greedy_l = [bool(greedy)] * bsz if isinstance(greedy, bool) else [bool(g) for g in greedy]
    gens = list(generators) if generators is not None else [None] * bsz
    if not (len(draft_probs) == len(greedy_l) == len(gens) == bsz):
        raise ValueError("verify_chains: draft_probs, greedy and generators need one entry per request")

    # Host-side index arithmetic (plain lists -> one copy each), no device reads.
    starts, s = [], 0
    for k in ks:
        starts.append(s)
        s += k + 1
    pad_tok = [
        [int(t) for t in (d.tolist() if isinstance(d, torch.Tensor) else d)] + [0] * (kmax - k)
        for d, k in zip(drafts, ks)
    ]
    if any(t >= target_probs.shape[1] for r in pad_tok for t in r):
        raise ValueError(f"verify_chains: a draft token is >= the vocab size {target_probs.shape[1]}")
    rows = [[st + min(i, k) for i in range(kmax + 1)] for st, k in zip(starts, ks)]
    is_prob = [q is not None and not g for q, g in zip(draft_probs, greedy_l)]
    qstarts, qs = [], 0
    for k, ip in zip(ks, is_prob):
        qstarts.append(qs)
        qs += k if ip else 0

    # One host -> device copy for all the index data: [B, K | K+1 | k, greedy, is_prob, q start].
    meta = torch.tensor(
        [t + r + [k, g, ip, qst] for t, r, k, g, ip, qst in zip(pad_tok, rows, ks, greedy_l, is_prob, qstarts)],
        dtype=torch.long,
    ).view(bsz, 2 * kmax + 5)
    meta = to_device(meta, dev)
    x = meta[:, :kmax]  # [B, K]
    row_idx = meta[:, kmax : 2 * kmax + 1]  # [B, K+1]
    k_t, greedy_t, is_prob_t, qstart_t = meta[:, 2 * kmax + 1 :].unbind(1)
    greedy_t, is_prob_t = greedy_t.bool(), is_prob_t.bool()
    pos = torch.arange(kmax + 1, device=dev)
    valid = pos[None, :kmax] < k_t[:, None]  # [B, K]

    if all(greedy_l):
        # Temperature 0 everywhere: compare with the argmax, no residuals, no randomness.
        amax = target_probs.argmax(-1)[row_idx]  # [B, K+1]
        n = ((x == amax[:, :kmax]) & valid).long().cumprod(1).sum(1)
        tokens = torch.where(pos[None, :] < n[:, None], torch.cat([x, amax[:, -1:]], 1), -1)
        tokens.scatter_(1, n[:, None], torch.gather(amax, 1, n[:, None]))
        return ChainVerifyOutput(tokens=tokens, num_accepted=n)

    px = target_probs[row_idx[:, :kmax], x].float()  # [B, K]: p_i(x_i)
    qx = torch.ones_like(px)  # deterministic drafts: q_i(x_i) = 1
    q_all = None
    if any(is_prob):
        for q, k, ip in zip(draft_probs, ks, is_prob):
            if ip and tuple(q.shape) != (k, target_probs.shape[1]):
                raise ValueError(
                    f"verify_chains: draft_probs of shape {tuple(q.shape)}, expected ({k}, {target_probs.shape[1]})"
                )
        q_all = torch.cat([q.float() for q, ip in zip(draft_probs, is_prob) if ip]).to(dev)  # [sum k, V]
        qrow = qstart_t[:, None] + pos[None, :kmax]
        qrow = torch.where(valid & is_prob_t[:, None], qrow, 0).clamp_max(max(q_all.shape[0] - 1, 0))
        qx = torch.where(is_prob_t[:, None], q_all[qrow, x], qx)
    # x ~ q implies q(x) > 0; the clamp only keeps padding finite.
    ratio = px / qx.clamp_min(1e-30)

    u = _uniform((bsz, kmax), ks, gens, generator, dev)
    accept = u < ratio
    if any(greedy_l):
        amax = target_probs.argmax(-1)  # [R]
        accept = torch.where(greedy_t[:, None], x == amax[row_idx[:, :kmax]], accept)
    accept &= valid
    n = accept.long().cumprod(1).sum(1)  # [B] accepted prefix length

    # The token at the stop row: residual max(0, p - q) after a rejection, p itself after full acceptance.
    stop_row = torch.gather(row_idx, 1, n[:, None]).squeeze(1)
    res = target_probs[stop_row].float()  # [B, V]
    rejected = n < k_t
    if kmax > 0:
        xn = torch.gather(x, 1, n.clamp_max(kmax - 1)[:, None])  # [B, 1]
        if q_all is not None:
            qn_row = (qstart_t + n).clamp_max(q_all.shape[0] - 1)
            use_q = (rejected & is_prob_t)[:, None]
            res = torch.where(use_q, (res - q_all[qn_row]).clamp_min(0), res)
        det_rej = (rejected & ~is_prob_t)[:, None]
        res.scatter_(1, xn, torch.where(det_rej, 0.0, res.gather(1, xn)))
        # p == q makes rejection a probability-0 event; float noise may still get here.
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, target_probs[stop_row].float())
    final = _sample_rows(res, gens, generator)
    if any(greedy_l):
        final = torch.where(greedy_t, amax[stop_row], final)

    tokens = torch.where(pos[None, :kmax] < n[:, None], x, -1)
    tokens = torch.cat([tokens, torch.full((bsz, 1), -1, dtype=torch.long, device=dev)], 1)
    tokens.scatter_(1, n[:, None], final[:, None])
    return ChainVerifyOutput(tokens=tokens, num_accepted=n)


# -- trees --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome for one request.

    path:   accepted node indices, root's child first (strictly increasing); keep their KV.
    tokens: the path's tokens followed by one token from the target: len(path) + 1 tokens to emit.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> TreeVerifyResult:
    """Greedy tree verification: walk down while some child's token equals the target's argmax.

    target_argmax: int [1 + n], row 0 at the root, row 1 + j at node j. The first matching sibling
    wins if several share a token.
    """
    a = target_argmax.tolist()
    if len(a) != tree.num_query_tokens:
        raise ValueError(f"verify_tree_greedy: target_argmax has {len(a)} entries, expected {tree.num_query_tokens}")
    return _greedy_walk(tree, a, 0)


def verify_tree_stochastic(
    tree: DraftTree, target_probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> TreeVerifyResult:
    """Multi-step speculative sampling over a token tree (SpecInfer). target_probs: float [1 + n, V]."""
    return verify_trees([tree], target_probs, generators=[generator])[0]


def verify_trees(
    trees: Sequence[DraftTree],
    target_probs: torch.Tensor,
    *,
    greedy: Union[bool, Sequence[bool]] = False,
    generators: Generators = None,
    generator: Optional[torch.Generator] = None,
) -> list[TreeVerifyResult]:
    """Verify a batch of trees; one host sync.

    target_probs: float [sum_b (1 + n_b), V] in the flat layout of the module doc.
    greedy / generators / generator: as in :func:`verify_chains`.

    On the device, for every node we compute its acceptance probability and for every row the
    distribution left after all its children are rejected: siblings are processed rank by rank
    (all first children of the batch at once, then all second children, ...), since the residual
    after rejecting children 1..r does not depend on the random outcomes. Uniforms and a sample from
    every row's final residual are drawn up front; the host then walks each tree.
    """
    dev = target_probs.device
    bsz = len(trees)
    greedy_l = [bool(greedy)] * bsz if isinstance(greedy, bool) else [bool(g) for g in greedy]
    gens = list(generators) if generators is not None else [None] * bsz
    if not (len(greedy_l) == len(gens) == bsz):
        raise ValueError("verify_trees: greedy and generators need one entry per tree")
    nrows = sum(t.num_query_tokens for t in trees)
    if target_probs.shape[0] != nrows:
        raise ValueError(f"verify_trees: target_probs has {target_probs.shape[0]} rows, expected {nrows}")

    vocab = target_probs.shape[1]
    if max((max(t.tokens, default=-1) for t in trees), default=-1) >= vocab:
        raise ValueError(f"verify_trees: a draft token is >= the vocab size {vocab}")
    offsets, o = [], 0
    for t in trees:
        offsets.append(o)
        o += t.num_query_tokens

    if all(greedy_l):
        return verify_greedy(trees, target_probs.argmax(-1).tolist(), offsets)

    # Flat host arrays over the stochastic trees' nodes. Row of node j of tree b: off_b + 1 + j.
    sto = [b for b in range(bsz) if not greedy_l[b]]
    lens = np.array([len(trees[b]) for b in sto], dtype=np.int64)
    tok_np = np.fromiter(itertools.chain.from_iterable(trees[b].tokens for b in sto), np.int64)
    par_np = np.fromiter(itertools.chain.from_iterable(trees[b].parents for b in sto), np.int64)
    rank_np = np.fromiter(itertools.chain.from_iterable(trees[b].sibling_ranks for b in sto), np.int64)
    prow_np = np.repeat(np.array([offsets[b] for b in sto], dtype=np.int64), lens) + 1 + par_np
    has_q = [trees[b].draft_probs is not None for b in sto]
    det_np = np.repeat(~np.array(has_q, dtype=bool), lens)
    # Row of node j of a tree with draft probs inside the concatenation of those trees' probs.
    q_first = np.cumsum([0] + [n if h else 0 for n, h in zip(lens.tolist(), has_q)])[:-1]
    node_first = np.cumsum(np.concatenate([[0], lens]))[:-1]
    local = np.arange(tok_np.shape[0]) - np.repeat(node_first, lens)
    qrow_np = np.where(det_np, 0, np.repeat(q_first, lens) + local)
    q_parts = []
    for b, h in zip(sto, has_q):
        if h:
            if trees[b].draft_probs.shape[1] != vocab:
                raise ValueError("verify_trees: draft_probs and target_probs disagree on V")
            q_parts.append(trees[b].draft_probs.float())
    q_all = torch.cat(q_parts).to(dev) if q_parts else None

    # Nodes sorted by sibling rank, all index data in one host -> device copy.
    order = np.argsort(rank_np, kind="stable")
    bounds = np.searchsorted(rank_np[order], np.arange(int(rank_np.max(initial=-1)) + 2))
    det_sorted = det_np[order]
    packed = np.stack([order, prow_np[order], tok_np[order], det_sorted.astype(np.int64), qrow_np[order]])
    packed_t = to_device(torch.from_numpy(packed), dev)  # [5, N]

    res = target_probs.to(torch.float32, copy=True)  # [R, V]: running residual at each row
    acc_prob = torch.zeros(tok_np.shape[0], device=dev)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        # prow is distinct within a rank: a parent has one child of each rank.
        nodes, prow, tok, det, qrow = packed_t[:, lo:hi]
        det = det.bool()
        cur = res[prow]  # [m, V], normalized
        px = cur.gather(1, tok[:, None]).squeeze(1)
        if q_all is not None and not det_sorted[lo:hi].all():
            q = torch.where(det[:, None], 0.0, q_all[qrow])
            qx = torch.where(det, 1.0, q.gather(1, tok[:, None]).squeeze(1))
            new = (cur - q).clamp_min(0)
        else:
            qx = torch.ones_like(px)
            new = cur.clone()
        # One-hot q for deterministic nodes: zero their token out of p.
        new.scatter_(1, tok[:, None], torch.where(det[:, None], 0.0, new.gather(1, tok[:, None])))
        acc_prob[nodes] = (px / qx.clamp_min(1e-30)).clamp_max(1.0)
        s = new.sum(-1, keepdim=True)
        # s == 0 means rejection had probability 0; keep cur so the row stays a distribution.
        res[prow] = torch.where(s > 0, new / s.clamp_min(1e-30), cur)

    # Randomness: per stochastic tree, its nodes' uniforms and a sample from each of its rows.
    counts = [len(t) if not greedy_l[b] else 0 for b, t in enumerate(trees)]
    u = _uniform_flat(counts, gens, generator, dev)
    final = _sample_rows(res, _expand_gens(gens, [t.num_query_tokens for t in trees]), generator)
    parts = [(u < acc_prob).long(), final]
    if any(greedy_l):
        parts.append(target_probs.argmax(-1))
    host = torch.cat(parts).tolist()  # the one device -> host transfer
    accept, final_l, amax_l = host[: len(u)], host[len(u) : len(u) + nrows], host[len(u) + nrows :]

    out = []
    a_i = 0
    for b, (t, off) in enumerate(zip(trees, offsets)):
        if greedy_l[b]:
            out.append(_greedy_walk(t, amax_l, off))
            continue
        acc = accept[a_i : a_i + len(t)]
        a_i += len(t)
        out.append(_walk(t, lambda j, acc=acc: bool(acc[j]), lambda nd, o=off: final_l[o + 1 + nd]))
    return out


def verify_greedy(trees: Sequence[DraftTree], amax: Sequence[int], offsets: Sequence[int]) -> list[TreeVerifyResult]:
    """Greedy verification of chains and trees on the host, from the target's argmax of every row
    (amax, already read from the device) and each tree's root row in it (offsets): the accepted
    path and the tokens it emits. Rows of amax that belong to no tree are ignored."""
    return [_greedy_walk(t, amax, o) for t, o in zip(trees, offsets)]


def greedy_match(tree: DraftTree, actual: Sequence[int]) -> int:
    """Nodes greedy verification would accept when the target's tokens are already known: actual[i]
    is the token that came at depth i + 1 (nothing deeper than len(actual) is accepted). Scores
    shadow drafts, made from a request's history while it decodes plainly, against what came."""
    depths = tree.depths
    n = len(actual)
    return len(_walk(tree, lambda j: depths[j] <= n and tree.tokens[j] == actual[depths[j] - 1], lambda node: -1).path)


def _greedy_walk(tree: DraftTree, amax: Sequence[int], offset: int) -> TreeVerifyResult:
    """Greedy walk with the target's argmax of every row (amax) and the tree's first row offset."""
    return _walk(
        tree, lambda j: tree.tokens[j] == amax[offset + 1 + tree.parents[j]], lambda node: amax[offset + 1 + node]
    )


def _walk(
    tree: DraftTree, accepted: Callable[[int], bool], final_token: Callable[[int], int]
) -> TreeVerifyResult:
    """Descend from the root: at each node take its first child (in sibling order) with
    ``accepted(child)``; stop at a node with none and emit ``final_token(node)`` (-1 = root).

    One pass in node order suffices: every child of the current node comes after it, in sibling
    order, so the first accepted node whose parent is the current one is the next step down.
    """
    path: list[int] = []
    node = -1
    for j, p in enumerate(tree.parents):
        if p == node and accepted(j):
            path.append(j)
            node = j
    return TreeVerifyResult(path=path, tokens=[tree.tokens[j] for j in path] + [int(final_token(node))])


# -- randomness ---------------------------------------------------------------------------------


def _uniform(
    shape: tuple[int, int],
    lens: Sequence[int],
    gens: Sequence[Optional[torch.Generator]],
    generator: Optional[torch.Generator],
    dev: torch.device,
) -> torch.Tensor:
    """Uniforms [B, K]; rows with their own generator draw exactly lens[b] values from it, so a
    seeded request's stream does not depend on the rest of the batch."""
    u = torch.empty(shape, device=dev)
    if u.numel():
        u.uniform_(generator=generator)
    for b, g in enumerate(gens):
        if g is not None and lens[b]:
            u[b, : lens[b]].uniform_(generator=g)
    return u


def _uniform_flat(
    counts: Sequence[int],
    gens: Sequence[Optional[torch.Generator]],
    generator: Optional[torch.Generator],
    dev: torch.device,
) -> torch.Tensor:
    u = torch.empty(sum(counts), device=dev)
    if u.numel():
        u.uniform_(generator=generator)
    o = 0
    for c, g in zip(counts, gens):
        if g is not None and c:
            u[o : o + c].uniform_(generator=g)
        o += c
    return u


def _expand_gens(gens: Sequence[Optional[torch.Generator]], counts: Sequence[int]) -> list[Optional[torch.Generator]]:
    return [g for g, c in zip(gens, counts) for _ in range(c)]


def _sample_rows(
    w: torch.Tensor, gens: Sequence[Optional[torch.Generator]], generator: Optional[torch.Generator]
) -> torch.Tensor:
    """One index per row of nonnegative weights w ([m, V]), proportional to the row: int64 [m].

    Exponential race (argmax w / E, E ~ Exp(1)) needs neither normalization nor a host sync. Row i
    uses gens[i] when set (seeded requests), else ``generator``.
    """
    e = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    if e.numel():
        e.exponential_(generator=generator)
    for i, g in enumerate(gens):
        if g is not None:
            e[i].exponential_(generator=g)
    return torch.argmax(w.float() / e, dim=-1)
