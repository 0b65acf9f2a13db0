"""The OpenAI-compatible server over the real engine (default model, CPU), through real sockets.

One engine for the module, served by uvicorn on 127.0.0.1 (a free port) in a thread. Covers the
`openai` client on both endpoints streaming and not, greedy equality with LLM.generate/LLM.chat,
n/logprobs/echo/stop/usage, every bad input of issue 5 (400/401/404/413, never 500, never a hang),
KV blocks freed at once when a client disconnects, /metrics, and 32 concurrent streaming clients.
max_tokens stay small: the whole file runs in about a minute on 2 CPU cores after the model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import re
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import openai
import torch
import pytest
import uvicorn

from pageflash import LLM, SamplingParams
from pageflash.engine.async_engine import AsyncLLMEngine
from pageflash.server import app as server_app
from pageflash.server.app import build_app

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 256
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]
LOAD_PROMPTS = ["Once upon a time", "The best way to learn", "In 1492,", "My favourite food is"]


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port in a thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class Srv:
    def __init__(self, base: str, aeng: AsyncLLMEngine, refs: dict[str, Any]) -> None:
        self.base = base
        self.aeng = aeng
        self.refs = refs
        self.http = httpx.Client(base_url=base, timeout=60)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return self.http.post(path, content=content, headers={"content-type": "application/json"}, **kw)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until no request holds KV blocks; return the engine's stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.aeng.get_stats()
            if s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 and not self.aeng.num_in_flight:
                return s
            assert time.monotonic() < deadline, f"blocks not freed in {timeout}s: {s}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def srv() -> Iterator[Srv]:
    # async scheduling, as the server runs on CUDA by default (outputs one step behind the launches)
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    # Offline references, computed before the engine thread owns the engine.
    refs = {
        "completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0],
        "chat": llm.chat(CHAT, greedy, use_tqdm=False)[0],
        "load": [
            o.outputs[0].text
            for o in llm.generate(LOAD_PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                  use_tqdm=False)
        ],
    }
    aeng = AsyncLLMEngine(llm.llm_engine)
    try:
        with serve(build_app(aeng, MODEL)) as base:
            s = Srv(base, aeng, refs)
            yield s
            s.http.close()
    finally:
        aeng.shutdown()


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, contains: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for text in contains:
        assert text in err["message"], err
    return err


# --------------------------------------------------------------------------- plain endpoints
def test_health_models_version(srv: Srv) -> None:
    assert srv.http.get("/health").status_code == 200
    assert srv.http.get("/ping").status_code == 200 and srv.http.post("/ping").status_code == 200  # vLLM's
    assert srv.http.get("/version").json()["version"]
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


# --------------------------------------------------------------------------- completions
def test_completion_greedy_equals_llm_generate(srv: Srv) -> None:
    ref = srv.refs["completion"]
    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_llm_generate(srv: Srv) -> None:
    ref = srv.refs["completion"]
    stream = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_raw_sse_format(srv: Srv) -> None:
    with srv.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_completion_token_ids_batch_echo_and_logprobs(srv: Srv) -> None:
    tok = srv.aeng.tokenizer
    ids = tok.encode(PROMPT)
    r = srv.client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [srv.refs["completion"].text] * 2
    assert r.usage.prompt_tokens == 2 * len(ids)

    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)

    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok_s, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tok_lp, abs=1e-4)  # greedy: the sampled token is the best



def test_stop_strings_streamed_and_not(srv: Srv) -> None:
    ref = srv.refs["completion"].text
    words = ref.split()
    stop = " ".join(words[1:3])  # two words, so several tokens: the stream must hold back their start
    expected = ref[: ref.index(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["@@@", stop])
    r = srv.client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(srv.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_ref = srv.refs["chat"].outputs[0].text
    chat_stop = chat_ref[2:6]
    chat = list(srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                   stream=True, stop=[chat_stop]))
    text = "".join(c.choices[0].delta.content or "" for c in chat)
    assert text == chat_ref[: chat_ref.index(chat_stop)] and chat[-1].choices[0].finish_reason == "stop"
    r = srv.client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == expected + stop


# --------------------------------------------------------------------------- chat
def test_chat_greedy_equals_llm_chat(srv: Srv) -> None:
    ref = srv.refs["chat"]
    r = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream(srv: Srv) -> None:
    ref = srv.refs["chat"].outputs[0]
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [ref.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_logprobs(srv: Srv) -> None:
    r = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


def test_logprob_bytes(srv: Srv) -> None:
    """`bytes` is what the token stands for, also for a token holding part of a character (alone it
    decodes to U+FFFD), so joining them rebuilds the text."""
    tok = copy.deepcopy(srv.aeng.tokenizer)  # a copy: the engine thread uses its own meanwhile
    text = "😀 café 東京 <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    tb = server_app.TokenBytes(tok)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # the case that matters is in there
    assert b"".join(bytes(tb(i, tok.decode([i]))) for i in ids).decode() == text


def _offsets(tokens: list[str], cap: int) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(min(pos, cap))
        pos += len(t)
    return out


def test_completion_text_offsets_with_stop_strings(srv: Srv) -> None:
    """Text held back for a possible stop string (stream or not) does not shift the offsets; a stop
    string that cuts the text caps the offsets of the tokens after the cut at its length."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    base = srv.client.completions.create(**kw).choices[0]
    assert base.logprobs.text_offset == _offsets(base.logprobs.tokens, len(base.text))
    assert "".join(base.logprobs.tokens) == base.text  # ASCII here: token lengths add up to the text
    k = len(base.logprobs.tokens[0]) + 1  # a stop string starting inside the second token
    cut = base.text[k : k + 3]
    assert base.text.find(cut) == k
    upto = next(i for i, o in enumerate(_offsets(base.logprobs.tokens, 10**9)) if o + len(base.logprobs.tokens[i]) >= k + 3)
    for stop, text, tokens in ((["zzzzzz"], base.text, base.logprobs.tokens),
                               ([cut], base.text[:k], base.logprobs.tokens[: upto + 1])):
        for stream in (False, True):
            if stream:
                got_text, got_tokens, got_offsets = "", [], []
                for c in srv.client.completions.create(stop=stop, stream=True, **kw):
                    for ch in c.choices:
                        got_text += ch.text
                        if ch.logprobs is not None:
                            got_tokens += ch.logprobs.tokens
                            got_offsets += ch.logprobs.text_offset
            else:
                ch = srv.client.completions.create(stop=stop, **kw).choices[0]
                got_text, got_tokens, got_offsets = ch.text, ch.logprobs.tokens, ch.logprobs.text_offset
            assert (got_text, got_tokens) == (text, tokens), (stop, stream)
            assert got_offsets == _offsets(tokens, len(text)), (stop, stream)


def test_nullable_fields_take_defaults(srv: Srv) -> None:
    r = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0, "n": None,
                                          "add_generation_prompt": None})  # fmt: skip
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == [srv.refs["chat"].outputs[0].text]
    r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_model_retrieve(srv: Srv) -> None:
    m = srv.client.models.retrieve(MODEL)
    assert m.id == MODEL and m.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("gpt-4")


