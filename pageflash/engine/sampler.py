"""Batched sampling: logits of one step -> next token ids (and logprobs), on any device.

The engine describes each row of the logits with a :class:`SamplingRow`, turns the step's rows into
a :class:`SamplingBatch` (per-row parameters as tensors on the device, built once per step on the
host, so that sampling itself needs no host sync), and calls :class:`Sampler`::

    batch = SamplingBatch.build(rows, vocab_size, device, eos_token_ids=eos_ids)
    out = sampler(logits, batch, generator)   # out.token_ids: int64 [B]

Processing order (as vLLM): penalties (repetition HF-style over prompt + output tokens; presence and
frequency OpenAI-style over output tokens), min_tokens (EOS and stop_token_ids masked while the row
has fewer than min_tokens outputs), then -- for random rows only -- temperature, top-k, top-p
(over the top-k renormalized distribution), min-p, and a draw. top-k and top-p become a threshold
on the logit values, so tokens tied with the last kept one are kept too and the kept set does not
depend on a device's tie order. Greedy rows take the argmax of the
penalized logits. The draw is ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per token (the
exponential-race form of categorical sampling, as in gpt-fast): no ``multinomial``, no host sync.
A row with its own ``torch.Generator`` draws its noise from it, so a seeded request gets the same
tokens alone or anywhere in any batch; the other rows share one draw (from the generator passed
to the call, or torch's default RNG). A seeded request's generator is keyed by the output position
it samples (:class:`SeedStream`), not drawn in sequence, so its tokens do not depend on how many
draws earlier steps took either: speculative steps sample several positions at once, and a seeded
request's token at each position is the one plain decoding samples there (spec/decoding.py).

Logprobs are ``log_softmax`` of the raw logits, before penalties and temperature (vLLM's default
"raw_logprobs" mode).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from pageflash.transfer import to_device
from pageflash.sampling_params import SamplingParams

# Packed per-row float parameters: one host->device copy per step instead of one per parameter.
_TEMP, _TOP_K, _TOP_P, _MIN_P, _PRES, _FREQ, _REP = range(7)
_NUM_PARAMS = 7
# Largest top_k for which top-p works on torch.topk's candidates rather than a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """One row of the logits, as the engine sees it.

    params: the request's sampling parameters.
    prompt_token_ids: the prompt (only read when repetition_penalty != 1).
    output_token_ids: tokens generated so far (penalties, min_tokens).
    generator: the request's own RNG when it has a seed, else None. The engine creates it once per
        request, on the logits' device: ``torch.Generator(device).manual_seed(params.seed)``, and
        keeps it for the request's life. Each non-greedy row draws V exponentials from it per call;
        greedy rows leave it untouched.
    grammar_bitmask: int32 [W] (numpy) or None: the tokens a structured-outputs matcher allows next,
        bit t % 32 of word t // 32 (``engine.structured``); the others' logits become -inf.
    bad_words: token sequences (a request's tokenized bad_words); a sequence's last token is masked
        where output_token_ids end with its other tokens (always, for a one-token word).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator] = None
    grammar_bitmask: Optional[np.ndarray] = None
    bad_words: Sequence[Sequence[int]] = ()


@dataclass
class SamplerOutput:
    """What one step's sampling returns (all on the logits' device).

    token_ids: int64 [B], the sampled (or argmax) token of every row.
    logprobs: float32 [B, K+1] or None (None when no row asked for logprobs). Column 0 is the
        sampled token's logprob, columns 1..K the top-K logprobs in decreasing order, K the largest
        ``params.logprobs`` in the batch; a row that asked for k < K reads columns 0..k.
    logprob_token_ids: int64 [B, K+1] or None, the token ids of the ``logprobs`` columns.
    sampled_ranks: int64 [B] or None, 1-based rank of the sampled token under the raw logits
        (1 = most likely): the number of tokens at least as likely, as vLLM counts it (so tied
        tokens share the worst rank of their tie).
    """

    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    logprob_token_ids: Optional[torch.Tensor] = None
    sampled_ranks: Optional[torch.Tensor] = None


