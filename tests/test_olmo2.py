"""OLMo 2 (Olmo2ForCausalLM): a Llama without input norms whose attention and MLP outputs are normed
(post_attention_layernorm, post_feedforward_layernorm) before each residual add, with q_norm / k_norm
over the whole q and k projections (not per head) and Olmo2RMSNorm's arithmetic (weight times the
normed x in float32, rounded once). Its config as transformers 5 reads it (defaults, refusals);
the norms' weights as tensor-parallel ranks slice them; the norm's arithmetic in bfloat16; HF's greedy tokens and prompt
log-probabilities with prefix-cache hits; the Triton backend (interpreter) with rotary fused into the
K/V store and the decode launch, and speculative decoding through the static-buffer step path; and a
check that per-head q/k norms would give other logits. (Greedy equality with chunked prefill and
preemption: the "olmo2*" entries of tests/test_engine_hf.py's CONFIGS.)"""

from __future__ import annotations

import pytest
import torch

from hf_ref import make_random_hf_folder, prefix_hits_and_prompt_logprobs_match_hf, triton_paths_match_hf
from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig
from test_engine_hf import CONFIGS

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             model_type="olmo2", architectures=["Olmo2ForCausalLM"])


def _prompts(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 211, (n,), generator=g).tolist() for n in lens]


def test_config_reads_as_transformers():
    """Defaults (KV heads = heads, rope base 1e4, untied, eos 50279, no bos, eps 1e-5, 2048 positions),
    head_dim, GQA, rope_scaling in either layout, each as Olmo2Config builds them; the OLMo 2 flags
    set; the config round-trips through to_hf_dict."""
    from transformers import AutoConfig

    cases = [dict(SMALL), dict(SMALL, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6),
             dict(SMALL, rope_theta=500000.0, tie_word_embeddings=True, eos_token_id=[2, 3]),
             dict(SMALL, rope_scaling=dict(rope_type="linear", factor=4.0)),
             dict(SMALL, rope_parameters=dict(rope_type="yarn", rope_theta=5e5, factor=2.0,
                                              original_max_position_embeddings=64))]
    for d in cases:
        cfg, hf = ModelConfig.from_hf_dict(d), AutoConfig.for_model(**d)
        assert cfg.architecture == "Olmo2ForCausalLM"
        assert cfg.num_key_value_heads == hf.num_key_value_heads
        assert cfg.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
        assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
        assert cfg.rope_type == hf.rope_parameters.get("rope_type", "default")
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings
        assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.max_position_embeddings == hf.max_position_embeddings
        hf_eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
        assert list(cfg.eos_token_ids) == hf_eos and cfg.bos_token_id == hf.bos_token_id
        assert cfg.qk_norm and cfg.qk_norm_full and cfg.post_norm and cfg.norm_float_weight
        assert not cfg.sandwich_norm and not cfg.attention_bias and cfg.sliding_window is None
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    base = ModelConfig.from_hf_dict(SMALL)
    assert base.num_key_value_heads == 4 and base.rope_theta == 10000.0 and not base.tie_word_embeddings
    assert base.eos_token_ids == (50279,) and base.bos_token_id is None
    assert base.rms_norm_eps == 1e-5 and base.max_position_embeddings == 2048
    default = ModelConfig.from_hf_dict(dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"]))
    hf = AutoConfig.for_model("olmo2")
    assert (default.vocab_size, default.hidden_size, default.intermediate_size, default.num_hidden_layers,
            default.num_attention_heads) == (hf.vocab_size, hf.hidden_size, hf.intermediate_size,
                                             hf.num_hidden_layers, hf.num_attention_heads)


def test_config_refusals_and_flags_kept_to_olmo2():
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_dict({**SMALL, "attention_bias": True})
    # tensor parallelism: each rank's share of the heads, its q / k norms over its slice of them
    s = ModelConfig.from_hf_dict(SMALL).shard(2)
    assert (s.num_attention_heads, s.q_size, s.kv_size, s.qk_norm_full) == (2, 32, 32, True)
    llama = dict(vocab_size=10, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="no OLMo 2 norms"):
        ModelConfig(**llama, post_norm=True).to_hf_dict()
    with pytest.raises(ValueError, match="needs qk_norm"):
        ModelConfig(**llama, qk_norm_full=True)
    with pytest.raises(ValueError, match="exclude each other"):
        ModelConfig(**llama, post_norm=True, sandwich_norm=True)


def test_norm_arithmetic_is_olmo2s_in_bfloat16():
    """RMSNorm(float_weight=True) equals transformers' Olmo2RMSNorm bit for bit in bfloat16 (weight
    times the float32 normed x, rounded once), with and without a residual."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from pageflash.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).bfloat16()
    r = torch.randn(7, 96, generator=g).bfloat16()
    w = (1 + 0.3 * torch.randn(96, generator=g)).bfloat16()
    ours, ref = RMSNorm(96, 1e-6, float_weight=True).bfloat16(), Olmo2RMSNorm(96, 1e-6).bfloat16()
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        out, s = ours(x, r)
        assert torch.equal(s, x + r) and torch.equal(out, ref(x + r))


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path_factory.mktemp("olmo2"), CONFIGS["olmo2"])
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_prefix_hits_and_prompt_logprobs_match_hf(olmo2):
    """A shared prefix hits the cache (blocks of 4, prefill chunks of 8), outputs equal HF's greedy
    tokens; prompt log-probabilities equal HF's log-softmax over the prompt."""
    folder, hf = olmo2
    prefix_hits_and_prompt_logprobs_match_hf(folder, hf, _prompts(6, (21,))[0], _prompts(7, (3, 6, 1)))


def test_per_head_qk_norms_would_give_other_logits(olmo2):
    """The whole-projection q/k norms matter on these weights: the model's logits equal HF's; with
    the q/k rows normed per head instead (the weights reshaped), they differ."""
    from pageflash.layers.norm import rms_norm_ref
    from pageflash.model.llama import LlamaAttention

    folder, hf = olmo2
    p = _prompts(8, (17,))[0]
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0, -1]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def top():
        llm = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=32)
        lp = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].logprobs[0]
        return {t: v.logprob for t, v in lp.items()}

    ref = torch.log_softmax(want.double(), -1)
    got = top()
    assert all(v == pytest.approx(ref[t].item(), abs=1e-4) for t, v in got.items())
    real = LlamaAttention.forward

    def per_head(self, x, *a, **k):
        norms = self.q_norm, self.k_norm
        d = self.head_dim

        class PerHead(torch.nn.Module):
            def __init__(self, n):
                super().__init__()
                self.n = n

            def forward(self, y):
                t = y.shape[0]
                return rms_norm_ref(y.reshape(t, -1, d), self.n.weight.view(-1, d), self.n.eps).reshape(t, -1)

        self.q_norm, self.k_norm = PerHead(norms[0]), PerHead(norms[1])
        try:
            return real(self, x, *a, **k)
        finally:
            self.q_norm, self.k_norm = norms

    LlamaAttention.forward = per_head
    try:
        other = top()
    finally:
        LlamaAttention.forward = real
    assert any(abs(other.get(t, -1e9) - v) > 1e-3 for t, v in got.items())


