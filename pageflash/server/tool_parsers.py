"""Tool-call parsers for tool_choice "auto": find the calls a model wrote into its free text.

A model trained for function calling writes its calls in a format of its own; the server is told which
(`--tool-call-parser hermes|llama3_json|mistral`, with `--enable-auto-tool-choice`, vLLM's flags). Each parser turns a finished
output into (content, calls) and, while streaming, says how much of the text so far is surely content
(``safe_prefix``), so that the start of a call is never sent as text.
"""

from __future__ import annotations

import json
import re
from typing import Optional


class HermesToolParser:
    """Hermes / Qwen2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block
    per call, after optional content. A block whose JSON does not parse leaves the whole output as text."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    # the model's tool-call tags may be special tokens: they must stay in the text (vLLM's adjust_request)
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
        """(content before the calls or None, [(name, arguments JSON)]); no calls: (text, [])."""
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = json.loads(block)
            except ValueError:
                return text, []
            parsed = _call_of(call)
            if parsed is None:
                return text, []
            calls.append(parsed)
        return (text[:start] or None), calls  # (the content as written, as vLLM's hermes parser)

    def safe_prefix(self, text: str) -> int:
        """How many leading characters are content whatever comes next: up to a call's start, and
        short of a tail that may begin one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - partial_tail(text, self.START)


def _call_of(obj: object) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a {"name": ..., "arguments" | "parameters": {...}} object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class Llama3JsonToolParser:
    """Llama 3.1 / 3.2 JSON format: the whole output is the calls, ``{"name": ..., "parameters": {...}}``
    objects (an optional ``<|python_tag|>`` first, several separated by ``;``). An output that does not
    start with one, or whose JSON does not parse, is text."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def _body(self, text: str) -> Optional[str]:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        return body if body.startswith("{") else None

    def parse(self, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
        body = self._body(text)
        if body is None:
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
        return None, calls

    def safe_prefix(self, text: str) -> int:
        """Nothing while the output may be calls (it starts, or may start, with the tag or a "{")."""
        head = text.lstrip()
        if not head or self.TAG.startswith(head) or self._body(text) is not None:
            return 0
        return len(text)


class MistralToolParser:
    """Mistral format: content, then ``[TOOL_CALLS]`` and either a JSON list of
    ``{"name": ..., "arguments": {...}}`` (tokenizers v3-v7) or ``name[ARGS]{...}`` per call (v11+,
    each after its own ``[TOOL_CALLS]``). Calls that do not parse leave the whole output as text."""

    name = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True  # [TOOL_CALLS] / [ARGS] are special tokens

    def parse(self, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls: list[tuple[str, str]] = []
        for block in text[start:].split(self.START)[1:]:
            block = block.strip()
            if not block:
                continue
            if self.ARGS in block:  # name[ARGS]{...}
                name, _, args = block.partition(self.ARGS)
                try:
                    obj = json.loads(args)
                except ValueError:
                    return text, []
                calls.append((name.strip(), json.dumps(obj, ensure_ascii=False)))
                continue
            try:
                objs = json.loads(block)
            except ValueError:
                return text, []
            for obj in objs if isinstance(objs, list) else [objs]:
                call = _call_of(obj)
                if call is None:
                    return text, []
                calls.append(call)
        if not calls:
            return text, []
        return (text[:start] or None), calls

    def safe_prefix(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - partial_tail(text, self.START)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
