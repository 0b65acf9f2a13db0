"""AsyncLLMEngine: one background thread owns an LLMEngine and serves many asyncio callers.

The engine's methods are not thread-safe, so exactly one thread (the *engine thread*) ever touches
the engine: it takes commands (add, abort, call) from a queue between steps, runs `engine.step()`
while any request is unfinished, and hands each `RequestOutput` to the asyncio loop of the caller
that owns the request. Callers never block the event loop; they await per-request asyncio queues.

Guarantees that the server relies on:
- `add_request` raises the engine's ValueError/TypeError to the caller (a bad prompt is the caller's
  fault and becomes an HTTP 400), before any output is produced.
- A consumer that stops early (closes the stream, or is cancelled because its client went away)
  aborts the request; the engine thread frees its KV blocks before its next step.
- An exception inside `engine.step()` fails every request in flight with `EngineError` and aborts
  them in the engine; it never leaves a caller waiting forever. Nor does a dead engine thread or a
  shut-down engine: waits poll the thread's liveness.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from pageflash.engine.detokenizer import stop_holdback
from pageflash.sampling_params import RequestOutputKind

if TYPE_CHECKING:  # only for hints: importing the engine here would load torch and the model code
    from pageflash.engine.engine import LLMEngine
    from pageflash.outputs import RequestOutput
    from pageflash.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long an idle engine thread sleeps waiting for a command, and how often an awaiting caller
# re-checks that the engine thread is still alive. Neither bounds latency: commands wake the thread.
_IDLE_WAIT_S = 0.5
_LIVENESS_POLL_S = 1.0


class EngineError(RuntimeError):
    """The engine failed (step raised, the loop died, or it was shut down): not the caller's fault."""


class EngineDeadError(EngineError):
    """The engine thread is no longer running."""


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: "SamplingParams"
    stream: "RequestStream"
    lora_request: Any = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Stop:
    pass


class _Aborted:
    """Put on a stream whose request was aborted by someone other than its consumer."""


_ABORTED = _Aborted()


def _delta(out: "RequestOutput", seen: dict[int, tuple[int, int]], holdback: int) -> "RequestOutput":
    """out with each sample cut to what is new since the (characters, tokens) in seen, which it
    updates. An unfinished sample's last `holdback` characters wait (a stop string may still cut
    them: detokenizer.stop_holdback), so no delta is ever taken back."""
    outs = []
    for c in out.outputs:
        t, i = seen.get(c.index, (0, 0))
        end = len(c.text) if c.finish_reason is not None else max(t, len(c.text) - holdback)
        seen[c.index] = (end, len(c.token_ids))
        outs.append(dataclasses.replace(
            c, text=c.text[t:end], token_ids=c.token_ids[i:],
            logprobs=c.logprobs[i:] if c.logprobs is not None else None,
            text_offsets=[o - t for o in c.text_offsets[i:]] if c.text_offsets is not None else None))
    return dataclasses.replace(out, outputs=outs)


