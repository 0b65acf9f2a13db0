"""Greedy output of the engine equals HF transformers token for token, on the same weights.

The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized by both sides) on raw and chat
prompts in one batch; small random Llama / Qwen2 / Qwen3 / MQA / GQA / Mixtral / Qwen2-MoE / Qwen3-MoE
/ Gemma / Phi-3 / Granite / SmolLM3 (NoPE layers) models in float32; again with a KV
pool so small that preemption must happen, and with prefix-cache hits.
"""

import pytest
import torch

from hf_ref import hf_greedy, hf_model_from_gguf, hf_reference, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig

NEW = 48
RAW = [
    "The history of the printing press begins",
    "def quicksort(arr):\n    \"\"\"Sort a list.\"\"\"\n",
    "Paris, London and Berlin are all capital cities. The largest of them",
    "Q: What is 17 times 3?\nA:",
]
CHATS = [
    [{"role": "user", "content": "Give me three tips for learning to play the guitar."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Why do cats purr?"}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def real():
    llm = LLM(max_model_len=512, num_kv_blocks=256)
    return llm, hf_model_from_gguf()


def _prompts(tok):
    prompts = [tok.encode(p) for p in RAW]
    for c in CHATS:
        text = tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


def _check(llm, hf, prompts, new=NEW):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY if new == NEW else
                        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, new), f"prompt {p[:8]}..."


def test_real_model_batch_matches_hf(real):
    llm, hf = real
    prompts = _prompts(llm.get_tokenizer())
    assert len({len(p) for p in prompts}) > 1
    _check(llm, hf, prompts)
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.pool.num_blocks  # nothing leaked


def test_real_model_text_and_chat_api(real):
    llm, hf = real
    tok = llm.get_tokenizer()
    out = llm.chat(CHATS[0], GREEDY, use_tqdm=False)[0]
    text = tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_real_model_with_preemption_matches_hf(real):
    _, hf = real
    # 4 prompts x ~60 tokens need ~20 blocks of 16; 12 blocks force preemption and recompute.
    llm = LLM(max_model_len=160, num_kv_blocks=12, block_size=16)
    prompts = _prompts(llm.get_tokenizer())[:4]
    _check(llm, hf, prompts)
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.num_free_blocks == 12


def test_real_model_with_prefix_hits_matches_hf(real):
    llm, hf = real
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    shared = tok.encode("You are reading a long shared system preamble about the history of astronomy, "
                        "from Babylonian star catalogues to Kepler's laws and the telescopes of Galileo. ")
    prompts = [shared + tok.encode(s) for s in ("Question one:", "Another question here:", "Third:")]
    hits0 = eng.get_stats()["prefix_cache_hits"]
    _check(llm, hf, prompts[:1], new=8)
    _check(llm, hf, prompts[1:], new=8)  # these hit the blocks of the first
    assert eng.get_stats()["prefix_cache_hits"] - hits0 >= 2 * 16 * (len(shared) // 16 - 1)


BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {
    "llama-gqa": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_attention_heads=8,
                      num_key_value_heads=2, rope_theta=10000.0),
    "llama-mqa-tied": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_attention_heads=4,
                           num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-mha-rope-scaling": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"],
                                   num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2-bias": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=1000000.0),
    # head_dim 32 with hidden 64 / 4 heads: q is wider than the hidden state
    "qwen3-qk-norm": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, attention_bias=False),
    "mistral": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=1000000.0, sliding_window=None),
    # Mistral v0.1's sliding window, shrunk: every layer sees the last 8 tokens (prompts up to 40 + 20)
    "mistral-window": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], num_attention_heads=4,
                           num_key_value_heads=2, rope_theta=10000.0, sliding_window=8),
    # mixtures of experts: top-2 of 4 renormalized; Qwen3-MoE top-2 of 6 with a dense layer (mlp_only_layers)
    # and q/k norm; Qwen2-MoE top-3 of 4 not renormalized, a gated shared expert, every 2nd layer sparse
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2),
    "qwen3-moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2-moe": dict(BASE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=3,
                      moe_intermediate_size=40, shared_expert_intermediate_size=56, norm_topk_prob=False,
                      decoder_sparse_step=1),
    # Gemma: GeGLU ("gelu" read as its tanh form), (1 + w) norms, scaled embeddings, MQA, head_dim 32
    "gemma": dict(BASE, model_type="gemma", architectures=["GemmaForCausalLM"], num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, hidden_act="gelu", tie_word_embeddings=True),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint; its sliding window on every layer
    "phi3": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, sliding_window=9, pad_token_id=0),
    # LongRoPE from a 32-token "pretraining" context (Phi3Config reads it from the top level): prompts of
    # 33 and 40 tokens rotate with the long factors throughout, those of 16 and 17 switch at position
    # 32 while decoding; cos / sin scaled by sqrt(1 + ln 8 / ln 32)
    "phi3-longrope": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], num_attention_heads=4,
                          num_key_value_heads=2, rope_theta=10000.0, pad_token_id=0,
                          original_max_position_embeddings=32,
                          rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                                            long_factor=[1.0 + i * i / 2 for i in range(8)])),
    # Phi-4-mini's shape: 12 of 16 head dims rotate (partial_rotary_factor 0.75), LongRoPE with unit
    # short factors, tied embeddings
    "phi4-mini-like": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], num_attention_heads=4,
                           num_key_value_heads=2, rope_theta=10000.0, pad_token_id=0, partial_rotary_factor=0.75,
                           original_max_position_embeddings=32, tie_word_embeddings=True,
                           rope_scaling=dict(type="longrope", short_factor=[1.0] * 6,
                                             long_factor=[1.0 + i * i for i in range(6)])),
    # YaRN as Qwen's model cards set it (here 4 x a 32-token context: max_model_len 128 runs past
    # max_position_embeddings, as vLLM allows), and Llama's with mscale / beta / untruncated ramp
    "qwen2-yarn": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=32,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    "llama-yarn-mscale": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_attention_heads=4,
                              num_key_value_heads=2, rope_theta=10000.0,
                              rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                                                mscale=1.0, mscale_all_dim=0.5, beta_fast=16, truncate=False)),
    # dynamic NTK within max_position_embeddings: the default rope, as transformers computes it there
    "llama-dynamic": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], num_attention_heads=4,
                          num_key_value_heads=4, rope_theta=10000.0,
                          rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    # Granite: embedding / residual / attention multipliers and the logits' scaling
    "granite": dict(BASE, model_type="granite", architectures=["GraniteForCausalLM"], num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=10000.0, embedding_multiplier=6.0, residual_multiplier=0.3,
                    attention_multiplier=0.05, logits_scaling=4.0),
    # Gemma 2: softcapped attention scores and logits (caps small enough to bite on these weights), the
    # even layers sliding (window 8), sandwich norms
    "gemma2": dict(BASE, model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=20, sliding_window=8,
                   attn_logit_softcapping=1.5, final_logit_softcapping=4.0, tie_word_embeddings=True),
    # Gemma 3: sandwich norms, q/k norms, query_pre_attn_scalar, two sliding layers (window 8, the local
    # rope base) and a full one (rope base 1e6 with linear scaling)
    "gemma3": dict(BASE, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                   sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling=dict(rope_type="linear", factor=2.0), tie_word_embeddings=True),
    # SmolLM3: NoPE layers (no_rope_layers 0: layers 0 and 2 apply no rotary embedding), GQA, tied
    # embeddings, rope base from rope_parameters (transformers 5's layout); pad id inside the vocabulary
    "smollm3": dict(BASE, model_type="smollm3", architectures=["SmolLM3ForCausalLM"], num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, no_rope_layers=[0, 1, 0],
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0), tie_word_embeddings=True,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # SmolLM3 with use_sliding_window: its NoPE layer (every 2nd: no_rope_layer_interval) slides with a
    # window of 8, the rotary one attends fully with YaRN; untied
    "smollm3-window-yarn": dict(BASE, model_type="smollm3", architectures=["SmolLM3ForCausalLM"],
                                num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2,
                                use_sliding_window=True, sliding_window=8, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2,
                                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                     original_max_position_embeddings=32)),
    # OLMo 2: no input norms, post_attention_layernorm / post_feedforward_layernorm on each block's output
    # before the residual add, q_norm / k_norm over the whole q and k projections; GQA, untied
    "olmo2": dict(BASE, model_type="olmo2", architectures=["Olmo2ForCausalLM"], num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, pad_token_id=1,
                  bos_token_id=None, eos_token_id=2),
    # OLMo 2 with head_dim * heads != hidden_size (q / k norms of 128 and 64), tied, linear rope
    # scaling in transformers 5's rope_parameters
    "olmo2-headdim-tied-linear": dict(BASE, model_type="olmo2", architectures=["Olmo2ForCausalLM"],
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=True, pad_token_id=1, eos_token_id=2,
                                      rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_models_match_hf(tmp_path, name):
    folder = make_random_hf_folder(tmp_path, CONFIGS[name])
    hf = hf_reference(folder)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 33, 40)]
    # block size 4 and a small token budget: many blocks per sequence, chunked prefill
    llm = LLM(folder, block_size=4, max_num_batched_tokens=24, max_model_len=128, num_kv_blocks=96)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 20)
    # tiny pool: preemption, same tokens (a sliding window's sequences hold only their windows: a
    # smaller pool still)
    tiny = dict(num_kv_blocks=8, max_num_batched_tokens=8) if ModelConfig.from_hf_dict(CONFIGS[name]).kv_window else \
        dict(num_kv_blocks=20, max_num_batched_tokens=24)
    small = LLM(folder, block_size=4, max_model_len=64, **tiny)
    outs2 = small.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs[:4]]


