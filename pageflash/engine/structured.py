"""Structured outputs: constrained decoding through llguidance (one grammar matcher per sequence).

A request's :class:`~pageflash.sampling_params.StructuredOutputsParams` (JSON schema, regex, choice,
Lark / GBNF grammar, any JSON object) is compiled when the request is added into an
``llguidance.LLMatcher`` over the model's tokenizer. Before each sampling of the request the engine
asks the matcher for the tokens that can continue a matching text (a bitmask, one bit per token,
computed on the host, for every constrained row of the step at once by llguidance's thread pool);
the sampler sets every other logit to -inf before penalties and sampling (``SamplingRow.
grammar_bitmask``), and the engine feeds the sampled token back into the matcher. The matcher
accepts EOS only where the text is complete; the engine also ends the request as soon as the
matcher cannot continue (``is_stopped``).

What this costs the engine loop: a constrained request's next mask depends on its newest token. With
async scheduling the next step's forward is still launched before that token reaches the host (its
input is copied on the device); the engine then reads the token, feeds the matchers and computes the
masks while that forward runs, and launches the sampling after (``LLMEngine.step``). Constrained
requests are not drafted by speculative decoding.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from pageflash.envs import int_env
from pageflash.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def grammar_threads() -> int:
    """Threads of llguidance's mask pool: PAGEFLASH_GRAMMAR_THREADS, else half the cores up to 4.
    llguidance's own default (80% of the cores) was the slowest on a 16-core H100 host: 3.2 ms for 64
    masks over a 128k vocabulary, against 1.1 ms with 4 threads and 1.4 ms with 2
    (scripts/structured_phases.py, docs/BENCHMARKS.md run 26)."""
    return int_env("PAGEFLASH_GRAMMAR_THREADS", min(4, max(1, (os.cpu_count() or 2) // 2)), minimum=1)


class StructuredOutputs:
    """Grammar compiler and mask filler of one engine (its tokenizer and vocabulary).

    tokenizer: the engine's HF tokenizer (a fast one: llguidance reads its tokenizer.json).
    vocab_size: the logits' width (may exceed the tokenizer's vocabulary: those ids are never allowed).
    eos_token_ids: the ids the matcher allows where the text is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ValueError("structured_outputs need the llguidance package: pip install llguidance") from None
        if tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none (dummy weights)")
        self._llg = llguidance
        # ids the tokenizer does not know (a config's EOS past a smaller tokenizer) cannot be matched
        eos = sorted(t for t in eos_token_ids if t < len(tokenizer)) or None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # a slow (Python) tokenizer, or one larger than the logits
            raise ValueError(f"structured_outputs cannot use this tokenizer: {e}") from None
        self.words = (self.tokenizer.vocab_size + 31) // 32  # int32 words per mask row
        self._executor = llguidance.LLExecutor(num_threads=grammar_threads())
        # compiled constraints, never advanced: a request gets a copy (a batch of prompts with one
        # schema compiles it once; the server compiles off the engine thread, the engine then copies)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _new_matcher(self, grammar: str) -> Any:
        return self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def grammar(self, so: StructuredOutputsParams) -> str:
        """The llguidance grammar of a constraint (not yet checked: matcher() reports its errors)."""
        LLMatcher = self._llg.LLMatcher
        kind = so.kind
        try:
            if kind in ("json", "json_object"):
                schema = so.json if kind == "json" else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                if so.disable_additional_properties:
                    schema = _closed_objects(schema)
                options = {"whitespace_flexible": not so.disable_any_whitespace}
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "regex":
                return LLMatcher.grammar_from_regex(so.regex)
            if kind == "choice":  # one regex: a rule of N alternatives stops at llguidance's 2000 items a row
                return LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in so.choice))
            return self._llg.grammar_from("grammar", so.grammar)  # Lark, or GBNF / EBNF converted
        except ValueError as e:
            raise ValueError(f"structured_outputs {kind}: {e}") from None

    CACHE_SIZE = 256

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A new matcher for a request; ValueError naming the problem if the constraint is invalid.
        Thread-safe; compiled constraints are cached (CACHE_SIZE, least recently used dropped)."""
        # (not sort_keys: a schema's property order is the order of the output's properties)
        key = json.dumps([so.kind, getattr(so, so.kind), so.disable_any_whitespace, so.disable_additional_properties])
        with self._lock:
            m = self._cache.get(key)
            if m is not None:
                self._cache.move_to_end(key)
                return m.deep_copy()
        m = self._new_matcher(self.grammar(so))  # (llguidance drops the GIL while it compiles)
        if m.is_error():
            raise ValueError(f"structured_outputs {so.kind}: {_short(m.get_error())}")
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return m.deep_copy()

    def bitmasks(self, matchers: Sequence[Any]) -> np.ndarray:
        """int32 [len(matchers), words]: bit t of row i (word t // 32, bit t % 32) set where matcher i
        allows token t next. Computed by llguidance's thread pool."""
        out = np.zeros((len(matchers), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], out.ctypes.data, self.words * 4, len(matchers)
        )
        return out


def _closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that lists "properties" but says nothing
    of "additionalProperties" (or "patternProperties") allows no others."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _regex_literal(text: str) -> str:
    """text as a regex matching exactly it: every character but ASCII letters and digits as \\x{...}."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _short(msg: str, limit: int = 400) -> str:
    """llguidance's error messages can carry a whole parser state: keep the head."""
    msg = msg.strip()
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a mask row allows (bool [vocab_size]): the reference of the sampler's unpacking."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