def _deliver(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run fn(*args) on `loop` from another thread; a closed loop (caller gone) is not an error."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # loop closed
        pass


def _put_many(items: list[tuple["RequestStream", Any]]) -> None:
    for stream, item in items:
        stream._put(item)


def _set_future(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # the awaiting caller was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


@dataclass
class RequestStream:
    """The outputs of one request, in order, as an async iterator (text and token ids cumulative).

    Created by `AsyncLLMEngine.add_request`. Iterating ends after the output with `finished=True`.
    `close()` (also run when the iterating task is cancelled) aborts the request if it is unfinished.
    """

    request_id: str
    _engine: "AsyncLLMEngine"
    _loop: asyncio.AbstractEventLoop
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _added: asyncio.Future | None = None
    finished: bool = False
    closed: bool = False

    # -- engine-thread side (called through the caller's loop) --
    def _put(self, item: "RequestOutput | BaseException | _Aborted") -> None:
        self._queue.put_nowait(item)

    # -- caller side --
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> "RequestOutput":
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                item = await self._engine._wait(self._queue.get())
            except BaseException:
                self.close()
                raise
        if isinstance(item, _Aborted):
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop listening; abort the request in the engine if it has not finished."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self._engine._abort_nowait([self.request_id])

    async def aclose(self) -> None:
        self.close()


class AsyncLLMEngine:
    """Serves an `LLMEngine` to asyncio code through one background thread.

    Usage:
        engine = AsyncLLMEngine(llm.llm_engine)      # starts the engine thread
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text)               # cumulative text
        engine.shutdown()
    """

    def __init__(self, engine: "LLMEngine", *, start: bool = True) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_reason: str | None = None
        self._stats: dict[str, Any] = {}
        self._stats_time = 0.0
        self._ids = itertools.count()
        self._refresh_stats()
        if start:
            self.start()

    # ---------------------------------------------------------------- properties of the engine
    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer. Only pure lookups are safe off the engine thread; encode via `call`."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def get_stats(self) -> dict[str, Any]:
        """The engine's stats as of the last engine-thread iteration (a copy; safe from any thread)."""
        return dict(self._stats)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pageflash-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests in flight fail with EngineError. Idempotent."""
        self._stop.set()
        self._commands.put(_Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- caller API (asyncio)
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    async def add_request(
        self, request_id: str, prompt: Any, params: "SamplingParams", lora_request: Any = None
    ) -> RequestStream:
        """Queue a request (under a LoRA adapter: lora_request); return its stream once the engine
        accepted it.

        Raises what `LLMEngine.add_request` raises (ValueError for a bad prompt), ValueError for a
        request id already in flight, and EngineError if the engine is not running.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        stream._added = loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, stream, lora_request))
        try:
            await self._wait(asyncio.shield(stream._added))
        except BaseException:
            # Rejected: nothing to abort. Cancelled while waiting (client gone): make sure the
            # request does not run on if the engine thread adds it after all.
            added = stream._added
            stream.finished = added.done() and not added.cancelled() and added.exception() is not None
            stream.close()
            raise
        return stream

    async def generate(
        self, prompt: Any, params: "SamplingParams", request_id: str | None = None, lora_request: Any = None
    ) -> AsyncIterator["RequestOutput"]:
        """Yield the request's outputs until it finishes, as params.output_kind says (vLLM's):
        CUMULATIVE (the default) everything so far each time, DELTA each sample's new text, token ids
        and logprobs since the last output (cumulative_logprob stays the running total), FINAL_ONLY
        the finished output alone; lora_request: the LoRA adapter it runs under (None: the base
        model), as vLLM's.

        Errors from `add_request` propagate on the first iteration. If the consumer stops early
        (break, aclose, cancellation), the request is aborted and its KV blocks freed.
        """
        if request_id is None:
            request_id = self.new_request_id()
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)
        stream = await self.add_request(request_id, prompt, params, lora_request)
        seen: dict[int, tuple[int, int]] = {}  # DELTA: sample index -> (characters, tokens) yielded
        holdback = stop_holdback(params.stop, params.include_stop_str_in_output) if kind == RequestOutputKind.DELTA \
            else 0
        try:
            async for out in stream:
                if kind == RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                if kind == RequestOutputKind.DELTA:
                    out = _delta(out, seen, holdback)
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort one or more requests (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_nowait(ids)  # the engine thread ends their streams

    async def call(self, fn: Callable[["LLMEngine"], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result.

        For anything that must not race the engine: tokenizer encoding, chat templates, exact stats.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(_Call(fn, loop, fut))
        return await self._wait(asyncio.shield(fut))

    # ---------------------------------------------------------------- internals (caller side)
    def _check_alive(self) -> None:
        if self._stop.is_set():
            raise EngineDeadError("the engine is shut down")
        if self._thread is None:
            raise EngineDeadError("the engine is not started (call start())")
        if not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop has died: {self._dead_reason}")

    async def _wait(self, aw: Any) -> Any:
        """Await `aw`, but fail with EngineDeadError if the engine thread dies meanwhile."""
        fut = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=_LIVENESS_POLL_S)
                if done:
                    return fut.result()
                if self._thread is None or not self._thread.is_alive():
                    # Give a final delivery from the dying thread a chance to land first.
                    await asyncio.sleep(0)
                    if fut.done():
                        return fut.result()
                    raise EngineDeadError(
                        f"the engine loop stopped: {self._dead_reason or 'shut down'}"
                    )
        finally:
            if not fut.done():
                fut.cancel()

    def _abort_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        reason = "shut down"
        dev = getattr(self.engine, "device", None)
        if dev is not None and dev.type == "cuda" and dev.index is not None:
            import torch

            torch.cuda.set_device(dev)  # the current device is per thread
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._take_commands(block=not busy)
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._refresh_stats()
        except BaseException as e:  # a bug in the loop itself: fail everyone, never hang them
            reason = f"{type(e).__name__}: {e}"
            logger.exception("pageflash engine loop died")
        finally:
            self._dead_reason = reason
            self._stop.set()
            err = EngineDeadError(f"the engine loop stopped: {reason}")
            self._fail_all(err)
            # Anything queued after the loop ended must not wait forever either.
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add):
                    _deliver(cmd.stream._loop, _set_future, cmd.stream._added, None, err)
                elif isinstance(cmd, _Call):
                    _deliver(cmd.loop, _set_future, cmd.future, None, err)

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            stream = cmd.stream
            if stream.closed:  # the caller went away before we got here
                _deliver(stream._loop, stream._added.cancel)
                return
            if cmd.request_id in self._streams:
                err: BaseException | None = ValueError(
                    f"request_id {cmd.request_id!r} is already in flight"
                )
            else:
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, lora_request=cmd.lora_request)
                    err = None
                except Exception as e:  # ValueError/TypeError: the caller's mistake, passed back
                    err = e
            if err is None:
                self._streams[cmd.request_id] = stream
            _deliver(stream._loop, _set_future, stream._added, None, err)
        elif isinstance(cmd, _Abort):
            known = []
            for rid in cmd.request_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    known.append(rid)
                    _deliver(stream._loop, stream._put, _ABORTED)
            if known:
                try:
                    self.engine.abort_request(known)
                except Exception:
                    logger.exception("abort_request(%s) failed", known)
                self._refresh_stats()
        elif isinstance(cmd, _Call):
            try:
                result, err = cmd.fn(self.engine), None
            except Exception as e:
                result, err = None, e
            _deliver(cmd.loop, _set_future, cmd.future, result, err)
        elif isinstance(cmd, _Stop):
            self._stop.set()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine.step() failed; failing %d requests", len(self._streams))
            ids = list(self._streams)
            if ids:  # released before the callers hear of it: a caller that sees the error finds them gone
                try:
                    self.engine.abort_request(ids)
                except Exception:
                    logger.exception("abort after failed step failed")
            self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            if self.engine_has_unfinished_safe():
                time.sleep(0.05)  # a persistently failing engine must not spin the CPU
            return
        # One wake-up per caller loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream._loop, []).append((stream, out))
        for loop, items in batches.items():
            _deliver(loop, _put_many, items)

    def engine_has_unfinished_safe(self) -> bool:
        try:
            return bool(self.engine.has_unfinished_requests())
        except Exception:
            return False

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _deliver(stream._loop, stream._put, err)

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.get_stats())
            self._stats_time = time.time()
        except Exception:
            logger.debug("get_stats failed", exc_info=True)
