"""Speculative decoding in the engine: greedy output equals plain greedy token for token.

Small random Llama models on the CPU (float32): every proposer (n-gram, draft model, early exit,
Medusa heads trained by ``pageflash train-medusa``), chains and SpecInfer trees, adaptive k; with
chunked prefill mixing prompts and verify steps in one batch, with a KV pool so small that requests
are preempted in the middle of speculation, with per-request sampling options (max_tokens of 1..3,
stop tokens hit inside an accepted run, logprobs, penalties, min_tokens) and parallel sampling.
No KV block of the target's pool (or the draft model's) may leak.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.engine.engine import EngineConfig

V = 97
CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    rnd = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 16, 33)]
    rep = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1]]  # n-gram lookup finds these
    return rnd + rep


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target = make_random_hf_folder(tmp_path_factory.mktemp("target"), CFG, seed=0)
    draft = make_random_hf_folder(tmp_path_factory.mktemp("draft"), dict(CFG, num_hidden_layers=1), seed=1)
    medusa = str(tmp_path_factory.mktemp("medusa") / "heads.safetensors")
    from pageflash.spec.train_medusa import main as train_main

    assert train_main(["--model", target, "--output", medusa, "--num-prompts", "24", "--max-tokens", "40",
                       "--epochs", "3", "--lr", "3e-3", "--batch-size", "64", "--max-model-len", "128",
                       "--num-kv-blocks", "400", "--num-heads", "3"]) == 0
    plain = LLM(target, num_kv_blocks=400, **ENGINE)
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                           use_tqdm=False)]
    return dict(target=target, draft=draft, medusa=medusa, plain=plain, ref=ref)


SPECS = {
    "ngram": dict(method="ngram", num_speculative_tokens=4),
    "ngram-tree": dict(method="ngram", tree=[3], num_speculative_tokens=9),
    "ngram-adaptive": dict(method="ngram", num_speculative_tokens=4, adaptive=True),
    "draft_model": dict(method="draft_model", model="{draft}", num_speculative_tokens=3),
    "draft_model-tree": dict(method="draft_model", model="{draft}", tree=[2, 2, 1]),
    "early_exit": dict(method="early_exit", num_layers=1, num_speculative_tokens=3),
    "early_exit-tree": dict(method="early_exit", num_layers=2, tree=[2, 1, 1]),
    "medusa": dict(method="medusa", medusa_path="{medusa}", num_speculative_tokens=3),
    "medusa-tree": dict(method="medusa", medusa_path="{medusa}", tree=[3, 2, 1]),
}


def _spec(env, name: str, **over) -> dict:
    s = dict(SPECS[name], **over)
    return {k: (v.format(**env) if isinstance(v, str) else v) for k, v in s.items()}


def _run(llm: LLM, params=GREEDY, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _no_leaks(llm: LLM) -> bool:
    eng = llm.llm_engine
    ok = eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.has_unfinished_requests()
    dk = eng.spec.draft_kv if eng.spec is not None else None
    if dk is not None:
        ok = ok and dk.num_free_blocks == dk.pool.num_blocks
    return ok


@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_equals_plain(env, name):
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
    outs = _run(llm)
    assert [o.outputs[0].token_ids for o in outs] == env["ref"]
    assert _no_leaks(llm)
    stats = llm.llm_engine.get_stats()["spec"][SPECS[name]["method"]]
    assert stats["num_steps"] > 0 and stats["num_accepted_tokens"] > 0, stats
    assert sum(stats["accepted_hist"]) == stats["num_steps"]
    for o in outs:  # per request: accepted counts per verify step; each step emitted accepted + 1 at most
        acc = o.metrics.spec_accepted
        assert len(o.outputs[0].token_ids) >= sum(acc) + len(acc)


@pytest.mark.parametrize("name", ["ngram-tree", "draft_model", "early_exit-tree", "medusa"])
def test_greedy_equals_plain_with_preemption(env, name):
    # 6 requests of up to 57 tokens need ~75 blocks of 4; 20 blocks force preemption mid-speculation
    spec = _spec(env, name, draft_num_kv_blocks=20) if name.startswith("draft") else _spec(env, name)
    llm = LLM(env["target"], num_kv_blocks=20, speculative_config=spec, **dict(ENGINE, max_model_len=64))
    outs = _run(llm)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == env["ref"]
    assert _no_leaks(llm)


@pytest.mark.parametrize("tree", [None, [2, 2, 1]])
def test_draft_with_a_smaller_vocabulary(env, tmp_path, tree):
    """A draft model whose vocabulary ends before the target's (90 of 97 ids): the prompts' and the
    target's ids past its end reach the draft as id 0; greedy output still equals plain greedy, and a
    sampled run finishes, with no block leaked."""
    draft = make_random_hf_folder(tmp_path / "small", dict(CFG, num_hidden_layers=1, vocab_size=90), seed=2)
    past = [t for p, r in zip(PROMPTS, env["ref"]) for t in p + r if t >= 90]
    assert past  # the case is exercised: ids the draft cannot embed, in prompts and outputs
    spec = dict(method="draft_model", model=draft, num_speculative_tokens=3)
    if tree is not None:
        spec = dict(spec, tree=tree, num_speculative_tokens=None)
    spec = {k: v for k, v in spec.items() if v is not None}
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=spec, **ENGINE)
    assert [o.outputs[0].token_ids for o in _run(llm)] == env["ref"]
    sampled = _run(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == NEW for o in sampled)
    assert llm.llm_engine.get_stats()["spec"]["draft_model"]["num_accepted_tokens"] > 0
    assert _no_leaks(llm)


def test_self_draft_and_full_early_exit_accept_everything(env):
    """A draft model identical to the target, or early exit after all layers, is always right."""
    for spec in (dict(method="draft_model", model=env["target"], num_speculative_tokens=4),
                 dict(method="early_exit", num_layers=CFG["num_hidden_layers"], tree=[2, 1, 1, 1])):
        llm = LLM(env["target"], num_kv_blocks=400, speculative_config=spec, **ENGINE)
        outs = _run(llm, SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [r[:21] for r in env["ref"]]
        for o in outs:  # 1 token from the prompt's step, then 4 full steps of 4 accepted + 1
            assert o.metrics.spec_accepted == [4] * 4
        assert _no_leaks(llm)


@pytest.mark.parametrize("method,code,agree", [("int8", torch.int8, 0.8), ("fp8", torch.float8_e4m3fn, 0.6)])
def test_quantized_self_draft_is_lossless(env, method, code, agree):
    """The target's own checkpoint quantized to int8 / e4m3 as the draft: greedy equals plain greedy,
    the draft's projections hold the codes (the target's do not), and it is right most of the time
    (e4m3's 3 mantissa bits agree less often than int8's per-row grid: 73% against 80%+ of its 3
    drafts a step on this model)."""
    spec = dict(method="draft_model", model=env["target"], num_speculative_tokens=3, quantization=method)
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=spec, **ENGINE)
    outs = _run(llm)
    assert [o.outputs[0].token_ids for o in outs] == env["ref"]
    eng = llm.llm_engine
    assert eng.spec.draft_runner.model.layers[0].mlp.down_proj.weight.dtype == code
    assert eng.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    stats = eng.get_stats()["spec"]["draft_model"]
    assert stats["num_accepted_tokens"] >= agree * 3 * stats["num_steps"], stats
    assert _no_leaks(llm)
    with pytest.raises(ValueError, match="applies to a draft model"):
        LLM(env["target"], speculative_config=dict(method="ngram", num_speculative_tokens=3, quantization="int8"))
    with pytest.raises(ValueError, match="quantization must be null or one of"):
        LLM(env["target"], speculative_config=dict(spec, quantization="int4"))


def test_mixed_batch_options_match_plain(env):
    """Requests with and without speculation in one batch; per-request options behave as without it."""
    ref4 = env["ref"][4]  # stop at the first new token from index 5 on: inside an accepted run
    stop_at = next(i for i in range(5, NEW) if ref4[i] not in ref4[:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),  # never speculates
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, presence_penalty=0.5, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[ref4[stop_at]]),
        # min_tokens masks the stop token the drafts keep proposing (the output repeats one token)
        SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=12, stop_token_ids=[env["ref"][5][0]]),
    ]
    want = _run(env["plain"], params)
    for name in ("ngram", "draft_model-tree"):
        llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
        got = _run(llm, params)
        for w, g in zip(want, got):
            cw, cg = w.outputs[0], g.outputs[0]
            assert cg.token_ids == cw.token_ids
            assert (cg.finish_reason, cg.stop_reason) == (cw.finish_reason, cw.stop_reason)
            if cw.logprobs is not None:
                assert len(cg.logprobs) == len(cw.logprobs)
                for a, b in zip(cw.logprobs, cg.logprobs):
                    assert a.keys() == b.keys()
                    for t in a:
                        assert a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-4
                assert abs(cg.cumulative_logprob - cw.cumulative_logprob) < 1e-3
        assert got[4].outputs[0].finish_reason == "stop" and len(got[4].outputs[0].token_ids) == stop_at + 1
        assert _no_leaks(llm)


def test_greedy_logprobs_match_plain(env):
    """All requests plain greedy (the host-side verification path), some asking for logprobs."""
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=lp) for lp in (None, 0, 3)]
    prompts = PROMPTS[4:6] + PROMPTS[1:2]
    want = _run(env["plain"], params, prompts)
    for name in ("ngram", "ngram-tree"):
        llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
        got = _run(llm, params, prompts)
        assert llm.llm_engine.get_stats()["spec"]["ngram"]["num_accepted_tokens"] > 0
        for w, g in zip(want, got):
            cw, cg = w.outputs[0], g.outputs[0]
            assert cg.token_ids == cw.token_ids
            assert (cg.logprobs is None) == (cw.logprobs is None)
            for a, b in zip(cw.logprobs or [], cg.logprobs or []):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-4
        assert _no_leaks(llm)


def test_parallel_sampling_with_speculation(env):
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, "draft_model"), **ENGINE)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(n=3, temperature=0.0, max_tokens=NEW,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [env["ref"][2]] * 3
    sampled = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(n=3, temperature=1.0, seed=5,
                                                                            max_tokens=NEW, ignore_eos=True),
                           use_tqdm=False)[0]
    assert all(len(c.token_ids) == NEW for c in sampled.outputs)
    assert _no_leaks(llm)


def _steps_to_finish(llm: LLM, max_steps: int = 400) -> list:
    """Step the engine until nothing is left (a bounded loop: a hang fails the test instead)."""
    eng, done = llm.llm_engine, []
    for _ in range(max_steps):
        done += [o for o in eng.step() if o.finished]
        if not eng.has_unfinished_requests():
            return done
    raise AssertionError(f"not finished after {max_steps} steps: {eng.groups}")


@pytest.mark.parametrize("block_size,chunk", [(4, 4), (1, 2), (1, 1)])
@pytest.mark.parametrize("name", ["ngram", "draft_model", "early_exit"])
def test_parallel_sampling_when_a_prompt_chunk_stops_one_short(env, name, block_size, chunk):
    """n > 1 with chunked prefill stopping one token before the prompt's end: that request looks like
    decode (only its last token lacks KV) but has not forked its siblings yet, so it must not be
    drafted for (the verify step would skip the fork). Each sibling equals plain greedy; with early
    exit the drafts' slots are never shared with a sibling."""
    prompt = [5, 6, 7] * 3  # 9 tokens: chunks of 4 or 2 stop at 8; chunks of 1 at every token
    want = _run(env["plain"], prompts=[prompt])[0].outputs[0].token_ids
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name),
              **dict(ENGINE, block_size=block_size, max_num_batched_tokens=chunk))
    llm.llm_engine.add_request("a", {"prompt_token_ids": prompt},
                               SamplingParams(n=2, temperature=0.0, max_tokens=NEW, ignore_eos=True))
    (out,) = _steps_to_finish(llm)
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert _no_leaks(llm)
    if chunk > 1:  # a budget of 1 token leaves no room to verify drafts (early exit still drafts)
        assert llm.llm_engine.get_stats()["spec"][SPECS[name]["method"]]["num_steps"] > 0