def _flat_token_index(rows: Sequence[Sequence[Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """int64 [N] on the host: ``row * vocab_size + token`` for every token of every row, i.e.
    indices into a flattened [B, V] tensor. Row i's tokens are those of the sequences rows[i]
    (e.g. prompt and outputs, without concatenating them). One numpy pass, no padding."""
    lengths = [sum(len(part) for part in parts) for parts in rows]
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(rows))
    tokens = np.fromiter(flat, dtype=np.int64, count=sum(lengths))
    row_ids = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    return torch.from_numpy(row_ids * vocab_size + tokens)


def _token_mask(rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [len(rows), vocab_size], True at every token of row i's sequences (as _flat_token_index);
    built on the device, so that only the token ids travel."""
    index = to_device(_flat_token_index(rows, vocab_size), device)
    mask = torch.zeros(len(rows) * vocab_size, dtype=torch.bool, device=device)
    mask.index_fill_(0, index, True)
    return mask.view(len(rows), vocab_size)


@dataclass
class SamplingBatch:
    """One step's sampling parameters as device tensors (B = number of logits rows).

    Optional tensors are None when no row of the batch uses the feature, so that a plain batch
    pays only for what it asks.

    all_greedy / all_random / num_greedy: host-side counts, for fast paths without a sync.
    temperature: float32 [B] (1.0 on greedy rows, so dividing by it is harmless).
    greedy_mask: bool [B], rows that take the argmax.
    top_k: int64 [B] or None; rows without top-k hold vocab_size. max_top_k: the largest active k.
    top_p: float32 [B] or None; rows without top-p hold 2.0 (never reached by a cumulative sum).
    top_p_candidates: when every top-p row also has top_k <= 1024, max_top_k: top-p then needs
        only the max_top_k largest logits (topk) instead of a sort of the whole vocabulary.
    min_p: float32 [B] or None (0.0 = off).
    presence_penalty / frequency_penalty / repetition_penalty: float32 [B] or None.
    output_counts: float32 [B, V] or None, occurrences of each token among the row's outputs
        (built when presence or frequency penalties are used; rows without them hold zeros).
    repetition_mask: bool [B, V] or None, tokens seen in the row's prompt or outputs (built when
        a repetition penalty is used).
    min_tokens_index: int64 [M] or None, flat indices ``row * V + token`` into the logits of the
        tokens to mask with -inf because their row has not reached min_tokens yet (flat, so that
        masking is one index_fill_, which unlike advanced-index assignment does not sync).
    generators: (row, generator) of every random row with its own generator.
    max_num_logprobs: K, the largest logprobs request in the batch, or None.
    """

    rows: list[SamplingRow] = field(repr=False)
    vocab_size: int
    device: torch.device
    eos_token_ids: tuple[int, ...]
    all_greedy: bool
    all_random: bool
    num_greedy: int
    temperature: torch.Tensor
    greedy_mask: torch.Tensor
    top_k: Optional[torch.Tensor] = None
    max_top_k: int = 0
    top_p: Optional[torch.Tensor] = None
    top_p_candidates: Optional[int] = None
    min_p: Optional[torch.Tensor] = None
    presence_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    repetition_penalty: Optional[torch.Tensor] = None
    output_counts: Optional[torch.Tensor] = None
    repetition_mask: Optional[torch.Tensor] = None
    min_tokens_index: Optional[torch.Tensor] = None
    # bool [B, V], True where a row's bad_words, allowed_token_ids or structured-outputs mask leave
    # a token out; None when no row has any
    banned_mask: Optional[torch.Tensor] = None
    # float32 [B, V], the rows' logit_bias (zeros elsewhere); None when no row has one
    logit_bias: Optional[torch.Tensor] = None
    generators: list[tuple[int, torch.Generator]] = field(default_factory=list)
    max_num_logprobs: Optional[int] = None

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def needs_logits_processing(self) -> bool:
        """True when penalties or min_tokens change the logits before argmax/sampling."""
        return (
            self.output_counts is not None
            or self.repetition_mask is not None
            or self.min_tokens_index is not None
            or self.banned_mask is not None
            or self.logit_bias is not None
        )

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: Union[torch.device, str],
        eos_token_ids: Union[int, Iterable[int], None] = None,
    ) -> "SamplingBatch":
        """Gather the rows' parameters into device tensors (host work, one copy per tensor kind).

        rows: one per logits row, in the logits' order.
        vocab_size: V, the logits' last dimension.
        device: the logits' device.
        eos_token_ids: the model's EOS id(s); used only by min_tokens, which masks them (unless
            ignore_eos) together with stop_token_ids while a row has fewer than min_tokens outputs.
        """
        device = torch.device(device)
        rows = list(rows)
        if eos_token_ids is None:
            eos: tuple[int, ...] = ()
        elif isinstance(eos_token_ids, int):
            eos = (eos_token_ids,)
        else:
            eos = tuple(int(t) for t in eos_token_ids)
        n = len(rows)
        ps = [r.params for r in rows]
        greedy = [p.greedy for p in ps]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        use_top_k = any(0 < p.top_k < vocab_size and not g for p, g in zip(ps, greedy))
        use_top_p = any(p.top_p < 1.0 and not g for p, g in zip(ps, greedy))
        # top-p rows that all have a small top-k need no full sort (a common generation config).
        top_p_within_top_k = all(
            0 < p.top_k <= min(_TOP_P_CANDIDATES, vocab_size - 1)
            for p, g in zip(ps, greedy)
            if p.top_p < 1.0 and not g
        )
        use_min_p = any(p.min_p > 0.0 and not g for p, g in zip(ps, greedy))
        use_pres_freq = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in ps)
        use_rep = any(p.repetition_penalty != 1.0 for p in ps)

        packed = torch.tensor(
            [
                [
                    1.0 if g else p.temperature,
                    p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size,
                    p.top_p if p.top_p < 1.0 and not g else 2.0,
                    0.0 if g else p.min_p,
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                ]
                for p, g in zip(ps, greedy)
            ],
            dtype=torch.float32,
        ).reshape(n, _NUM_PARAMS)
        packed = to_device(packed, device)
        greedy_mask = to_device(torch.tensor(greedy, dtype=torch.bool), device)

        max_top_k = max(
            (p.top_k for p, g in zip(ps, greedy) if 0 < p.top_k < vocab_size and not g), default=0
        )

        output_counts = None
        if use_pres_freq:
            # Only rows that use the penalties pay for their outputs' transfer.
            outs = [
                (r.output_token_ids,)
                if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
                else ()
                for r in rows
            ]
            index = to_device(_flat_token_index(outs, vocab_size), device)
            output_counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
            # Sums of ones are exact in float32 whatever the order of the atomic adds.
            output_counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
            output_counts = output_counts.view(n, vocab_size)

        repetition_mask = None
        if use_rep:
            seen = [
                (r.prompt_token_ids, r.output_token_ids)
                if r.params.repetition_penalty != 1.0
                else ()
                for r in rows
            ]
            repetition_mask = _token_mask(seen, vocab_size, device)

        masked = [
            i * vocab_size + t
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens and not _grammar_only_stops(r, eos, vocab_size)
            for t in sorted(r.params.all_stop_token_ids(eos))
            if t < vocab_size
        ]
        min_tokens_index = None
        if masked:
            min_tokens_index = to_device(torch.tensor(masked, dtype=torch.int64), device)

        banned_mask = None
        if any(r.bad_words for r in rows):  # (checked first: a plain decode step pays one any())
            bad = [(_bad_word_tokens(r, vocab_size),) for r in rows]
            if any(b for (b,) in bad):
                banned_mask = _token_mask(bad, vocab_size, device)
        limited = [p.allowed_token_ids is not None for p in ps]
        if any(limited):  # built on the device, as the repetition mask: only the allowed ids travel
            allowed = _token_mask([(p.allowed_token_ids,) if p.allowed_token_ids else () for p in ps], vocab_size, device)
            outside = to_device(torch.tensor(limited), device)[:, None] & ~allowed
            banned_mask = outside if banned_mask is None else banned_mask | outside
        if any(r.grammar_bitmask is not None for r in rows):
            words = next(r.grammar_bitmask for r in rows if r.grammar_bitmask is not None).shape[0]
            if words * 32 < vocab_size:
                raise ValueError(f"grammar_bitmask has {words} words, fewer than a vocabulary of {vocab_size} needs")
            packed_bits = np.full((n, words), -1, dtype=np.int32)  # rows without a grammar allow all
            for i, r in enumerate(rows):
                if r.grammar_bitmask is not None:
                    packed_bits[i] = r.grammar_bitmask
            grammar_banned = ~unpack_bitmask(to_device(torch.from_numpy(packed_bits), device), vocab_size)
            banned_mask = grammar_banned if banned_mask is None else banned_mask | grammar_banned

        logit_bias = None
        if any(p.logit_bias for p in ps):  # only the biased entries travel
            index = [i * vocab_size + t for i, p in enumerate(ps) for t in (p.logit_bias or ()) if t < vocab_size]
            values = [b for p in ps for t, b in (p.logit_bias or {}).items() if t < vocab_size]
            logit_bias = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
            logit_bias.index_copy_(0, to_device(torch.tensor(index, dtype=torch.int64), device),
                                   to_device(torch.tensor(values, dtype=torch.float32), device))
            logit_bias = logit_bias.view(n, vocab_size)

        asked = [p.logprobs for p in ps if p.logprobs is not None]
        return cls(
            rows=rows,
            vocab_size=vocab_size,
            device=device,
            eos_token_ids=eos,
            all_greedy=all_greedy,
            all_random=all_random,
            num_greedy=sum(greedy),
            temperature=packed[:, _TEMP],
            greedy_mask=greedy_mask,
            top_k=packed[:, _TOP_K].long() if use_top_k else None,
            max_top_k=max_top_k,
            top_p=packed[:, _TOP_P] if use_top_p else None,
            top_p_candidates=max_top_k if use_top_p and top_p_within_top_k else None,
            min_p=packed[:, _MIN_P] if use_min_p else None,
            presence_penalty=packed[:, _PRES] if use_pres_freq else None,
            frequency_penalty=packed[:, _FREQ] if use_pres_freq else None,
            repetition_penalty=packed[:, _REP] if use_rep else None,
            output_counts=output_counts,
            repetition_mask=repetition_mask,
            min_tokens_index=min_tokens_index,
            banned_mask=banned_mask,
            logit_bias=logit_bias,
            generators=[
                (i, r.generator)
                for i, (r, g) in enumerate(zip(rows, greedy))
                if r.generator is not None and not g
            ],
            max_num_logprobs=max(asked) if asked else None,
        )

    def expand(
        self,
        counts: Sequence[int],
        draft_token_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> "SamplingBatch":
        """A batch with row i repeated counts[i] times (repeat_interleave), for logits with several
        rows per request (speculative verification: k draft positions + 1 bonus row).

        draft_token_ids: when given, the j-th copy of row i sees ``draft_token_ids[i][:j]`` appended
            to its outputs, so that penalties and min_tokens at every draft position are exactly
            those of sequential decoding. Without it every copy uses the row's current outputs.
        Copies of a seeded row share its generator and draw their noise from it in row order.
        """
        if len(counts) != self.num_rows:
            raise ValueError(f"counts must have {self.num_rows} entries, got {len(counts)}")
        if draft_token_ids is not None and len(draft_token_ids) != self.num_rows:
            raise ValueError(
                f"draft_token_ids must have {self.num_rows} entries, got {len(draft_token_ids)}"
            )
        rows: list[SamplingRow] = []
        for i, (row, c) in enumerate(zip(self.rows, counts)):
            for j in range(c):
                if draft_token_ids is None or j == 0:
                    rows.append(row)
                else:
                    drafts = list(draft_token_ids[i][:j])
                    if len(drafts) < j:
                        raise ValueError(
                            f"draft_token_ids[{i}] has {len(drafts)} tokens, needs {c - 1}"
                        )
                    rows.append(
                        SamplingRow(
                            row.params,
                            row.prompt_token_ids,
                            list(row.output_token_ids) + drafts,
                            row.generator,
                            row.grammar_bitmask,
                            row.bad_words,
                        )
                    )
        return SamplingBatch.build(rows, self.vocab_size, self.device, self.eos_token_ids)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] bitmasks (token t is bit t % 32 of word t // 32) -> bool [B, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _bad_word_tokens(row: SamplingRow, vocab_size: int) -> list[int]:
    """The tokens row's bad words forbid next: each word's last token where the outputs end with the
    rest of it (vLLM's NoBadWordsLogitsProcessor)."""
    out: list[int] = []
    outs = row.output_token_ids
    for seq in row.bad_words:
        k = len(seq) - 1
        if seq[-1] < vocab_size and (k == 0 or (len(outs) >= k and list(outs[len(outs) - k:]) == list(seq[:-1]))):
            out.append(seq[-1])
    return out


def _grammar_only_stops(row: SamplingRow, eos: Sequence[int], vocab_size: int) -> bool:
    """Whether a row's grammar allows only stop tokens next (its text is complete): min_tokens then
    yields, since masking them too would leave no token at all."""
    if row.grammar_bitmask is None:
        return False
    bits = np.unpackbits(row.grammar_bitmask.view(np.uint8), bitorder="little")[:vocab_size].copy()
    stops = [t for t in row.params.all_stop_token_ids(eos) if t < vocab_size]
    bits[stops] = 0
    return not bits.any()


def argmax_rows(x: torch.Tensor, two_pass: Optional[bool] = None) -> torch.Tensor:
    """x.argmax(-1) for x [B, V]: the first index of the largest value.

    A few long rows (a large vocabulary at small batch) are reduced in two passes: a single row of
    128k logits is one reduction that runs at a small fraction of the bandwidth (27.7 us on an H100 in
    a llama-3-8b batch-1 decode step); split into C chunks, the chunk maxima spread over C programs.
    Chunks keep the order, so the first chunk holding the maximum holds its first occurrence.
    """
    b, v = x.shape
    if two_pass is None:
        two_pass = x.is_cuda and v >= 32768 and b <= 64
    if two_pass:
        c = next((c for c in (64, 32, 16) if v % c == 0), 0)
        if c:
            vals, idx = x.reshape(b, c, v // c).max(-1)
            best = vals.argmax(-1, keepdim=True)
            return (best * (v // c) + idx.gather(-1, best)).squeeze(-1)
    return x.argmax(dim=-1)


class Sampler:
    """Turns logits into token ids following each row's SamplingParams (stateless)."""

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        generator: Optional[torch.Generator] = None,
        greedy_ids: Optional[torch.Tensor] = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V], any float dtype, on batch.device; not modified.
        generator: RNG of the rows without their own generator (e.g. the engine's, seeded from its
            config, so that a whole run is reproducible); None = torch's default RNG.
        greedy_ids: int64 [B], logits.argmax(-1) where the caller already has it (the decode graphs
            compute it); used when every row is greedy and no logits processing applies.
        Returns a SamplerOutput (token_ids int64 [B]; logprobs when any row asked).
        """
        _check_shapes(logits, batch)
        if greedy_ids is not None and (greedy_ids.shape != (logits.shape[0],) or greedy_ids.dtype != torch.int64):
            raise ValueError(f"greedy_ids must be int64 [{logits.shape[0]}], got {greedy_ids.dtype} "
                             f"{tuple(greedy_ids.shape)}")
        if batch.all_greedy and not batch.needs_logits_processing:
            # fast path: no copy, no float32 cast
            token_ids = greedy_ids if greedy_ids is not None else argmax_rows(logits)
        else:
            processed = apply_penalties_and_min_tokens(logits, batch)
            if greedy_ids is None or batch.needs_logits_processing:
                greedy_ids = processed.argmax(dim=-1)
            if batch.all_greedy:
                token_ids = greedy_ids
            else:
                probs = _probs_from_processed(processed, batch)
                random_ids = _exponential_race(probs, batch, generator)
                token_ids = (
                    random_ids if batch.all_random
                    else torch.where(batch.greedy_mask, greedy_ids, random_ids)
                )
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_num_logprobs is not None:
            _add_logprobs(out, logits, batch.max_num_logprobs)
        return out


def compute_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The final distribution each row samples from, after all processing.

    logits: [B, V], any float dtype (not modified). For several rows per request, pass
        ``batch.expand(counts, ...)``.
    Returns float32 [B, V], rows summing to 1. Random rows: softmax of the penalized,
    temperature-scaled logits restricted to the top-k / top-p / min-p set and renormalized.
    Greedy rows: one-hot at the argmax of the penalized logits (the point mass the sampler takes),
    which makes speculative rejection sampling reduce to exact-match acceptance for them.
    """
    _check_shapes(logits, batch)
    processed = apply_penalties_and_min_tokens(logits, batch)
    if batch.all_greedy:
        probs = torch.zeros_like(processed)
    else:
        probs = _probs_from_processed(processed, batch)
    if not batch.all_random:
        one_hot = torch.zeros_like(processed)
        one_hot.scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(batch.greedy_mask[:, None], one_hot, probs)
    return probs


def _check_shapes(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
        raise ValueError(
            f"logits must be [{batch.num_rows}, {batch.vocab_size}], got {list(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")


_PENALIZED_MAX = 1e30  # / a temperature >= SAMPLING_EPS stays below float32's 3.4e38


def apply_penalties_and_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks (bad_words, allowed_token_ids, structured outputs), logit_bias, penalties, then the
    min_tokens mask. logits [B, V] any float -> new float32 [B, V]."""
    # float32 copy: processing happens in place on it, never on the model's buffer.
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if batch.banned_mask is not None:
        x.masked_fill_(batch.banned_mask, float("-inf"))
    if batch.logit_bias is not None:
        x += batch.logit_bias
    if batch.repetition_mask is not None:
        pen = batch.repetition_penalty[:, None]
        # HF/CTRL: divide positive logits, multiply negative ones, so > 1 always discourages.
        scaled = torch.where(x > 0, x / pen, x * pen)
        # A penalty near 0 overflows positive logits to +inf, and softmax over several +inf is NaN
        # (every sample would then be token 0): cap them where the smallest temperature keeps them finite.
        scaled.clamp_(max=_PENALIZED_MAX)
        x = torch.where(batch.repetition_mask, scaled, x)
    if batch.output_counts is not None:
        counts = batch.output_counts
        x -= batch.frequency_penalty[:, None] * counts
        x -= batch.presence_penalty[:, None] * (counts > 0).to(torch.float32)
    if batch.min_tokens_index is not None:
        x.view(-1).index_fill_(0, batch.min_tokens_index, float("-inf"))
    return x


def _probs_from_processed(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p (vLLM's order: min-p filters before top-k / top-p, so top-p's
    mass is measured on what min-p kept). x: float32 [B, V] (modified) -> probs float32 [B, V].

    Greedy rows come out as softmax(x) (temperature 1, no filtering); callers overwrite them.
    """
    x.div_(batch.temperature[:, None])
    if batch.min_p is not None:
        # p / p_max < min_p  <=>  x - x_max < log(min_p); min_p 0 (off) keeps every token
        floor = x.amax(dim=-1, keepdim=True) + torch.log(batch.min_p[:, None])
        x = x.masked_fill(x < floor, float("-inf"))
    if batch.top_p is not None:
        x = _top_k_top_p(x, batch.top_k, batch.top_p, batch.top_p_candidates)
    elif batch.top_k is not None:
        x = _top_k_only(x, batch.top_k, batch.max_top_k)
    return torch.softmax(x, dim=-1)


def _top_k_only(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (a topk of width max_top_k, no full sort).

    x: float32 [B, V]; top_k: int64 [B] (V = off). Tokens tied with the k-th value are all kept,
    so the kept set depends on values only, not on a device's tie order.
    """
    values = torch.topk(x, max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth = kth.masked_fill(top_k[:, None] >= x.shape[-1], float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _top_k_top_p(
    x: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: torch.Tensor,
    candidates: Optional[int],
) -> torch.Tensor:
    """top-k, then top-p over the top-k renormalized distribution, as one value threshold per row.

    x: float32 [B, V] (temperature applied); top_k: int64 [B] or None (V = off);
    top_p: float32 [B] (2.0 = off).
    candidates: when every top-p row also has a top-k of at most this many tokens, only the
        ``candidates`` largest logits are sorted (torch.topk) instead of the whole vocabulary.
    Sorted position i is kept iff the mass of positions before it is < top_p: the smallest prefix
    of most likely tokens reaching top_p (never empty). The result is turned into a threshold on
    the values (the logit of the last kept position), so tokens tied with it are kept too.
    """
    vocab = x.shape[-1]
    if candidates is not None:
        sorted_x = torch.topk(x, candidates, dim=-1).values
    else:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
    width = sorted_x.shape[-1]
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k.clamp(max=width) - 1)[:, None])
        kth = kth.masked_fill(top_k[:, None] >= vocab, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_x.gather(1, num_kept - 1)
    threshold = threshold.masked_fill(top_p[:, None] > 1.0, float("-inf"))
    if top_k is not None:
        threshold = torch.maximum(threshold, kth)
    return x.masked_fill(x < threshold, float("-inf"))


_MASK64 = (1 << 64) - 1


def _mix64(*words: int) -> int:
    """A 63-bit seed from integers (splitmix64's finalizer over their golden-ratio-weighted sum)."""
    x = 0
    for i, w in enumerate(words):
        x = (x + (w & _MASK64) * (0x9E3779B97F4A7C15 + 2 * i)) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x >> 1


class SeedStream:
    """A seeded request's randomness, keyed by use rather than drawn in sequence: ``at(pos, salt)`` is
    a new generator seeded from (seed, pos, salt), where pos is the output position a draw is for.

    salt: SAMPLE (0) for the token at pos -- plain sampling, and the speculative verification that
    samples each drafted position and keeps the drafts that match (spec/decoding.py); DRAFT (1) for a
    draft model's draws from pos on; VERIFY (2) for the uniforms and residual draws of rejection
    sampling from pos on. So the token at a position does not depend on how many draws earlier steps
    took (a verify step draws for several positions, a plain step for one)."""

    SAMPLE, DRAFT, VERIFY = 0, 1, 2

    def __init__(self, seed: int, device: Union[str, torch.device]) -> None:
        self.seed = int(seed)
        self.device = torch.device(device)

    def at(self, pos: int, salt: int = SAMPLE) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(_mix64(self.seed, pos, salt))


def sample_rows_keyed(probs: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """Row i of probs [m, V] (float32) drawn with noise from gens[i], exactly as the sampler draws a
    seeded row (_exponential_race): the same token as plain sampling for the same generator and
    distribution. int64 [m]."""
    noise = torch.empty_like(probs)
    for i, gen in enumerate(gens):
        noise[i].exponential_(generator=gen)
    return _race(probs, noise)


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row, noise Exp(1) draws (floored in place: Exp(1) can round to 0 on
    some backends; a tiny floor keeps p/E finite and 0/E = 0)."""
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def _exponential_race(
    probs: torch.Tensor, batch: SamplingBatch, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) i.i.d.: a categorical draw per row. probs [B, V] -> int64 [B].

    P(argmax = j) = p_j / sum(p): the race of exponential clocks with rates p_j.
    """
    if batch.generators and len(batch.generators) == batch.num_rows - batch.num_greedy:
        noise = torch.empty_like(probs)  # every random row has its own generator
    else:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, gen in batch.generators:
        noise[i].exponential_(generator=gen)
    return _race(probs, noise)


def _add_logprobs(out: SamplerOutput, logits: torch.Tensor, k: int) -> None:
    """Fill out.logprobs / logprob_token_ids / sampled_ranks from the raw logits [B, V]."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    sampled = out.token_ids[:, None]
    sampled_lp = logprobs.gather(1, sampled)
    if k > 0:
        top = torch.topk(logprobs, k, dim=-1)
        out.logprobs = torch.cat([sampled_lp, top.values], dim=1)
        out.logprob_token_ids = torch.cat([sampled, top.indices], dim=1)
    else:
        out.logprobs = sampled_lp
        out.logprob_token_ids = sampled.clone()
    out.sampled_ranks = (logprobs >= sampled_lp).sum(dim=-1)  # (vLLM's count: ties rank below)
