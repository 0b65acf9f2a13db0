"""Beam search over the engine (vLLM's ``LLM.beam_search``): keep the beam_width most likely
continuations of each prompt, one token at a time.

Each round hands every live beam to the engine as a prompt (its tokens so far) for one token with the
top 2 x beam_width log-probabilities; a beam's blocks are found again through the prefix cache, so a
round computes only the tail of each beam past its last full block. Every candidate ending with EOS
is set aside as finished; of the others, the beam_width with the largest cumulative log-probability
live on. At the end the
finished and the live beams are ranked by ``cum_logprob / len(tokens) ** length_penalty`` (the prompt
counted, a final EOS not, as vLLM; compared in log space, so no length_penalty overflows) and the best
beam_width returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pageflash.outputs import Logprob
from pageflash.sampling_params import MAX_LOGPROBS, SamplingParams, _check_bool, _check_float, _check_int

if TYPE_CHECKING:  # pragma: no cover
    from pageflash.llm import LLM

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_search"]

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each round reads the top 2 x beam_width logprobs


@dataclass
class BeamSearchParams:
    """beam_width: beams kept per prompt (1..10; each round reads the top 2 x beam_width tokens).
    max_tokens: most tokens generated per beam (also capped by the context).
    ignore_eos: keep extending beams past EOS instead of finishing them.
    temperature: must be 0: beams are ranked by the model's own log-probabilities (vLLM accepts other
        values and ignores them).
    length_penalty: the exponent of the length the final scores are divided by (1.0: per-token mean;
        0.0: the plain sum, which favours short beams).
    include_stop_str_in_output: accepted for vLLM's signature; an EOS ends a beam and, like every
        special token, is left out of the text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if _check_float("temperature", self.temperature) != 0.0:
            raise ValueError("beam search ranks beams by the model's log-probabilities: temperature must be 0 "
                             f"(got {self.temperature}); use SamplingParams(n=...) to sample")
        self.length_penalty = _check_float("length_penalty", self.length_penalty)


