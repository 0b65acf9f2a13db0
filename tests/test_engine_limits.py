"""Limits the engine keeps whatever the requests ask: max_num_seqs per step with parallel sampling
(n larger than it), and logprobs against a vocabulary smaller than MAX_LOGPROBS."""

from __future__ import annotations

import pytest

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams

V = 16  # smaller than MAX_LOGPROBS (20)
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_random_hf_folder(tmp_path_factory.mktemp("tiny16"), CFG, seed=0)


def _no_leaks(llm: LLM) -> bool:
    eng = llm.llm_engine
    return eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.has_unfinished_requests()


def _record_batches(llm: LLM) -> list[int]:
    sizes: list[int] = []
    runner = llm.llm_engine.runner
    execute = runner.execute

    def wrapped(sched, *a, **k):
        sizes.append(len(sched.seqs))
        return execute(sched, *a, **k)

    runner.execute = wrapped
    return sizes


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_parallel_sampling_beyond_max_num_seqs(model, spec):
    """n = 11 siblings with max_num_seqs = 4: no step runs more than 4 sequences, the siblings past
    it wait their turn, and every one finishes with plain greedy's tokens (another request too)."""
    prompt = [3, 4, 5] * 4
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(model, max_model_len=64, num_kv_blocks=64).generate(
        {"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model, max_model_len=64, num_kv_blocks=64, max_num_seqs=4, speculative_config=spec)
    sizes = _record_batches(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2,
                        [SamplingParams(n=11, temperature=0.0, max_tokens=12, ignore_eos=True), greedy],
                        use_tqdm=False)
    assert [c.index for c in outs[0].outputs] == list(range(11))
    assert [c.token_ids for c in outs[0].outputs] == [want] * 11
    assert outs[1].outputs[0].token_ids == want
    assert max(sizes) == 4
    assert _no_leaks(llm)


def test_logprobs_above_vocabulary_is_refused(model):
    """logprobs within MAX_LOGPROBS but above the vocabulary: a clear error at add time, nothing else
    affected; logprobs equal to the vocabulary size works (every token ranked)."""
    llm = LLM(model, max_model_len=64, num_kv_blocks=32)
    eng = llm.llm_engine
    other = eng.add_request("other", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=r"logprobs=17 exceeds the vocabulary size \(16\)"):
        eng.add_request("bad", [1, 2, 3], SamplingParams(logprobs=V + 1, max_tokens=2))
    full = eng.add_request("full", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=V, max_tokens=2,
                                                             ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert set(done) == {other, full}
    assert len(done[other].outputs[0].token_ids) == 4
    lps = done[full].outputs[0].logprobs
    assert len(lps) == 2 and all(len(d) == V for d in lps)
    assert _no_leaks(llm)


def test_allowed_token_ids_that_min_tokens_would_empty_are_refused(model):
    """Allowed tokens that are all stop tokens, with min_tokens: no token could be generated (every
    logit masked), so the request is refused, naming both; one more allowed token makes it fine."""
    llm = LLM(model, max_model_len=64, num_kv_blocks=32)
    eng = llm.llm_engine
    bad = SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2, max_tokens=4)
    with pytest.raises(ValueError, match="allowed_token_ids holds only stop / EOS tokens, which min_tokens=2"):
        eng.add_request("bad", [1, 2, 3], bad)
    ok = SamplingParams(temperature=0.0, allowed_token_ids=[5, 6], stop_token_ids=[5], min_tokens=2, max_tokens=4)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, ok, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == [6, 6] and set(out.token_ids) <= {5, 6}
    assert _no_leaks(llm)


def test_weights_beyond_host_memory_are_refused_up_front(tmp_path, monkeypatch):
    """On the CPU a model whose weights exceed MemAvailable is a ValueError naming both sizes (loading it
    would end in the kernel's OOM kill, silently: `pageflash bench latency`'s default llama-3-8b is 30
    GiB in float32); a host that has the room, or no /proc/meminfo, passes."""
    import torch

    import pageflash.engine.engine as engine_mod
    from pageflash.model.loader import load_config, resolve_model

    check = engine_mod.check_host_memory
    cfg = load_config(resolve_model("llama-3-8b", "dummy"))
    small = tmp_path / "small"
    small.write_text("MemTotal: 4194304 kB\nMemAvailable: 2097152 kB\n")  # 2 GiB free
    with pytest.raises(ValueError, match=r"llama-3-8b: its weights take about 29.9 GiB in float32 .* 2.0 GiB"):
        check(cfg, torch.float32, "llama-3-8b", meminfo=str(small))
    with pytest.raises(ValueError, match="15.0 GiB in bfloat16"):
        check(cfg, torch.bfloat16, "llama-3-8b", meminfo=str(small))
    big = tmp_path / "big"
    big.write_text("MemAvailable: 67108864 kB\n")  # 64 GiB
    check(cfg, torch.float32, "llama-3-8b", meminfo=str(big))
    check(cfg, torch.float32, "llama-3-8b", tp=2, meminfo=str(tmp_path / "absent"))
    # the engine checks before it allocates anything
    monkeypatch.setattr(engine_mod, "check_host_memory", lambda *a, **k: check(*a, **k, meminfo=str(small)))
    with pytest.raises(ValueError, match="choose a smaller model"):
        LLM("llama-3-8b", load_format="dummy", device="cpu")
