"""Prometheus metrics of the server, named as vLLM's (`vllm:` -> `pageflash:`).

Each server gets its own CollectorRegistry (no global state: several apps can live in one process,
as in the tests). Two sources:
- the engine's own counters and gauges (`LLMEngine.get_stats()`, snapshotted by the engine thread)
  are read at scrape time by a custom collector: running/waiting requests, KV-cache usage, free
  blocks, prefix-cache queries/hits, preemptions, prompt/generation token totals, and speculative
  decoding per proposer (drafts, draft/accepted/emitted tokens, acceptance rate, accepted per step);
- per-request latencies that only the server sees (time to first token, time per output token,
  end-to-end latency) and finished requests by reason are histograms/counters updated per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pageflash.engine.async_engine import AsyncLLMEngine

PREFIX = "pageflash:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineStatsCollector(Collector):
    """Turns the engine's latest stats snapshot into metrics at scrape time."""

    def __init__(self, engine: "AsyncLLMEngine", model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.get_stats()
        lbl = ["model_name"]
        val = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=lbl)
            g.add_metric(val, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=lbl)
            c.add_metric(val, float(value))
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("num_requests_in_flight", "Requests the server is streaming or awaiting.",
                    self.engine.num_in_flight)  # fmt: skip
        yield gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).", s.get("kv_cache_usage", 0.0))
        yield gauge("num_kv_blocks_free", "Free KV-cache blocks.", s.get("num_free_blocks", 0))
        yield gauge("num_kv_blocks_total", "KV-cache blocks in all.", s.get("num_total_blocks", 0))
        queries = s.get("prefix_cache_queries", 0)
        hits = s.get("prefix_cache_hits", 0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens).",
                    hits / queries if queries else 0.0)  # fmt: skip
        yield counter("num_preemptions", "Requests preempted since start.", s.get("num_preemptions", 0))
        yield counter("prompt_tokens", "Prompt tokens processed.", s.get("prompt_tokens_total", 0))
        yield counter("generation_tokens", "Tokens generated.", s.get("generation_tokens_total", 0))
        yield gauge("engine_healthy", "1 while the engine loop runs.", 1.0 if self.engine.is_running else 0.0)
        yield from spec_metrics(s.get("spec") or {}, self.model_name)


def spec_metrics(spec: dict, model_name: str) -> Iterator[Metric]:
    """Speculative decoding, per proposer (LLMEngine.get_stats()["spec"], SpecMetrics.as_dict())."""
    if not spec:
        return
    lbl = ["model_name", "proposer"]
    counters = (
        ("num_steps", "spec_decode_num_drafts", "Verify steps of one request's draft."),
        ("num_no_draft", "spec_decode_num_no_draft", "Times the proposer had no draft for a request."),
        ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified."),
        ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        ("num_emitted_tokens", "spec_decode_num_emitted_tokens", "Tokens emitted by verify steps."),
    )
    gauges = (
        ("acceptance_rate", "spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start."),
        ("mean_accepted_per_step", "spec_decode_mean_accepted_per_step", "Accepted drafts per verify step."),
        ("mean_emitted_per_step", "spec_decode_mean_emitted_per_step", "Tokens per verify step (1 = no gain)."),
    )
    for family, rows in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
        for key, name, doc in rows:
            m = family(PREFIX + name, doc, labels=lbl)
            for prop, st in spec.items():
                m.add_metric([model_name, prop], float(st.get(key, 0)))
            yield m
    h = CounterMetricFamily(PREFIX + "spec_decode_accepted_per_step", "Verify steps by number of accepted drafts.",
                            labels=lbl + ["accepted"])
    for prop, st in spec.items():
        for a, n in enumerate(st.get("accepted_hist", [])):
            h.add_metric([model_name, prop, str(a)], float(n))
    yield h


@dataclass
class RequestTimer:
    """Timing of the engine requests behind one HTTP request (its rows: prompts x n choices, or one per
    embedding input), created at arrival. Every row is recorded as a request of its own, as vLLM records
    each engine request: its prompt length, first-token time, time per output token, generated tokens,
    latency and finish reason."""

    metrics: "ServerMetrics"
    arrival: float = field(default_factory=time.perf_counter)
    num_tokens: list[int] = field(default_factory=list)  # per row, generated so far
    first_token: list[float | None] = field(default_factory=list)
    last_token: list[float | None] = field(default_factory=list)
    done: bool = False

    def _rows(self, n: int) -> None:
        for lst, fill in ((self.num_tokens, 0), (self.first_token, None), (self.last_token, None)):
            lst.extend([fill] * (n - len(lst)))  # type: ignore[list-item]

    def on_tokens(self, counts: list[int]) -> None:
        """Called with each row's generated tokens so far."""
        self._rows(len(counts))
        now = None
        for i, c in enumerate(counts):
            if c > self.num_tokens[i]:
                now = time.perf_counter() if now is None else now
                if self.first_token[i] is None:
                    self.first_token[i] = now
                    self.metrics.ttft.labels(self.metrics.model_name).observe(now - self.arrival)
                self.last_token[i] = now
                self.num_tokens[i] = c

    def finish(self, finished_reasons: list[str | None], prompt_tokens: list[int],
               generated: list[int] | None = None) -> None:
        """One finish reason and prompt length per row (reason None: aborted); generated: the rows' token
        counts where on_tokens did not follow them (beam search)."""
        if self.done:
            return
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        self._rows(len(finished_reasons))
        e2e = time.perf_counter() - self.arrival
        for i, reason in enumerate(finished_reasons):
            n = generated[i] if generated is not None else self.num_tokens[i]
            first, last = self.first_token[i], self.last_token[i]
            m.e2e.labels(name).observe(e2e)
            if first is not None and last is not None and n > 1:
                m.tpot.labels(name).observe((last - first) / (n - 1))
            m.prompt_len.labels(name).observe(prompt_tokens[i])
            m.gen_len.labels(name).observe(n)
            m.success.labels(name, reason or "abort").inc()


class ServerMetrics:
    def __init__(self, engine: "AsyncLLMEngine", model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              lbl, buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              lbl, buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to end.",
                             lbl, buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.",
                                    lbl, buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.gen_len = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per request.",
                                 lbl, buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.errors = Counter(PREFIX + "request_errors", "Requests answered with an error, by status.",
                              ["model_name", "status"], registry=r)  # fmt: skip
        r.register(EngineStatsCollector(engine, model_name))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