def test_prompts_encoded_off_the_engine_thread(srv: Srv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt encoding and chat templates run on the server's tokenizer worker (its own copy of the
    tokenizer), never on the engine thread, whose time every stream shares: a client sending a huge
    prompt must not freeze the others."""
    serving = srv.aeng  # the engine-thread entry point the server used to tokenize through
    calls: list[Any] = []

    async def engine_call(fn: Any) -> Any:
        calls.append(fn)
        raise AssertionError("tokenized on the engine thread")

    monkeypatch.setattr(serving, "call", engine_call)
    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == srv.refs["completion"].text
    r = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == srv.refs["chat"].outputs[0].text
    r = srv.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text
    assert not calls
    assert_error(srv.post("/v1/completions", {"prompt": "hi " * 300}), 400, param="prompt")


def test_chat_text_parts_equal_plain_content(srv: Srv) -> None:
    """A message's text parts are joined one a line, as vLLM joins them ("\n"), in chat requests, in
    /tokenize's messages and in /v1/responses' input_text parts."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]}]
    plain = [{"role": "user", "content": "Name a\ncolor."}]
    want = srv.post("/tokenize", {"messages": plain}).json()["tokens"]
    assert srv.post("/tokenize", {"messages": parts}).json()["tokens"] == want
    r = srv.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    ref = srv.client.chat.completions.create(model=MODEL, messages=plain, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens == len(want)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a"},
                                          {"type": "input_text", "text": "color."}]}]
    resp = srv.post("/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 8}).json()
    assert resp["usage"]["input_tokens"] == len(want)
    assert isinstance(resp["created_at"], int)  # (OpenAI's: whole seconds)


def test_completions_many_prompts(srv: Srv) -> None:
    """No cap on prompts a request other than prompts x n <= MAX_CHOICES (vLLM has none; lm-eval style
    clients batch hundreds): 300 prompts come back in order, one choice each."""
    from pageflash.server.app import MAX_CHOICES

    prompts = [f"Count to {i}:" for i in range(300)]
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0},
                  timeout=300)  # (300 prompts on a loaded 2-core CI host: past the client's 60 s)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(300))
    assert r.json()["usage"]["completion_tokens"] == 300
    assert_error(srv.post("/v1/completions", {"model": MODEL, "prompt": ["a"] * (MAX_CHOICES // 2 + 1), "n": 2}),
                 400, param="n")
    assert_error(srv.post("/v1/completions", {"model": MODEL, "prompt": ["a"] * (MAX_CHOICES + 1)}), 400,
                 param="prompt")


# --------------------------------------------------------------------------- bad input
BAD_COMPLETIONS = [
    ("{not json", None, ("Malformed JSON",)),
    ("", None, ("Malformed JSON",)),
    ("[1, 2]", None, ()),
    ({}, "prompt", ("Field required",)),
    ({"prompt": 5}, "prompt", ()),
    ({"prompt": []}, "prompt", ()),
    ({"prompt": ""}, "prompt", ()),
    ({"prompt": [1, "a"]}, "prompt", ()),
    ({"prompt": [-1, 2]}, "prompt", ("outside the vocabulary",)),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", ("valid integer",)),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", ()),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ("at least 1, or 0 with echo",)),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens", ()),
    ({"prompt": "hi", "temperature": -0.5}, "temperature", ()),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", ()),
    # above float32's range (it was inf in the sampler: NaN probabilities, garbage tokens); 2.5 is taken
    # as vLLM takes it (OpenAI's cap of 2 holds on /v1/responses only)
    ({"prompt": "hi", "temperature": 1e39}, "temperature", ("finite",)),
    ({"prompt": "hi", "temperature": 1e308, "stream": True}, "temperature", ("finite",)),
    ({"prompt": "hi", "repetition_penalty": 1e39}, "repetition_penalty", ("finite",)),
    ({"prompt": "hi", "top_p": 0}, "top_p", ()),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", ()),
    ({"prompt": "hi", "n": 0}, "n", ()),
    ({"prompt": "hi", "n": True}, "n", ()),
    ({"prompt": "hi", "top_k": -5}, "top_k", ()),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", ()),
    ({"prompt": "hi", "stop": [""]}, "stop", ()),
    ({"prompt": "hi", "stream": "yes"}, "stream", ()),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, None, ("stream",)),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", ("[-100, 100]",)),
    ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias", ("token ids",)),
    ({"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias", ("number",)),
    ({"prompt": "hi", "logit_bias": {"999999999": 1}}, "logit_bias", ("outside the vocabulary",)),
    ({"prompt": "hi", "logit_bias": {"999999999": 0}}, "logit_bias", ("outside the vocabulary",)),
    ({"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias", ("token ids",)),
    ({"prompt": "hi", "logit_bias": [5]}, "logit_bias", ()),
    ({"prompt": "hi", "suffix": "x"}, None, ("suffix",)),
    ({"prompt": "hi", "max_tokens": 400}, "max_tokens", ("400", str(MAX_MODEL_LEN))),
    ({"prompt": "hi " * 300, "max_tokens": 1}, "prompt", (str(MAX_MODEL_LEN),)),
    ({"prompt": ["hi", "hi " * 300], "max_tokens": 1}, "prompt[1]", (str(MAX_MODEL_LEN),)),
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]", ("outside the vocabulary",)),
    # structured outputs: invalid constraints are named
    ({"prompt": "hi", "guided_regex": "[a-z"}, "guided_regex", ("regex", "unclosed character class")),
    ({"prompt": "hi", "guided_grammar": "start: foo"}, "guided_grammar", ("grammar",)),
    ({"prompt": "hi", "guided_json": "{not json"}, "guided_json", ("json",)),
    ({"prompt": "hi", "guided_choice": [""]}, "guided_choice", ("choice",)),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", ("json",)),
    ({"prompt": "hi", "structured_outputs": {"json": False}}, "structured_outputs", ("JSON schema",)),
    ({"prompt": "hi", "guided_choice": "yes"}, "guided_choice", ()),
    ({"prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json",
     ("at most one output constraint", "guided_json", "guided_regex")),
    ({"prompt": "hi", "structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", ("exactly one",)),
    ({"prompt": "hi", "structured_outputs": {"regexp": "a"}}, "structured_outputs", ("regexp",)),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format", ("json_schema.schema",)),
    ({"prompt": "hi", "response_format": {"type": "structural_tag"}}, None, ("structural_tag",)),
    ({"prompt": "hi", "response_format": {}}, "response_format", ("needs a type",)),
    ({"prompt": "hi", "response_format": {"json_schema": {"schema": {"type": "object"}}}}, "response_format",
     ("needs a type",)),
    ({"prompt": "hi", "structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
     "structured_outputs", ("disable_any_whitespace", "bool")),
    ({"prompt": "hi", "structured_outputs": {"json_object": "yes"}}, "structured_outputs", ("json_object", "bool")),
    ({"prompt": "hi", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ("not supported",)),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "stream": True}, "stream", ("use_beam_search",)),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature", ("use_beam_search",)),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p", ("use_beam_search",)),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs", ("use_beam_search",)),
    ({"prompt": "hi", "use_beam_search": True, "n": 11}, "n", ("at most 10",)),
    ({"prompt": "hi", "use_beam_search": "yes"}, "use_beam_search", ()),
    # vLLM extras that would change the result: refused by name, never silently ignored
    ({"prompt": "hi", "allowed_token_ids": [1, "x"]}, "allowed_token_ids[1]", ()),
    ({"prompt": "hi", "allowed_token_ids": [10**9]}, "allowed_token_ids", ("outside the vocabulary",)),
    ({"prompt": "hi", "bad_words": "x"}, "bad_words", ()),
    ({"prompt": "hi", "bad_words": ["  "]}, "bad_words", ("non-blank",)),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ()),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", ("max_logprobs",)),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", ("20 logprobs allowed",)),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, None, ("prompt_logprobs", "stream")),
]


@pytest.mark.parametrize("body,param,contains", BAD_COMPLETIONS, ids=lambda x: str(x)[:40])
def test_bad_completion_requests_get_400(srv: Srv, body: Any, param: str | None, contains: tuple) -> None:
    assert_error(srv.post("/v1/completions", body), 400, param=param, contains=contains)


BAD_CHATS = [
    ({}, "messages", ("Field required",)),
    ({"messages": []}, "messages", ("at least 1",)),
    ({"messages": {"role": "user", "content": "hi"}}, "messages", ()),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]", ("unknown role",)),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", ()),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ()),
    ({"messages": [{"role": "user"}]}, "messages[0]", ("needs content",)),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0]",
     ("'image_url' is not supported",)),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", ()),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", ()),
    ({"messages": CHAT, "temperature": -1}, "temperature", ()),
    ({"messages": CHAT, "temperature": 1e39}, "temperature", ("finite",)),
    ({"messages": CHAT, "response_format": {"type": "json_object"}, "structured_outputs": None,
      "tools": None, "stream": True, "temperature": 1e300}, "temperature", ()),
    ({"messages": CHAT, "top_p": 0.0}, "top_p", ()),
    ({"messages": CHAT, "n": 0}, "n", ()),
    ({"messages": CHAT, "top_logprobs": 2}, None, ("logprobs",)),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ("top_logprobs=21", "max_logprobs")),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     ('tool_choice "auto"', "--tool-call-parser")),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, ("'g'", "not among the tools")),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, None, ("constrains the output already",)),
    ({"messages": CHAT, "tools": [{"type": "retrieval"}]}, "tools[0].type", ()),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
      "tool_choice": "required"}, "tools", ("$defs", "'f'")),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "none"},
     "tools[0].function.name", ()),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"type": "function", "function": {"name": "f",
      "arguments": "{}"}}]}]}, "messages[0]", ("assistant",)),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, None, ("response_format", "'xml'")),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None,
     ("json_schema.schema",)),
    ({"messages": CHAT, "max_tokens": 1000}, "max_tokens", ("1000", str(MAX_MODEL_LEN))),
    # the openai SDK's max_completion_tokens: the error names the field the request set
    ({"messages": CHAT, "max_completion_tokens": 1000}, "max_completion_tokens",
     ("max_completion_tokens (1000)", str(MAX_MODEL_LEN))),
    ({"messages": CHAT, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens", ("max_completion_tokens=2",)),
    ({"messages": CHAT, "max_completion_tokens": 1000, "use_beam_search": True, "n": 2}, "max_completion_tokens",
     ("max_completion_tokens (1000)",)),
    ({"messages": [{"role": "user", "content": "hi " * 300}]}, "messages", ("chat prompt", str(MAX_MODEL_LEN))),
    ({"messages": CHAT, "functions": [{"name": "f", "parameters": {}}]}, None, ("functions",)),
    ({"messages": CHAT, "function_call": "auto"}, None, ("function_call",)),
    ({"messages": CHAT, "tools": [], "tool_choice": "required"}, None, ("tool_choice",)),
    ({"messages": CHAT, "continue_final_message": True}, None, ("add_generation_prompt",)),
    ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}, None,
     ("continues an assistant message",)),
    ({"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", ("tools",)),
    ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs", ()),
    ({"messages": CHAT, "documents": [{"text": "x"}]}, "documents", ("not supported",)),
    ({"messages": CHAT, "chat_template": "{% if %}"}, "chat_template", ("--trust-request-chat-template",)),
    ({"messages": CHAT, "echo": "yes"}, "echo", ()),
    ({"messages": CHAT, "structured_outputs": {"choice": "a"}}, "structured_outputs", ("choice",)),
]


@pytest.mark.parametrize("body,param,contains", BAD_CHATS, ids=lambda x: str(x)[:40])
def test_bad_chat_requests_get_400(srv: Srv, body: Any, param: str | None, contains: tuple) -> None:
    assert_error(srv.post("/v1/chat/completions", body), 400, param=param, contains=contains)