@pytest.mark.parametrize("name", ["draft_model", "draft_model-tree", "early_exit-tree"])
def test_seeded_sampling_with_drafts_is_reproducible(env, name):
    """A seeded request's drafts are drawn from its own generator, not torch's global one: the same
    seeds give the same tokens whatever the global RNG state, its siblings (n > 1) too. (The engine
    starts each run in the same state: a prefix-cache hit changes the schedule, and the token
    budget's trimming of drafts with it, which changes what a seeded request's draws select.)"""
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=NEW, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, top_k=20, seed=3, max_tokens=NEW, ignore_eos=True)]
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        llm.reset_prefix_cache()
        runs.append([[c.token_ids for c in o.outputs] for o in _run(llm, params, PROMPTS[4:6])])
    assert runs[0] == runs[1]
    assert llm.llm_engine.get_stats()["spec"][SPECS[name]["method"]]["num_steps"] > 0
    assert _no_leaks(llm)


@pytest.mark.parametrize("name", ["ngram", "ngram-tree", "ngram-adaptive", "medusa-tree"])
def test_seeded_requests_get_plain_decodings_tokens_under_deterministic_drafts(env, name):
    """A seeded request's token at each output position is drawn from its generator for that
    position (sampler.SeedStream): with deterministic drafts (n-gram, Medusa) verification samples
    each drafted position so and keeps the matching drafts, so the tokens are plain decoding's --
    alone, beside unseeded requests, with n = 2 siblings, and in the adaptive mode, whose choice of k
    follows measured step times. Drafts are accepted (the top-k of 3 keeps acceptance up)."""
    seeded = [SamplingParams(temperature=0.8, top_k=3, seed=11, max_tokens=NEW, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, top_k=3, seed=3, max_tokens=NEW, ignore_eos=True)]
    prompts = PROMPTS[4:6]
    want = [[c.token_ids for c in o.outputs] for o in _run(env["plain"], seeded, prompts)]
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
    alone = [[c.token_ids for c in o.outputs] for o in _run(llm, seeded, prompts)]
    free = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    mixed = _run(llm, [free, seeded[0], free, seeded[1]], [PROMPTS[1], prompts[0], PROMPTS[3], prompts[1]])
    assert alone == want
    assert [[c.token_ids for c in o.outputs] for o in (mixed[1], mixed[3])] == want
    assert llm.llm_engine.get_stats()["spec"][SPECS[name]["method"]]["num_accepted_tokens"] > 0
    assert _no_leaks(llm)


