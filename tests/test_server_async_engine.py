"""AsyncLLMEngine against a scripted fake LLMEngine: ordering, errors, aborts, failures, shutdown.

The fake lets these tests inject what the real engine should never do (a step that raises) and
check instantly that callers are failed, never left hanging. The server over the real engine is
tested in test_server.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pageflash.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError
from pageflash.outputs import CompletionOutput, RequestOutput
from pageflash.sampling_params import SamplingParams


class FakeEngine:
    """Emits the letters of 'abcdefgh...' one per step; one KV 'block' per request."""

    model_name = "fake"
    max_model_len = 64
    vocab_size = 256
    tokenizer = None

    def __init__(self, total_blocks: int = 8, step_delay: float = 0.0) -> None:
        self.reqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.total_blocks = total_blocks
        self.step_delay = step_delay
        self.fail_steps = 0  # the next this-many steps raise
        self.threads: set[str] = set()
        self.aborted: list[str] = []

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def add_request(self, request_id: str, prompt, params: SamplingParams, lora_request=None) -> None:
        self._touch()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else [ord(c) for c in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) > {self.max_model_len}")
        self.reqs[request_id] = (list(ids), params, [])

    def abort_request(self, request_ids) -> None:
        self._touch()
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        outs = []
        for rid, (prompt, params, out) in list(self.reqs.items()):
            out.append(ord("a") + len(out) % 26)
            done = len(out) >= (params.max_tokens or 16)
            comp = CompletionOutput(0, "".join(map(chr, out)), list(out), finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, prompt, [comp], done))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self) -> dict:
        used = len(self.reqs)
        return {"num_running": used, "num_waiting": 0, "kv_cache_usage": used / self.total_blocks,
                "num_free_blocks": self.total_blocks - used, "num_total_blocks": self.total_blocks}


@pytest.fixture
def fake():
    eng = FakeEngine()
    aeng = AsyncLLMEngine(eng)
    yield eng, aeng
    aeng.shutdown()


def run(coro, timeout: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_generate_streams_cumulative_outputs_on_the_engine_thread(fake):
    eng, aeng = fake

    async def go():
        return [o async for o in aeng.generate("hi", SamplingParams(max_tokens=4), "r1")]

    outs = run(go())
    assert [o.outputs[0].text for o in outs] == ["a", "ab", "abc", "abcd"]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert eng.threads == {"pageflash-engine"}  # the caller's thread never touched the engine


def test_concurrent_requests_interleave(fake):
    eng, aeng = fake

    async def one(i: int) -> str:
        last = None
        async for o in aeng.generate(f"p{i}", SamplingParams(max_tokens=3 + i % 3), f"r{i}"):
            last = o
        return last.outputs[0].text

    async def go():
        return await asyncio.gather(*(one(i) for i in range(20)))

    assert run(go()) == ["abcdef"[: 3 + i % 3] for i in range(20)]


def test_add_request_errors_reach_the_caller(fake):
    eng, aeng = fake
    eng.step_delay = 0.01

    async def go():
        with pytest.raises(ValueError, match="max_tokens"):
            await aeng.add_request("big", "x" * 60, SamplingParams(max_tokens=10))
        s = await aeng.add_request("dup", "x", SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in flight"):
            await aeng.add_request("dup", "x", SamplingParams(max_tokens=5))
        s.close()

    run(go())
    assert "big" not in eng.reqs


def test_consumer_leaving_early_aborts(fake):
    eng, aeng = fake
    eng.step_delay = 0.01

    async def go():
        agen = aeng.generate("hi", SamplingParams(max_tokens=50), "early")
        async for o in agen:
            if len(o.outputs[0].token_ids) == 2:
                break
        await agen.aclose()
        await _wait_until(lambda: "early" in eng.aborted)
        await _wait_until(lambda: aeng.get_stats()["num_free_blocks"] == eng.total_blocks)

    run(go())
    assert not eng.reqs


def test_cancelled_consumer_aborts(fake):
    eng, aeng = fake
    eng.step_delay = 0.01

    async def consume():
        async for _ in aeng.generate("hi", SamplingParams(max_tokens=60), "cancelme"):
            pass

    async def go():
        task = asyncio.ensure_future(consume())
        await _wait_until(lambda: "cancelme" in eng.reqs)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: "cancelme" in eng.aborted)

    run(go())


def test_abort_from_elsewhere_ends_the_stream(fake):
    eng, aeng = fake
    eng.step_delay = 0.01

    async def go():
        stream = await aeng.add_request("victim", "hi", SamplingParams(max_tokens=60))
        await aeng.abort("victim")
        outs = [o async for o in stream]  # ends, does not hang
        assert all(not o.finished for o in outs)
        # the engine thread applies the abort between steps, possibly after the stream ended
        await _wait_until(lambda: "victim" in eng.aborted)

    run(go())
    assert "victim" in eng.aborted


def test_step_failure_fails_requests_in_flight_and_engine_recovers(fake):
    eng, aeng = fake

    async def go():
        eng.step_delay = 0.02
        streams = [await aeng.add_request(f"f{i}", "hi", SamplingParams(max_tokens=40)) for i in range(3)]
        eng.fail_steps = 1
        for s in streams:
            with pytest.raises(EngineError, match="injected step failure"):
                async for _ in s:
                    pass
        assert not eng.reqs  # the failed requests were aborted in the engine
        eng.step_delay = 0.0
        outs = [o async for o in aeng.generate("ok", SamplingParams(max_tokens=2), "after")]
        assert outs[-1].finished and outs[-1].outputs[0].text == "ab"

    run(go())


def test_shutdown_fails_in_flight_and_refuses_new(fake):
    eng, aeng = fake
    eng.step_delay = 0.01

    async def go():
        stream = await aeng.add_request("long", "hi", SamplingParams(max_tokens=60))
        await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await aeng.add_request("late", "hi", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await aeng.call(lambda e: 1)

    run(go())
    assert not aeng.is_running


def test_call_runs_on_engine_thread_and_passes_errors(fake):
    eng, aeng = fake

    async def go():
        assert await aeng.call(lambda e: threading.current_thread().name) == "pageflash-engine"
        with pytest.raises(ZeroDivisionError):
            await aeng.call(lambda e: 1 / 0)

    run(go())


def test_dead_loop_never_hangs_a_waiting_caller(fake, monkeypatch):
    eng, aeng = fake

    def boom():
        raise SystemExit("loop bug")  # not an Exception: escapes step()'s handler, kills the loop

    async def go():
        monkeypatch.setattr(eng, "step", boom)
        stream = await aeng.add_request("x", "hi", SamplingParams(max_tokens=60))
        with pytest.raises(EngineError):
            async for _ in stream:
                pass

    run(go())
    assert "loop bug" in (aeng.dead_reason or "")


def test_output_kind_delta_and_final_only(fake):
    """vLLM's output_kind: DELTA yields each output's new text and token ids (an unfinished text's last
    characters held back while a stop string could still cut them), which add up to the cumulative
    output; FINAL_ONLY yields the finished output alone."""
    from pageflash.sampling_params import RequestOutputKind

    eng, aeng = fake

    async def go(**kw):
        return [o async for o in aeng.generate("hi", SamplingParams(max_tokens=5, **kw))]

    cum = run(go())
    delta = run(go(output_kind=RequestOutputKind.DELTA))
    assert [o.outputs[0].text for o in delta] == ["a", "b", "c", "d", "e"]
    assert [o.outputs[0].token_ids for o in delta] == [[ord(c)] for c in "abcde"]
    held = run(go(output_kind=RequestOutputKind.DELTA, stop=["zzz"]))  # 2 characters held back
    assert [o.outputs[0].text for o in held] == ["", "", "a", "b", "cde"]
    assert sum((o.outputs[0].token_ids for o in held), []) == cum[-1].outputs[0].token_ids
    final = run(go(output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == cum[-1].outputs[0].text == "abcde"
