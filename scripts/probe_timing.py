"""Timing loops shared by the probes (scripts/decode_probe.py, prefetch_probe.py, step_timeline.py,
graph_times.py, the decode split / PDL probes) and their dummy-weights decoding engine: graph replays and engine steps, one variant after another in rounds, so that
the clocks' drift within a process falls on every variant alike."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def replay_us(graph: Any, reps: int = 50, warm: int = 5) -> float:
    """GPU time of one replay of a CUDA graph, in us (mean over reps back-to-back replays)."""
    for _ in range(warm):
        graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3


def graph_rounds(fns: dict, rounds: int, rep: int = 100) -> dict:
    """{name: [us per round]}: each callable timed as CUDA-graph replays (triton's
    do_bench_cudagraph, median), the variants alternated round by round."""
    from triton.testing import do_bench_cudagraph

    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()
            torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream: inputs ready first
            t[k].append(do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3)
    return t


def step_us(eng: Any, steps: int = 100, warm: int = 5) -> float:
    """Wall time of one engine step, in us (mean over steps)."""
    for _ in range(warm):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e6


def decode_engine(name: str) -> tuple[Any, Any]:
    """(llm, engine) of a dummy-weights model decoding one 128-token prompt (up to 8000 new tokens),
    a few steps in: its decode graphs are captured and its steps are batch-1 decode steps."""
    from pageflash import LLM, SamplingParams

    llm = LLM(name, load_format="dummy")
    eng = llm.llm_engine
    eng.add_request(None, {"prompt_token_ids": list(range(10, 138))},
                    SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True))
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    return llm, eng


def chat_waves() -> tuple[Any, list[dict], Any, int]:
    """The host-bound batch-64 workload of adaptive_overhead.py and clock_probe.py: (engine, prompts,
    sampling params, batch). Dummy smollm2-135m; PROMPTS (256) random chat-like prompts of 30-90
    tokens (nothing to copy), run in waves of B (64), MAX_TOKENS (128) new tokens each, greedy."""
    import os
    import random

    from pageflash import LLM, SamplingParams

    b, n = int(os.environ.get("B", "64")), int(os.environ.get("PROMPTS", "256"))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 90))]}
               for _ in range(n)]
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=1024, max_num_seqs=256)
    sp = SamplingParams(temperature=0, max_tokens=int(os.environ.get("MAX_TOKENS", "128")), ignore_eos=True)
    return llm.llm_engine, prompts, sp, b


def round_robin(graphs: dict, eng: Any, graph_of: Callable[[Any], Any], replay_rounds: int = 7,
                step_rounds: int = 3) -> tuple[dict, dict]:
    """graphs: variant -> DecodeGraphs. Returns ({variant: [replay us per round]}, {variant: [step
    us per round]}); graph_of(decode_graphs) picks the graph to replay, and the engine's runner is
    given each variant's DecodeGraphs in turn for its steps."""
    replays = {v: [] for v in graphs}
    for _ in range(replay_rounds):
        for v, g in graphs.items():
            replays[v].append(replay_us(graph_of(g)))
    steps = {v: [] for v in graphs}
    for _ in range(step_rounds):
        for v, g in graphs.items():
            eng.runner.graphs = g
            steps[v].append(step_us(eng))
    return replays, steps
