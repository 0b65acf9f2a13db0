"""logit_bias on the real default model: greedy equals an HF reference that adds the same bias, a +100
bias forces its token, n-gram speculation and a batch beside unbiased requests change nothing, and an
id outside the vocabulary is a clear error."""

import pytest
import torch

from pageflash import LLM, SamplingParams

from hf_ref import hf_greedy_processed, hf_model_from_gguf


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, num_kv_blocks=96, max_num_seqs=8, dtype="float32")


def hf_greedy_biased(model, prompt_ids, bias, max_new_tokens, eos_ids):
    def add_bias(logits, _out):
        for t, b in bias.items():
            logits[t] += b

    return hf_greedy_processed(model, prompt_ids, add_bias, max_new_tokens, eos_ids)


def test_logit_bias_greedy_matches_hf_and_spec(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a rainy morning in a city."}],
                                     tokenize=False, add_generation_prompt=True)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, logprobs=1), use_tqdm=False)[0].outputs[0]
    # push down the tokens greedy decoding picked first, and push up one it did not pick
    bias = {t: -8.0 for t in free.token_ids[:4]}
    bias[tok.encode(" umbrella", add_special_tokens=False)[0]] = 6.0
    sp = SamplingParams(temperature=0, max_tokens=24, logit_bias=bias, logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate([prompt, prompt], [sp, plain], use_tqdm=False)
    got = outs[0].outputs[0]
    assert outs[1].outputs[0].token_ids == free.token_ids  # the unbiased neighbour is untouched
    assert got.token_ids != free.token_ids
    eos = llm.llm_engine.eos_token_ids
    assert got.token_ids == hf_greedy_biased(hf_model_from_gguf(), tok.encode(prompt), bias, 24, eos)
    # logprobs report the model's own distribution, not the biased one (vLLM's raw logprobs): at the
    # first position the raw top token is still the unbiased run's, with the same logprob and rank 1
    ref = free.token_ids[0]
    top = got.logprobs[0][ref]
    assert top.rank == 1 and top.logprob == pytest.approx(free.logprobs[0][ref].logprob, abs=1e-4)
    assert got.logprobs[0][got.token_ids[0]].logprob < top.logprob
    spec = LLM(max_model_len=256, num_kv_blocks=96, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == got.token_ids


def test_plus_100_forces_a_token_and_bad_ids_are_refused(llm):
    tok = llm.get_tokenizer()
    t = tok.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate("My favourite fruit is", SamplingParams(temperature=1.0, seed=0, max_tokens=6,
                                                               logit_bias={t: 100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [t] * 6
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias has token id {vocab}, outside the vocabulary"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()