@pytest.mark.parametrize("mode", ["fused", "speculative"])
def test_triton_backend_and_drafts_match_hf(tmp_path, monkeypatch, mode):
    """Through the Triton kernels under the interpreter. "fused": rotary inside the K/V store
    (prefill) and inside the decode launch, on the whole-projection-normed q and k. "speculative":
    the model drafting for itself (draft_model), verified through the static-buffer step path
    (StepGraphs, eager). HF's greedy tokens."""
    name = "olmo2-headdim-tied-linear" if mode == "fused" else "olmo2"
    ropes = triton_paths_match_hf(tmp_path, monkeypatch, CONFIGS[name], mode, _prompts(4, (11, 26)))
    if mode == "fused":
        assert ropes and all(ropes)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tensor_parallel_shards_slice_the_whole_projection_norms(tmp_path, kv_heads):
    """Under tensor parallelism each rank's q_norm / k_norm weights are the slices of the whole ones
    that scale its q / k columns (one KV head over two ranks: both hold it whole); the engine's two
    ranks over gloo give HF's greedy tokens: tests/test_tensor_parallel.py."""
    from pageflash.model.llama import LlamaForCausalLM
    from pageflash.model.loader import iter_weights, load_config, resolve_model

    src = resolve_model(make_random_hf_folder(tmp_path, dict(CONFIGS["olmo2"], num_key_value_heads=kv_heads)))
    cfg = load_config(src)
    models = [LlamaForCausalLM(cfg.shard(size), max_positions=64, tp_rank=r, tp_size=size)
              for r, size in [(0, 1), (0, 2), (1, 2)]]
    for m in models:
        m.load_weights(iter_weights(src, cfg))
    full, r0, r1 = (m.layers[0].self_attn for m in models)
    torch.testing.assert_close(torch.cat([r0.q_norm.weight, r1.q_norm.weight]), full.q_norm.weight, rtol=0, atol=0)
    ks = [r0.k_norm.weight, r1.k_norm.weight]
    want = [full.k_norm.weight] * 2 if kv_heads == 1 else list(full.k_norm.weight.chunk(2))
    for got, w in zip(ks, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
