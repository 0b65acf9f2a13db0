"""Tool-call parsers (server/tool_parsers.py) on whole outputs, and their streaming safe prefixes: what
a stream sends as content before the end is never part of a call."""

import json
import random

import pytest

from pageflash.server.tool_parsers import TOOL_PARSERS


def calls(*pairs):
    return [(name, json.dumps(args)) for name, args in pairs]


@pytest.mark.parametrize("name,text,content,want", [
    ("hermes", 'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Sure. ", calls(("f", {"x": 1}))),
    ("hermes", "no calls here", "no calls here", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', None, calls(("f", {"x": 1}))),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     calls(("f", {"x": 1}), ("g", {}))),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {"x": 1}', []),  # cut
    ("llama3_json", '{"title": "not a call"}', '{"title": "not a call"}', []),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     "Let me look. ", calls(("f", {"x": 1}), ("g", {}))),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', None, calls(("f", {"x": 1}), ("g", {}))),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("mistral", "plain text", "plain text", []),
])
def test_parse(name, text, content, want):
    assert TOOL_PARSERS[name]().parse(text) == (content, want)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streamed_content_is_never_part_of_a_call(name):
    """For outputs made of call fragments, every prefix's safe content is a prefix of the final content
    (or of the text when it has no calls), and never grows past the final content."""
    p = TOOL_PARSERS[name]()
    pieces = ["Sure. ", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name": "f", ',
              '"arguments": {"x": 1}}', '"parameters": {}}', "; ", "[", "]", "<", "{", " "]
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        content, found = p.parse(text)
        final = (p.safe_prefix(text) if found else len(text))
        final_text = text[:final]
        if found:
            assert (content or "") == final_text, text
        sent = 0
        for cut in range(len(text) + 1):
            upto = max(sent, p.safe_prefix(text[:cut]))
            assert text[:upto] == final_text[:upto] and upto <= len(final_text), (text, cut)
            sent = upto
