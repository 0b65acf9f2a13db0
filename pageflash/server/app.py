"""OpenAI-compatible HTTP server over an AsyncLLMEngine (FastAPI + uvicorn), as vLLM's.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streams ending with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus), GET /version.

Bad input never reaches the engine thread as an exception: bodies are size-bounded (413), parsed
strictly (400, OpenAI error body naming the field), the model name is checked (404), and
SamplingParams/engine ValueErrors become 400s. A client that disconnects (streaming or not) aborts
its requests at once, which frees their KV blocks before the engine's next step.

    pageflash serve --model smollm2-135m --host 127.0.0.1 --port 8000 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pageflash.engine.async_engine import AsyncLLMEngine, EngineError, RequestStream
from pageflash.engine.detokenizer import IncrementalDetokenizer, stop_holdback
from pageflash.server import protocol as P
from pageflash.server.metrics import CONTENT_TYPE_LATEST, RequestTimer, ServerMetrics
from pageflash.server.reasoning_parsers import REASONING_PARSERS
from pageflash.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pageflash.server")

__version__ = "0.1.0"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_CHOICES = 16384  # prompts x n per HTTP request (vLLM sets none; the body's size bounds the prompts)
LOGPROB_FLOOR = -9999.0  # -inf is not JSON; the openai client expects a float (vLLM clamps the same)


# --------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
             503: "server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | int | None = None, type_: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else status
        self.type = type_ or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        info = P.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return P.ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union-branch tags like 'list[int]' dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part) in ("str", "int", "float", "bool"):
            continue  # the name of a union branch, not a field
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _validation_error(e: pydantic.ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return APIError(400, f"Malformed JSON body: {errors[0]['msg']}", code="invalid_json")
    parts: list[str] = []
    first_param = None
    for err in errors:
        param = _loc_to_param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        named = False
        if param is None:  # a check across fields: the one its message starts with, if any
            head = re.match(r"\w+", msg)
            param = head.group(0) if head and head.group(0) in _REQUEST_FIELDS else None
            named = param is not None
        first_param = first_param or param
        text = f"{param}: {msg}" if param and not named else msg
        if err["type"] not in ("missing", "model_type") and "input" in err and param and not named:
            text += f" (got {json.dumps(err['input'], default=str)[:80]})"
        if text not in parts:
            parts.append(text)
    if len(parts) > 4:
        parts = parts[:4] + [f"... and {len(parts) - 4} more"]
    return APIError(400, "Invalid request: " + "; ".join(parts), param=first_param)


_REQUEST_FIELDS = frozenset(P.CompletionRequest.model_fields) | frozenset(P.ChatCompletionRequest.model_fields)

# request fields that LLMEngine.validate_request's errors may name (else the prompt is to blame)
_PARAMS_FIELDS = ("max_tokens", "allowed_token_ids", "prompt_logprobs", "logprobs", "structured_outputs", "logit_bias")


def _value_error(e: Exception, fields: Sequence[str] = ()) -> APIError:
    """A ValueError/TypeError from SamplingParams or the engine; param guessed from its message."""
    msg = str(e) or type(e).__name__
    param = next((f for f in fields if re.search(rf"\b{re.escape(f)}\b", msg)), None)
    return APIError(400, msg, param=param)


# --------------------------------------------------------------------------- SSE response
class SSEResponse(Response):
    """Streams an async iterator of SSE lines, watching for the client's disconnect throughout.

    Starlette's StreamingResponse only notices a disconnect on its next send under ASGI 2.4; here
    the body and a receive() watcher race, so a disconnect cancels the body at once (its `finally`
    aborts the engine requests) even while no token is being produced.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        # Not Response.__init__: that would render a body and declare its Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.body_iter = body
        self.on_close = on_close  # runs however the response ends, even if the body never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for chunk in self.body_iter:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(watch())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            try:
                results = await asyncio.gather(*tasks, return_exceptions=True)
                await self.body_iter.aclose()  # type: ignore[attr-defined]
            finally:
                if self.on_close is not None:
                    self.on_close()
        err = results[0]
        if isinstance(err, Exception) and not isinstance(err, OSError):
            logger.error("stream failed", exc_info=err)


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its `finally` closes the streams, which aborts the requests
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


# --------------------------------------------------------------------------- one generation
@dataclass
class _Choice:
    """What has been sent for one choice (index = prompt_index * n + output index)."""

    index: int
    prompt_idx: int
    text_len: int = 0  # characters of the cumulative text already sent
    num_tokens: int = 0  # token ids already sent (their logprobs too)
    # completions logprobs: (token id, its logprobs, its text offset) whose text starts in what is held
    # back, sent later
    lp_pending: list[tuple[int, Any, int]] = field(default_factory=list)
    started: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_generated: int = 0
    text: str = ""  # the cumulative text that may be sent so far (the final text at the end)


def _clamp(x: float) -> float:
    x = float(x)
    return max(x, LOGPROB_FLOOR) if x == x else LOGPROB_FLOOR  # NaN -> floor too


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave request streams as (stream index, RequestOutput); every stream is closed at the
    end, so leaving early (error, cancellation) aborts the unfinished requests."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    q.put_nowait((i, out))
                q.put_nowait((i, done))
            except Exception as e:
                q.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await q.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it stands for (bytes that are
    printable Latin-1 stand for themselves; the other 68 map to U+0100 upwards, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + extra)] = b
            extra += 1
    return out