def _collect_completion(srv: Srv, stream: bool, **kw: Any) -> tuple[str, Any, Any]:
    """(text, logprobs as one object, usage) of a one-choice completion, streamed or not."""
    if not stream:
        r = srv.client.completions.create(model=MODEL, **kw)
        return r.choices[0].text, r.choices[0].logprobs, r.usage
    text, usage = "", None
    lp = SimpleNamespace(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for c in srv.client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        usage = c.usage or usage
        for ch in c.choices:
            text += ch.text
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lp, name).extend(getattr(ch.logprobs, name) if ch.logprobs is not None else [])
    return text, lp, usage


def test_echo_with_logprobs_scores_the_prompt(srv: Srv) -> None:
    """lm-eval's loglikelihood request: echo + logprobs, max_tokens 0 (the prompt alone) or 1. The
    prompt's tokens come first (the first without a logprob), scored as the model scores them: a
    prompt ending in the greedy continuation's first token gives it the logprob that generation did."""
    tok = srv.aeng.tokenizer
    ids = tok.encode(PROMPT)
    gen = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=0)
    g_lp = gen.choices[0].logprobs.token_logprobs[0]
    g_tok = tok.encode(PROMPT + gen.choices[0].text)[len(ids):]
    assert len(g_tok) == 1
    for max_tokens in (0, 1):
        for stream in (False, True):
            text, lp, usage = _collect_completion(srv, stream, prompt=ids + g_tok, echo=True, logprobs=2,
                                                  max_tokens=max_tokens, temperature=0)
            n = len(ids) + 1
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + max_tokens
            assert text.startswith(PROMPT + gen.choices[0].text) and "".join(lp.tokens) == text
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
            assert lp.token_logprobs[n - 1] == pytest.approx(g_lp, abs=1e-3)
            assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
            assert usage.prompt_tokens == n and usage.completion_tokens == max_tokens
    assert_error(srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}), 400, param="max_tokens")
    # characters split over several tokens, in the prompt; the generated tokens over several chunks
    prompt = "Hello 🎉 party, naïve café 日本語 test"
    assert any(tok.decode([i]) == "\ufffd" for i in tok.encode(prompt))
    for stream in (False, True):
        text, lp, _ = _collect_completion(srv, stream, prompt=prompt, echo=True, logprobs=1, max_tokens=6,
                                          temperature=0)
        n = len(tok.encode(prompt))
        assert text.startswith(prompt) and len(lp.tokens) == n + 6
        assert lp.text_offset == sorted(lp.text_offset) and min(lp.text_offset[n:]) >= len(prompt)
        for t, o in zip(lp.tokens, lp.text_offset):
            if "\ufffd" not in t:
                assert text[o : o + len(t)] == t, (t, o, stream)


def test_prompt_offsets_skip_a_bos_the_echo_does_not_show(srv: Srv) -> None:
    """A string prompt is echoed as given; when its encoding added a BOS (Llama, Mistral), the
    prompt tokens' offsets still point into the echoed text."""
    tok = copy.deepcopy(srv.aeng.tokenizer)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [bos] + tok.encode("Hello world", add_special_tokens=False)
    assert server_app._prompt_offsets(tok, ids, "Hello world") == [0, 0, 5]
    assert server_app._prompt_offsets(tok, ids, tok.decode(ids)) == [0, 12, 17]  # token-id prompt: BOS shown


def test_truncate_prompt_tokens(srv: Srv) -> None:
    """vLLM's truncate_prompt_tokens keeps the prompt's last k tokens (usage counts those; echo shows
    their text); a prompt too long for the context fits once truncated."""
    tok = srv.aeng.tokenizer
    ids = tok.encode(PROMPT)
    k = 3
    want = srv.client.completions.create(model=MODEL, prompt=ids[-k:], max_tokens=4, temperature=0)
    for prompt in (PROMPT, ids):
        r = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": k})
        assert r.choices[0].text == want.choices[0].text and r.usage.prompt_tokens == k
    e = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                      extra_body={"truncate_prompt_tokens": k})
    assert e.choices[0].text.startswith(tok.decode(ids[-k:])) and not e.choices[0].text.startswith(PROMPT)
    long = "hi " * 300  # over max_model_len alone
    r = srv.client.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    c = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=2,
                                           extra_body={"truncate_prompt_tokens": 16})
    assert c.usage.prompt_tokens == 16


def test_allowed_token_ids(srv: Srv) -> None:
    tok = srv.aeng.tokenizer
    allowed = tok.encode(" yes no maybe")
    for stream in (False, True):
        text, _, _ = _collect_completion(srv, stream, prompt=PROMPT, max_tokens=5, temperature=0.8, seed=3,
                                         extra_body={"allowed_token_ids": allowed})
        assert set(tok.encode(text)) <= set(allowed)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_through_the_openai_client(srv: Srv) -> None:
    """response_format json_schema / json_object and vLLM's guided_* / structured_outputs fields, streamed
    and not: every output satisfies its constraint, and streaming returns the same text."""
    msgs = [{"role": "user", "content": "Give me a person as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    c = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                           response_format=rf)  # fmt: skip
    person = json.loads(c.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    assert c.choices[0].finish_reason == "stop"
    chunks = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                                response_format=rf, stream=True)  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.choices[0].message.content
    c = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0.9, seed=1, n=3,
                                           response_format={"type": "json_object"})  # fmt: skip
    for ch in c.choices:
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert ch.finish_reason == "length" and ch.message.content.startswith("{")
    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, n=4,
                                      extra_body={"guided_choice": ["red", "green", "blue"]})  # fmt: skip
    assert all(ch.text in ("red", "green", "blue") and ch.finish_reason == "stop" for ch in r.choices)
    for stream in (False, True):
        text, _, _ = _collect_completion(srv, stream, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    text, _, _ = _collect_completion(srv, False, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"guided_grammar": grammar})
    assert text in ("The answer is yes.", "The answer is no."), text
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_logit_bias_through_the_openai_client(srv: Srv) -> None:
    """OpenAI's logit_bias (string keys, as JSON sends them), completions and chat, streamed and not: a
    +100 bias forces its token, a -100 bias keeps the reference's first token out."""
    tok = srv.aeng.engine.tokenizer
    t = tok.encode(" banana", add_special_tokens=False)[0]
    r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=2, n=2,
                                      logit_bias={str(t): 100})  # fmt: skip
    assert all(tok.encode(ch.text, add_special_tokens=False) == [t] * 4 for ch in r.choices), [c.text for c in r.choices]
    ref = srv.refs["chat"].outputs[0]
    banned = {str(ref.token_ids[0]): -100}
    for stream in (False, True):
        c = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                               logit_bias=banned, stream=stream)  # fmt: skip
        text = c.choices[0].message.content if not stream else "".join(
            ch.choices[0].delta.content or "" for ch in c if ch.choices)
        assert text
        assert tok.encode(text, add_special_tokens=False)[:1] != ref.token_ids[:1]
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}


def _tool_args_ok(name: str, args: str) -> bool:
    a = json.loads(args)
    if name == "get_weather":
        return set(a) == {"city", "unit"} and a["unit"] in ("c", "f")
    return name == "get_time" and set(a) == {"zone"}


def test_openai_sdk_parse_with_pydantic_models(srv: Srv) -> None:
    """The openai SDK's structured-output helpers: parse(response_format=Model) sends a strict
    json_schema and reads message.parsed; pydantic_function_tool reads the call's parsed_arguments."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str

    class Answer(pydantic.BaseModel):
        city: City
        reason: str

    msgs = [{"role": "user", "content": "Name the biggest city in Japan."}]
    r = srv.client.beta.chat.completions.parse(model=MODEL, messages=msgs, response_format=Answer, max_tokens=120,
                                               temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Answer)
    r = srv.client.beta.chat.completions.parse(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                               tools=[openai.pydantic_function_tool(City, name="lookup")],
                                               tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and isinstance(call.function.parsed_arguments, City)


def test_constraints_compile_off_the_engine_thread(srv: Srv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server compiles a request's constraint on its worker thread; the engine thread only copies
    the cached matcher (a large schema does not stall the other streams)."""
    so = srv.aeng.engine.structured_outputs()
    threads: list[str] = []
    orig = so._new_matcher
    monkeypatch.setattr(so, "_new_matcher", lambda g: threads.append(threading.current_thread().name) or orig(g))
    choices = [f"code-{i}" for i in range(2500)]
    r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "guided_choice": choices})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices
    assert threads and "pageflash-engine" not in threads