@dataclass
class BeamSearchSequence:
    """One beam: tokens (the prompt's, then the generated ones, as vLLM), cum_logprob (the sum of the
    generated tokens' log-probabilities), logprobs (per generated token: {token id: Logprob} of the
    candidates that round read, as vLLM's: ``.logprob``, ``.rank``, ``.decoded_token``), text (the whole sequence decoded, special tokens skipped, as
    vLLM's; ``output_text`` is the generated part alone), finish_reason ("stop": EOS; "length")."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    text: Optional[str] = None
    output_text: Optional[str] = None
    finish_reason: Optional[str] = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def rank_key(seq: BeamSearchSequence, eos: frozenset, length_penalty: float) -> float:
    """Ascending order of vLLM's length-normalized score cum_logprob / len ** length_penalty (a final
    EOS not counted), best first, computed in log space: cum_logprob <= 0, so the score's order is
    that of -(log(-cum_logprob) - length_penalty * log(len)), and no power can overflow."""
    n = max(len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos else 0), 1)
    if seq.cum_logprob >= 0.0:
        return -math.inf  # a sure sequence: the best score there is (0)
    return math.log(-seq.cum_logprob) - length_penalty * math.log(n)


class BeamSearch:
    """The search's state over rounds, whatever runs the engine (LLM.beam_search here, the server's
    async engine there): ``pending()`` lists the token sequences to run for one token each (with
    ``step_params``), ``advance()`` takes each one's top logprobs, ``results()`` ranks the beams."""

    def __init__(self, engine: Any, prompt_ids: Sequence[list[int]], params: BeamSearchParams) -> None:
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        self.params = params
        self.eos = frozenset() if params.ignore_eos else engine.eos_token_ids
        self.max_model_len = engine.max_model_len
        self.width = w = params.beam_width
        if 2 * w > engine.vocab_size:
            raise ValueError(f"beam_width={w} needs 2 x {w} candidates per round, more than the vocabulary "
                             f"of {engine.vocab_size}")
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * w,
                                          skip_special_tokens=True)  # fmt: skip
        self.live = [[BeamSearchSequence(tokens=list(ids), num_prompt_tokens=len(ids))] for ids in prompt_ids]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        self.rounds = 0
        self._flat: list[tuple[int, BeamSearchSequence]] = []

    def pending(self) -> list[list[int]]:
        """The live beams' tokens, one engine request each (none left: the search is over)."""
        if self.rounds >= self.params.max_tokens:
            return []
        self._flat = [(i, b) for i, beams in enumerate(self.live) for b in beams]
        return [b.tokens for _, b in self._flat]

    def prompt_of_pending(self) -> list[int]:
        """The prompt index of each of pending()'s sequences."""
        return [i for i, _ in self._flat]

    def advance(self, tops: Sequence[dict[int, Any]]) -> None:
        """tops[j]: the {token id: Logprob} of pending()[j]'s next token (top 2 x width)."""
        self.rounds += 1
        width = self.width
        cands: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (i, beam), top in zip(self._flat, tops):
            for tok, lp in sorted(top.items(), key=lambda kv: -kv[1].logprob)[: 2 * width]:
                cands[i].append(BeamSearchSequence(
                    tokens=beam.tokens + [tok], cum_logprob=beam.cum_logprob + lp.logprob,
                    logprobs=beam.logprobs + [dict(top)],
                    num_prompt_tokens=beam.num_prompt_tokens))  # fmt: skip
        for i, cs in enumerate(cands):
            for c in cs:
                if c.tokens[-1] in self.eos:  # every candidate ending with EOS is a finished beam (as vLLM)
                    c.finish_reason = "stop"
                    self.done[i].append(c)
            rest = sorted((c for c in cs if c.finish_reason is None), key=lambda c: -c.cum_logprob)[:width]
            self.live[i] = []
            for c in rest:  # (sorted is stable: ties keep the engine's order)
                if len(c.tokens) >= self.max_model_len:  # no room for another token
                    c.finish_reason = "length"
                    self.done[i].append(c)
                else:
                    self.live[i].append(c)

    def results(self, tokenizer: Any = None) -> list[BeamSearchOutput]:
        """Per prompt, the best beam_width of the finished and live beams, with their texts."""
        out = []
        for i, beams in enumerate(self.live):
            for b in beams:
                b.finish_reason = b.finish_reason or "length"
            ranked = sorted(self.done[i] + beams, key=lambda s: rank_key(s, self.eos, self.params.length_penalty))
            ranked = ranked[: self.width]
            for s in ranked:
                if tokenizer is not None:
                    s.text = tokenizer.decode(s.tokens, skip_special_tokens=True)
                    s.output_text = tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
            out.append(BeamSearchOutput(sequences=ranked))
        return out


def beam_search(llm: "LLM", prompts: Sequence[Any], params: BeamSearchParams,
                use_tqdm: bool = False, lora_request: Any = None) -> list[BeamSearchOutput]:  # fmt: skip
    """Beam search for each prompt (as LLM.generate takes them); one BeamSearchOutput per prompt.
    lora_request: the LoRA adapter of every prompt's beams, or a list of one per prompt (None: the
    base model)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if isinstance(lora_request, (list, tuple)):
        loras = list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; they must match")
    else:
        loras = [lora_request] * len(prompts)
    eng = llm.llm_engine
    step = SamplingParams(temperature=0.0, max_tokens=1)
    ids_list = []
    for i, p in enumerate(prompts):
        try:
            if loras[i] is not None:
                eng.get_lora(loras[i])  # the adapter read and checked before the first round
            _, ids = eng.tokenize_prompt(p)
            eng.validate_request(ids, step)
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompt {i}: {e}") from e
        ids_list.append(ids)
    search = BeamSearch(eng, ids_list, params)
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True)
    try:
        while True:
            todo = search.pending()
            if not todo:
                break
            outs = llm.generate([{"prompt_token_ids": t} for t in todo], search.step_params, use_tqdm=False,
                                lora_request=[loras[i] for i in search.prompt_of_pending()])
            search.advance([o.outputs[0].logprobs[0] for o in outs])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return search.results(eng.tokenizer)