class TokenBytes:
    """The UTF-8 bytes a token stands for (the logprobs' `bytes` field), also for tokens that hold
    part of a character and decode alone to U+FFFD: byte-level BPE pieces (GPT-2 / Llama 3 / SmolLM2)
    map back through the byte table, SentencePiece byte-fallback pieces (<0xE2>) are their byte, and
    anything else is its decoded text. Only id -> piece lookups, safe beside the engine thread."""

    _SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: dict[int, list[int]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.table = _gpt2_byte_decoder() if self.byte_level else {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        got = self.cache.get(token_id)
        if got is None:
            got = self.cache[token_id] = self._bytes(token_id, text)
        return got

    def _bytes(self, token_id: int, text: str) -> list[int]:
        try:
            piece = self.tok.convert_ids_to_tokens(token_id) if self.tok is not None else None
        except Exception:
            piece = None
        if isinstance(piece, str) and piece:
            if self.byte_level and all(c in self.table for c in piece):
                return [self.table[c] for c in piece]
            m = self._SP_BYTE.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
        return list(text.encode())


# (choice, new text, new token ids, their logprobs, their text offsets)
OnDelta = Callable[[_Choice, str, list[int], "list[dict[int, Any]] | None", "list[int] | None"], Any]


class _Generation:
    """The engine requests behind one HTTP request (prompts x n choices) and what was sent of them."""

    def __init__(self, streams: list[RequestStream], params: Any, timer: RequestTimer) -> None:
        self.streams = streams
        self.n = n = params.n
        self.timer = timer
        # While unfinished, the text's tail may be the start of a stop string that the engine will
        # cut off when it completes: hold back that many characters so no delta has to be taken back.
        self.holdback = stop_holdback(params.stop, params.include_stop_str_in_output)
        self.choices = [_Choice(index=i * n + j, prompt_idx=i) for i in range(len(streams)) for j in range(n)]
        self.prompt_tokens = [0] * len(streams)
        self.cached_tokens = [0] * len(streams)  # per prompt: its tokens found in the prefix cache
        self.prompt_ids: list[list[int]] = [[] for _ in streams]
        self.prompt_logprobs: list[Any] = [None] * len(streams)  # per prompt, when asked for (echo + logprobs)
        self.echo_only = False  # max_tokens 0 with echo: the one token generated is not returned

    def close(self) -> None:
        """Abort whatever is unfinished (a no-op after a normal end); safe to call more than once."""
        for stream in self.streams:
            stream.close()
        self._finish([c.finish_reason or "abort" for c in self.choices])

    def _finish(self, reasons: list[str | None]) -> None:
        """Record the choices in the metrics (once; later calls do nothing), each with its prompt's length."""
        self.timer.finish(reasons, [self.prompt_tokens[c.prompt_idx] for c in self.choices])

    def choice_usage(self, index: int) -> P.Usage:
        """One choice's usage so far (its prompt's tokens, its own generated ones): what vLLM's
        continuous_usage_stats puts on each of that choice's chunks."""
        ch = self.choices[index]
        i = ch.prompt_idx
        return self._usage(self.prompt_tokens[i], ch.num_generated, self.cached_tokens[i])

    def usage(self) -> P.Usage:
        return self._usage(sum(self.prompt_tokens), sum(c.num_generated for c in self.choices),
                           sum(self.cached_tokens))

    def _usage(self, prompt: int, generated: int, cached: int) -> P.Usage:
        completion = 0 if self.echo_only else generated
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    async def deltas(self, on_delta: OnDelta) -> AsyncIterator[Any]:
        """For each choice with news, yield on_delta(choice, new text, new token ids, their logprobs).

        Outputs carry cumulative text/token ids; a delta is what was not sent yet. A delta with
        new tokens but no new text (a partial UTF-8 character or a possible stop string held back)
        waits for the next one.
        """
        finished = False
        try:
            async for i, out in _merge(self.streams):
                self.prompt_tokens[i] = len(out.prompt_token_ids or [])
                self.cached_tokens[i] = out.num_cached_tokens or 0
                self.prompt_ids[i] = out.prompt_token_ids or []
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = out.prompt_logprobs
                for comp in out.outputs:
                    ch = self.choices[i * self.n + comp.index]
                    if ch.finish_reason is not None:
                        continue
                    ch.num_generated = len(comp.token_ids)
                    if comp.finish_reason is not None:
                        ch.finish_reason, ch.stop_reason = comp.finish_reason, comp.stop_reason
                        sendable = len(comp.text)
                    else:
                        sendable = len(comp.text) - self.holdback
                        if sendable <= ch.text_len:
                            continue
                    # what may be sent: a held-back tail (a possible stop string) is not the choice's text yet
                    ch.text = comp.text[:sendable]
                    delta = comp.text[ch.text_len : sendable]
                    new_ids = list(comp.token_ids[ch.num_tokens :])
                    new_lps = list(comp.logprobs[ch.num_tokens :]) if comp.logprobs is not None else None
                    offs = comp.text_offsets[ch.num_tokens :] if comp.text_offsets is not None else None
                    item = on_delta(ch, delta, new_ids, new_lps, offs)
                    ch.text_len, ch.num_tokens, ch.started = max(sendable, ch.text_len), len(comp.token_ids), True
                    if item is not None:
                        yield item
                self.timer.on_tokens([c.num_generated for c in self.choices])
            finished = True
        finally:
            self._finish([c.finish_reason if finished else "abort" for c in self.choices])


def _prompt_offsets(tokenizer: Any, ids: list[int], echoed: str) -> list[int]:
    """Where each prompt token's text starts in the echoed prompt text, as the engine's detokenizer
    builds text (special tokens kept; a token holding part of a character starts where that character
    does). A string prompt is echoed as given, without the BOS its encoding added: when the decoded
    text ends with the echoed one, offsets are moved back by what it has in front (BOS and its space)."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    out = []
    for t in ids:
        out.append(len(detok.output_text))
        detok.add_tokens([t])
    detok.flush()
    text = detok.output_text
    lead = len(text) - len(echoed) if text != echoed and text.endswith(echoed) else 0
    return [min(max(0, o - lead), len(echoed)) for o in out]


def _sse(obj: pydantic.BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json() if isinstance(obj, pydantic.BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


_DONE = "data: [DONE]\n\n"


# --------------------------------------------------------------------------- serving
class TokenizerWorker:
    """Prompt encoding, chat templates and prompt decoding on one worker thread with its own copy
    of the tokenizer (as vLLM tokenizes in its API front end, not in the engine loop): a huge prompt
    then takes the worker's time, not the engine thread's, which streams every other request. HF's
    fast tokenizers release the GIL while they encode. If the tokenizer cannot be copied, the work
    runs on the engine thread as before (`engine.call`)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.tok: Any = None
        if engine.tokenizer is not None:
            try:
                self.tok = copy.deepcopy(engine.tokenizer)
            except Exception as e:  # pragma: no cover - depends on the tokenizer class
                logger.warning("tokenizer copy failed (%s); prompts are encoded on the engine thread", e)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pageflash-tokenize") if self.tok else None

    async def run(self, fn: Callable[[Any], Any], what: str, param: str) -> Any:
        """fn(tokenizer) off the engine thread; its errors are the request's fault (400)."""
        try:
            if self.pool is None:
                return await self.engine.call(lambda e: fn(e.tokenizer))
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, self.tok)
        except EngineError as e:
            raise APIError(503, f"The engine is not available: {e}") from None
        except Exception as e:
            raise APIError(400, f"{what}: {type(e).__name__}: {e}", param=param) from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class OpenAIServing:
    """The endpoints' logic; one per app, shared by all requests (holds no per-request state)."""

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], max_body_bytes: int,
                 chat_template: str | None = None, trust_request_chat_template: bool = False) -> None:
        self.engine = engine
        self.model_names = model_names
        self.loras: dict[str, Any] = {}  # served LoRA adapters: model name -> LoRARequest (build_app)
        self.next_lora_id = 0  # the last lora_int_id handed out (adapters loaded at run time take the next)
        self.lora_loading: set[str] = set()
        self.max_body_bytes = max_body_bytes
        self.chat_template = chat_template  # replaces the tokenizer's (--chat-template)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser: Any = None  # set by build_app (--enable-auto-tool-choice --tool-call-parser)
        self.reasoning_parser: Any = None  # set by build_app (--reasoning-parser)
        self.return_tokens_as_token_ids = False  # set by build_app (--return-tokens-as-token-ids)
        self.metrics = ServerMetrics(engine, model_names[0])
        self.tokenizer = TokenizerWorker(engine)
        self.token_bytes = TokenBytes(engine.tokenizer)
        tok = engine.tokenizer
        vocab = getattr(engine.engine, "vocab_size", None)
        self.vocab_size: int | None = vocab if isinstance(vocab, int) else (len(tok) if tok is not None else None)

    # ---- parsing and checks
    async def read_json(self, request: Request, cls: type[pydantic.BaseModel]) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body of {declared} bytes is over the limit of {limit} bytes",
                           code="request_too_large")  # fmt: skip
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"Request body is over the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body was whole: not a server error
            raise APIError(499, "client disconnected", code="client_disconnected") from None
        try:
            return cls.model_validate_json(b"".join(chunks))
        except pydantic.ValidationError as e:
            raise _validation_error(e) from None

    def response_model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.loras:
            served = ", ".join(self.model_names + list(self.loras))
            raise APIError(404, f"The model `{requested}` does not exist (served: {served})",
                           param="model", code="model_not_found")  # fmt: skip
        return requested

    def lora_for(self, model: str) -> Any:
        """The LoRARequest a request's (known) model name runs under; None for the base model. Taken
        as soon as the name is checked: an adapter unloaded while the request is prepared (prompts
        tokenized, a chat template rendered, a constraint compiled) still runs it, as it does the
        requests already running under it -- never the base model in its place."""
        return self.loras.get(model)

    def model_cards(self) -> list[P.ModelCard]:
        """/v1/models: the base model's names, then the adapters (parent: the base model, as vLLM)."""
        e = self.engine
        cards = [P.ModelCard(id=n, root=e.model_name, max_model_len=e.max_model_len) for n in self.model_names]
        cards += [P.ModelCard(id=name, root=r.lora_path, parent=r.base_model_name or self.model_names[0],
                              max_model_len=e.max_model_len) for name, r in self.loras.items()]
        return cards

    # ---- runtime LoRA updates (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter)
    async def load_lora_adapter(self, request: Request) -> Response:
        """Serve a new adapter under lora_name, read (and checked against the model) now: 400 for a bad
        folder or a name already served."""
        from pageflash.lora.request import LoRARequest

        body: P.LoadLoRAAdapterRequest = await self.read_json(request, P.LoadLoRAAdapterRequest)
        name = body.lora_name
        if not name:
            raise APIError(400, "lora_name must not be empty", param="lora_name")
        if name in self.loras or name in self.model_names or name in self.lora_loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self.lora_loading.add(name)  # (a second load of the name while this one reads the folder: a 400)
        try:
            self.next_lora_id += 1
            lora = LoRARequest(name, self.next_lora_id, body.lora_path)
            await self.engine.call(lambda eng: eng.add_lora(lora))
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="lora_path") from None
        finally:
            self.lora_loading.discard(name)
        self.loras[name] = lora
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Stop serving an adapter (requests running under it finish under it): 404 if unknown."""
        body: P.UnloadLoRAAdapterRequest = await self.read_json(request, P.UnloadLoRAAdapterRequest)
        lora = self.loras.get(body.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")  # fmt: skip
        del self.loras[body.lora_name]
        await self.engine.call(lambda eng: eng.remove_lora(lora.lora_int_id))
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def sampling_params(self, kw: dict[str, Any], constraint_field: str | None = None) -> Any:
        """SamplingParams(**kw), a 400 naming the field at fault; constraint_field: the request field an
        output constraint came from (response_format, guided_json, tools, ...)."""
        from pageflash.sampling_params import SamplingParams

        eng = self.engine.engine
        kw = dict(kw)
        defaulted = False
        if "max_tokens" in kw:  # vLLM's: max_new_tokens of the generation config is the default, and an
            default = eng.default_sampling.get("max_tokens")  # override's also the ceiling
            if kw["max_tokens"] is None:
                kw["max_tokens"] = default
                defaulted = default is not None
            elif eng.max_tokens_ceiling is not None:
                kw["max_tokens"] = min(kw["max_tokens"], eng.max_tokens_ceiling)
        try:
            # the fields a request leaves unset take the model's defaults (generation_config.json)
            params = SamplingParams(**{**eng.default_sampling, **kw})
            params.max_tokens_defaulted = defaulted  # (fit_room may cut it to a prompt's room)
            return params
        except (ValueError, TypeError) as e:
            err = _value_error(e, list(kw))
            if err.param == "structured_outputs" and constraint_field:
                err.param = constraint_field
            raise err from None

    async def compile_constraint(self, params: Any, field: str) -> None:
        """Compile a request's output constraint on the worker thread (a large schema or choice list
        takes the worker's time, not the engine thread's); the engine then copies the cached matcher.
        Its bad_words are tokenized there too (cached by the engine for add_request)."""
        eng = self.engine.engine
        if params.bad_words:
            words = params.bad_words
            await self.tokenizer.run(lambda tok: eng.bad_word_ids(words, tok), "Cannot tokenize bad_words", "bad_words")
        so = params.structured_outputs
        if so is None:
            return

        def compile_it(_tok: Any) -> str | None:
            try:
                eng.structured_outputs().matcher(so)
            except (ValueError, TypeError) as e:
                return str(e)
            return None

        err = await self.tokenizer.run(compile_it, "Invalid output constraint", field)
        if err is not None:
            raise APIError(400, err, param=field)

    def fit_room(self, ids: list[int], params: Any) -> Any:
        """params for the prompt ids: a max_tokens that came from the model's default (not the request)
        cut to the prompt's room, as vLLM's (a copy; params itself when it fits)."""
        room = self.engine.max_model_len - len(ids)
        if getattr(params, "max_tokens_defaulted", False) and params.max_tokens > room > 0:
            params = params.clone()
            params.max_tokens = room
        return params

    def validate(self, ids: list[int], params: Any, param: str, what: str | None = None) -> None:
        """The engine's own length rules (`LLMEngine.validate_request`, which only reads limits), checked
        here so that an over-long prompt never reaches the engine thread. param: the field to blame
        unless the error names one of _PARAMS_FIELDS; what: a prefix for the message."""
        try:
            self.engine.engine.validate_request(ids, params, compile_constraints=False)
        except ValueError as e:
            err = _value_error(e, _PARAMS_FIELDS)
            if err.param is None:
                err.param = param
                if what:
                    err.message = f"{what}: {err.message}"
            raise err from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        vocab = self.vocab_size
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def add_all(self, base_id: str, prompts: list[Any], params: Any, param: str = "prompt",
                      lora: Any = None) -> list[RequestStream]:  # fmt: skip
        """Add one engine request per prompt (under the LoRA adapter lora, if any); on any refusal abort
        those already added. params: one for all, or a list of one per prompt. param: the request
        field the prompts came from ("prompt" or "messages"), named by a refusal's error."""
        streams: list[RequestStream] = []
        i = 0
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                p = params[i] if isinstance(params, list) else params
                streams.append(await self.engine.add_request(rid, prompt, p, lora))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, EngineError):
                raise APIError(503, f"The engine is not available: {e}") from None
            if isinstance(e, (ValueError, TypeError)):
                err = _value_error(e, _PARAMS_FIELDS)
                if err.param is None:
                    err.param = param if len(prompts) == 1 else f"{param}[{i}]"
                raise err from None
            raise
        return streams

    # ---- logprobs
    def decoded(self, token_id: int, lp: Any, as_id: bool = False) -> str:
        """A token's text for logprobs; as_id: "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        tok = getattr(lp, "decoded_token", None)
        if tok is not None:
            return tok
        try:  # an id -> string lookup: safe beside the engine thread
            return str(self.engine.tokenizer.convert_ids_to_tokens(token_id))
        except Exception:
            return f"token_id:{token_id}"

    @staticmethod
    def _ranked(d: dict[int, Any] | None) -> list[tuple[int, Any]]:
        return sorted((d or {}).items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))

    def completion_logprobs(self, ch: _Choice, ids: list[int], lps: list[dict[int, Any]] | None,
                            offsets: list[int] | None, sent: int, final: bool,
                            as_ids: bool = False) -> P.CompletionLogprobs | None:  # fmt: skip
        """The delta's tokens for the logprobs; offsets: where each one's text starts (the engine's
        CompletionOutput.text_offsets). sent: characters of generated text sent once this delta is
        (text held back for a possible stop string is not). A token whose text starts in the held-back
        text waits for a later delta: a stop string may still cut the text before it, and its offset
        is then the cut. At the end (final) every token goes."""
        if lps is None:
            return None
        out = P.CompletionLogprobs()
        pending = ch.lp_pending
        pending.extend(zip(ids, lps, offsets if offsets is not None else [sent] * len(ids)))
        done = 0
        for tid, d, off in pending:
            if not final and off >= sent:
                break
            self._add_token(out, tid, d, None, min(off, sent), as_ids)
            done += 1
        del pending[:done]
        return out

    def prompt_logprob_part(self, ids: list[int], plp: list[Any] | None, first: str | None,
                            offsets: list[int], k: int, as_ids: bool = False) -> P.CompletionLogprobs:  # fmt: skip
        """Completions logprobs of the echoed prompt: the first token (text `first`) has none (null),
        as in vLLM; offsets: where each token's text starts (`_prompt_offsets`); k: top entries kept."""
        out = P.CompletionLogprobs()
        for j, tid in enumerate(ids):
            d = plp[j] if plp is not None and j < len(plp) else None
            if d is not None:
                d = {t: v for t, v in d.items() if t == tid or (v.rank is not None and v.rank <= k)}
            self._add_token(out, tid, d, first if j == 0 and not as_ids else None, offsets[j], as_ids)
        return out

    def prompt_logprobs_field(self, plp: list[Any] | None, ids: list[int], k: int) -> P.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token its own entry and the top k (the first null; k -1:
        all the engine returned, the whole vocabulary)."""
        if plp is None:
            return None
        k = _top_count(k)
        out: P.PromptLogprobs = []
        for j, d in enumerate(plp):
            if d is None:
                out.append(None)
                continue
            tid = ids[j] if j < len(ids) else None
            out.append({str(t): P.PromptLogprob(logprob=_clamp(v.logprob), rank=v.rank, decoded_token=self.decoded(t, v))
                        for t, v in self._ranked(d) if t == tid or (v.rank is not None and v.rank <= k)})  # fmt: skip
        return out

    def _add_token(self, out: P.CompletionLogprobs, tid: int, d: dict[int, Any] | None, text: str | None,
                   offset: int, as_ids: bool = False) -> None:  # fmt: skip
        """One token of completions logprobs: its text (decoded unless given), logprob, top ones and
        offset; no logprobs (null) when d is None (an echoed prompt's first token)."""
        lp = (d or {}).get(tid)
        out.tokens.append(text if text is not None else self.decoded(tid, lp, as_ids))
        out.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
        top = {self.decoded(t, v, as_ids): _clamp(v.logprob) for t, v in self._ranked(d)} if d is not None else None
        out.top_logprobs.append(top or None)
        out.text_offset.append(offset)

    def chat_logprobs(self, ids: list[int], lps: list[dict[int, Any]] | None, k: int,
                      as_ids: bool = False) -> P.ChatLogprobs | None:  # fmt: skip
        """as_ids: tokens as "token_id:ID" (bytes stay the token's own, so joining them still rebuilds
        the text)."""
        if lps is None:
            return None
        content = []
        for tid, d in zip(ids, lps):
            lp = (d or {}).get(tid)
            tok = self.decoded(tid, lp)
            top = []
            for t, v in [(t, v) for t, v in self._ranked(d) if v.rank is not None][: _top_count(k)]:
                s = self.decoded(t, v)
                top.append(P.ChatTopLogprob(token=self.decoded(t, v, as_ids), logprob=_clamp(v.logprob),
                                            bytes=self.token_bytes(t, s)))  # fmt: skip
            content.append(P.ChatTokenLogprob(token=self.decoded(tid, lp, as_ids),
                                              logprob=_clamp(lp.logprob) if lp is not None else LOGPROB_FLOOR,
                                              bytes=self.token_bytes(tid, tok), top_logprobs=top))  # fmt: skip
        return P.ChatLogprobs(content=content)

    async def render_chat(self, req: P.ChatCompletionRequest, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids (on the worker thread): the messages, tools and
        template options through the chat template (checked against the server's trust first)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template in a request needs a server started with --trust-request-chat-template",
                           param="chat_template")  # fmt: skip
        template = req.chat_template if req.chat_template is not None else self.chat_template
        messages = req.template_messages()

        def render(tok: Any) -> tuple[str, list[int]]:
            if tok is None:
                raise ValueError("this model has no tokenizer (dummy weights)")
            text = tok.apply_chat_template(messages, tools=req.template_tools(), chat_template=template,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=bool(req.continue_final_message), tokenize=False,
                                           **(req.chat_template_kwargs or {}))  # fmt: skip
            # The template writes its own special tokens (BOS etc.): do not add them twice.
            return text, list(tok.encode(text, add_special_tokens=add_special_tokens))

        return await self.tokenizer.run(render, "Cannot apply the chat template", "messages")

    async def completions_beam_search(self, request: Request, req: P.CompletionRequest, raw: list[Any],
                                      model: str, lora: Any) -> Response:  # fmt: skip
        for name in ("echo", "logprobs"):
            if getattr(req, name):
                raise APIError(400, f"use_beam_search does not take {name}", param=name)
        ids_list = []
        for i, p in enumerate(raw):
            name = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            if isinstance(p, list):
                self.check_token_ids(p, name)
                ids_list.append(p)
            elif not p:
                raise APIError(400, f"{name} must not be empty", param=name)
            else:
                ids_list.append(await self.tokenizer.run(lambda t, p=p: list(t.encode(p)), "Cannot tokenize the prompt",
                                                         name))  # fmt: skip
        results, usage = await self.beam_search(request, req, ids_list, req.max_tokens, "prompt", lora)
        choices = [P.CompletionChoice(index=i * req.n + j, text=s.output_text or "", finish_reason=s.finish_reason)
                   for i, r in enumerate(results) for j, s in enumerate(r.sequences)]  # fmt: skip
        body = P.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    # ---- beam search (vLLM's use_beam_search)
    async def beam_search(self, request: Request, req: Any, prompts: list[list[int]], max_tokens: int | None,
                          param: str, lora: Any) -> tuple[list[Any], P.Usage]:  # fmt: skip
        """Beam search with n beams (pageflash.beam_search.BeamSearch), its rounds of one-token
        requests run through the async engine. Returns per prompt its BeamSearchOutput (best n
        first, texts decoded on the worker thread) and the usage (prompt tokens, the returned
        beams' generated tokens). A request that sets what beam search does not take is a 400."""
        from pageflash.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
        from pageflash.sampling_params import SamplingParams

        bad = req.beam_search_conflicts()
        if bad:
            raise APIError(400, f"use_beam_search ranks the model's own log-probabilities and takes only n, the "
                                f"length limit, length_penalty and ignore_eos; not {', '.join(bad)}", param=bad[0])
        if req.n > MAX_BEAM_WIDTH:
            raise APIError(400, f"use_beam_search: n (the beam width) must be at most {MAX_BEAM_WIDTH}, got {req.n}",
                           param="n")  # fmt: skip
        # each prompt's room as for any request (max_tokens past it: a 400); None: to the end of the context
        check = SamplingParams(max_tokens=max_tokens)
        for i, ids in enumerate(prompts):
            self.validate(ids, check, param if len(prompts) == 1 else f"{param}[{i}]")
        try:
            bp = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens or self.engine.max_model_len,
                                  ignore_eos=bool(req.ignore_eos),
                                  length_penalty=1.0 if req.length_penalty is None else req.length_penalty)
            search = BeamSearch(self.engine.engine, prompts, bp)
        except (ValueError, TypeError) as e:
            raise _value_error(e, ["n", "length_penalty"]) from None
        rid = f"beam-{uuid.uuid4().hex}"
        timer = self.metrics.timer()
        cached = [0] * len(prompts)  # per prompt: its tokens found in the prefix cache (first round)

        async def rounds() -> None:
            r = 0
            while todo := search.pending():
                owners = search.prompt_of_pending()
                streams = await self.add_all(f"{rid}-{r}", [{"prompt_token_ids": t} for t in todo], search.step_params,
                                             param, lora)  # fmt: skip
                try:
                    tops = []
                    for stream in streams:
                        last = None
                        async for out in stream:
                            last = out
                        if last is None or not last.finished or not last.outputs[0].logprobs:
                            raise APIError(500, "beam search: a round's request ended without its token")
                        tops.append(last.outputs[0].logprobs[0])
                        if r == 0:  # (later rounds' prompts are the beams, cached by the search itself)
                            cached[owners[len(tops) - 1]] = last.num_cached_tokens or 0
                finally:
                    for stream in streams:
                        stream.close()
                search.advance(tops)
                r += 1

        reasons: list[str | None] = [None] * len(prompts)
        prompt_lens, generated = [len(p) for p in prompts], [0] * len(prompts)
        try:
            await _run_request(request, rounds())
            results = await self.tokenizer.run(lambda tok: search.results(tok), "Cannot decode the beams", param)
            reasons = [s.finish_reason for r in results for s in r.sequences]
            generated = [len(s.output_token_ids) for r in results for s in r.sequences]
            prompt_lens = [len(p) for p, r in zip(prompts, results) for _ in r.sequences]
        except EngineError as e:
            raise APIError(500, f"Engine error: {e}") from None
        finally:
            timer.finish(reasons, prompt_lens, generated)
        n_out = sum(len(s.output_token_ids) for r in results for s in r.sequences)
        n_in = sum(len(p) for p in prompts)
        return results, P.Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                                prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(cached)))

    # ---- /v1/responses (OpenAI's Responses API, the stateless text subset)
    async def responses(self, request: Request) -> Response:
        """A Responses API request run as the equivalent chat request: one assistant message item with
        one output_text part; streamed as Responses events (created, in_progress, output_item.added,
        content_part.added, output_text.delta..., output_text.done, content_part.done,
        output_item.done, then completed, or incomplete when max_output_tokens cut it)."""
        body: P.ResponsesRequest = await self.read_json(request, P.ResponsesRequest)
        model = self.response_model_name(body.model)
        lora = self.lora_for(model)
        shift = 1 if body.instructions else 0  # the system message instructions become comes first

        def ours(e: APIError) -> APIError:
            """An error about the equivalent chat request, in this request's terms."""
            def item(m: re.Match) -> str:
                return f"input[{int(m.group(1)) - shift}]"

            for old, new in (("max_tokens", "max_output_tokens"), ("response_format json_schema", "text.format"),
                             ("json_schema.schema", "text.format.schema"), ("response_format", "text.format")):
                e.message = e.message.replace(old, new)
            e.message = re.sub(r"messages\[(\d+)\]", item, e.message)
            if e.param is not None:
                e.param = re.sub(r"messages\[(\d+)\]", item, e.param)
                e.param = {"messages": "input", "max_tokens": "max_output_tokens",
                           "response_format": "text"}.get(e.param.split(".")[0], e.param)
            return e

        drop = 0
        while True:
            try:
                chat = P.ChatCompletionRequest.model_validate(body.chat_request(drop))
            except ValueError as e:  # (pydantic's ValidationError is a ValueError)
                err = _validation_error(e) if isinstance(e, pydantic.ValidationError) else APIError(400, str(e), param="text")
                raise ours(err) from None
            rendered, prompt_ids = await self.render_chat(chat)
            if not prompt_ids:
                raise APIError(400, "input: the chat template produced an empty prompt", param="input")
            kw = chat.sampling_kwargs()
            kw["max_tokens"] = chat.max_new_tokens
            field = "text" if chat.structured_from == "response_format" else chat.structured_from
            try:
                params = self.sampling_params(kw, field)
            except APIError as e:
                raise ours(e) from None
            await self.compile_constraint(params, field)
            params = self.fit_room(prompt_ids, params)
            try:
                self.validate(prompt_ids, params, "input", "the prompt (input after the chat template)")
                break
            except APIError as e:
                # truncation "auto" (OpenAI's): drop the oldest input items until the prompt fits
                if (body.truncation == "auto" and e.param in ("input", "max_tokens") and isinstance(body.input, list)
                        and drop + 1 < len(body.input)):
                    drop += 1
                    continue
                raise ours(e) from None
        rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        gen = _Generation(await self.add_all(rid, [{"prompt_token_ids": prompt_ids}], params, "input", lora),
                          params, self.metrics.timer())  # fmt: skip
        created = int(time.time())  # (an integer, as OpenAI's created_at)

        # With a --reasoning-parser the thought is a reasoning item before the message (the split as in
        # chat: a constrained output holds a thought only where it opens one itself).
        parser = self.reasoning_parser
        opened = parser is not None and params.structured_outputs is None and parser.starts_in_thought(rendered)
        rs_id = f"rs_{uuid.uuid4().hex}"

        def split(text: str, final: bool) -> tuple[str | None, str]:
            """(reasoning or None, content) settled so far; an empty thought counts as none."""
            if parser is None:
                return None, text
            part = parser.split(text, final, opened)
            return part.reasoning or None, part.content or ""

        def thought_ended(text: str) -> bool:
            return parser is not None and parser.split(text, True, opened).ended

        def items(status: str, text: str) -> list[dict[str, Any]]:
            thought, content = split(text, True)
            state = "completed" if status == "completed" else "incomplete"
            out = []
            if thought is not None:  # (a thought that reached </think> was complete, whatever cut the rest)
                out.append({"type": "reasoning", "id": rs_id, "summary": [],
                            "status": "completed" if thought_ended(text) else state,
                            "content": [{"type": "reasoning_text", "text": thought}]})  # fmt: skip
            out.append({"type": "message", "id": msg_id, "status": state, "role": "assistant",
                        "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
            return out

        def response(status: str, text: str | None = None, reason: str | None = None) -> dict[str, Any]:
            usage = None
            if status != "in_progress":
                u = gen.usage()
                usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                         "total_tokens": u.total_tokens,
                         "input_tokens_details": {"cached_tokens": sum(gen.cached_tokens), "cache_write_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
            return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                    "output": items(status, text) if text is not None else [], "usage": usage, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                    "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                    "temperature": body.temperature, "top_p": body.top_p, "text": body.text or {"format": {"type": "text"}},
                    "tool_choice": "none" if body.tool_choice is None else body.tool_choice, "tools": [],
                    "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
                    "reasoning": None, "store": False, "truncation": body.truncation, "metadata": body.metadata or {},
                    "user": body.user}  # fmt: skip

        def status_of(reason: str | None) -> str:
            return "incomplete" if reason == "length" else "completed"

        def on_delta(ch: _Choice, delta: str, ids: list[int], lps: Any, _offs: Any) -> tuple[str, str | None]:
            return delta, ch.finish_reason

        if body.stream:
            async def events() -> AsyncIterator[str]:
                seq = 0

                def event(kind: str, **fields: Any) -> str:
                    nonlocal seq
                    seq += 1
                    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

                # Items open as their text starts: the reasoning item (when a thought comes first), then
                # the message; output_index counts them in that order. The thought closes when the
                # content starts (or at the end); the message always comes, last.
                index: dict[str, int] = {}
                sent = {"reasoning": 0, "message": 0}
                closed: set[str] = set()

                def open_item(kind: str) -> Iterator[str]:
                    if kind in index:
                        return
                    i = index[kind] = len(index)
                    if kind == "reasoning":
                        yield event("response.output_item.added", output_index=i, item={
                            "type": "reasoning", "id": rs_id, "summary": [], "status": "in_progress", "content": []})
                        return
                    yield event("response.output_item.added", output_index=i, item={
                        "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []})
                    yield event("response.content_part.added", item_id=msg_id, output_index=i, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

                def close_reasoning(thought: str, state: str) -> Iterator[str]:
                    closed.add("reasoning")
                    i = index["reasoning"]
                    yield event("response.reasoning_text.done", item_id=rs_id, output_index=i, content_index=0, text=thought)
                    yield event("response.output_item.done", output_index=i, item={
                        "type": "reasoning", "id": rs_id, "summary": [], "status": state,
                        "content": [{"type": "reasoning_text", "text": thought}]})

                def send(text: str, final: bool, state: str = "completed") -> Iterator[str]:
                    thought, content = split(text, final)
                    if thought is not None and len(thought) > sent["reasoning"] and "reasoning" not in closed:
                        yield from open_item("reasoning")
                        yield event("response.reasoning_text.delta", item_id=rs_id, output_index=index["reasoning"],
                                    content_index=0, delta=thought[sent["reasoning"]:])
                        sent["reasoning"] = len(thought)
                    if (content or final) and "reasoning" in index and "reasoning" not in closed:
                        yield from close_reasoning(thought or "", "completed" if content or thought_ended(text) else state)
                    if content or final:
                        yield from open_item("message")
                    if len(content) > sent["message"]:
                        yield event("response.output_text.delta", item_id=msg_id, output_index=index["message"],
                                    content_index=0, delta=content[sent["message"]:], logprobs=[])
                        sent["message"] = len(content)

                yield event("response.created", response=response("in_progress"))
                yield event("response.in_progress", response=response("in_progress"))
                text, reason = "", None
                try:
                    async for delta, reason in gen.deltas(on_delta):
                        text += delta
                        for e in send(text, False):
                            yield e
                except EngineError as e:
                    yield event("response.failed", response={**response("failed"),
                                                             "error": {"code": "server_error", "message": str(e)}})
                    return
                status = status_of(reason)
                state = "completed" if status == "completed" else "incomplete"
                for e in send(text, True, state):
                    yield e
                content = split(text, True)[1]
                i = index["message"]
                part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
                yield event("response.output_text.done", item_id=msg_id, output_index=i, content_index=0, text=content,
                            logprobs=[])  # fmt: skip
                yield event("response.content_part.done", item_id=msg_id, output_index=i, content_index=0, part=part)
                yield event("response.output_item.done", output_index=i, item={
                    "type": "message", "id": msg_id, "status": state, "role": "assistant", "content": [part]})
                yield event(f"response.{status}", response=response(status, text, reason))

            return SSEResponse(events(), on_close=gen.close)

        async def collect() -> tuple[str, str | None]:
            text, reason = "", None
            async for delta, reason in gen.deltas(on_delta):
                text += delta
            return text, reason

        try:
            text, reason = await _run_request(request, collect())
        finally:
            gen.close()
        return JSONResponse(response(status_of(reason), text, reason))

    # ---- /v1/embeddings
    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: per input the final hidden state at its last token, normalized
        (PoolingParams; LLM.embed's), as floats or base64 of little-endian float32."""
        from pageflash.sampling_params import PoolingParams

        body: P.EmbeddingRequest = await self.read_json(request, P.EmbeddingRequest)
        model = self.response_model_name(body.model)
        lora = self.lora_for(model)
        try:
            raw = body.inputs()
            pooling = PoolingParams(dimensions=body.dimensions, truncate_prompt_tokens=body.truncate_prompt_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="input") from None
        hidden = self.engine.engine.model_config.hidden_size
        if body.dimensions is not None and body.dimensions > hidden:
            raise APIError(400, f"dimensions={body.dimensions} exceeds the model's hidden size ({hidden})",
                           param="dimensions")  # fmt: skip
        prompts: list[Any] = []
        for i, p in enumerate(raw):
            name = "input" if len(raw) == 1 else f"input[{i}]"
            if isinstance(p, list):
                self.check_token_ids(p, name)
                ids = p
            elif not p:
                raise APIError(400, f"{name} must not be empty", param=name)
            else:
                ids = await self.tokenizer.run(lambda t, p=p: list(t.encode(p, add_special_tokens=body.add_special_tokens)),
                                               "Cannot tokenize the input", name)  # fmt: skip
            ids = pooling.truncate_prompt(ids, self.engine.max_model_len)
            self.validate(ids, pooling, name)
            prompts.append({"prompt_token_ids": ids})
        timer = self.metrics.timer()  # (e2e latency, prompt length and success counts; no tokens are generated)
        streams = await self.add_all(f"embd-{uuid.uuid4().hex}", prompts, pooling, "input", lora)

        async def collect() -> list[Any]:
            outs = []
            for s in streams:
                last = None
                async for out in s:
                    last = out
                outs.append(last)
            return outs

        outs: list[Any] = [None] * len(streams)
        try:
            outs = await _run_request(request, collect())
        except EngineError as e:
            raise APIError(500, f"Engine error: {e}") from None
        finally:
            for s in streams:
                s.close()
            timer.finish(["stop" if o is not None and o.finished else None for o in outs],
                         [len(p["prompt_token_ids"]) for p in prompts])
        data = []
        for i, o in enumerate(outs):
            if o is None or o.embedding is None:
                raise APIError(500, f"input[{i}]: the engine returned no embedding (aborted)")
            vec: Any = o.embedding
            if body.encoding_format == "base64":
                import base64

                import numpy as np

                vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "embedding": vec, "index": i})
        n = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})  # fmt: skip

    # ---- /tokenize, /detokenize (vLLM's)
    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request, P.TokenizeRequest)
        self.response_model_name(body.model)
        if body.messages is not None:
            try:
                chat = P.ChatCompletionRequest.model_validate(body.chat_fields())
            except pydantic.ValidationError as e:
                raise _validation_error(e) from None
            _, ids = await self.render_chat(chat, add_special_tokens=bool(body.add_special_tokens))
        else:
            def encode(tok: Any) -> list[int]:
                if tok is None:
                    raise ValueError("this model has no tokenizer (dummy weights)")
                add = True if body.add_special_tokens is None else body.add_special_tokens
                return list(tok.encode(body.prompt, add_special_tokens=add))

            ids = await self.tokenizer.run(encode, "Cannot tokenize the prompt", "prompt")
        strs = None
        if body.return_token_strs:
            strs = await self.tokenizer.run(lambda tok: [str(t) for t in tok.convert_ids_to_tokens(ids)],
                                            "Cannot name the tokens", "prompt")  # fmt: skip
        out = P.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)
        return Response(out.model_dump_json(), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request, P.DetokenizeRequest)
        self.response_model_name(body.model)
        vocab = self.vocab_size
        bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")

        def decode(tok: Any) -> str:
            if tok is None:
                raise ValueError("this model has no tokenizer (dummy weights)")
            return tok.decode(body.tokens)

        text = await self.tokenizer.run(decode, "Cannot decode the tokens", "tokens")
        return Response(P.DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    # ---- /v1/completions
    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = await self.read_json(request, P.CompletionRequest)
        model = self.response_model_name(req.model)
        lora = self.lora_for(model)
        try:
            raw = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if len(raw) * req.n > MAX_CHOICES:
            raise APIError(400, f"prompts x n = {len(raw)} x {req.n} is over the limit of {MAX_CHOICES} choices a "
                                f"request", param="n" if req.n > 1 else "prompt")
        if req.use_beam_search:
            return await self.completions_beam_search(request, req, raw, model, lora)
        kw = req.sampling_kwargs()
        echo_only = req.max_tokens == 0  # vLLM's echo without generation: one token is run, not returned
        kw["max_tokens"] = 1 if echo_only else req.max_tokens
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
            if req.echo:  # (the echoed prompt shows the top `logprobs`, prompt_logprobs its own count)
                plp = req.prompt_logprobs or 0
                kw["prompt_logprobs"] = -1 if plp == -1 else max(req.logprobs, plp)
        params = self.sampling_params(kw, req.structured_from)
        await self.compile_constraint(params, req.structured_from)
        prompts: list[Any] = []
        each: list[Any] = []  # each prompt's params (a max_tokens default cut to its room)
        for i, p in enumerate(raw):
            name = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            if isinstance(p, list):
                self.check_token_ids(p, name)
                p = raw[i] = params.truncate_prompt(p, self.engine.max_model_len)
                each.append(self.fit_room(p, params))
                self.validate(p, each[-1], name)
                prompts.append({"prompt_token_ids": p})
            elif not p:
                raise APIError(400, f"{name} must not be empty", param=name)
            elif self.tokenizer.tok is None:
                each.append(params)
                prompts.append(p)  # no tokenizer copy: the engine encodes it (and says if it cannot)
            else:
                ids = await self.tokenizer.run(lambda t, p=p: list(t.encode(p)), "Cannot tokenize the prompt", name)
                cut = params.truncate_prompt(ids, self.engine.max_model_len)
                if len(cut) < len(ids):  # echo then shows the text that was run
                    ids = raw[i] = cut
                each.append(self.fit_room(ids, params))
                self.validate(ids, each[-1], name)
                prompts.append({"prompt": p if isinstance(raw[i], str) else None, "prompt_token_ids": ids})
        echo = [p if isinstance(p, str) else "" for p in raw]
        if req.echo and any(isinstance(p, list) for p in raw):
            texts = await self.tokenizer.run(lambda t: [t.decode(p) if isinstance(p, list) else p for p in raw],
                                             "Cannot decode the prompt", "prompt")  # fmt: skip
            echo = list(texts)
        # echo + logprobs: per prompt, its first token's text and where each token's text starts
        first_tokens: list[str | None] = [None] * len(raw)
        prompt_offsets: list[list[int]] = [[] for _ in raw]
        if req.echo and req.logprobs is not None and self.tokenizer.tok is not None:
            pids = [pr["prompt_token_ids"] for pr in prompts]
            found = await self.tokenizer.run(lambda t: [(t.decode(ids[:1]), _prompt_offsets(t, ids, e))
                                                        for ids, e in zip(pids, echo)],
                                             "Cannot decode the prompt", "prompt")  # fmt: skip
            first_tokens, prompt_offsets = [f for f, _ in found], [o for _, o in found]
        rid = f"cmpl-{uuid.uuid4().hex}"
        timer = self.metrics.timer()
        gen = _Generation(await self.add_all(rid, prompts, each, "prompt", lora), params, timer)
        gen.echo_only = echo_only
        created = int(time.time())

        as_ids = bool(req.return_tokens_as_token_ids or self.return_tokens_as_token_ids)

        def on_delta(ch: _Choice, delta: str, ids: list[int], lps: Any, offs: Any) -> P.CompletionChoice:
            if echo_only:  # the prompt alone: the generated token is dropped
                delta, ids, lps, offs = "", [], ([] if lps is not None else None), []
            lp = None
            if req.logprobs is not None:
                lp = self.completion_logprobs(ch, ids, lps, offs, ch.text_len + len(delta), ch.finish_reason is not None,
                                              as_ids)  # fmt: skip
            if req.echo and lp is not None:  # generated text follows the echoed prompt's
                lp.text_offset = [o + len(echo[ch.prompt_idx]) for o in lp.text_offset]
            if req.echo and not ch.started:
                if lp is not None:  # the prompt's tokens come first
                    i = ch.prompt_idx
                    head = self.prompt_logprob_part(gen.prompt_ids[i], gen.prompt_logprobs[i], first_tokens[i],
                                                    prompt_offsets[i], req.logprobs, as_ids)  # fmt: skip
                    lp = P.CompletionLogprobs(
                        tokens=head.tokens + lp.tokens, token_logprobs=head.token_logprobs + lp.token_logprobs,
                        top_logprobs=head.top_logprobs + lp.top_logprobs, text_offset=head.text_offset + lp.text_offset)
                delta = echo[ch.prompt_idx] + delta
            return P.CompletionChoice(index=ch.index, text=delta, logprobs=lp,
                                      finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)  # fmt: skip

        def chunk(choices: list[P.CompletionChoice], usage: P.Usage | None = None) -> str:
            return _sse(P.CompletionStreamResponse(id=rid, created=created, model=model, choices=choices, usage=usage))

        if req.stream:
            async def body() -> AsyncIterator[str]:
                try:
                    async for c in gen.deltas(on_delta):
                        yield chunk([c], gen.choice_usage(c.index) if req.continuous_usage else None)
                    if req.include_usage:
                        yield chunk([], gen.usage())
                except EngineError as e:
                    yield _sse(APIError(500, f"Engine error: {e}").body())
                yield _DONE

            return SSEResponse(body(), on_close=gen.close)

        async def collect() -> list[P.CompletionChoice]:
            merged: dict[int, P.CompletionChoice] = {}
            async for c in gen.deltas(on_delta):
                prev = merged.setdefault(c.index, c)
                if prev is c:
                    continue
                prev.text += c.text
                prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
                if prev.logprobs is not None and c.logprobs is not None:
                    for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                        getattr(prev.logprobs, name).extend(getattr(c.logprobs, name))
            if req.prompt_logprobs is not None:
                for c in merged.values():
                    i = c.index // req.n
                    c.prompt_logprobs = self.prompt_logprobs_field(gen.prompt_logprobs[i], gen.prompt_ids[i],
                                                                   req.prompt_logprobs)  # fmt: skip
            return [merged[i] for i in sorted(merged)]

        try:
            choices = await _run_request(request, collect())
        finally:
            gen.close()
        body = P.CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=gen.usage())
        return Response(body.model_dump_json(), media_type="application/json")

    # ---- /v1/chat/completions
    async def chat_completions(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = await self.read_json(request, P.ChatCompletionRequest)
        model = self.response_model_name(req.model)
        lora = self.lora_for(model)
        if req.n > MAX_CHOICES:
            raise APIError(400, f"n = {req.n} is over the limit of {MAX_CHOICES}", param="n")
        if req.calls_tools == "auto" and self.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs a server started with '
                                '--enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice "required", '
                                'a named function, or "none"', param="tool_choice")  # fmt: skip
        echo = "" if req.calls_tools else req.echo_prefix
        rendered, prompt_ids = await self.render_chat(req)
        if not prompt_ids:
            raise APIError(400, "messages: the chat template produced an empty prompt", param="messages")
        if req.use_beam_search:
            for name in ("echo", "logprobs", "tools"):
                if getattr(req, name):
                    raise APIError(400, f"use_beam_search does not take {name}", param=name)
            try:
                results, usage = await self.beam_search(request, req, [prompt_ids], req.max_new_tokens, "messages",
                                                        lora)  # fmt: skip
            except APIError as e:
                raise _in_request_terms(e, req) from None
            beams = [P.ChatChoice(index=j, message=P.ChatResponseMessage(role=req.response_role, content=s.output_text),
                                  finish_reason=s.finish_reason) for j, s in enumerate(results[0].sequences)]  # fmt: skip
            if self.reasoning_parser is not None:  # the thought split off, as for any chat reply
                thinking = _Reasoning(self.reasoning_parser, self.reasoning_parser.starts_in_thought(rendered),
                                      req.include_reasoning)  # fmt: skip
                for b in beams:
                    thinking.finish_message(b)
            body = P.ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                            choices=beams, usage=usage)  # fmt: skip
            return Response(body.model_dump_json(), media_type="application/json")
        kw = req.sampling_kwargs()
        kw["max_tokens"] = req.max_new_tokens
        if req.calls_tools == "auto" and getattr(self.tool_parser, "keeps_special_tokens", False):
            kw["skip_special_tokens"] = False
        k = req.top_logprobs or 0
        if req.logprobs:
            kw["logprobs"] = k
        try:
            params = self.sampling_params(kw, req.structured_from)
            await self.compile_constraint(params, req.structured_from)
            prompt_ids = params.truncate_prompt(prompt_ids, self.engine.max_model_len)
            params = self.fit_room(prompt_ids, params)
            self.validate(prompt_ids, params, "messages", "the chat prompt (messages after the chat template)")
        except APIError as e:
            raise _in_request_terms(e, req) from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        timer = self.metrics.timer()
        gen = _Generation(await self.add_all(rid, [{"prompt_token_ids": prompt_ids}], params, "messages", lora),
                          params, timer)  # fmt: skip
        created = int(time.time())

        tools = _ToolCalls(req, self.tool_parser) if req.calls_tools else None
        # The thought is split off free text (and text that may hold auto tool calls). Named / required
        # tools are JSON from the first token. Under structured outputs the constraint starts at the first
        # token too, so the output holds a thought only where it opens one with <think> itself.
        # With echo, the echoed message (continue_final_message's open one, which the rendered prompt ends
        # with) is the start of the text the parser splits.
        thinking = None
        if self.reasoning_parser is not None and req.calls_tools in (None, "auto"):
            before = rendered[: len(rendered) - len(echo)] if echo and rendered.endswith(echo) else rendered
            opened = params.structured_outputs is None and self.reasoning_parser.starts_in_thought(before)
            thinking = _Reasoning(self.reasoning_parser, opened, req.include_reasoning, prefix=echo)
            echo = ""

        as_ids = bool(req.return_tokens_as_token_ids or self.return_tokens_as_token_ids)

        def chat_lps(ids: list[int], lps: Any) -> P.ChatLogprobs | None:
            return self.chat_logprobs(ids, lps, k, as_ids) if req.logprobs else None

        def on_delta(ch: _Choice, delta: str, ids: list[int], lps: Any, _offs: Any) -> P.ChatStreamChoice | None:
            if thinking is not None and req.stream:
                return thinking.stream_delta(ch, ids, lps, chat_lps, tools)
            if tools is not None and req.stream:
                return tools.stream_delta(ch, delta, ids, lps, chat_lps)
            lp = chat_lps(ids, lps)
            return P.ChatStreamChoice(index=ch.index, delta=P.DeltaMessage(content=delta), logprobs=lp,
                                      finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)  # fmt: skip

        def chunk(choices: list[P.ChatStreamChoice], usage: P.Usage | None = None) -> str:
            return _sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=choices,
                                                       usage=usage))  # fmt: skip

        if req.stream:
            async def body() -> AsyncIterator[str]:
                try:
                    for i in range(req.n):  # the first chunk of each choice carries the role
                        yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role=req.response_role, content=""))])
                        if echo:
                            yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(content=echo))])
                    async for c in gen.deltas(on_delta):
                        yield chunk([c], gen.choice_usage(c.index) if req.continuous_usage else None)
                    if req.include_usage:
                        yield chunk([], gen.usage())
                except EngineError as e:
                    yield _sse(APIError(500, f"Engine error: {e}").body())
                yield _DONE

            return SSEResponse(body(), on_close=gen.close)

        async def collect() -> list[P.ChatChoice]:
            merged: dict[int, P.ChatChoice] = {}
            async for c in gen.deltas(on_delta):
                prev = merged.get(c.index)
                if prev is None:
                    merged[c.index] = P.ChatChoice(index=c.index, message=P.ChatResponseMessage(role=req.response_role,
                                                                                                content=c.delta.content),
                                                   logprobs=c.logprobs, finish_reason=c.finish_reason,
                                                   stop_reason=c.stop_reason)  # fmt: skip
                    continue
                prev.message.content = (prev.message.content or "") + (c.delta.content or "")
                prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
                if prev.logprobs is not None and c.logprobs is not None:
                    prev.logprobs.content = [*(prev.logprobs.content or []), *(c.logprobs.content or [])]
            for c in merged.values():
                if thinking is not None:
                    thinking.finish_message(c)
                if tools is not None:
                    tools.finish_message(c)
                elif echo:
                    c.message.content = echo + (c.message.content or "")
            return [merged[i] for i in sorted(merged)]

        try:
            choices = await _run_request(request, collect())
        finally:
            gen.close()
        plp = None
        if req.prompt_logprobs is not None:
            plp = self.prompt_logprobs_field(gen.prompt_logprobs[0], gen.prompt_ids[0], req.prompt_logprobs)
        body = P.ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=gen.usage(),
                                        prompt_logprobs=plp)  # fmt: skip
        return Response(body.model_dump_json(), media_type="application/json")