def test_longrope_switch_with_prefix_cache_matches_hf(tmp_path):
    """LongRoPE (a 32-token original context, blocks of 4, prefill chunks of 8) with the prefix cache:
    the short factors' KV of a prompt that fits is never reused by a request longer than the original
    context (which rotates all of its tokens with the long factors); a long request reuses another's
    long blocks; a short one crossing position 32 while decoding is recomputed, from the long blocks,
    as transformers' Phi-3 generation recomputes its cache there. Each output equals HF's."""
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path, CONFIGS["phi3-longrope"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 211, (24,), generator=g).tolist()
    tail = torch.randint(0, 211, (15,), generator=g).tolist()
    llm = LLM(folder, block_size=4, max_num_batched_tokens=8, max_model_len=64, num_kv_blocks=96)
    eng = llm.llm_engine

    def run(prompt, new):
        hits0 = eng.get_stats()["prefix_cache_hits"]
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy(hf, prompt, new), f"prompt of {len(prompt)} tokens"
        return eng.get_stats()["prefix_cache_hits"] - hits0

    assert run(shared + tail[:4], 2) == 0  # 28 + 2 tokens: short throughout
    assert run(shared + tail[:12], 4) == 0  # 36 tokens: long; the shared 24 tokens' short blocks are not hits
    assert run(shared + tail[:15], 4) == 36  # long: B's 9 long blocks
    # 26 tokens: hits A's 6 short blocks; at 33 tokens it starts over, hitting the 6 long ones, and
    # recomputes 9 tokens in two chunks (the first ends at position 31: still long)
    assert run(shared + tail[:2], 12) == 24 + 24
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