def test_bad_words_are_tokenized_off_the_engine_thread(srv: Srv, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's bad_words are tokenized on the server's worker thread (300k words took the engine
    thread 13 s, stalling every other stream); the engine finds them in its cache."""
    from pageflash.engine import engine as engine_mod

    threads: list[str] = []
    orig = engine_mod._tokenize_bad_words
    monkeypatch.setattr(engine_mod, "_tokenize_bad_words",
                        lambda tok, words: threads.append(threading.current_thread().name) or orig(tok, words))
    ref = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
    word = ref.split()[0]
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        words = [word, f"zq{path}"] + [f"w{i}" for i in range(2000)]
        r = srv.post(path, {**body, "max_tokens": 8, "temperature": 0, "bad_words": words})
        assert r.status_code == 200, r.text
    assert len(threads) == 2 and "pageflash-engine" not in threads, threads
    text = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                        "bad_words": [word]}).json()["choices"][0]["text"]
    assert word not in text


def test_tool_calls_named_and_required_through_the_openai_client(srv: Srv) -> None:
    """tool_choice naming a function, and "required", streamed and not: the calls' arguments satisfy the
    tools' schemas, the streamed deltas add up to the same calls, and an earlier call plus a tool result
    can go back in as history."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    c = srv.client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=60, temperature=0)  # fmt: skip
    m = c.choices[0].message
    assert m.content is None and len(m.tool_calls) == 1 and c.choices[0].finish_reason == "stop"
    call = m.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert _tool_args_ok("get_weather", call.function.arguments)
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                                     tool_choice=named, max_tokens=60, temperature=0, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    for stream in (False, True):
        kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                  temperature=0.8, seed=4, n=2)
        if not stream:
            r = srv.client.chat.completions.create(**kw)
            got = [(ch.finish_reason, [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []])
                   for ch in r.choices]  # fmt: skip
        else:
            calls: dict[int, list] = {0: [], 1: []}
            reasons: dict[int, str] = {}
            for ch in srv.client.chat.completions.create(stream=True, **kw):
                for choice in ch.choices:
                    calls[choice.index] += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls or []]
                    if choice.finish_reason:
                        reasons[choice.index] = choice.finish_reason
            got = [(reasons[i], calls[i]) for i in (0, 1)]
        for reason, cs in got:
            if reason == "tool_calls":
                assert cs and all(_tool_args_ok(name, args) for name, args in cs)
            else:
                assert reason == "length" and not cs  # cut before the list closed: left as text
    # "required" with $defs in a tool's parameters: they move to the root, where the $ref points
    ref = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"], "additionalProperties": False,
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}}}}
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, tools=[ref, TIME], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    t = r.choices[0].message.tool_calls[0]
    assert (t.function.name, set(json.loads(t.function.arguments))) in (("get_weather", {"loc"}), ("get_time", {"zone"}))
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    c = srv.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0)  # fmt: skip
    assert c.choices[0].message.content and not c.choices[0].message.tool_calls
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_auto_tool_choice_with_the_hermes_parser(srv: Srv) -> None:
    """tool_choice "auto" reads Hermes-style calls out of the text (a regex makes the model write one),
    streamed and not; plain text stays content; without --tool-call-parser "auto" is a 400."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"messages": msgs, "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 0}
    assert_error(srv.post("/v1/chat/completions", body), 400, param="tool_choice", contains=("--tool-call-parser",))
    with serve(build_app(srv.aeng, MODEL, tool_call_parser="hermes")) as base:
        def post(**kw: Any) -> Any:
            return httpx.post(f"{base}/v1/chat/completions", json={**body, **kw}, timeout=120)

        forced = {"guided_regex": "Let me check. " + re.escape(call)}
        c = post(**forced).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check. "
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]] == [
            ("get_weather", {"city": "Paris", "unit": "c"})]
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, **forced, "stream": True,
                                                                         "logprobs": True}, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [e["choices"][0] for e in events if e["choices"]]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        assert content == "Let me check. "
        assert all(d["delta"].get("content") or d["delta"].get("tool_calls") or d["delta"].get("role")
                   for d in deltas)  # no empty chunks while a call is held back
        n_lp = sum(len((d.get("logprobs") or {}).get("content") or []) for d in deltas)
        assert n_lp == post(**forced).json()["usage"]["completion_tokens"]  # every token's logprob, once
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        plain = post(max_tokens=8).json()["choices"][0]
        assert plain["message"]["tool_calls"] == [] and plain["message"]["content"]
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_return_tokens_as_token_ids(srv: Srv) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:ID" (the ids decode to the
    text; top entries too; chat bytes stay the tokens' own), per request or server-wide."""
    tok = srv.aeng.tokenizer
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    plain = srv.post("/v1/completions", body).json()["choices"][0]
    c = srv.post("/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
    assert all(t.startswith("token_id:") for t in c["logprobs"]["tokens"])
    assert tok.decode(ids) == c["text"] == plain["text"]
    assert c["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] if top for k in top)
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    ref = srv.post("/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    with serve(build_app(srv.aeng, MODEL, return_tokens_as_token_ids=True)) as base:
        got = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["logprobs"]["content"]
    assert [tok.decode([int(e["token"].removeprefix("token_id:"))]) for e in got] == [e["token"] for e in ref]
    assert [e["bytes"] for e in got] == [e["bytes"] for e in ref]
    assert all(t["token"].startswith("token_id:") for e in got for t in e["top_logprobs"])
    assert_error(srv.post("/v1/completions", {**body, "return_tokens_as_token_ids": "yes"}), 400,
                 param="return_tokens_as_token_ids")


def test_responses_api_through_the_openai_client(srv: Srv) -> None:
    """/v1/responses (OpenAI's Responses API, stateless text): the SDK's responses.create, streamed and
    not, gives the chat endpoint's reply to the same messages; instructions become a system message;
    max_output_tokens makes the response incomplete; text.format constrains the output; what this
    server does not serve is a 400 naming the field."""
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    ref = srv.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0}).json()
    r = srv.client.responses.create(model=MODEL, instructions="You are terse.", input="Name a color.",
                                    max_output_tokens=12, temperature=0)  # fmt: skip
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.status == ("incomplete" if ref["choices"][0]["finish_reason"] == "length" else "completed")
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"] and r.usage.output_tokens == ref["usage"]["completion_tokens"]
    items = srv.client.responses.create(model=MODEL, input=[{"role": "system", "content": "You are terse."},
                                                            {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}],
                                        max_output_tokens=12, temperature=0)  # fmt: skip
    assert items.output_text == r.output_text
    short = srv.client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    events = list(srv.client.responses.create(model=MODEL, instructions="You are terse.", input="Name a color.",
                                              max_output_tokens=12, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{r.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    j = srv.client.responses.create(model=MODEL, input="A person as JSON.", max_output_tokens=60, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": person}})
    assert set(json.loads(j.output_text)) == {"name", "age"}
    assert_error(srv.post("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}), 400, param="tools")
    assert_error(srv.post("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}), 400,
                 param="previous_response_id")
    assert_error(srv.post("/v1/responses", {"input": [{"type": "input_image", "image_url": "x"}]}), 400, param="input")
    assert_error(srv.post("/v1/responses", {"input": ""}), 400, param="input")
    assert_error(srv.post("/v1/responses", {"input": "hi", "max_output_tokens": 0}), 400, param="max_output_tokens")
    assert_error(srv.post("/v1/responses", {"input": "hi", "guided_regex": "[a-"}), 400, param="guided_regex")
    g = srv.post("/v1/responses", {"input": "Pick one.", "guided_choice": ["red", "blue"], "temperature": 0}).json()
    assert g["output"][0]["content"][0]["text"] in ("red", "blue")
    assert_error(srv.post("/v1/responses", {"input": "hi", "text": {"format": {"type": "xml"}}}), 400, param="text")
    assert_error(srv.post("/v1/responses", {"input": [{"role": "wizard", "content": "x"}]}), 400, param="input[0]")
    assert_error(srv.post("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}), 400,
                 param="max_output_tokens", contains=("max_output_tokens",))
    for field, value in (("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}), ("tool_choice", "required"),
                         ("tool_choice", 5)):
        assert_error(srv.post("/v1/responses", {"input": "hi", field: value}), 400, param=field)
    # errors name this request's fields: input items counted without the instructions' system message
    e = assert_error(srv.post("/v1/responses", {"input": [{"role": "bot", "content": "hi"}], "instructions": "x"}), 400)
    assert e["param"].startswith("input[0]") and "input[0]" in e["message"] and "messages" not in e["message"]
    e = assert_error(srv.post("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}), 400)
    assert e["param"] == "text" and "response_format" not in e["message"]
    assert_error(srv.post("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}),
                 400, param="input", contains=("must be a string",))
    # truncation "auto" drops the oldest items until the prompt fits; "disabled" is a 400
    long = [{"role": "user", "content": "hello " * 300}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Name a color."}]
    assert_error(srv.post("/v1/responses", {"input": long, "max_output_tokens": 4}), 400, param="input")
    cut = srv.post("/v1/responses", {"input": long, "max_output_tokens": 4, "truncation": "auto", "temperature": 0})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["input_tokens"] < 100
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_responses_echoed_fields_are_json(srv: Srv) -> None:
    """/v1/responses echoes text and metadata back: a NaN or an overflowing number (1e400 parses as
    inf) there was a 500 (and a dropped connection); OpenAI's metadata holds strings."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for stream in (False, True):
        raw = ('{"input": "hi", "max_output_tokens": 2, "stream": %s, "text": {"format": {"type": "json_schema", '
               '"name": "x", "schema": {"type": "object", "default": 1e400}}}}' % json.dumps(stream))
        assert_error(srv.post("/v1/responses", raw), 400, param="text", contains=("finite",))
        raw = '{"input": "hi", "max_output_tokens": 2, "stream": %s, "metadata": {"a": NaN}}' % json.dumps(stream)
        assert_error(srv.post("/v1/responses", raw), 400, param="metadata.a")
    assert_error(srv.post("/v1/responses", {"input": "hi", "metadata": {"a": 1}}), 400, param="metadata.a")
    assert_error(srv.post("/v1/responses", {"input": "hi", "metadata": ["a"]}), 400, param="metadata")
    r = srv.client.responses.create(model=MODEL, input="hi", max_output_tokens=2, metadata={"user": "u1"},
                                    text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert r.metadata == {"user": "u1"} and r.text.format.type == "json_schema"
    srv.wait_idle()


def test_embeddings_through_the_openai_client(srv: Srv) -> None:
    """/v1/embeddings: the openai SDK (base64 by default) and float JSON agree; unit vectors; text and
    its token ids give the same vector; dimensions truncates; bad input is a 400 naming the field."""
    tok = srv.aeng.tokenizer
    texts = ["The cat sat on the mat.", "Quantum chromodynamics", "The cat sat on the mat."]
    r = srv.client.embeddings.create(model=MODEL, input=texts)
    vecs = [torch.tensor(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(v.shape == (576,) for v in vecs)
    assert all(abs(v.norm().item() - 1) < 1e-3 for v in vecs)
    assert torch.allclose(vecs[0], vecs[2], atol=1e-3) and not torch.allclose(vecs[0], vecs[1], atol=1e-2)
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    f = srv.post("/v1/embeddings", {"input": texts[0], "encoding_format": "float"}).json()
    torch.testing.assert_close(torch.tensor(f["data"][0]["embedding"]), vecs[0], atol=1e-3, rtol=0)
    ids = srv.post("/v1/embeddings", {"input": tok.encode(texts[0]), "encoding_format": "float"}).json()
    assert ids["data"][0]["embedding"] == f["data"][0]["embedding"]
    d = srv.client.embeddings.create(model=MODEL, input=texts[0], dimensions=32, encoding_format="float").data[0]
    assert len(d.embedding) == 32 and abs(torch.tensor(d.embedding).norm().item() - 1) < 1e-3
    assert_error(srv.post("/v1/embeddings", {"input": ""}), 400, param="input")
    assert_error(srv.post("/v1/embeddings", {"input": []}), 400, param="input")
    assert_error(srv.post("/v1/embeddings", {"input": ["ok", ""]}), 400, param="input[1]")
    assert_error(srv.post("/v1/embeddings", {"input": [10**9]}), 400, param="input")
    assert_error(srv.post("/v1/embeddings", {"input": "x", "dimensions": 10**4}), 400, param="dimensions")
    assert_error(srv.post("/v1/embeddings", {"input": "x", "encoding_format": "int8"}), 400, param="encoding_format")
    assert_error(srv.post("/v1/embeddings", {"input": "x " * 400}), 400, param="input")
    cut = srv.post("/v1/embeddings", {"input": "x " * 400, "truncate_prompt_tokens": -1}).json()  # vLLM's: the
    assert cut["usage"]["prompt_tokens"] == MAX_MODEL_LEN  # last max_model_len tokens
    assert_error(srv.post("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": -2}), 400,
                 param="truncate_prompt_tokens")  # fmt: skip
    before = _metric(srv.http.get("/metrics").text, "pageflash:e2e_request_latency_seconds_count")
    srv.client.embeddings.create(model=MODEL, input="one more")
    assert _metric(srv.http.get("/metrics").text, "pageflash:e2e_request_latency_seconds_count") == before + 1
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_beam_search_over_http(srv: Srv) -> None:
    """use_beam_search with n beams: the beams LLM.beam_search finds offline on the same model, best
    first, in completions (per prompt) and chat."""
    from pageflash import BeamSearchParams

    offline = LLM(MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    tok = offline.get_tokenizer()
    prompts = ["The capital of France is", "Once upon a time"]
    want = offline.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6))
    r = srv.post("/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 6, "use_beam_search": True,
                                     "temperature": 0}).json()  # fmt: skip
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [c["text"] for c in r["choices"]] == [s.output_text for w in want for s in w.sequences]
    assert [c["finish_reason"] for c in r["choices"]] == [s.finish_reason for w in want for s in w.sequences]
    assert r["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for w in want for s in w.sequences)
    msgs = [{"role": "user", "content": "Name a color."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat_want = offline.beam_search({"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                                    BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.5))
    c = srv.client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=8,
                                           extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [ch.message.content for ch in c.choices] == [s.output_text for s in chat_want[0].sequences]
    # prompts of different lengths each get max_tokens (the longer one's room does not cap the other's)
    short, longer = [504, 3575, 282, 4649, 314], [504] * 200
    want = offline.beam_search([short, longer], BeamSearchParams(beam_width=1, max_tokens=20, ignore_eos=True))
    r = srv.post("/v1/completions", {"prompt": [short, longer], "n": 1, "max_tokens": 20, "use_beam_search": True,
                                     "ignore_eos": True}).json()  # fmt: skip
    assert [c["text"] for c in r["choices"]] == [w.sequences[0].output_text for w in want]
    assert r["usage"]["completion_tokens"] == 40
    assert_error(srv.post("/v1/completions", {"prompt": [504] * 250, "max_tokens": 50, "use_beam_search": True}), 400,
                 param="max_tokens")
    huge = srv.post("/v1/completions", {"prompt": "Hello", "n": 2, "max_tokens": 4, "use_beam_search": True,
                                        "length_penalty": 1e308, "presence_penalty": 0, "top_p": 1.0})  # fmt: skip
    assert huge.status_code == 200 and len(huge.json()["choices"]) == 2
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_usage_counts_cached_prompt_tokens(srv: Srv) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's; Responses: input_tokens_details): the prompt
    tokens the prefix cache served, whole blocks of them, the second time a long prompt comes."""
    bs = srv.aeng.engine.kv.block_size
    msgs = [{"role": "system", "content": "You are a careful assistant who answers in one word. " * 6},
            {"role": "user", "content": "Name a color."}]
    body = {"messages": msgs, "max_tokens": 2, "temperature": 0}
    srv.post("/v1/chat/completions", body)
    u = srv.post("/v1/chat/completions", body).json()["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    assert cached >= bs * ((u["prompt_tokens"] - 1) // bs - 1) and cached % bs == 0 and cached < u["prompt_tokens"]
    c = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens == cached
    r = srv.client.responses.create(model=MODEL, input=msgs, max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens_details.cached_tokens == cached
    # beam search counts its prompt's cached tokens once (its rounds' re-sent beams are its own business)
    b = srv.post("/v1/chat/completions", {**body, "n": 2, "use_beam_search": True}).json()["usage"]
    assert b["prompt_tokens"] == u["prompt_tokens"] and b["prompt_tokens_details"]["cached_tokens"] == cached


def test_tokenize_and_detokenize(srv: Srv) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template: the very ids a chat request
    runs on) and /detokenize; bad input is a 400 naming the field."""
    tok = srv.aeng.tokenizer
    r = srv.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert srv.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == tok.encode(
        PROMPT, add_special_tokens=False)
    chat = srv.post("/tokenize", {"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False) and chat["token_strs"] is None
    usage = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]  # what a chat request counts
    assert srv.post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    assert_error(srv.post("/tokenize", {"prompt": "x", "messages": CHAT}), 400, param="prompt",
                 contains=("exactly one", "both"))
    assert_error(srv.post("/tokenize", {}), 400, param="prompt", contains=("exactly one", "neither"))
    assert_error(srv.post("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}), 400, param="messages[0]")
    assert_error(srv.post("/tokenize", {"prompt": "x", "model": "gpt-4"}), 404, param="model")
    assert_error(srv.post("/detokenize", {"tokens": [1, 10**9]}), 400, param="tokens", contains=("outside",))
    assert_error(srv.post("/detokenize", {"tokens": "abc"}), 400, param="tokens")


def _stream_events(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_reasoning_parsers_split_the_thought(srv: Srv) -> None:
    """--reasoning-parser: the thought comes back as `reasoning` (and `reasoning_content`), the answer
    as content, streamed and not, with every token's logprob once; include_reasoning false drops the
    thought; auto tool calls are read from the content after it. A regex makes the 135M model think."""
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0}
    forced = {"guided_regex": r"<think>I should greet\.</think>Hello there!"}
    with serve(build_app(srv.aeng, MODEL, reasoning_parser="qwen3", tool_call_parser="hermes")) as base:
        def post(**kw: Any) -> Any:
            return httpx.post(f"{base}/v1/chat/completions", json={**body, **kw}, timeout=120).json()

        m = post(**forced)["choices"][0]["message"]
        assert (m["reasoning"], m["reasoning_content"], m["content"]) == ("I should greet.",) * 2 + ("Hello there!",)
        events = _stream_events(base, {**body, **forced, "logprobs": True})
        deltas = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "I should greet."
        assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "I should greet."
        assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hello there!"
        assert not any("</think>" in (d["delta"].get("content") or "") + (d["delta"].get("reasoning") or "")
                       for d in deltas)  # fmt: skip
        n_lp = sum(len((d.get("logprobs") or {}).get("content") or []) for d in deltas)
        assert n_lp == post(**forced)["usage"]["completion_tokens"]
        # a stop string's held-back tail is not split off early: streamed == whole, for both fields
        for stop in (["should gX", "should g"], ["thereX", "there"]):
            whole = post(**forced, stop=stop)["choices"][0]["message"]
            ds = [e["choices"][0]["delta"] for e in _stream_events(base, {**body, **forced, "stop": stop}) if e["choices"]]
            assert "".join(d.get("reasoning") or "" for d in ds) == (whole.get("reasoning") or "")
            assert "".join(d.get("content") or "" for d in ds) == (whole["content"] or ""), stop
        # echo of an open assistant message that starts a thought: the echoed part is split too
        cont = {"messages": [*CHAT, {"role": "assistant", "content": "<think>I"}], "add_generation_prompt": False,
                "continue_final_message": True, "echo": True, "max_tokens": 12, "temperature": 0}
        e = httpx.post(f"{base}/v1/chat/completions", json=cont, timeout=120).json()["choices"][0]["message"]
        assert e["reasoning"].startswith("I") and "<think>" not in (e["content"] or "") + e["reasoning"]
        ds = [x["choices"][0]["delta"] for x in _stream_events(base, cont) if x["choices"]]
        assert "".join(d.get("reasoning") or "" for d in ds) == e["reasoning"]
        assert ("".join(d.get("content") or "" for d in ds) or None) == e["content"]
        hidden = post(**forced, include_reasoning=False)["choices"][0]["message"]
        assert "reasoning" not in hidden and hidden["content"] == "Hello there!"
        # qwen3: an output without <think> (the model's own free text) is all content
        free = post()["choices"][0]["message"]
        assert "reasoning" not in free and free["content"] == post()["choices"][0]["message"]["content"]
        # auto tools: the calls are read from the content after the thought
        call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
        tools = {"tools": [WEATHER, TIME], "guided_regex": "<think>Time\\?</think>" + re.escape(call), "max_tokens": 60}
        c = post(**tools)["choices"][0]
        assert c["message"]["reasoning"] == "Time?" and c["finish_reason"] == "tool_calls"
        assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_time"]
        deltas = [e["choices"][0] for e in _stream_events(base, {**body, **tools}) if e["choices"]]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "Time?"
        # auto tools with a stop string: streamed content == whole content
        cut = {"tools": [WEATHER, TIME], "guided_regex": "Well, well, I should greet\\. Hello there!",
               "stop": ["should gX", "should g"]}
        whole = post(**cut)["choices"][0]["message"]["content"]
        ds = [e["choices"][0]["delta"] for e in _stream_events(base, {**body, **cut}) if e["choices"]]
        assert "".join(d.get("content") or "" for d in ds) == whole == "Well, well, I "
        assert [t["function"]["name"] for d in deltas for t in d["delta"].get("tool_calls") or []] == ["get_time"]
        # /v1/responses: the thought is a reasoning item before the message, streamed and not
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        rq = dict(model=MODEL, input="Hi", max_output_tokens=40, temperature=0, extra_body=forced)
        r = client.responses.create(**rq)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hello there!"
        assert r.output[0].content[0].text == "I should greet."
        events = list(client.responses.create(**rq, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I should greet."
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there!"
        assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello there!"
        with client.responses.stream(**rq) as st:
            assert st.get_final_response().output_text == "Hello there!"
        cut = client.responses.create(**{**rq, "max_output_tokens": 4})  # cut inside the thought
        assert cut.status == "incomplete" and [o.type for o in cut.output] == ["reasoning", "message"]
        assert cut.output[0].status == "incomplete" and cut.output_text == ""
        events = list(client.responses.create(**{**rq, "max_output_tokens": 4}, stream=True))
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
        assert events[-1].type == "response.incomplete"
        # an empty thought is no reasoning item, streamed or not
        empty = dict(rq, extra_body={"guided_regex": "<think></think>Hello there!"})
        assert [o.type for o in client.responses.create(**empty).output] == ["message"]
        events = list(client.responses.create(**empty, stream=True))
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["message"]
        assert [o.type for o in events[-1].response.output] == ["message"]
        # beam search replies are split too: a prompt that leaves a thought open
        open_msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}]
        b = post(messages=open_msgs, add_generation_prompt=False, continue_final_message=True, use_beam_search=True,
                 n=2, max_tokens=6, ignore_eos=True)["choices"]  # fmt: skip
        assert all(c["message"]["content"] is None and c["message"]["reasoning"] for c in b)
    with serve(build_app(srv.aeng, MODEL, reasoning_parser="deepseek_r1")) as base:
        # deepseek_r1: the output is a thought until </think>; the model never closes one here
        plain = srv.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert r["reasoning"] == plain and r["content"] is None
        deltas = [e["choices"][0] for e in _stream_events(base, body) if e["choices"]]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == plain
        # a constrained output is a thought only where it opens one: JSON stays content
        j = httpx.post(f"{base}/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}},
                       timeout=120).json()["choices"][0]["message"]  # fmt: skip
        assert "reasoning" not in j and j["content"].startswith("{")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(srv.aeng, MODEL, reasoning_parser="nope")
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


@pytest.mark.parametrize("parser,written", [
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
])
def test_auto_tool_choice_with_llama3_json_and_mistral_parsers(srv: Srv, parser: str, written: str) -> None:
    """The llama3_json and mistral parsers read the calls a model writes in their formats (a regex makes
    the 135M model write one), streamed and not."""
    body = {"messages": [{"role": "user", "content": "What time is it in UTC?"}], "tools": [WEATHER, TIME],
            "max_tokens": 60, "temperature": 0, "guided_regex": re.escape(written)}
    content = "Checking. " if parser == "mistral" else None
    with serve(build_app(srv.aeng, MODEL, tool_call_parser=parser)) as base:
        c = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == content
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]] == [
            ("get_time", {"zone": "UTC"})]
        deltas = [e["choices"][0] for e in _stream_events(base, body) if e["choices"]]
        assert ("".join(d["delta"].get("content") or "" for d in deltas) or None) == content
        assert [t["function"]["name"] for d in deltas for t in d["delta"].get("tool_calls") or []] == ["get_time"]
        assert deltas[-1]["finish_reason"] == "tool_calls"
    assert srv.aeng.engine.kv.num_free_blocks == srv.aeng.engine.kv.pool.num_blocks


def test_continue_final_message_echo_and_template_kwargs(srv: Srv) -> None:
    """continue_final_message leaves the assistant's last message open and the reply continues it (the
    same tokens as a completion of the rendered text); echo puts that message in front of the reply,
    streamed and not; chat_template_kwargs reach the template."""
    tok = srv.aeng.tokenizer
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "continue_final_message": True,
            "add_generation_prompt": False}
    c = srv.post("/v1/chat/completions", body).json()
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True, add_generation_prompt=False)
    assert text.endswith("My favourite color is")
    ref = srv.post("/v1/completions", {"prompt": tok.encode(text, add_special_tokens=False), "max_tokens": 6,
                                       "temperature": 0}).json()  # fmt: skip
    assert c["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    e = srv.post("/v1/chat/completions", {**body, "echo": True}).json()
    assert e["choices"][0]["message"]["content"] == "My favourite color is" + ref["choices"][0]["text"]
    chunks = srv.client.chat.completions.create(model=MODEL, stream=True, messages=msgs, max_tokens=6, temperature=0,
                                                extra_body={"continue_final_message": True, "echo": True,
                                                            "add_generation_prompt": False})  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == e["choices"][0]["message"]["content"]
    # without a generation prompt the reply continues the last message in its role, and echo repeats it
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color:"}], "echo": True,
                                          "add_generation_prompt": False, "max_tokens": 3, "temperature": 0}).json()
    assert r["choices"][0]["message"]["role"] == "user"
    assert r["choices"][0]["message"]["content"].startswith("Name a color:")
    # echo after a generation prompt: the reply is the assistant's, the user's message is not echoed
    plain = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}).json()
    echoed = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    # chat_template_kwargs: SmolLM2's template reads none, so they change nothing; a server-side template
    # that reads one is tested through render() in test_request_chat_template_needs_trust
    kw = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                           "chat_template_kwargs": {"enable_thinking": False}}).json()  # fmt: skip
    assert kw["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_request_chat_template_needs_trust() -> None:
    """A server started with trust_request_chat_template renders a request's own template, and its
    chat_template_kwargs; the same request is a 400 on a server without the flag."""
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=32)
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "chat_template": template,
            "chat_template_kwargs": {"greeting": "Dear"}}
    tok = llm.get_tokenizer()
    want = tok.encode("".join(f"Dear {m['content']}\n" for m in CHAT), add_special_tokens=False)
    for trusted in (False, True):
        aeng = AsyncLLMEngine(llm.llm_engine)
        try:
            with serve(build_app(aeng, MODEL, trust_request_chat_template=trusted)) as base:
                r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
                if not trusted:
                    assert_error(r, 400, param="chat_template", contains=("--trust-request-chat-template",))
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens"] == len(want)
        finally:
            aeng.shutdown()


def test_prompt_logprobs_field(srv: Srv) -> None:
    """vLLM's prompt_logprobs: per completions choice (each prompt's own), and once per chat response;
    the same figures as the engine's RequestOutput.prompt_logprobs, the first entry null."""
    eng = srv.aeng.engine
    tok = srv.aeng.tokenizer
    prompts = [PROMPT, "The sea is"]
    r = srv.post("/v1/completions", {"prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2,
                                     "prompt_logprobs": 2}).json()  # fmt: skip
    for ch in r["choices"]:
        plp = ch["prompt_logprobs"]
        ids = tok.encode(prompts[ch["index"] // 2])
        assert plp[0] is None and len(plp) == len(ids)
        for tid, entry in zip(ids[1:], plp[1:]):
            assert str(tid) in entry and 2 <= len(entry) <= 3
            assert {1, 2} <= {v["rank"] for v in entry.values()}  # the top 2, and the token itself
    # the numbers: the same as echo + logprobs gives for the prompt's tokens
    r2 = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
                                      "logprobs": 1}).json()  # fmt: skip
    echo_lps = r2["choices"][0]["logprobs"]["token_logprobs"]
    first = r["choices"][0]["prompt_logprobs"]
    ids = tok.encode(PROMPT)
    assert [first[j][str(ids[j])]["logprob"] for j in range(1, len(ids))] == pytest.approx(echo_lps[1:len(ids)], abs=1e-5)
    assert "prompt_logprobs" not in r2["choices"][0]  # not asked: not there
    c = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in c["prompt_logprobs"][1:])
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_whole_vocabulary_logprobs(srv: Srv) -> None:
    """vLLM's -1 for chat top_logprobs and prompt_logprobs: every token of the vocabulary, allowed only
    when the server's --max-logprobs is -1 (else a 400 naming the field and the option)."""
    eng = srv.aeng.engine
    vocab = eng.vocab_size
    chat = {"messages": CHAT, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": -1}
    cmpl = {"prompt": "The sea is", "max_tokens": 1, "temperature": 0, "prompt_logprobs": -1}
    assert_error(srv.post("/v1/chat/completions", chat), 400, param="top_logprobs",
                 contains=("whole vocabulary", "max_logprobs"))
    assert_error(srv.post("/v1/completions", cmpl), 400, param="prompt_logprobs", contains=("whole vocabulary",))
    assert_error(srv.post("/v1/chat/completions", {**chat, "top_logprobs": -2}), 400, param="top_logprobs")
    config = eng.config
    eng.config = dataclasses.replace(config, max_logprobs=-1)  # as `serve --max-logprobs -1`
    try:
        c = srv.post("/v1/chat/completions", chat).json()
        (tok,) = c["choices"][0]["logprobs"]["content"]
        assert len(tok["top_logprobs"]) == vocab
        lps = [t["logprob"] for t in tok["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and tok["top_logprobs"][0]["logprob"] == tok["logprob"]  # greedy
        assert math.isclose(sum(math.exp(x) for x in lps), 1.0, rel_tol=1e-3)
        r = srv.post("/v1/completions", cmpl).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and all(len(e) == vocab for e in plp[1:])
        assert {v["rank"] for v in plp[1].values()} == set(range(1, vocab + 1))
        # echo + logprobs 1 with prompt_logprobs -1: the echoed prompt keeps its top 1 (+ the token itself)
        e = srv.post("/v1/completions", {**cmpl, "echo": True, "logprobs": 1}).json()["choices"][0]
        assert all(len(e["prompt_logprobs"][j]) == vocab for j in range(1, len(plp)))
        assert all(1 <= len(t) <= 2 for t in e["logprobs"]["top_logprobs"][1:])
    finally:
        eng.config = config
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_unimplemented_extras_left_at_their_defaults_are_fine(srv: Srv) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "guided_json": None, "use_beam_search": False,
            "truncate_prompt_tokens": None, "prompt_logprobs": None, "bad_words": [], "logits_processors": [],
            "guided_regex": ""}
    assert srv.post("/v1/completions", body).status_code == 200
    body = {"messages": CHAT, "max_tokens": 2, "echo": False, "continue_final_message": False,
            "chat_template_kwargs": {}}
    assert srv.post("/v1/chat/completions", body).status_code == 200


def test_unknown_model_404_and_unknown_route(srv: Srv) -> None:
    assert_error(srv.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404, param="model",
                 contains=("gpt-4",))
    assert_error(srv.post("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}), 404, param="model")
    assert_error(srv.http.get("/v1/nothing"), 404)
    r = srv.http.get("/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods the route takes
    with pytest.raises(openai.NotFoundError):
        srv.client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def test_openai_client_sees_bad_request(srv: Srv) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=400)
    assert str(MAX_MODEL_LEN) in str(e.value)
    with pytest.raises(openai.BadRequestError):
        srv.client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # a bad streaming request fails before the stream starts
        srv.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1, stream=True)


def test_bad_input_leaves_engine_clean(srv: Srv) -> None:
    # one bad request of its own, so that the test holds when run alone (-k) as after the ones above
    assert_error(srv.post("/v1/chat/completions", {"messages": CHAT, "temperature": -1}), 400, param="temperature")
    s = srv.wait_idle()
    assert s["num_waiting"] == 0
    metrics = srv.http.get("/metrics").text
    assert 'pageflash:request_errors_total{model_name="smollm2-135m",status="400"}' in metrics
    assert 'status="500"' not in metrics


def test_api_key_and_body_limit() -> None:
    # A second app over a stub engine: auth and size checks come before any generation.

    stub = SimpleNamespace(tokenizer=None, model_name="stub", max_model_len=64, get_stats=lambda: {},
                           has_unfinished_requests=lambda: False)
    aeng = AsyncLLMEngine(stub)  # type: ignore[arg-type]
    try:
        with serve(build_app(aeng, "stub", api_key="sekret", max_body_bytes=2048)) as base, \
                httpx.Client(base_url=base) as http:
            assert_error(http.get("/v1/models"), 401, contains=("API key",))
            assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(http.get("/v1/models", headers={"Authorization": "sekret"}), 401)
            assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 401)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
            ok = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0).models.list()
            assert [m.id for m in ok.data] == ["stub"]
            assert http.get("/health").status_code == 200  # open, like /metrics
            auth = {"Authorization": "Bearer sekret"}
            big = json.dumps({"prompt": "x" * 5000})
            assert_error(http.post("/v1/completions", content=big, headers=auth), 413, contains=("2048",))

            def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
                for _ in range(10):
                    yield b" " * 1000

            assert_error(http.post("/v1/completions", content=chunks(), headers=auth), 413)

            # CORS (vLLM's defaults): a browser's preflight needs no key; answers name the origin
            pre = http.options("/v1/chat/completions", headers={
                "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
            assert "POST" in pre.headers["access-control-allow-methods"]
            r = http.get("/v1/models", headers={**auth, "Origin": "http://ui.example"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    finally:
        aeng.shutdown()


def test_internal_error_is_a_500_that_keeps_the_connection() -> None:
    """A bug in an endpoint is an OpenAI-shaped 500, and the client's keep-alive connection stays
    open for its next request (Starlette answers the 500 and re-raises: uvicorn then closed the
    connection, and a client's next request on it failed with a reset)."""
    stub = SimpleNamespace(tokenizer=None, model_name="stub", max_model_len=64, get_stats=lambda: {},
                           has_unfinished_requests=lambda: False)
    aeng = AsyncLLMEngine(stub)  # type: ignore[arg-type]
    app = build_app(aeng, "stub")

    def broken() -> None:
        raise RuntimeError("a bug")

    app.state.serving.model_cards = broken
    try:
        with serve(app) as base:
            host, port = base.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                f = sock.makefile("rb")

                def get(path: str) -> tuple[int, bytes]:
                    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                    status = int(f.readline().split()[1])
                    length = 0
                    while (line := f.readline()) not in (b"\r\n", b""):
                        name, _, value = line.decode().partition(":")
                        if name.lower() == "content-length":
                            length = int(value)
                    return status, f.read(length)

                status, body = get("/v1/models")
                assert status == 500
                err = json.loads(body)["error"]
                assert err["type"] == "server_error" and "RuntimeError: a bug" in err["message"]
                assert get("/health") == (200, b"")  # the same connection
    finally:
        aeng.shutdown()


def test_cors_flags() -> None:
    from pageflash.server.app import make_arg_parser

    p = make_arg_parser()
    a = p.parse_args(["--allowed-origins", '["http://a.example"]', "--allow-credentials"])
    assert a.allowed_origins == ["http://a.example"] and a.allow_credentials and a.allowed_methods == ["*"]
    for bad in ("http://a.example", '"*"', "[1]"):
        with pytest.raises(SystemExit):
            p.parse_args(["--allowed-origins", bad])
    assert p.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])


# --------------------------------------------------------------------------- disconnects
def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_stream_disconnect_frees_blocks_at_once(srv: Srv) -> None:
    srv.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with srv.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 2:
                    break
        assert srv.aeng.get_stats()["num_free_blocks"] < srv.aeng.get_stats()["num_total_blocks"]
    t0 = time.monotonic()
    srv.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 5  # far less than the ~200 steps the request had left
    m = srv.http.get("/metrics").text
    assert _metric(m, "pageflash:num_kv_blocks_free") == _metric(m, "pageflash:num_kv_blocks_total")
    assert _metric(m, "pageflash:num_requests_running") == 0
    assert 'finished_reason="abort"' in m


def test_chat_stream_disconnect_through_openai_client(srv: Srv) -> None:
    srv.wait_idle()
    stream = srv.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    srv.wait_idle(timeout=5)


def test_disconnect_while_sending_the_body_is_no_server_error(srv: Srv) -> None:
    """A client gone before its body is whole is counted as a 499 (client closed), not as a 500
    internal error with a traceback."""
    def errors(status: str) -> float:
        line = f'pageflash:request_errors_total{{model_name="{MODEL}",status="{status}"}}'
        return next((float(x.rsplit(" ", 1)[1]) for x in srv.http.get("/metrics").text.splitlines()
                     if x.startswith(line)), 0.0)

    before = errors("499"), errors("500")
    host, port = srv.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while errors("499") == before[0]:
        assert time.monotonic() < deadline, "the disconnect was not counted as a 499"
        time.sleep(0.05)
    assert errors("500") == before[1]


def test_non_stream_disconnect_frees_blocks(srv: Srv) -> None:
    srv.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        srv.http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    srv.wait_idle(timeout=5)


# --------------------------------------------------------------------------- load and metrics
def test_32_concurrent_streaming_clients(srv: Srv) -> None:
    srv.wait_idle()
    n_clients = 32

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None, int]:
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return i, text, finish, usage

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n_clients))), 150)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(results) == n_clients
    for i, text, finish, usage in results:
        assert finish == "length" and usage == 4
        assert text == srv.refs["load"][i % len(LOAD_PROMPTS)], i
    srv.wait_idle()
    assert elapsed < 150


def test_metrics_exposition(srv: Srv) -> None:
    m = srv.http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in [
        "pageflash:num_requests_running", "pageflash:num_requests_waiting", "pageflash:kv_cache_usage_perc",
        "pageflash:prefix_cache_queries_total", "pageflash:prefix_cache_hits_total",
        "pageflash:prompt_tokens_total", "pageflash:generation_tokens_total",
        "pageflash:time_to_first_token_seconds_bucket", "pageflash:time_per_output_token_seconds_bucket",
        "pageflash:e2e_request_latency_seconds_bucket", "pageflash:request_success_total",
    ]:
        assert name in text, name
    assert _metric(text, "pageflash:generation_tokens_total") > 0
    assert _metric(text, "pageflash:time_to_first_token_seconds_count") > 0
    assert 'finished_reason="length"' in text
    assert _metric(text, "pageflash:prefix_cache_hits_total") > 0  # the load test repeats prompts


def test_metrics_count_each_engine_request(srv: Srv) -> None:
    """As vLLM's: every engine request (each prompt x each of n choices; each embedding input) is a
    request in /metrics: its own latency, first token, prompt length, generated tokens and success."""
    srv.wait_idle()

    def total(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    names = ["e2e_request_latency_seconds_count", "time_to_first_token_seconds_count", "request_success_total",
             "request_prompt_tokens_count", "request_prompt_tokens_sum", "request_generation_tokens_count",
             "request_generation_tokens_sum"]
    before = {n: total(srv.http.get("/metrics").text, "pageflash:" + n) for n in names}
    r = srv.client.completions.create(model=MODEL, prompt=["Hello there", "a b c d e"], max_tokens=3, n=2,
                                      temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    tok = srv.aeng.tokenizer
    lens = [len(tok.encode(p)) for p in ("Hello there", "a b c d e")]
    after = {n: total(srv.http.get("/metrics").text, "pageflash:" + n) for n in names}
    d = {n: after[n] - before[n] for n in names}
    assert r.usage.prompt_tokens == sum(lens) and r.usage.completion_tokens == 12
    for n in ("e2e_request_latency_seconds_count", "time_to_first_token_seconds_count", "request_success_total",
              "request_prompt_tokens_count", "request_generation_tokens_count"):
        assert d[n] == 4, (n, d)
    assert d["request_prompt_tokens_sum"] == 2 * sum(lens) and d["request_generation_tokens_sum"] == 12, d
    srv.client.embeddings.create(model=MODEL, input=["one", "two", "three"])
    final = {n: total(srv.http.get("/metrics").text, "pageflash:" + n) for n in names}
    assert final["e2e_request_latency_seconds_count"] - after["e2e_request_latency_seconds_count"] == 3
    assert final["request_success_total"] - after["request_success_total"] == 3


# --------------------------------------------------------------------------- n > 1
# Last among the engine tests: should n > 1 ever wedge the engine, the client's timeout aborts the
# request and the failure stays here instead of spreading to the tests after it.
def test_completion_n_and_seed(srv: Srv) -> None:
    client = srv.client.with_options(timeout=20)  # bounded: a stuck request is aborted on timeout
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7)
    r1 = client.completions.create(n=3, **kw)
    assert sorted(c.index for c in r1.choices) == [0, 1, 2]
    r2 = client.completions.create(n=3, **kw)
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]  # the seed makes it reproducible
    chunks = list(client.completions.create(n=2, stream=True, **kw))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 2


def test_chat_n_and_content_parts(srv: Srv) -> None:
    parts = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
    r = srv.client.with_options(timeout=20).chat.completions.create(model=MODEL, messages=parts, max_tokens=3,
                                                                    temperature=0.7, n=2, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 6


# --------------------------------------------------------------------------- `pageflash serve`
def test_main_wires_flags_to_llm_and_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    seen: dict[str, Any] = {}

    class StubLLM:
        def __init__(self, model: str, **kw: Any) -> None:
            seen["model"], seen["kw"] = model, kw
            self.llm_engine = SimpleNamespace(tokenizer=None, model_name=model, max_model_len=128,
                                              get_stats=lambda: {}, has_unfinished_requests=lambda: False)

    def fake_run(app: Any, engine: Any, **kw: Any) -> None:
        seen["app"], seen["uvicorn"] = app, kw
        assert engine is app.state.engine

    monkeypatch.setattr("pageflash.llm.LLM", StubLLM)
    monkeypatch.setattr(server_app, "serve_uvicorn", fake_run)
    server_app.main(["serve", MODEL, "--port", "8123", "--max-model-len", "128", "--dtype", "float32",
                     "--num-kv-blocks", "64", "--seed", "3", "--served-model-name", "a", "b", "--api-key", "k"])
    assert seen["model"] == MODEL
    kw = seen["kw"]
    assert (kw["max_model_len"], kw["dtype"], kw["num_kv_blocks"], kw["seed"]) == (128, "float32", 64, 3)
    assert seen["uvicorn"]["port"] == 8123 and seen["uvicorn"]["host"] == "127.0.0.1"
    assert not seen["app"].state.engine.is_running  # main shut the engine down after uvicorn returned
    assert seen["app"].state.serving.model_names == ["a", "b"]
    server_app.main(["--model", "other", "--max-num-seqs", "4"])
    assert seen["model"] == "other" and seen["kw"]["max_num_seqs"] == 4
    assert seen["app"].state.serving.model_names == ["other"]
    assert seen["app"].state.serving.chat_template is None
    assert not seen["app"].state.serving.trust_request_chat_template
    server_app.main(["--model", "other", "--chat-template", "{{ messages[0]['content'] }}",
                     "--trust-request-chat-template"])
    assert seen["app"].state.serving.chat_template == "{{ messages[0]['content'] }}"
    assert seen["app"].state.serving.trust_request_chat_template
    # no --api-key: $PAGEFLASH_API_KEY, else vLLM's $VLLM_API_KEY (a deployment moved from vLLM stays closed)
    from fastapi.testclient import TestClient

    for env, key in (("VLLM_API_KEY", "v-key"), ("PAGEFLASH_API_KEY", "p-key")):
        monkeypatch.setenv(env, key)
        server_app.main(["--model", "other"])
        client = TestClient(seen["app"])
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_streams_at_once_and_exits_0(sig: str, tmp_path: Any) -> None:
    """`pageflash serve` stopped by SIGTERM (what systemd / Kubernetes send) or SIGINT with a stream in
    flight: the stream ends at once with an error event and [DONE], not cut off after uvicorn's graceful
    wait; no traceback is logged; the process exits with status 0 (vLLM's), not 143."""
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pageflash.cli import main; sys.exit(main())",
                             "serve", MODEL, "--port", str(port), "--max-model-len", "256", "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        lines = []
        with httpx.stream("POST", base + "/v1/completions", timeout=60, json=dict(
                model=MODEL, prompt="Once upon a time", max_tokens=200, ignore_eos=True, stream=True)) as r:
            it = r.iter_lines()
            for line in it:  # the first tokens arrive: the request is running
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    break
            t0 = time.monotonic()
            proc.send_signal(getattr(signal, sig))
            lines = [line for line in it if line]
            ended = time.monotonic() - t0
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert any('"error"' in line for line in lines), lines[-3:]
        assert ended < 4.0, ended  # uvicorn's graceful wait is 5 s
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


def test_temperature_above_openais_two_is_taken_as_vllm_takes_it(srv: Srv) -> None:
    """vLLM's completions and chat take any finite temperature >= 0 (OpenAI caps it at 2)."""
    r = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=2.5, seed=1)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    r = srv.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=4.0, seed=1)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_continuous_usage_is_per_choice_and_needs_include_usage(srv: Srv) -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is its own choice's (its prompt's tokens, its
    own generated tokens so far), only with include_usage; the closing chunk holds the whole
    request's. A prompt too long for the context is a 400 in OpenAI's words ("maximum context length")."""
    def events(path: str, body: dict) -> list[dict]:
        with httpx.stream("POST", f"{srv.base}{path}", json={**body, "stream": True}, timeout=120) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 3, "temperature": 1,
            "seed": 3, "ignore_eos": True, "stream_options": opts}
    evs = events("/v1/completions", body)
    tok = srv.aeng.tokenizer
    plen = [len(tok.encode(PROMPT)), len(tok.encode("Once upon a time"))]
    seen: dict[int, int] = {}
    for e in evs[:-1]:
        (c,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == plen[c["index"] // 2], e
        assert u["completion_tokens"] >= seen.get(c["index"], 0) and u["completion_tokens"] <= 3
        seen[c["index"]] = u["completion_tokens"]
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 12
    assert evs[-1]["usage"]["prompt_tokens"] == sum(plen)
    chat = events("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                           "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert chat and all(e.get("usage") is None for e in chat)
    for long in ({"prompt": "hi " * 300, "max_tokens": 2}, {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}):
        assert_error(srv.post("/v1/completions", {"model": MODEL, **long}), 400,
                     contains=("maximum context length is 256 tokens",))