def _top_count(k: int) -> int:
    """A request's top-logprobs count for slicing: -1 (the whole vocabulary) keeps every entry."""
    return sys.maxsize if k < 0 else k


def _in_request_terms(e: APIError, req: P.ChatCompletionRequest) -> APIError:
    """An error about the engine's max_tokens, in the terms of a chat request that set the length
    limit as max_completion_tokens (OpenAI's newer name, which the openai SDK sends); one about its
    logprobs, in terms of top_logprobs (the count a chat request sets)."""
    if e.param == "logprobs" and req.top_logprobs is not None:
        e.message = re.sub(r"\blogprobs\b", "top_logprobs", e.message)
        e.param = "top_logprobs"
    if req.max_completion_tokens is not None:
        e.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", e.message)
        if e.param == "max_tokens":
            e.param = "max_completion_tokens"
    return e


def _call_deltas(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Whole tool calls as one streamed delta's tool_calls entries."""
    return [{"index": i, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(calls)]  # fmt: skip


def _tool_calls(calls: list[tuple[str, str]]) -> list[P.ToolCall]:
    """Whole tool calls as a message's tool_calls."""
    return [P.ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=P.FunctionCall(name=name, arguments=args))
            for name, args in calls]  # fmt: skip


class _Held:
    """Tokens (and logprobs) of streamed choices that no chunk has carried yet: they go with the
    choice's next chunk."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[list[int], list[Any] | None]] = {}

    def hold(self, index: int, ids: list[int], lps: Any) -> None:
        held_ids, held_lps = self.held.setdefault(index, ([], [] if lps is not None else None))
        held_ids += ids
        if held_lps is not None and lps is not None:
            held_lps += lps

    def release(self, index: int, logprobs: Callable[[list[int], Any], Any]) -> Any:
        """The held tokens' logprobs for the chunk going out now; nothing is held after."""
        held_ids, held_lps = self.held.pop(index, ([], None))
        return logprobs(held_ids, held_lps)


class _ToolCalls:
    """A chat request whose tool_choice calls tools, answered as tool_calls, as vLLM does.

    Named: the output is constrained to the function's arguments (ChatCompletionRequest.tool_schema);
    streamed as they come (the first delta carries the call's id and name), finish_reason as
    generated ("stop"). Required: constrained to a list of {"name", "parameters"}; streamed whole once
    the choice ends (a list cannot be split into calls before it is complete), finish_reason
    "tool_calls". Auto: free text read by the server's tool-call parser (tool_parsers.py). Output cut
    by max_tokens that does not parse stays text (content), with finish_reason "length"."""

    def __init__(self, req: P.ChatCompletionRequest, parser: Any = None) -> None:
        self.mode = req.calls_tools
        self.name = req.tool_choice_name
        self.parser = parser  # auto: the server's tool-call parser (tool_parsers.py)
        self.held = _Held()  # streamed: ids, logprobs not yet sent
        self.content_sent: dict[int, int] = {}  # auto, streamed: characters sent as content

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) per call, or None when the text is not a complete list of calls."""
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  for c in calls):  # fmt: skip
            return None
        return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]

    def stream_delta(self, ch: _Choice, delta: str, ids: list[int], lps: Any,
                     logprobs: Callable[[list[int], Any], Any], text: str | None = None) -> P.ChatStreamChoice | None:
        """The chunk for a choice's new tokens, or None while they are held. text: the choice's text
        to read calls from (auto; default ch.text, the output so far; the content after the thought
        with a reasoning parser)."""
        if self.mode == "auto":
            return self._auto_delta(ch, ids, lps, logprobs, ch.text if text is None else text)
        if self.mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if not ch.started:
                call = {"index": 0, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                        "function": {"name": self.name, "arguments": delta}}  # fmt: skip
            return P.ChatStreamChoice(index=ch.index, delta=P.DeltaMessage(tool_calls=[call]), logprobs=logprobs(ids, lps),
                                      finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)  # fmt: skip
        self.held.hold(ch.index, ids, lps)
        if ch.finish_reason is None:
            return None
        calls = self.parse(ch.text)
        lp = self.held.release(ch.index, logprobs)
        if calls is None:
            return P.ChatStreamChoice(index=ch.index, delta=P.DeltaMessage(content=ch.text), logprobs=lp,
                                      finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)  # fmt: skip
        reason = "tool_calls" if ch.finish_reason == "stop" else ch.finish_reason
        return P.ChatStreamChoice(index=ch.index, delta=P.DeltaMessage(tool_calls=_call_deltas(calls)), logprobs=lp,
                                  finish_reason=reason, stop_reason=ch.stop_reason)  # fmt: skip

    def _auto_delta(self, ch: _Choice, ids: list[int], lps: Any, logprobs: Callable[[list[int], Any], Any],
                    text: str) -> P.ChatStreamChoice | None:
        """Auto: content is streamed up to where a call may start; once the choice ends, the calls
        found come in one delta (finish_reason "tool_calls"), or the held text as content."""
        sent = self.content_sent.get(ch.index, 0)
        calls: list[tuple[str, str]] = []
        if ch.finish_reason is None:
            upto = self.parser.safe_prefix(text)
        else:
            calls = self.parser.parse(text)[1]
            upto = self.parser.safe_prefix(text) if calls else len(text)  # calls: the content before them
        delta = text[sent:max(sent, upto)]
        self.content_sent[ch.index] = max(sent, upto)
        self.held.hold(ch.index, ids, lps)
        if not delta and ch.finish_reason is None:
            return None  # nothing to say yet (tokens of a possible call): their logprobs wait too
        msg = P.DeltaMessage(content=delta or None, tool_calls=_call_deltas(calls) or None)
        if msg.content is None and msg.tool_calls is None:
            msg.content = ""
        lp = self.held.release(ch.index, logprobs)
        reason = "tool_calls" if calls else ch.finish_reason
        return P.ChatStreamChoice(index=ch.index, delta=msg, logprobs=lp, finish_reason=reason,
                                  stop_reason=ch.stop_reason)  # fmt: skip

    def finish_message(self, c: P.ChatChoice) -> None:
        """A whole (non-streamed) choice: its text becomes tool_calls."""
        text = c.message.content or ""
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            if calls:
                c.message.content = content
                c.message.tool_calls = _tool_calls(calls)
                c.finish_reason = "tool_calls"
            return
        if self.mode == "named":
            calls = [(self.name, text)]
        else:
            calls = self.parse(text)
            if calls is None:
                return
            if c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
        c.message.content = None
        c.message.tool_calls = _tool_calls(calls)


class _Reasoning:
    """A chat request whose output a reasoning parser (reasoning_parsers.py) splits into the thought
    (the message's `reasoning` and `reasoning_content`; left out with include_reasoning false) and
    the content. Streamed, each chunk carries what the split settled since the last one; tokens of a
    held-back tail (a possible </think>) send their logprobs with the next chunk. With tool_choice
    auto, the content part is what the tool-call parser reads."""

    def __init__(self, parser: Any, opened: bool, include: bool, prefix: str = "") -> None:
        self.parser = parser
        self.opened = opened  # the text starts inside a thought (see ThinkReasoningParser.split)
        self.prefix = prefix  # echo: the echoed message, which the output continues
        self.include = include
        self.sent: dict[int, tuple[int, int]] = {}  # choice -> characters of reasoning, content sent
        self.held = _Held()

    def stream_delta(self, ch: _Choice, ids: list[int], lps: Any, logprobs: Callable[[list[int], Any], Any],
                     tools: _ToolCalls | None) -> P.ChatStreamChoice | None:
        split = self.parser.split(self.prefix + ch.text, ch.finish_reason is not None, self.opened)
        reasoning, content = split.reasoning or "", split.content or ""
        r_sent, c_sent = self.sent.get(ch.index, (0, 0))
        thought = reasoning[r_sent:] if self.include else ""
        self.sent[ch.index] = (len(reasoning), len(content))
        if tools is not None:  # auto: the content goes through the tool-call parser (which holds its tokens)
            out = tools.stream_delta(ch, "", ids, lps, logprobs, text=content)
            if thought:
                if out is None:
                    out = P.ChatStreamChoice(index=ch.index, delta=P.DeltaMessage())
                elif out.delta.content == "":
                    out.delta.content = None
                out.delta.reasoning = out.delta.reasoning_content = thought
            return out
        new = content[c_sent:]
        self.held.hold(ch.index, ids, lps)
        if not thought and not new and ch.finish_reason is None:
            return None
        msg = P.DeltaMessage(content=new or (None if thought else ""), reasoning=thought or None,
                             reasoning_content=thought or None)  # fmt: skip
        return P.ChatStreamChoice(index=ch.index, delta=msg, logprobs=self.held.release(ch.index, logprobs),
                                  finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)  # fmt: skip

    def finish_message(self, c: P.ChatChoice) -> None:
        """A whole (non-streamed) choice: its text split into thought and content."""
        split = self.parser.split(self.prefix + (c.message.content or ""), True, self.opened)
        c.message.content = split.content
        if self.include and split.reasoning:  # (an empty thought, as streamed: none)
            c.message.reasoning = c.message.reasoning_content = split.reasoning


class _InternalErrors:
    """ASGI middleware: an unexpected exception in an endpoint is answered with the OpenAI-shaped 500
    here and the connection is kept. (Starlette's own catch-all answers it too, then re-raises, and
    uvicorn closes the client's keep-alive connection: the client's next request on it fails with a
    connection reset.) An exception once a response has started (a stream) is re-raised."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as exc:
            if started:
                raise
            await _internal_error(scope.get("path"), exc, self.metrics)(scope, receive, send)


def _internal_error(path: Any, exc: Exception, metrics: Any) -> JSONResponse:
    """The 500 of an unexpected exception (logged with its traceback: call it where it is handled)."""
    logger.exception("internal error on %s", path)
    metrics.count_error(500)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}").response()


