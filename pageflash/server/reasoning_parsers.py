"""Reasoning parsers: split a thinking model's output into its reasoning and its answer (vLLM's
``--reasoning-parser``).

Models such as DeepSeek-R1 and Qwen3 write their chain of thought between ``<think>`` and ``</think>``
before the answer. The server returns the thought as the message's ``reasoning`` (vLLM's field since
late 2025; also as ``reasoning_content``, the earlier name that DeepSeek's API and many clients read)
and the rest as ``content``.

A split is a pure function of the text so far, so the streamed deltas and the whole response agree:
``split(text, final)`` says which characters are reasoning and which are content, holding back a tail
that may still turn into the closing tag while the output is not final.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pageflash.server.tool_parsers import partial_tail

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    """reasoning / content: the settled text of each part (None: none of that part so far);
    ended: the thought's closing tag was seen."""

    reasoning: Optional[str]
    content: Optional[str]
    ended: bool = False


class ThinkReasoningParser:
    """``<think>reasoning</think>content``.

    thinks_first: whether an output with no opening tag starts inside the thought. DeepSeek-R1's
    templates open the thought in the prompt, so its parser says yes always. Qwen3's (``qwen3``)
    says yes only when the prompt itself ends inside an open ``<think>`` (Qwen3 thinking-2507
    templates); otherwise an output that does not begin with ``<think>`` is all content (thinking
    switched off with ``enable_thinking: false``, whose template writes an empty thought into the
    prompt). An output that ends before ``</think>`` is all reasoning, with no content.
    """

    def __init__(self, name: str, thinks_first: bool) -> None:
        self.name = name
        self.thinks_first = thinks_first

    def starts_in_thought(self, prompt: str) -> bool:
        """Whether an output after this prompt is a thought until </think>, without an opening tag:
        always for thinks_first, else when the prompt leaves a thought open (its last <think> after
        its last </think>)."""
        return self.thinks_first or prompt.rfind(START) > prompt.rfind(END)

    def split(self, text: str, final: bool, opened: bool) -> Split:
        """The settled parts of text (the output so far; final: nothing more will come). opened:
        the output starts inside a thought (starts_in_thought); otherwise only an output that opens
        with <think> has one."""
        head = text.lstrip()
        if head.startswith(START):
            body = head[len(START):]
        elif not final and START.startswith(head):
            return Split(None, None)  # may still become the opening tag
        elif not opened:
            return Split(None, text or None)
        else:
            body = text
        end = body.find(END)
        if end >= 0:
            return Split(body[:end], body[end + len(END):] or None, ended=True)
        keep = 0 if final else partial_tail(body, END)
        return Split(body[: len(body) - keep] or None, None)


REASONING_PARSERS = {
    "deepseek_r1": lambda: ThinkReasoningParser("deepseek_r1", thinks_first=True),
    "qwen3": lambda: ThinkReasoningParser("qwen3", thinks_first=False),
}
