"""Async scheduling: step N+1 is launched before step N's sampled tokens are read on the host.

The outputs must be exactly those of synchronous stepping, whatever happens in between: requests
that stop (EOS / stop ids / length / stop strings) while the next step is already running, aborts
of requests whose token is in flight, preemption, chunked prefill, prefix-cache hits, n > 1,
logprobs, seeded sampling, and options that need the newest token on the host first (penalties,
min_tokens), which make the engine fall back to synchronous steps. No KV block may leak.
Small random Llama model on the CPU (float32), plus the real default model for stop strings.
"""

from __future__ import annotations

import pytest
import torch

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams

V = 97
CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, eos_token_id=7)
ENGINE = dict(block_size=4, max_model_len=96, max_num_batched_tokens=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_random_hf_folder(tmp_path_factory.mktemp("m"), CFG, seed=3)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, V, (9,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(0, V, (1 + (5 * i) % 23,), generator=g).tolist()
        out.append(shared + own if i % 3 == 0 else own)  # prefix-cache hits for every third prompt
    return out


def _params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, max_tokens=30, ignore_eos=True),
        dict(temperature=0.0, max_tokens=40),  # stops at EOS (id 7) when the model produces it
        dict(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=25, stop_token_ids=[11, 12, 13]),
        dict(temperature=0.0, max_tokens=1),
        dict(temperature=1.0, seed=200 + i, max_tokens=12, logprobs=3, ignore_eos=True),
        dict(n=2, temperature=1.0, seed=300 + i, max_tokens=10, ignore_eos=True),
        dict(temperature=0.0, max_tokens=18, stop_token_ids=[3, 5, 9, 21, 40]),
        dict(temperature=0.0, max_tokens=33, ignore_eos=True),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


class _Close(float):
    """A logprob that compares equal within 1e-3: a request recomputed after preemption gets its
    logits from a prefill instead of decode steps (other float rounding, same tokens)."""

    def __eq__(self, other) -> bool:
        return abs(float(self) - float(other)) < 1e-3

    __hash__ = float.__hash__


def _result(outs) -> list:
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason,
          [sorted((t, _Close(lp.logprob), lp.rank) for t, lp in d.items()) for d in c.logprobs or []])
         for c in o.outputs]
        for o in outs
    ]


def _no_leak(llm: LLM) -> bool:
    eng = llm.llm_engine
    return eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.has_unfinished_requests()


def _run(llm: LLM, prompts, params) -> list:
    return _result(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


@pytest.mark.parametrize("num_kv_blocks", [400, 40])  # 40 blocks of 4: preemption
def test_async_equals_sync(model, num_kv_blocks):
    prompts = _prompts(16)
    params = [_params(i) for i in range(16)]
    sync = LLM(model, num_kv_blocks=num_kv_blocks, async_scheduling=False, **ENGINE)
    asy = LLM(model, num_kv_blocks=num_kv_blocks, async_scheduling=True, **ENGINE)
    assert asy.llm_engine.async_scheduling and not sync.llm_engine.async_scheduling
    ref = _run(sync, prompts, params)
    got = _run(asy, prompts, params)
    assert got == ref
    # the token computed past a stop (by the step already in flight) is dropped, not counted
    assert asy.llm_engine.generation_tokens_total == sync.llm_engine.generation_tokens_total
    reasons = {c[1] for r in ref for c in r}
    assert {"length", "stop"} <= reasons  # requests stopped while their next step was in flight
    if num_kv_blocks == 40:
        assert asy.llm_engine.scheduler.num_preemptions > 0
    assert _no_leak(sync) and _no_leak(asy)
    # a second batch on the same engine: whatever was left in flight by the first is harmless
    prompts2 = _prompts(6, seed=5)
    assert _run(asy, prompts2, params[:6]) == _run(sync, prompts2, params[:6])
    assert _no_leak(asy)


def test_steps_overlap_and_fall_back(model):
    llm = LLM(model, num_kv_blocks=400, async_scheduling=True, **ENGINE)
    eng = llm.llm_engine

    def count_overlapped(params: SamplingParams) -> tuple[int, int]:
        for p in _prompts(4, seed=9):
            eng.add_request(None, {"prompt_token_ids": p}, params)
        steps = overlapped = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
            overlapped += eng._inflight is not None
        return steps, overlapped

    steps, overlapped = count_overlapped(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert overlapped >= steps - 3  # every step but the last ones left its tokens in flight
    steps, overlapped = count_overlapped(
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3))
    assert overlapped == 0  # penalties read the newest tokens: synchronous steps
    steps, overlapped = count_overlapped(SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5))
    assert 0 < overlapped < steps  # synchronous only until min_tokens is reached
    assert _no_leak(llm)


