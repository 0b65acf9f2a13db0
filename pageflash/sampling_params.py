"""Per-request sampling parameters, with vLLM's names, defaults and meaning.

A :class:`SamplingParams` is validated once, in ``__post_init__``: every user mistake raises a
``ValueError`` (bad value) or ``TypeError`` (bad type) whose message names the field and the limit,
so that the server can turn it into an OpenAI-style 400 body. Normalization (``stop`` to a list,
``top_k == 0`` to ``-1``, ints to floats) also happens there and nowhere else; the engine must treat
the object as read-only afterwards.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most top logprobs one request may ask for per token by default (OpenAI's cap, vLLM's default
# max_logprobs; the engine's max_logprobs option sets it, LLMEngine.validate_request checks it).
MAX_LOGPROBS = 20
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# The sampler holds temperatures and penalties in float32: a larger value becomes inf there, and
# logits / inf (-inf / inf, 0 * inf) are NaN, which samples garbage, even tokens that
# allowed_token_ids or a grammar forbid.
_FLOAT32_MAX = 3.4028234663852886e38


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; True as a token count is almost surely a bug in the caller.
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def _truncate(ids: list[int], k: Optional[int], max_len: Optional[int]) -> list[int]:
    """The last k prompt token ids (all for None; -1: the last max_len, the model's context, as vLLM)."""
    if k == -1:
        k = max_len
    return ids[-k:] if k is not None and len(ids) > k else ids


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


class RequestOutputKind(enum.IntEnum):
    """vLLM's: CUMULATIVE outputs hold everything generated so far, DELTA only what is new since the
    last output, FINAL_ONLY one output when the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's structured outputs): exactly one of

    json: a JSON schema (dict or JSON string); the output is a JSON value that satisfies it.
    regex: a regular expression the whole output matches, in Rust ``regex`` syntax (as llguidance
        reads it): ``\\d`` and ``\\w`` are Unicode classes there; write ``[0-9]`` for ASCII digits.
    choice: a list of strings; the output is one of them.
    grammar: a context-free grammar, in Lark syntax (llguidance's dialect) or GBNF / EBNF (llama.cpp).
    json_object: True for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    disable_any_whitespace: JSON without whitespace between tokens (vLLM's option); by default any
        JSON whitespace is allowed there.
    disable_additional_properties: an object schema with "properties" but no "additionalProperties"
        takes only its properties (as vLLM's default xgrammar backend does; JSON Schema itself would
        allow any others, and small models then invent some). False keeps JSON Schema's rule.

    The engine compiles the constraint when the request is added (an invalid schema, regex or grammar
    is a ValueError naming it) and masks, at every step, the tokens that cannot continue a matching
    text; the request stops when the constraint is complete. Needs the ``llguidance`` package and a
    model with a tokenizer.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        asked = self._asked()
        if len(asked) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(asked) if asked else 'none'}")
        if self.json is not None and (isinstance(self.json, bool) or not isinstance(self.json, (str, dict))):
            raise TypeError(f"structured_outputs json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"structured_outputs {name} must be a non-empty str, got {v!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError(f"structured_outputs choice must be a non-empty list of non-empty str, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None:
            _check_bool("structured_outputs json_object", self.json_object)
        _check_bool("structured_outputs disable_any_whitespace", self.disable_any_whitespace)
        _check_bool("structured_outputs disable_additional_properties", self.disable_additional_properties)

    def _asked(self) -> list[str]:
        """The kinds set (json_object: False asks for nothing; json: False is a bad schema)."""
        return [k for k in self.KINDS if getattr(self, k) is not None and not (k == "json_object" and self.json_object is False)]

    @property
    def kind(self) -> str:
        return self._asked()[0]

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                 "disable_additional_properties"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown or unsupported key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**d)



@dataclass
class SamplingParams:
    """How to sample one request (vLLM's fields, defaults and semantics).

    n: number of completions for the prompt.
    temperature: 0 means greedy (argmax); any value below 1e-5 counts as 0.
    top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
    top_k: keep the top_k most likely tokens; 0 or -1 turns it off (normalized to -1).
    min_p: drop tokens whose probability is below min_p times the most likely token's.
    seed: per-request seed; the same seed gives the same tokens whatever else runs in the batch.
        -1 means no seed (vLLM's spelling; normalized to None).
    presence_penalty / frequency_penalty: OpenAI-style, over the generated tokens, in [-2, 2].
    repetition_penalty: HF-style (CTRL) over prompt and generated tokens; 1 = off, > 1 discourages.
    stop: strings that end the output (normalized to a list; the stop string is not returned unless
        include_stop_str_in_output).
    stop_token_ids: token ids that end the output (in addition to EOS, unless ignore_eos).
    max_tokens: most tokens to generate; None = until the model's context is full.
    min_tokens: EOS and stop_token_ids are masked until this many tokens were generated.
    ignore_eos: keep generating after EOS (benchmarks).
    logprobs: number of top logprobs per generated token; 0 = only the sampled token's; -1 = the
        whole vocabulary (as vLLM); None = no logprobs. At most the engine's max_logprobs (20 by
        default, as vLLM's; -1 there allows the whole vocabulary).
    prompt_logprobs: the same for each prompt token after the first (RequestOutput.prompt_logprobs;
        the prompt is then computed whole, without prefix-cache hits); None = none.
    truncate_prompt_tokens: keep only the prompt's last k tokens (left truncation); -1 = the last
        max_model_len (as vLLM); None = all.
    allowed_token_ids: only these tokens may be generated (the others' logits are -inf before
        anything else, so logprobs still report the model's own distribution); None = any. The
        engine refuses a set of stop / EOS tokens only together with min_tokens (nothing could
        be generated).
    logit_bias: {token id: bias} added to the logits before penalties and sampling (OpenAI's:
        each bias in [-100, 100]; -100 in effect bans a token, +100 in effect forces it; keys may be
        ints or strings of ints, as JSON sends them). Logprobs still report the model's own
        distribution. None = no bias.
    bad_words: words that must not be generated (vLLM's): each is tokenized as written and with a
        leading space; a one-token word is masked always, a longer one's last token is masked where
        the output so far ends with its other tokens. Needs the model's tokenizer.
    structured_outputs: a :class:`StructuredOutputsParams` (or a dict of its fields) that constrains
        the output to a JSON schema, regex, choice or grammar; None = free text.
    skip_special_tokens: drop special tokens from the output text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[int, float]] = None
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: detokenize=False leaves the output text empty (token ids only; no stop strings then);
    # spaces_between_special_tokens is taken for compatibility (fast tokenizers, the only ones loaded,
    # ignore it, as in vLLM); extra_args is kept for the caller; logits_processors: none (as vLLM V1,
    # which has no per-request ones)
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: Optional[dict[str, Any]] = None
    logits_processors: Optional[list[Any]] = None
    # vLLM's: what a stream of this request's outputs holds (AsyncEngine.generate); LLM.generate
    # returns each request's final output whatever it says (vLLM's LLM sets FINAL_ONLY)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's SamplingParams.clone)."""
        return copy.deepcopy(self)

    def __post_init__(self) -> None:
        # ---- ints -------------------------------------------------------------------------
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1  # one spelling of "off" so that the sampler tests only top_k > 0
        _check_int("seed", self.seed, allow_none=True)
        if self.seed == -1:
            self.seed = None  # vLLM's "no seed"
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        # vLLM's: True asks for one top logprob (a bool is refused as any other count)
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if not isinstance(self.output_kind, RequestOutputKind):
            if isinstance(self.output_kind, bool) or not isinstance(self.output_kind, int) or \
                    self.output_kind not in tuple(RequestOutputKind):
                raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got "
                                 f"{self.output_kind!r}")
            self.output_kind = RequestOutputKind(self.output_kind)
        _check_int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be at least 0, -1 (the whole vocabulary) or None, got {self.logprobs}")
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_none=True)
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1, -1 (the model's context) or None, got "
                             f"{self.truncate_prompt_tokens}")
        _check_int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs must be at least 0, -1 (the whole vocabulary) or None, got "
                             f"{self.prompt_logprobs}")

        # ---- floats -----------------------------------------------------------------------
        self.temperature = _check_float("temperature", self.temperature)
        if not 0.0 <= self.temperature <= _FLOAT32_MAX:
            raise ValueError(f"temperature must be finite and >= 0 (at most {_FLOAT32_MAX:.4g}, float32's largest), "
                             f"got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= _FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty must be finite and > 0 (at most {_FLOAT32_MAX:.4g}, float32's largest), "
                f"got {self.repetition_penalty}"
            )

        # ---- bools ------------------------------------------------------------------------
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        if self.logits_processors:
            raise ValueError("logits_processors are not supported (as in vLLM V1): use logit_bias, "
                             "allowed_token_ids, bad_words or structured_outputs")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

        # ---- stops ------------------------------------------------------------------------
        self.stop = self._normalize_stop(self.stop)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (without text there is nothing to match)")
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted(set(self._normalize_stop_token_ids(self.allowed_token_ids,
                                                                               "allowed_token_ids")))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias) or None
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise TypeError(f"bad_words must be a list of str or None, got {type(self.bad_words).__name__}")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must hold non-blank strings, got {w!r}")
            self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams, a dict or None, got "
                            f"{type(self.structured_outputs).__name__}")

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must hold only str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop must not hold an empty string (it would match everywhere)")
        return stop

    @staticmethod
    def _normalize_stop_token_ids(ids: Any, name: str = "stop_token_ids") -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise TypeError(
                f"{name} must be a list of int or None, got {type(ids).__name__}"
            )
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"{name} must hold only int, got {type(t).__name__} {t!r}")
            if t < 0:
                raise ValueError(f"{name} must be >= 0, got {t}")
        return list(ids)

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> float or None, got {type(bias).__name__}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            tok = key
            if isinstance(key, str):
                # decimal ASCII digits only: int() would also take " 5", "+5", "1_0" and other scripts'
                # digits, and two spellings of one id would silently merge
                if not (key.isascii() and key.lstrip("-").isdigit() and key.count("-") <= 1):
                    raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
                tok = int(key)
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise TypeError(f"logit_bias keys must be token ids (integers), got {type(key).__name__} {key!r}")
            if tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok}")
            if tok in out:
                raise ValueError(f"logit_bias names token id {tok} twice")
            v = _check_float(f"logit_bias[{key!r}]", value)
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {v}")
            out[tok] = v  # (zeros kept: their ids are still checked against the vocabulary)
        return out

    def truncate_prompt(self, ids: list[int], max_len: Optional[int] = None) -> list[int]:
        """The prompt token ids this request runs on (truncate_prompt_tokens keeps the last k; -1 the last
        max_len, the engine's max_model_len)."""
        return _truncate(ids, self.truncate_prompt_tokens, max_len)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def reads_outputs(self, num_output: Optional[int] = None) -> bool:
        """Whether sampling reads the outputs so far: their tokens (penalties, bad_words) or their count
        (min_tokens, while fewer than min_tokens exist; with num_output None: at any point)."""
        if self.uses_penalties or self.bad_words:  # (a bad word of several tokens follows the outputs)
            return True
        return self.min_tokens > 0 if num_output is None else num_output < self.min_tokens

    def changes_logits(self, num_output: Optional[int] = None) -> bool:
        """Whether the logits are processed before the argmax: reads_outputs (penalties, min_tokens)
        or allowed_token_ids, logit_bias or structured outputs; a greedy request then takes the
        processed argmax, not the raw one."""
        return (self.reads_outputs(num_output) or self.allowed_token_ids is not None
                or self.logit_bias is not None or self.structured_outputs is not None)

    def all_stop_token_ids(self, eos_token_id: Union[int, list[int], None]) -> set[int]:
        """Token ids that end this request: stop_token_ids, plus EOS unless ignore_eos.

        eos_token_id: the model's EOS id(s) (Llama 3 has several), or None.
        """
        ids = set(self.stop_token_ids)
        if not self.ignore_eos and eos_token_id is not None:
            ids.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        return ids


@dataclass
class PoolingParams:
    """An embedding request (vLLM's PoolingParams for ``LLM.embed`` and /v1/embeddings): the final
    hidden state (after the model's last norm) at the prompt's last token, as vLLM pools decoder
    models (and Qwen3-Embedding is trained to be read).

    normalize: scale the vector to unit L2 norm (vLLM's default for embeddings).
    dimensions: keep only the first d components (Matryoshka-style truncation), before normalizing;
        None = all of hidden_size.
    truncate_prompt_tokens: keep only the prompt's last k tokens; -1 = the last max_model_len; None = all.
    """

    normalize: bool = True
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        _check_bool("normalize", self.normalize)
        _check_int("dimensions", self.dimensions, allow_none=True)
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1 (or None), got {self.dimensions}")
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_none=True)
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1, -1 (the model's context) or None, got "
                             f"{self.truncate_prompt_tokens}")

    def truncate_prompt(self, ids: list[int], max_len: Optional[int] = None) -> list[int]:
        """The prompt token ids this request runs on (truncate_prompt_tokens keeps the last k; -1 the last
        max_len, the engine's max_model_len)."""
        return _truncate(ids, self.truncate_prompt_tokens, max_len)