@pytest.mark.parametrize("mode", ["fused", "speculative"])
def test_longrope_through_kernels_and_drafts_matches_hf(tmp_path, monkeypatch, mode):
    """LongRoPE on both sides of its switch through the Triton kernels under the interpreter. "fused":
    Phi-4-mini's rope (partial rotary 0.75) with rotary inside the K/V store and inside the decode
    kernel. "speculative": the model drafting for itself (its drafts are accepted unless the rope
    differs), verified through the static-buffer step path (StepGraphs, eager): a short request's
    drafts stop before position 32, whose logits take the long factors. HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from pageflash.layers import rotary as rotary_layer

    folder = make_random_hf_folder(tmp_path, CONFIGS["phi4-mini-like" if mode == "fused" else "phi3-longrope"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=96, dtype="float32",
              attention_backend="triton")
    if mode == "fused":
        monkeypatch.setattr(rotary_layer, "_use_fused", lambda q, k: True)
        lens = (27, 36)
    else:
        kw["speculative_config"] = dict(method="draft_model", model=folder, num_speculative_tokens=3)
        lens = (26, 31)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lens]
    llm = LLM(folder, **kw)
    eng = llm.llm_engine
    if mode == "speculative":
        for r in (eng.runner, eng.spec.draft_runner):
            r.enable_step_graphs(4, cuda_graphs=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert eng.runner.backend.decode_rope and (mode == "fused" or eng.runner.step_graphs.replays > 0)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_prompt_logprobs_match_hf(tmp_path, monkeypatch):
    """SamplingParams.prompt_logprobs equal HF's log-softmax over the prompt, with chunked prefill,
    a prefix already in the cache (not used: the prompt is computed whole), n > 1, preemption and
    requests without them in the same batch; the first prompt token has None. Logits in slices of
    5 rows (the engine's PROMPT_LOGPROB_ROWS, small here so that steps cross slices)."""
    from transformers import AutoModelForCausalLM

    from pageflash.engine.engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "PROMPT_LOGPROB_ROWS", 5)

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 2, 23, 41)]
    for pool in (96, 24):  # 24 blocks of 4: preemption
        llm = LLM(folder, block_size=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=pool, dtype="float32")
        plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)  # cache the prefixes
        asks = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=k, n=n)
                for k, n in ((3, 1), (0, 1), (2, 2), (1, 1))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, asks + [plain] * 4, use_tqdm=False)
        if pool == 24:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        for p, sp, o in zip(prompts, asks, outs):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
            plp = o.prompt_logprobs
            assert len(plp) == len(p) and plp[0] is None
            for t in range(1, len(p)):
                d = plp[t]
                own = ref[t - 1, p[t]].item()
                assert d[p[t]].logprob == pytest.approx(own, abs=1e-4)
                assert d[p[t]].rank == int((ref[t - 1] > own).sum()) + 1
                top = ref[t - 1].topk(sp.prompt_logprobs).indices.tolist()
                assert set(top) <= set(d) and len(d) <= sp.prompt_logprobs + 1
                assert [d[i].rank for i in top] == list(range(1, sp.prompt_logprobs + 1))
            assert all(c.token_ids == outs[4 + prompts.index(p)].outputs[0].token_ids for c in o.outputs)
        assert all(o.prompt_logprobs is None for o in outs[4:])
        kv = llm.llm_engine.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
