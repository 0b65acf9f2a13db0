"""Embeddings (LLM.embed, PoolingParams): the final hidden state at the prompt's last token, as HF
transformers' base model gives it (last_hidden_state, after the final norm), normalized; through
chunked prefill, prefix-cache hits and beside generation in one engine."""

import pytest
import torch

from hf_ref import make_random_hf_folder
from pageflash import LLM, PoolingParams, SamplingParams

CFG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151, hidden_size=64,
           intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
           attention_bias=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModel

    folder = make_random_hf_folder(tmp_path_factory.mktemp("embed"), CFG)
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    # block size 4 and a small token budget: prompts span many blocks and are prefilled in chunks
    llm = LLM(folder, block_size=4, max_num_batched_tokens=24, max_model_len=128, num_kv_blocks=96, dtype="float32")
    return llm, hf


@torch.no_grad()
def hf_last_hidden(hf, ids):
    return hf(torch.tensor([ids])).last_hidden_state[0, -1].float()


PROMPTS = [[1, 5, 9, 22, 40], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3]


def test_embeddings_match_hf(models):
    llm, hf = models
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        want = torch.nn.functional.normalize(hf_last_hidden(hf, p), dim=0)
        got = torch.tensor(o.outputs.embedding)
        assert got.shape == (64,) and o.prompt_token_ids == p
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    raw = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), hf_last_hidden(hf, PROMPTS[0]), rtol=1e-4, atol=1e-5)
    short = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    want = torch.nn.functional.normalize(hf_last_hidden(hf, PROMPTS[0])[:16], dim=0)
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), want, rtol=1e-4, atol=1e-5)
    # a prompt may fill max_model_len (nothing is generated); one PoolingParams per prompt; generate()
    # takes a single PoolingParams for all prompts
    full = [(7 * i) % 150 + 1 for i in range(128)]
    both = llm.embed([{"prompt_token_ids": full}, {"prompt_token_ids": PROMPTS[0]}],
                     [PoolingParams(), PoolingParams(dimensions=16)], use_tqdm=False)  # fmt: skip
    torch.testing.assert_close(torch.tensor(both[0].outputs.embedding),
                               torch.nn.functional.normalize(hf_last_hidden(hf, full), dim=0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(both[1].outputs.embedding), torch.tensor(short.outputs.embedding),
                               rtol=1e-4, atol=1e-5)  # (a batch of other shapes: rounding may differ)
    gen = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], PoolingParams(), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.embedding for o in gen]),
                               torch.tensor([o.outputs.embedding for o in outs[:2]]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prompt 0: prompt has 129 tokens, but max_model_len is 128"):
        llm.embed({"prompt_token_ids": full + [1]}, use_tqdm=False)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_embeddings_beside_generation_and_from_the_prefix_cache(models):
    """One batch mixing generation and embedding requests (the same prompt twice: the second one's
    blocks come from the prefix cache, down to a one-token tail) gives what each gives alone."""
    llm, _ = models
    long = PROMPTS[2]
    alone = llm.embed({"prompt_token_ids": long}, use_tqdm=False)[0].outputs.embedding
    gen_alone = llm.generate({"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    hits0 = llm.llm_engine.get_stats()["prefix_cache_hits"]
    mixed = llm.generate([{"prompt_token_ids": long}] * 3,
                         [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), PoolingParams(), PoolingParams()],
                         use_tqdm=False)  # fmt: skip
    assert mixed[0].outputs[0].token_ids == gen_alone
    for o in mixed[1:]:
        assert o.outputs == [] and o.finished
        torch.testing.assert_close(torch.tensor(o.embedding), torch.tensor(alone), rtol=1e-4, atol=1e-5)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > hits0
    assert all(o.num_cached_tokens and o.num_cached_tokens % 4 == 0 for o in mixed)  # (RequestOutput.num_cached_tokens)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_bad_pooling_params(models):
    llm, _ = models
    for kw, match in (({"dimensions": 0}, "dimensions"), ({"normalize": "yes"}, "normalize"),
                      ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        with pytest.raises((ValueError, TypeError), match=match):
            PoolingParams(**kw)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)
    # vLLM's -1: the last max_model_len tokens (an embedding input may fill the context)
    long = [(7 * i) % 140 + 3 for i in range(300)]
    cut, want = llm.embed([{"prompt_token_ids": long}, {"prompt_token_ids": long[-128:]}],
                          [PoolingParams(truncate_prompt_tokens=-1), PoolingParams()], use_tqdm=False)  # fmt: skip
    assert cut.prompt_token_ids == long[-128:]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), torch.tensor(want.outputs.embedding))
    with pytest.raises(ValueError, match="prompt 0: dimensions=65 exceeds the model's hidden size"):
        llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.embed([[1, 2]], SamplingParams())
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()