async def _run_request(request: Request, work: Awaitable[Any]) -> Any:
    try:
        return await _until_disconnect(request, work)
    except EngineError as e:
        raise APIError(500, f"Engine error: {e}") from None


# --------------------------------------------------------------------------- the app
def build_app(engine: AsyncLLMEngine, served_model_name: str | Sequence[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_origins: Sequence[str] = ("*",),
              allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
              allow_credentials: bool = False, chat_template: str | None = None,
              trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, return_tokens_as_token_ids: bool = False,
              lora_modules: Sequence[Any] = (), allow_runtime_lora_updating: bool = False) -> FastAPI:  # fmt: skip
    """The FastAPI app serving `engine` under the given model name(s) (the first is the default).

    `api_key`: if set, /v1/* require `Authorization: Bearer <api_key>` (401 otherwise); /health and
    /metrics stay open. `max_body_bytes`: larger request bodies get 413. CORS (browser front-ends
    calling the API directly): the `allowed_*` lists and `allow_credentials`, vLLM's defaults (any
    origin, no credentials). `chat_template`: a Jinja chat template used instead of the tokenizer's;
    `trust_request_chat_template`: let requests bring their own (`chat_template`), as vLLM's flag.
    `tool_call_parser`: the name of the parser (tool_parsers.TOOL_PARSERS) that reads tool calls out of
    free text for tool_choice "auto"; None refuses "auto". `reasoning_parser`: the name of the parser
    (reasoning_parsers.REASONING_PARSERS) that splits a thinking model's chat output into `reasoning`
    and `content`; None returns the output as content. `return_tokens_as_token_ids`: logprobs name
    tokens "token_id:ID" for every request (a request can ask for it alone).
    `lora_modules`: LoRARequests (an engine with enable_lora) served as models of their lora_name: a
    request whose "model" names one runs under that adapter. `allow_runtime_lora_updating`: vLLM's
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`pageflash serve` turns them on with
    PAGEFLASH_ALLOW_RUNTIME_LORA_UPDATING=1, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    serving = OpenAIServing(engine, names, max_body_bytes, chat_template, trust_request_chat_template)
    if (lora_modules or allow_runtime_lora_updating) and getattr(engine.engine, "lora_cache", None) is None:
        raise ValueError("LoRA modules need an engine started with enable_lora=True (--enable-lora)")
    for lora in lora_modules:
        if lora.lora_name in names or lora.lora_name in serving.loras:
            raise ValueError(f"LoRA module name {lora.lora_name!r} is used twice (or is the base model's name)")
        serving.loras[lora.lora_name] = lora
        serving.next_lora_id = max(serving.next_lora_id, lora.lora_int_id)
    if tool_call_parser is not None:
        if tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        serving.tool_parser = TOOL_PARSERS[tool_call_parser]()
    if reasoning_parser is not None:
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_PARSERS)}")
        serving.reasoning_parser = REASONING_PARSERS[reasoning_parser]()
    serving.return_tokens_as_token_ids = return_tokens_as_token_ids
    metrics = serving.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()  # idempotent; the caller that made the engine shuts it down
        try:
            yield
        finally:
            serving.tokenizer.close()

    app = FastAPI(title="pageflash OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.add_middleware(_InternalErrors, metrics=metrics)  # (inside CORS: its 500s carry CORS headers too)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)  # fmt: skip
    app.state.engine = engine
    app.state.serving = serving

    # Every error leaves as an OpenAI body; none as a bare HTML/text page.
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.count_error(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.count_error(exc.status_code)
        resp = APIError(exc.status_code, str(exc.detail)).response()
        resp.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.count_error(400)
        return APIError(400, f"Invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)  # (what escapes _InternalErrors: a failure in the CORS middleware)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request.url.path, exc, metrics)

    async def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return APIError(503, f"The engine is not running: {engine.dead_reason}").response()

    # vLLM's /ping (GET or POST; what SageMaker's health check calls): the same answer as /health
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_auth)])

    # vLLM's tokenizer endpoints: outside /v1 and, as there, without the API key
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"])

    @v1.get("/models")
    async def models() -> Response:
        return Response(P.ModelList(data=serving.model_cards()).model_dump_json(), media_type="application/json")

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        serving.response_model_name(model_id)  # 404 naming the served models if unknown
        card = next(c for c in serving.model_cards() if c.id == model_id)
        return Response(card.model_dump_json(), media_type="application/json")

    if allow_runtime_lora_updating:
        v1.add_api_route("/load_lora_adapter", serving.load_lora_adapter, methods=["POST"])
        v1.add_api_route("/unload_lora_adapter", serving.unload_lora_adapter, methods=["POST"])

    for path, handler in (("/completions", serving.completions), ("/chat/completions", serving.chat_completions),
                          ("/responses", serving.responses), ("/embeddings", serving.embeddings)):
        v1.add_api_route(path, handler, methods=["POST"])

    app.include_router(v1)
    return app


# --------------------------------------------------------------------------- `pageflash serve`
def make_arg_parser() -> argparse.ArgumentParser:
    """Server flags plus the engine flags every pageflash command shares (pageflash.cli)."""
    from pageflash.cli import add_engine_args

    p = argparse.ArgumentParser(prog="pageflash serve", description="OpenAI-compatible HTTP server for pageflash.")
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as --model (vLLM's `serve MODEL`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $PAGEFLASH_API_KEY, else vLLM's $VLLM_API_KEY)")  # fmt: skip
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API answers to; the first is the default (default: the --model value)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default: %(default)s)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        p.add_argument(f"--allowed-{flag}", type=_json_str_list, default=["*"], metavar="JSON",
                       help=f"CORS: {what} allowed, as a JSON list (default: [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: no)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (off: such requests get a 400)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": read tool calls out of the output with --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format (with --enable-auto-tool-choice)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token "token_id:ID" (for tokens that are not valid text alone)')
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's <think>...</think> off the chat content into `reasoning`")
    p.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves this app under (uvicorn's)")
    # vLLM serve flags that change nothing here (requests are not logged; replies are the assistant's)
    p.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--enable-log-requests", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--response-role", default="assistant", choices=["assistant"],
                   help="the role of replies after a generation prompt (only 'assistant')")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models (with --enable-lora): name=path, or vLLM's JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    add_engine_args(p)
    return p


def parse_lora_modules(values: Sequence[str]) -> list[Any]:
    """--lora-modules values (vLLM's syntax: name=path, or a JSON object with name, path and optionally
    base_model_name) as LoRARequests with ids 1, 2, ...; ValueError naming a bad one."""
    from pageflash.lora.request import LoRARequest

    out = []
    for i, v in enumerate(values, 1):
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {v!r}: not valid JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules {v!r}: the JSON form needs string 'name' and 'path'")
            out.append(LoRARequest(d["name"], i, d["path"], base_model_name=d.get("base_model_name")))
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {v!r}: expected name=path (or a JSON object)")
            out.append(LoRARequest(name, i, path))
    return out


def _json_str_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """`pageflash serve ...`: load the model, start the engine thread, run uvicorn until stopped.
    A bad flag or model is one `error:` line and exit status 2, before anything loads where it can be."""
    from pageflash.cli import engine_kwargs

    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    from pageflash.cli import check_vllm_flags

    check_vllm_flags(args, parser.error)
    if args.model_tag is not None:
        given = any(x == "--model" or x.startswith("--model=") for x in (argv if argv is not None else sys.argv[1:]))
        if given and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        loras = parse_lora_modules(args.lora_modules or [])
    except ValueError as e:
        parser.error(str(e))
    if loras and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    served = set(args.served_model_name or [args.model])
    for i, lora in enumerate(loras):  # (checked before the model loads, as build_app would refuse them after)
        if lora.lora_name in served or any(lora.lora_name == o.lora_name for o in loras[:i]):
            parser.error(f"--lora-modules: the name {lora.lora_name!r} is used twice (or is a served model name)")
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    elif template is not None and not any(tag in template for tag in ("{{", "{%")):
        parser.error(f"--chat-template {template!r} is neither a file nor a Jinja template")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # before the model loads: a taken port fails in a second, not after a minute of loading
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    from pageflash import LLM

    try:
        llm = LLM(**engine_kwargs(args))
        for lora in loras:  # each adapter read and checked against the model now, not at its first request
            llm.llm_engine.add_lora(lora)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(llm.llm_engine)
    runtime_lora = any(os.environ.get(v, "").lower() in ("1", "true")
                       for v in ("PAGEFLASH_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"))
    api_key = args.api_key or os.environ.get("PAGEFLASH_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    names = args.served_model_name or [args.model]
    app = build_app(engine, names, api_key=api_key, max_body_bytes=args.max_body_bytes,
                    allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                    allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                    chat_template=template, trust_request_chat_template=args.trust_request_chat_template,
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    reasoning_parser=args.reasoning_parser,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, lora_modules=loras,
                    allow_runtime_lora_updating=runtime_lora and args.enable_lora)
    logger.info("serving %s as %s on http://%s:%d/v1", args.model, ", ".join(names), args.host, args.port)
    try:
        serve_uvicorn(app, engine, host=args.host, port=args.port,
                      log_level=args.uvicorn_log_level or args.log_level, root_path=args.root_path,
                      timeout_keep_alive=5, timeout_graceful_shutdown=5)  # nothing may hold a shutdown forever
    finally:
        engine.shutdown()
    return 0


def serve_uvicorn(app: FastAPI, engine: AsyncLLMEngine, **config: Any) -> None:
    """uvicorn.run(app, **config), except at a stop (SIGINT / SIGTERM):
    - the engine stops first, so that the requests in flight end at once (a stream with its error event,
      any other with a 500) instead of running on through uvicorn's graceful wait, to be cut off there
      with a traceback;
    - once shut down, the signal is not raised again (uvicorn 0.29+ raises it again, so that a SIGTERM
      ended the process with status 143): a stop asked for is a clean exit, status 0, as vLLM's."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # (uvicorn < 0.29 has none and raises nothing again)
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: Any = None) -> None:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
            await super().shutdown(sockets=sockets)

    Server(uvicorn.Config(app, **config)).run()


if __name__ == "__main__":
    main()
