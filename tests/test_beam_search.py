"""LLM.beam_search (vLLM's algorithm over the engine) against the same algorithm written over HF
transformers' full log-softmax, on a small random model in float32."""

import math

import pytest
import torch

from hf_ref import make_random_hf_folder
from pageflash import LLM, BeamSearchParams, SamplingParams
from pageflash.outputs import Logprob

CFG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=48,
           intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
           eos_token_id=3, bos_token_id=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path_factory.mktemp("beam"), CFG, std=0.3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=128, dtype="float32")
    return llm, hf


@torch.no_grad()
def reference(hf, prompt, width, max_tokens, eos, length_penalty):
    """vLLM's beam search, plainly: (tokens, cum_logprob) best first."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        cands = []
        for toks, cum in live:
            lp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].float(), -1)
            vals, ids = lp.topk(2 * width)
            cands += [(toks + [int(t)], cum + float(v)) for v, t in zip(vals, ids)]
        done += [c for c in cands if c[0][-1] in eos]
        live = sorted((c for c in cands if c[0][-1] not in eos), key=lambda c: -c[1])[:width]
    def score(c):
        n = len(c[0]) - (1 if c[0][-1] in eos else 0)
        return c[1] / n ** length_penalty
    return sorted(done + live, key=lambda c: -score(c))[:width]


@pytest.mark.parametrize("width,penalty", [(1, 1.0), (3, 1.0), (4, 0.0)])
def test_beam_search_matches_the_reference(models, width, penalty):
    llm, hf = models
    prompts = [[1, 5, 9, 22, 40], [1, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=penalty)
    hits0 = llm.llm_engine.get_stats()["prefix_cache_hits"]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        want = reference(hf, p, width, 10, {3}, penalty)
        got = [(s.tokens, s.cum_logprob) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
        for s in out.sequences:
            assert s.tokens[:len(p)] == p and s.output_token_ids == s.tokens[len(p):]
            assert s.finish_reason == ("stop" if s.tokens[-1] == 3 else "length")
            assert len(s.logprobs) == len(s.output_token_ids)
            # vLLM's BeamSearchSequence.logprobs: per generated token {token id: Logprob} (was floats)
            assert all(isinstance(v, Logprob) and v.rank is not None for d in s.logprobs for v in d.values())
            assert math.isclose(sum(d[t].logprob for d, t in zip(s.logprobs, s.output_token_ids)), s.cum_logprob,
                                rel_tol=1e-6, abs_tol=1e-5)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > hits0  # rounds reuse the beams' blocks
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_width_one_without_eos_is_greedy(models):
    llm, _ = models
    p = [1, 5, 9, 22, 40]
    greedy = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    beam = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert beam[0].sequences[0].output_token_ids == greedy


def test_bad_beam_params(models):
    llm, _ = models
    for kw, match in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, r"\[1, 10\]"),
                      ({"max_tokens": 0}, "max_tokens"), ({"temperature": 0.7}, "temperature must be 0"),
                      ({"beam_width": True}, "beam_width")):
        with pytest.raises((ValueError, TypeError), match=match):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.beam_search([[1, 2], [1] * 80], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[1, 2]], SamplingParams())