def test_abort_while_in_flight(model):
    prompts = _prompts(3, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = _run(LLM(model, num_kv_blocks=400, async_scheduling=False, **ENGINE), prompts, sp)
    llm = LLM(model, num_kv_blocks=400, async_scheduling=True, **ENGINE)
    eng = llm.llm_engine
    rids = [eng.add_request(None, {"prompt_token_ids": p}, sp) for p in prompts]
    final = {}
    n = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        n += 1
        if n == 8:
            assert eng._inflight is not None and any(r.request_id == rids[1] for r in eng._inflight.reqs)
            eng.abort_request(rids[1])
    assert rids[1] not in final
    assert _result([final[rids[0]], final[rids[2]]]) == [ref[0], ref[2]]
    assert _no_leak(llm)


def test_stop_strings_real_model():
    prompts = ["1, 2, 3, 4,", "Once upon a time", "The capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[" 9"]),
              SamplingParams(temperature=0, max_tokens=16, stop=["time", "."], include_stop_str_in_output=True),
              SamplingParams(temperature=0.7, seed=1, max_tokens=10, logprobs=1)]
    outs = {}
    for mode in (False, True):
        llm = LLM(max_model_len=128, num_kv_blocks=64, max_num_seqs=4, async_scheduling=mode)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[mode] = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for o in res for c in o.outputs]
        assert _no_leak(llm)
    assert outs[True] == outs[False]
    assert outs[True][0][2] == "stop" and outs[True][0][3] == " 9"


def test_speculative_decoder_attached_at_run_time(model):
    """`pageflash bench spec` attaches and detaches SpecDecoders on one engine: steps with a
    decoder attached are synchronous (speculation reads every token on the host), and the step
    left in flight before attaching is resolved first."""
    from pageflash.spec.config import SpeculativeConfig
    from pageflash.spec.decoding import SpecDecoder

    llm = LLM(model, num_kv_blocks=400, async_scheduling=True, **ENGINE)
    eng = llm.llm_engine
    prompts = [[5, 6, 7, 8] * 5, [3, 1, 4, 1, 5, 9] * 3, *_prompts(4, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, stop_token_ids=[40 + i], ignore_eos=True)
              for i in range(len(prompts))]
    ref = _run(LLM(model, num_kv_blocks=400, async_scheduling=False, **ENGINE), prompts, params)
    assert _run(llm, prompts, params) == ref
    d = SpecDecoder(eng, SpeculativeConfig.parse(dict(method="ngram", num_speculative_tokens=3)))
    d.bind(eng.kv.pool.num_blocks)
    for spec in (d, None, d):
        eng.spec = spec
        assert eng.async_scheduling == (spec is None)
        assert _run(llm, prompts, params) == ref
        assert _no_leak(llm)
    assert d.metrics.as_dict()["ngram"]["num_accepted_tokens"] > 0

    # Adaptive: the steps its controller keeps plain (decided without the newest tokens) overlap;
    # the others are synchronous. Either way the output is plain greedy's.
    ad = SpecDecoder(eng, SpeculativeConfig.parse(dict(method="ngram", num_speculative_tokens=3, adaptive=True)))
    ad.bind(eng.kv.pool.num_blocks)
    eng.spec = ad
    assert eng.async_scheduling
    for _ in range(2):
        rids = [eng.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
        final, overlapped, synced = {}, 0, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
            if eng._inflight is not None:
                overlapped += 1
            else:
                synced += 1
        assert _result([final[r] for r in rids]) == ref
        assert _no_leak(llm)
        assert overlapped > 0 and synced > 0
    assert ad.metrics.as_dict()["ngram"]["num_steps"] > 0  # it did speculate in between


@pytest.mark.parametrize("mode", [False, True])
def test_min_tokens_reached_then_stop_token(model, mode):
    """min_tokens masks stop ids only while fewer outputs exist: once reached, a stop token ends the
    request at its first occurrence (the sampling row must see the true output count, even though
    rows without penalties are not given their outputs)."""
    llm = LLM(model, num_kv_blocks=400, async_scheduling=mode, **ENGINE)
    prompt = {"prompt_token_ids": _prompts(2, seed=11)[1]}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    j = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # a token first seen at j >= 3
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=2, ignore_eos=True,
                                              stop_token_ids=[free[j]]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: j + 1]
    assert _no_leak(llm)


def test_longrope_restart_with_a_token_in_flight(tmp_path):
    """LongRoPE: a request that grows past the original context (32 tokens) is recomputed in the step
    that crosses, which async scheduling launches while its newest token is still on the device
    (filled in there); n = 2 siblings cross apart. Async equals sync, and greedy equals HF."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS["phi3-longrope"])
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (20, 29, 31)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    runs = []
    for mode in (False, True):
        llm = LLM(folder, async_scheduling=mode, num_kv_blocks=200, **ENGINE)
        assert llm.llm_engine.async_scheduling == mode
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        assert llm.llm_engine.kv.num_free_blocks == 200
    assert runs[0] == runs[1]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert runs[1][0][0] == hf_greedy(hf, prompts[0], 12) and runs[1][2][0] == hf_greedy(hf, prompts[2], 6)
