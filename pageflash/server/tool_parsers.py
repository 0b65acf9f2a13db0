"""Tool-call parsers for tool_choice "auto": find the calls a model wrote into its free text.

A model trained for function calling writes its calls in a format of its own; the server is told which
(`--tool-call-parser`, with `--enable-auto-tool-choice`, vLLM's flags). Each parser turns a finished
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
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            args = call.get("arguments", call.get("parameters", {}))
            calls.append((call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return (text[:start] or None), calls  # (the content as written, as vLLM's hermes parser)

    def safe_prefix(self, text: str) -> int:
        """How many leading characters are content whatever comes next: up to a call's start, and
        short of a tail that may begin one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


TOOL_PARSERS = {"hermes": HermesToolParser}
