"""Incremental detokenization and stop-string search for streamed outputs.

:class:`IncrementalDetokenizer` turns a request's generated token ids into text deltas with vLLM's
prefix/read-offset scheme: each step decodes a short window of recent ids twice, once without and
once with the new ids, and emits the difference. A window that ends in an incomplete UTF-8 sequence
decodes to a trailing U+FFFD; the new text is then held back until the following ids complete the
character, so that no delta ever contains half of a multi-byte character.

Why windows rather than one token at a time: BPE tokens are byte sequences (an emoji can span
three tokens) and SentencePiece decoders drop the leading space of the first token of a decoded
sequence; decoding with at least one already-emitted id in front gets both right.

The window starts with a few ids of the prompt (as vLLM does) so that the first generated token's
leading space or byte continuation decodes as it would inside the full text. For byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM) the concatenation of all deltas, after :meth:`flush`,
equals ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
without the U+FFFD of a trailing incomplete character (vLLM's text).
For SentencePiece tokenizers it differs only in keeping the first token's leading space, which a
standalone decode strips (vLLM streams the same text).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

_REPLACEMENT = "\ufffd"
# Prompt ids used as left context: vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET is 5; if those
# decode to an incomplete character, try longer suffixes (up to this many ids), then none.
_CONTEXT_MIN, _CONTEXT_MAX = 5, 24


class IncrementalDetokenizer:
    """Streams one sequence's text as its token ids arrive.

    tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...,
        clean_up_tokenization_spaces=...)``).
    prompt_token_ids: the prompt; only its last few ids are kept, as left context.
    skip_special_tokens: drop special tokens from the text (as SamplingParams.skip_special_tokens).

    ``output_text`` is the cumulative text emitted so far. Text is never emitted twice or
    revised; ids that decode to an incomplete character wait in the window until they complete
    (or until :meth:`flush`, at the end of the sequence, which drops a trailing incomplete character
    as vLLM's detokenizer does, rather than show it as U+FFFD).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = self._choose_context(list(prompt_token_ids))
        # The window's ids: prompt context, then outputs. Only ids from prefix_offset on are decoded;
        # older ones are dropped now and then so that memory stays O(window).
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decoded window (already-emitted ids, for context)
        self._read_offset = len(context)  # ids before this one are emitted
        self._prefix_text: Optional[str] = None  # decode(ids[prefix:read]), cached
        self.output_text = ""
        self.num_output_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _choose_context(self, prompt: list[int]) -> list[int]:
        """The shortest prompt suffix of >= 5 ids that decodes to whole characters (else none).

        A suffix that starts or ends inside a multi-byte character would decode to U+FFFD and
        could swallow or shift the first output characters.
        """
        if len(prompt) <= _CONTEXT_MIN:
            return prompt if _REPLACEMENT not in self._decode(prompt) else []
        for n in range(_CONTEXT_MIN, min(len(prompt), _CONTEXT_MAX) + 1):
            suffix = prompt[-n:]
            if _REPLACEMENT not in self._decode(suffix):
                return suffix
        return []

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "").

        Ids are consumed one at a time so that a character left incomplete by the last id holds
        back only itself, not the text of the earlier ids of the same call (speculative decoding
        appends several at once).
        """
        parts = []
        for t in new_ids:
            self._ids.append(int(t))
            self.num_output_tokens += 1
            delta = self._advance(final=False)
            if delta:
                parts.append(delta)
        delta = "".join(parts)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: emit held-back text, except a trailing incomplete character
        (an output cut by max_tokens inside an emoji, say), which vLLM's detokenizer leaves out too;
        ``tokenizer.decode`` of the ids would end in U+FFFD there. Idempotent."""
        delta = self._advance(final=True)
        self.output_text += delta
        return delta

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if final:
            new_text = new_text.rstrip(_REPLACEMENT)
        # Hold back while the window adds nothing (e.g. a skipped special token) or ends inside a
        # multi-byte character: the next id may complete it and the text must not split it.
        if len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset > 64:  # keep the id list short on long generations
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


def stop_holdback(stops: Sequence[str], include: bool) -> int:
    """Characters at the end of an unfinished output to hold back when streaming it: they may be the
    start of a stop string that a later token completes, which cuts them off (none when the stop
    string stays in the output, include_stop_str_in_output)."""
    return 0 if include else max((len(s) for s in stops), default=1) - 1


def find_stop_string(
    output_text: str,
    new_delta_len: int,
    stops: Sequence[str],
    include: bool,
) -> Optional[tuple[int, str]]:
    """Find a stop string that ends inside the newest delta of ``output_text``.

    output_text: the cumulative text, whose last ``new_delta_len`` characters are new. Earlier
        text was searched by earlier calls, so only matches finishing in the new part count; the
        search starts ``len(stop) - 1`` characters before the delta.
    stops: the stop strings (SamplingParams.stop). include: include_stop_str_in_output.
    Returns ``(cut, stop)``: the output is ``output_text[:cut]``, which ends just before the stop
    string (or just after it when ``include``); among several matches the earliest in the text wins
    (on a tie, the first in ``stops``). None when no stop string completes in the delta.

    No hold-back: characters that may begin a stop string are streamed before it is known whether
    the stop string completes (as vLLM's non-streaming path; vLLM's streaming path holds back
    ``max(len(stop)) - 1`` characters, which a server may add on top of this).
    """
    if new_delta_len <= 0 or not stops:
        return None
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        start = max(0, len(output_text) - new_delta_len - len(stop) + 1)
        idx = output_text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return (idx + len(stop) if include else idx), stop
