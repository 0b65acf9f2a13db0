"""Reasoning parsers (server/reasoning_parsers.py): the split of a thinking model's output into
reasoning and content, for whole outputs and for every prefix of a stream."""

import random

import pytest

from pageflash.server.reasoning_parsers import REASONING_PARSERS, Split


def parser(name):
    return REASONING_PARSERS[name]()


@pytest.mark.parametrize("name,prompt,text,want", [
    # both tags in the output
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me see.\n</think>\n\nHello!", ("\nLet me see.\n", "\n\nHello!")),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Hmm.</think>Hi", ("Hmm.", "Hi")),
    # the prompt opened the thought: only the closing tag in the output
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm.</think>Hi", ("Hmm.", "Hi")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>Hi", ("Hmm.", "Hi")),
    # Qwen3 with thinking switched off: the template wrote an empty thought; the output is content
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello!", (None, "Hello!")),
    ("qwen3", "<|im_start|>assistant\n", "Plain answer, no tags.", (None, "Plain answer, no tags.")),
    # cut before the thought ended: all reasoning, no content
    ("qwen3", "", "<think>still thinking", ("still thinking", None)),
    ("deepseek_r1", "", "still thinking", ("still thinking", None)),
    # a thought with nothing after it
    ("deepseek_r1", "", "<think>done</think>", ("done", None)),
    # a later </think> in content stays content
    ("qwen3", "", "<think>a</think>b</think>c", ("a", "b</think>c")),
])
def test_whole_outputs(name, prompt, text, want):
    p = parser(name)
    s = p.split(text, True, p.starts_in_thought(prompt))
    assert (s.reasoning, s.content) == want


def stream(p, text, opened, cuts):
    """Feed text in pieces; return the concatenated reasoning and content deltas (what a client builds)."""
    r_sent, c_sent = "", ""
    for i, cut in enumerate(cuts + [len(text)]):
        s = p.split(text[:cut], cut == len(text) and i == len(cuts), opened)
        r, c = s.reasoning or "", s.content or ""
        assert r.startswith(r_sent) and c.startswith(c_sent), (text[:cut], r_sent, r, c_sent, c)
        r_sent, c_sent = r, c
    return r_sent, c_sent


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_prefix_settles_a_prefix_of_the_final_split(name):
    """What a stream has sent is never taken back: for random outputs built from tag fragments, the
    settled parts of each prefix are prefixes of the final parts, and the stream ends with them."""
    p = parser(name)
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "</th", "ink>", "abc", " ", "\n", "x<y", "think"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for opened in (False, True):
            final = p.split(text, True, opened)
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
            got = stream(p, text, opened, cuts)
            assert got == (final.reasoning or "", final.content or ""), text
            # a one-character-at-a-time stream too
            assert stream(p, text, opened, list(range(len(text)))) == got


def test_a_possible_tag_is_held_back():
    p = parser("qwen3")
    assert p.split("<thi", False, False) == Split(None, None)
    assert p.split("<think>abc</th", False, False) == Split("abc", None)
    assert p.split("<think>abc</th", True, False) == Split("abc</th", None)
    assert p.split("<th", True, False) == Split(None, "<th")
