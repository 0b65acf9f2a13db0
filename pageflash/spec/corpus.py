"""Prompts built from text shipped with Python: the language reference topics of ``pydoc_data``
(what ``help("topics")`` shows; ~79 topics, ~460k characters of English prose and code) and the
docstrings of standard-library modules.

Topics are split by name into a training part and a held-out part (benchmarks); the training split
(Medusa self-distillation) adds the stdlib docstrings (~400 texts of 300+ characters: wider than the
topics alone, which heads would memorize), so heads are never measured on text they were trained
on. Two prompt kinds:

- grounded: the answer quotes or edits a given text (summarize / repeat / rewrite / fix), the case
  where n-gram lookup and copying drafts shine;
- chat: free questions about the topics, with no text to copy from.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

GROUNDED_TEMPLATES = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Repeat the following text exactly, word for word.\n\n{text}",
    "Rewrite the following text in plain English, keeping its structure and examples.\n\n{text}",
    "Fix any typos in the following text and return the corrected text.\n\n{text}",
)
CHAT_TEMPLATES = (
    "Explain {topic} in Python to a beginner, with a short example.",
    "What are common mistakes people make with {topic} in Python?",
    "Write a short story in which a programmer learns about {topic}.",
    "Give three tips for using {topic} well.",
    "Compare {topic} in Python with how other languages handle it.",
)


STDLIB_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar codecs collections colorsys concurrent.futures "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis doctest email enum "
    "filecmp fnmatch fractions ftplib functools getpass gettext glob gzip hashlib heapq hmac html "
    "html.parser http.client imaplib inspect io ipaddress itertools json linecache locale logging lzma "
    "mailbox math mimetypes netrc numbers operator optparse os pathlib pickle platform plistlib poplib "
    "pprint queue random re reprlib sched secrets selectors shelve shlex shutil smtplib socket "
    "socketserver statistics string struct subprocess tarfile tempfile textwrap threading timeit "
    "tokenize trace traceback types typing unittest urllib.parse urllib.request uuid wave weakref "
    "xml.dom.minidom xml.etree.ElementTree zipfile zlib"
).split()


def topics(split: str = "heldout") -> list[tuple[str, str]]:
    """(name, text) of a split: "train" (3 of every 4 pydoc topics by sorted name, plus the stdlib
    docstrings), "heldout" (the 4th topic) or "all" (every topic)."""
    from pydoc_data.topics import topics as table

    names = sorted(table)
    if split == "all":
        pick = names
    elif split == "train":
        pick = [n for i, n in enumerate(names) if i % 4 != 3]
    elif split == "heldout":
        pick = [n for i, n in enumerate(names) if i % 4 == 3]
    else:
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    out = [(n, table[n]) for n in pick if table[n].strip()]
    return out + docstrings() if split == "train" else out


def docstrings(min_chars: int = 300) -> list[tuple[str, str]]:
    """(qualified name, docstring) of stdlib modules, classes, functions and methods, in a fixed order."""
    import importlib
    import inspect

    out: dict[str, str] = {}

    def add(name: str, obj: object) -> None:
        d = inspect.getdoc(obj)
        if d and len(d) >= min_chars and d not in out.values():
            out[name] = d

    for m in STDLIB_MODULES:
        try:
            mod = importlib.import_module(m)
        except Exception:  # a module missing from this Python build
            continue
        add(m, mod)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj):
                add(f"{m}.{name}", obj)
            elif inspect.isclass(obj):
                add(f"{m}.{name}", obj)
                for meth, f in sorted(vars(obj).items()):
                    if not meth.startswith("_") and inspect.isfunction(f):
                        add(f"{m}.{name}.{meth}", f)
    return list(out.items())


def _chunks(text: str, max_chars: int) -> list[str]:
    """Paragraph-aligned pieces of at most ~max_chars characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > max_chars:
            out.append(cur.strip())
            cur = ""
        cur += para + "\n\n"
        while len(cur) > max_chars * 1.5:  # a huge paragraph: cut it
            out.append(cur[:max_chars].strip())
            cur = cur[max_chars:]
    if cur.strip():
        out.append(cur.strip())
    return [c for c in out if len(c) > max_chars // 4]


def build_prompts(
    kind: str,
    n: int,
    split: str = "heldout",
    text_tokens: int = 1000,
    seed: int = 0,
    count_tokens: Optional[Callable[[str], int]] = None,
) -> list[str]:
    """n user messages of one kind ("grounded" or "chat") from a split of the topics.

    text_tokens: target length of the quoted text of grounded prompts (counted with count_tokens
    when given, else as characters / 4).
    """
    rng = random.Random(seed)
    tps = topics(split)
    if kind == "chat":
        out = []
        for i in range(n):
            name, _ = tps[rng.randrange(len(tps))]
            out.append(CHAT_TEMPLATES[i % len(CHAT_TEMPLATES)].format(topic=name.replace("-", " ")))
        return out
    if kind != "grounded":
        raise ValueError(f"kind must be 'grounded' or 'chat', got {kind!r}")
    pieces = [c for _, t in tps for c in _chunks(t, max(200, text_tokens * 4))]
    rng.shuffle(pieces)
    out = []
    for i in range(n):
        text = pieces[i % len(pieces)]
        if count_tokens is not None:
            # trim to the token target (characters per token vary between tokenizers)
            while count_tokens(text) > text_tokens * 1.1 and len(text) > 100:
                text = text[: int(len(text) * 0.9)]
        out.append(GROUNDED_TEMPLATES[i % len(GROUNDED_TEMPLATES)].format(text=text))
    return out


def chat_prompt(tokenizer: Any, message: str) -> dict:
    """A {"prompt", "prompt_token_ids"} dict with the model's chat template applied (raw text when
    the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    return {"prompt": message, "prompt_token_ids": tokenizer.encode(message)}