@pytest.mark.parametrize("name", ["ngram", "draft_model-tree"])
def test_allowed_token_ids_with_speculation(env, name):
    """Greedy with allowed_token_ids goes through the processed distribution in verification too:
    the same tokens as plain decoding, all of them allowed; sampled ones stay inside the set."""
    allowed = [t for t in range(V) if t != env["ref"][4][0]][::8]  # plain greedy's first token is out
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=1, max_tokens=NEW, ignore_eos=True, allowed_token_ids=allowed)]
    want = _run(env["plain"], params, PROMPTS[4:6])
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, name), **ENGINE)
    got = _run(llm, params, PROMPTS[4:6])
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert want[0].outputs[0].token_ids != env["ref"][4]  # the set did change the greedy output
    for o in got + want:
        assert set(o.outputs[0].token_ids) <= set(allowed)
    assert _no_leaks(llm)


def test_abort_mid_speculation_frees_everything(env):
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, "draft_model-tree"), **ENGINE)
    eng = llm.llm_engine
    ids = [eng.add_request(None, {"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    for _ in range(6):
        eng.step()
    assert eng.get_stats()["spec"]["draft_model"]["num_steps"] > 0
    eng.abort_request(ids)
    assert _no_leaks(llm)


@pytest.mark.parametrize("name", ["ngram-adaptive", "ngram-tree"])
def test_adaptive_shadow_drafts_watch_plain_requests(env, name):
    """One request at a time (batch 1): while a request decodes plainly, the adaptive decoder drafts
    from its history on the host and scores the draft against the tokens that come; those scores
    reach the controller (more acceptance observations than verify steps, both outcome states
    seen), never the spec metrics, and the output stays plain greedy."""
    spec = _spec(env, name, adaptive=True)
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=spec, **ENGINE)
    eng = llm.llm_engine
    # speculation never pays here: off but for probes, so the requests decode plainly
    eng.spec.ctrl.config = dataclasses.replace(eng.spec.ctrl.config, on_threshold=1e9, off_threshold=1e9)
    outs = [_run(llm, prompts=[p])[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == env["ref"]
    assert _no_leaks(llm)
    st = eng.spec.ctrl._state(eng.spec.name)
    verify_steps = sum(len(o.metrics.spec_accepted) for o in outs)
    assert eng.get_stats()["spec"].get("ngram", {}).get("num_steps", 0) == verify_steps
    assert st.acceptance.num_observations > verify_steps + 20
    assert st.cond[True].num_observations > 0 and st.cond[False].num_observations > 0
    assert not st.last_hit and not st.requests  # finished requests are forgotten


def test_stats_and_disabled_toggle(env):
    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, "ngram"), **ENGINE)
    eng = llm.llm_engine
    eng.spec.enabled = False  # the benchmarks' baseline: same engine, no speculation
    assert [o.outputs[0].token_ids for o in _run(llm)] == env["ref"]
    assert eng.get_stats()["spec"] == {}
    eng.spec.enabled = True
    _run(llm)
    s = eng.get_stats()["spec"]["ngram"]
    assert set(s) >= {"acceptance_rate", "mean_accepted_per_step", "mean_emitted_per_step", "accepted_hist"}
    assert 0 < s["acceptance_rate"] <= 1 and s["mean_emitted_per_step"] == pytest.approx(
        s["num_emitted_tokens"] / s["num_steps"])


def test_config_validation_names_the_field(env):
    bad = [
        (dict(method="lookahead"), "method"),
        (dict(method="draft_model", num_speculative_tokens=3), "model"),
        (dict(method="medusa", num_speculative_tokens=3), "medusa_path"),
        (dict(method="early_exit", num_speculative_tokens=3), "num_layers"),
        (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="ngram", tree=[2, 0]), "tree"),
        (dict(method="ngram", prompt_lookup_min=5, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(method="ngram", k=3), "unknown key"),
        (dict(method="draft_model", num_speculative_tokens=2), "model"),
        ("{not json", "JSON"),
    ]
    for cfg, word in bad:
        with pytest.raises(ValueError, match=word):
            EngineConfig(model=env["target"], speculative_config=cfg)
    with pytest.raises(ValueError, match="num_layers"):
        LLM(env["target"], num_kv_blocks=64, speculative_config=dict(method="early_exit", num_layers=9,
                                                                      num_speculative_tokens=2), **ENGINE)
    with pytest.raises(ValueError, match="only 3 heads"):  # a chain drafts one token a head
        LLM(env["target"], num_kv_blocks=64, speculative_config=dict(method="medusa", medusa_path=env["medusa"],
                                                                      num_speculative_tokens=5), **ENGINE)
    c = EngineConfig(model=env["target"], speculative_config='{"method": "ngram", "tree": [2]}')
    assert c.speculative_config.tree == (2,) and c.speculative_config.num_speculative_tokens == 10


def test_cli_and_server_flag():
    import argparse

    from pageflash.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})])
    assert engine_kwargs(a)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_kwargs(p.parse_args([]))["speculative_config"] is None
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "{oops"])


def test_server_metrics_expose_spec_counters(env):
    from pageflash.server.metrics import ServerMetrics

    llm = LLM(env["target"], num_kv_blocks=400, speculative_config=_spec(env, "ngram"), **ENGINE)
    _run(llm)
    eng = llm.llm_engine

    class Snapshot:  # what ServerMetrics reads of an AsyncLLMEngine
        num_in_flight = 0
        is_running = True

        def get_stats(self):
            return eng.get_stats()

    text = ServerMetrics(Snapshot(), "tiny").render().decode()
    s = eng.get_stats()["spec"]["ngram"]
    lbl = 'model_name="tiny",proposer="ngram"'
    assert f'pageflash:spec_decode_num_accepted_tokens_total{{{lbl}}} {float(s["num_accepted_tokens"])}' in text
    assert f'pageflash:spec_decode_num_drafts_total{{{lbl}}} {float(s["num_steps"])}' in text
    assert "pageflash:spec_decode_acceptance_rate{" in text
    assert 'pageflash:spec_decode_accepted_per_step_total{accepted="0",' in text
