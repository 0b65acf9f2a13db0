"""SmolLM3 (SmolLM3ForCausalLM): a Llama whose NoPE layers (no_rope_layers[i] == 0) apply no rotary
embedding. Its config as transformers 5 reads it (defaults, no_rope_layer_interval, sliding layers,
refusals); HF's greedy tokens and prompt log-probabilities with prefix-cache hits; the Triton backend
(interpreter) with rotary fused into the K/V store and the decode launch, and speculative decoding
through the static-buffer step path; and a check that the NoPE layers matter (rotating every layer
gives other tokens). (Greedy equality with chunked prefill and preemption, and on two tensor-parallel
ranks: the "smollm3*" entries of tests/test_engine_hf.py's CONFIGS.)"""

from __future__ import annotations

import pytest
import torch

from hf_ref import hf_greedy, make_random_hf_folder, prefix_hits_and_prompt_logprobs_match_hf, triton_paths_match_hf
from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig
from test_engine_hf import CONFIGS

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, model_type="smollm3", architectures=["SmolLM3ForCausalLM"])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_config_reads_as_transformers():
    """Defaults (rope base 2e6, tied, every 4th layer NoPE), no_rope_layer_interval, a no_rope_layers
    list longer than the model, the sliding layers (use_sliding_window: the NoPE ones; or layer_types),
    each as SmolLM3Config builds them; the config round-trips through to_hf_dict."""
    from transformers import AutoConfig

    cases = [dict(SMALL), dict(SMALL, no_rope_layer_interval=3), dict(SMALL, no_rope_layers=[1, 0] * 6),
             dict(SMALL, use_sliding_window=True, sliding_window=16),
             dict(SMALL, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 4),
             dict(SMALL, rope_theta=50000.0, tie_word_embeddings=False)]
    for d in cases:
        cfg, hf = ModelConfig.from_hf_dict(d), AutoConfig.for_model(**d)
        assert cfg.architecture == "SmolLM3ForCausalLM"
        assert [int(cfg.layer_rope(i)) for i in range(8)] == list(hf.no_rope_layers[:8])
        assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings
        slides = [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
        assert [i for i in range(8) if cfg.layer_window(i)] == slides
        assert all(cfg.layer_window(i) == hf.sliding_window for i in slides)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    base = ModelConfig.from_hf_dict(SMALL)
    assert base.nope_layers == (3, 7) and base.rope_theta == 2_000_000.0 and base.tie_word_embeddings
    assert base.rms_norm_eps == 1e-6 and base.max_position_embeddings == 32768
    assert ModelConfig.from_hf_dict({**SMALL, "num_hidden_layers": 2}).nope_layers == ()


@pytest.mark.parametrize("extra,match", [(dict(attention_bias=True), "attention_bias"),
                                         (dict(mlp_bias=True), "mlp_bias"),
                                         (dict(no_rope_layers=[1, 0, 1]), "no_rope_layers"),
                                         (dict(no_rope_layers=[1, 2] * 4), "no_rope_layers")])
def test_config_refusals(extra, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**SMALL, **extra})


def test_nope_layers_are_checked_and_kept_to_smollm3():
    llama = ModelConfig(vocab_size=10, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, nope_layers=(1,))
    with pytest.raises(ValueError, match="no NoPE layers"):
        llama.to_hf_dict()
    with pytest.raises(ValueError, match="nope_layers"):
        ModelConfig(vocab_size=10, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, nope_layers=(2,))


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path_factory.mktemp("smollm3"), CONFIGS["smollm3"])
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompts(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 211, (n,), generator=g).tolist() for n in lens]


def test_rotating_every_layer_gives_other_tokens(smollm3, monkeypatch):
    """The NoPE layers matter on these weights: an engine that rotates every layer (as before SmolLM3)
    does not give HF's tokens; the engine as it is does."""
    folder, hf = smollm3
    prompts = _prompts(5, (9, 23, 30))
    want = [hf_greedy(hf, p, 16) for p in prompts]

    def run():
        llm = LLM(folder, block_size=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=64)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16),
                                                             use_tqdm=False)]

    assert run() == want
    monkeypatch.setattr(ModelConfig, "layer_rope", lambda self, i: True)
    assert run() != want


def test_prefix_hits_and_prompt_logprobs_match_hf(smollm3):
    """A shared prefix hits the cache (blocks of 4, prefill chunks of 8), outputs equal HF's greedy
    tokens; prompt log-probabilities equal HF's log-softmax over the prompt (its logits, position by
    position, through the NoPE and rotary layers)."""
    folder, hf = smollm3
    prefix_hits_and_prompt_logprobs_match_hf(folder, hf, _prompts(6, (21,))[0], _prompts(7, (3, 6, 1)))


@pytest.mark.parametrize("mode", ["fused", "speculative"])
def test_triton_backend_and_drafts_match_hf(tmp_path, monkeypatch, mode):
    """Through the Triton kernels under the interpreter. "fused": rotary inside the K/V store
    (prefill) and inside the decode launch for the rotary layers, the NoPE layers given no rope=
    (the sliding NoPE layer of "smollm3-window-yarn"). "speculative": the model drafting for itself
    (draft_model), verified through the static-buffer step path (StepGraphs, eager). HF's greedy tokens."""
    name = "smollm3-window-yarn" if mode == "fused" else "smollm3"
    ropes = triton_paths_match_hf(tmp_path, monkeypatch, CONFIGS[name], mode, _prompts(4, (11, 26)))
    if mode == "fused":  # layer 0 rotates in the backend, layer 1 (NoPE) passes no rope
        assert ropes[0::2] == [True] * (len(ropes) // 2) and not any(ropes[1::2])
