"""Timing loops shared by the decode probes (scripts/decode_probe.py, prefetch_probe.py,
step_timeline.py): graph replays and engine steps, one variant after another in rounds, so that
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
