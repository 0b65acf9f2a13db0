"""Rotary embeddings against transformers 5: each rope type's inverse frequencies and attention factor
(its _compute_*_parameters), the cos/sin tables (its models' rotary modules, LongRoPE on both sides
of its switch), the configs as it reads them, partial rotary in the PyTorch rotation, and the errors."""

import importlib
import json

import pytest
import torch

from pageflash import LLM
from pageflash.config import ModelConfig
from pageflash.layers.rotary import RotaryEmbedding, _rotate, rope_attention_factor, rope_inv_freq
from pageflash.model.registry import NAMED_CONFIGS

SMALL = dict(vocab_size=100, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)  # head_dim 32
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "phi3": "Phi3ForCausalLM"}
LONGROPE = dict(short_factor=[1.0 + 0.15 * i for i in range(16)], long_factor=[1.0 + i * i / 16 for i in range(16)])
CASES = {
    "llama-linear": dict(SMALL, model_type="llama", max_position_embeddings=256, rope_theta=10000.0,
                         rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama3": dict(SMALL, model_type="llama", max_position_embeddings=2048, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=256)),
    # (a context that is no power of two: the base's arithmetic rounds)
    "llama-dynamic": dict(SMALL, model_type="llama", max_position_embeddings=3000, rope_theta=10000.0,
                          rope_scaling=dict(rope_type="dynamic", factor=1.3)),
    # Qwen2.5's model card: YaRN x4 over its 32768-token context
    "qwen2-yarn": dict(SMALL, model_type="qwen2", max_position_embeddings=32768, rope_theta=1000000.0,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    "qwen3-yarn-old-key": dict(SMALL, model_type="qwen3", head_dim=64, max_position_embeddings=40960,
                               rope_theta=1000000.0, rope_scaling=dict(type="yarn", factor=4.0,
                                                                       original_max_position_embeddings=32768)),
    "llama-yarn-mscale": dict(SMALL, model_type="llama", max_position_embeddings=4096, rope_theta=10000.0,
                              rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                                mscale=1.0, mscale_all_dim=0.707, beta_fast=24, beta_slow=2)),
    "llama-yarn-untruncated": dict(SMALL, model_type="llama", max_position_embeddings=512, rope_theta=10000.0,
                                   rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=128,
                                                     truncate=False, attention_factor=1.25)),
    # Phi-3 LongRoPE: the pretraining context from the top level (the dict's own is ignored, as
    # transformers' Phi3Config does), the old type name "su"; a factor given outright
    "phi3-longrope": dict(SMALL, model_type="phi3", max_position_embeddings=256, original_max_position_embeddings=32,
                          rope_theta=10000.0,
                          rope_scaling=dict(LONGROPE, type="su", original_max_position_embeddings=99)),
    "phi3-longrope-factor": dict(SMALL, model_type="phi3", max_position_embeddings=256,
                                 original_max_position_embeddings=64, rope_theta=10000.0,
                                 rope_scaling=dict(LONGROPE, type="longrope", factor=16.0)),
    # partial rotary: 24 of 32 dims rotate, 12 factors
    "phi3-partial": dict(SMALL, model_type="phi3", max_position_embeddings=256, original_max_position_embeddings=32,
                         partial_rotary_factor=0.75, rope_theta=10000.0,
                         rope_scaling=dict(type="longrope", short_factor=[1.0] * 12,
                                           long_factor=[1.0 + i for i in range(12)])),
}
CASES = {k: dict(v, architectures=[ARCH[v["model_type"]]]) for k, v in CASES.items()}
CASES.update({name: NAMED_CONFIGS[name] for name in ("phi-3.5-mini", "phi-4-mini")})


def _hf(d):
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads(json.dumps(d)))  # (a copy: transformers edits the dicts)


def _hf_rotary(hf):
    """transformers' rotary module of the config's model (Phi3RotaryEmbedding, Qwen2RotaryEmbedding...)."""
    mt = hf.model_type
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding") and n.lower().startswith(mt))
    return cls(hf)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = CASES[name]
    cfg, hf = ModelConfig.from_hf_dict(d), _hf(d)
    rp = hf.rope_parameters
    assert cfg.rope_type == rp["rope_type"] and cfg.rope_type != "default"
    assert cfg.rotary_dim == int(cfg.head_dim * rp.get("partial_rotary_factor", 1.0))
    inv, factor = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf)
    assert rope_inv_freq(cfg).shape == (cfg.rotary_dim // 2,)
    assert torch.equal(rope_inv_freq(cfg), inv)
    assert rope_attention_factor(cfg) == factor
    if cfg.rope_type == "longrope":
        assert cfg.rope_original_max == rp["original_max_position_embeddings"] == d["original_max_position_embeddings"]
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=cfg.rope_original_max + 1)
        assert torch.equal(rope_inv_freq(cfg, long=True), long_inv)
        assert not torch.equal(long_inv, inv)
    # the layouts transformers writes (rope_parameters) and the one the tests' HF folders use read the same
    for again in (ModelConfig.from_hf_dict(hf.to_dict()), ModelConfig.from_hf_dict(cfg.to_hf_dict())):
        assert (again.rope_type, again.rotary_dim, again.rope_original_max) == \
            (cfg.rope_type, cfg.rotary_dim, cfg.rope_original_max)
        assert torch.equal(rope_inv_freq(again), inv) and rope_attention_factor(again) == factor


@pytest.mark.parametrize("name", ["llama-dynamic", "qwen2-yarn", "llama-yarn-mscale", "phi3-longrope", "phi3-partial",
                                  "phi-3.5-mini"])
def test_tables_equal_transformers_rotary_modules(name):
    """cos / sin rows (the attention factor in them) equal what the model's rotary module gives, in
    float32; LongRoPE: a forward whose longest position passes original_max_position_embeddings
    rotates every token with the long factors, which are rows position + P of the table."""
    d = CASES[name]
    cfg, hf = ModelConfig.from_hf_dict(d), _hf(d)
    half = cfg.rotary_dim // 2
    orig = cfg.rope_original_max if cfg.rope_type == "longrope" else 200
    rows = orig + 40
    rot = RotaryEmbedding(cfg, rows)
    ref = _hf_rotary(hf)
    x = torch.zeros(1, dtype=torch.float32)
    short = torch.tensor([[0, 1, 7, orig - 1]])
    cos, sin = ref(x, short)
    assert torch.equal(rot.cos[rot.rows(short[0])], cos[0, :, :half])
    assert torch.equal(rot.sin[rot.rows(short[0])], sin[0, :, :half])
    both = torch.tensor([[0, 5, orig - 1, orig, orig + 39]])
    cos, sin = ref(x, both)
    if cfg.rope_type != "longrope":
        assert rot.long_offset is None and torch.equal(rot.cos[rot.rows(both[0])], cos[0, :, :half])
        return
    assert rot.cos.shape == (2 * rows, half) and rot.long_offset == rows
    assert torch.equal(rot.cos[both[0] + rows], cos[0, :, :half])
    assert torch.equal(rot.sin[both[0] + rows], sin[0, :, :half])
    assert torch.equal(rot.rows(both[0]), both[0] + rows)  # (one sequence's forward, as transformers')


def test_long_rule():
    """LongRoPE: a sequence longer than the original context rotates with the long factors (all of
    it: the scheduler recomputes one that grows past it); other types never do."""
    cfg = ModelConfig.from_hf_dict(CASES["phi3-longrope"])
    assert cfg.rope_long_after == 32 and [cfg.rope_long(n) for n in (1, 32, 33, 200)] == [False, False, True, True]
    yarn = ModelConfig.from_hf_dict(CASES["qwen2-yarn"])
    assert yarn.rope_long_after is None and not yarn.rope_long(10**6)


def test_context_lengths():
    """YaRN runs to original_max_position_embeddings x factor (vLLM's rule: Qwen's cards leave
    max_position_embeddings at 32768); the others to max_position_embeddings."""
    assert ModelConfig.from_hf_dict(CASES["qwen2-yarn"]).max_context_len == 131072
    assert ModelConfig.from_hf_dict(CASES["qwen3-yarn-old-key"]).max_context_len == 131072
    assert ModelConfig.from_hf_dict(CASES["llama-yarn-mscale"]).max_context_len == 163840
    for name in ("llama-dynamic", "phi-3.5-mini", "llama3"):
        cfg = ModelConfig.from_hf_dict(CASES[name])
        assert cfg.max_context_len == cfg.max_position_embeddings


def test_named_phi_configs():
    """The Phi configs' published shapes: Phi-4-mini's 3,836,021,760 parameters, 96 of 128 head dims
    rotating; Phi-3.5-mini's 3.82B; LongRoPE from 4096 tokens, windows that never bite dropped."""
    p4 = ModelConfig.from_hf_dict(NAMED_CONFIGS["phi-4-mini"])
    assert p4.num_params() == 3_836_021_760 and (p4.head_dim, p4.rotary_dim) == (128, 96)
    p35 = ModelConfig.from_hf_dict(NAMED_CONFIGS["phi-3.5-mini"])
    assert round(p35.num_params() / 1e9, 2) == 3.82 and p35.rotary_dim == 96
    for c in (p4, p35):
        assert c.rope_type == "longrope" and c.rope_original_max == 4096 and c.sliding_window is None
        assert abs(rope_attention_factor(c) - (1 + torch.log(torch.tensor(32.0)).item() / torch.log(
            torch.tensor(4096.0)).item()) ** 0.5) < 1e-12


def test_partial_rotation_passes_the_rest_through():
    """_rotate with tables narrower than the head: rotate-halves within the first R dims (transformers'
    Phi-3 formula), the other dims unchanged."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 16, generator=g)
    ang = torch.rand(3, 1, 6, generator=g) * 6
    out = _rotate(x, ang.cos(), ang.sin())
    c, s = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    xr = x[..., :12]
    ref = xr * c + torch.cat((-xr[..., 6:], xr[..., :6]), -1) * s
    assert torch.equal(out[..., 12:], x[..., 12:]) and torch.allclose(out[..., :12], ref, atol=1e-6)


@pytest.mark.parametrize("change,match", [
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 15, long_factor=[2.0] * 16)), "short_factor"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 16, long_factor=[2.0] * 15 + [0])), "long_factor"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    (dict(partial_rotary_factor=0.3), "must be even"),  # int(32 x 0.3) = 9
    (dict(rope_scaling=dict(type="yarn", factor=2.0)), "short_factor"),  # (Phi-3 reads yarn as longrope)
], ids=["short", "long", "factor>1", "odd-dim", "phi3-yarn"])
def test_phi3_rope_errors_name_the_field(change, match):
    d = dict(CASES["phi3-longrope"], **change)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_rope_errors_name_the_field():
    llama = dict(SMALL, model_type="llama")
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5.*Phi3ForCausalLM only"):
        ModelConfig.from_hf_dict(dict(llama, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="'longrope' is supported for Phi3ForCausalLM only"):
        ModelConfig.from_hf_dict(dict(llama, rope_scaling=dict(LONGROPE, type="longrope")))
    with pytest.raises(ValueError, match="rope_scaling type 'ntk' is not supported"):
        ModelConfig.from_hf_dict(dict(llama, rope_scaling=dict(type="ntk", factor=2.0)))
    with pytest.raises(ValueError, match="factor of linear must be a number >= 1"):
        ModelConfig.from_hf_dict(dict(llama, rope_scaling=dict(type="linear")))
    with pytest.raises(ValueError, match="beta_fast of yarn"):
        ModelConfig.from_hf_dict(dict(llama, rope_scaling=dict(type="yarn", factor=2.0, beta_fast="32")))
    # infinite factors (tables of zero angles) and a base that is no positive number (NaN tables)
    with pytest.raises(ValueError, match="factor of linear must be a number >= 1.0 and finite"):
        ModelConfig.from_hf_dict(dict(llama, rope_scaling=dict(type="linear", factor=float("inf"))))
    with pytest.raises(ValueError, match="long_factor of longrope must be a list of 16 positive finite numbers"):
        ModelConfig.from_hf_dict(dict(CASES["phi3-longrope"], rope_scaling=dict(
            type="longrope", short_factor=[1.0] * 16, long_factor=[1.0] * 15 + [float("inf")])))
    for theta in (0, -1.0, "1e4", float("nan")):
        with pytest.raises(ValueError, match="rope_theta must be a positive number"):
            ModelConfig.from_hf_dict(dict(llama, rope_theta=theta))
    with pytest.raises(ValueError, match="rope_theta must be a positive number"):
        ModelConfig.from_hf_dict(dict(llama, rope_parameters=dict(rope_type="default", rope_theta=0)))


def test_dynamic_ntk_runs_to_max_position_embeddings_only(tmp_path):
    """Dynamic NTK equals the default rope up to max_position_embeddings (transformers rescales its base
    only past it); a longer max_model_len is refused, the message saying why."""
    d = dict(SMALL, model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=64,
             rope_scaling=dict(rope_type="dynamic", factor=2.0))
    cfg = ModelConfig.from_hf_dict(d)
    assert torch.equal(rope_inv_freq(cfg), rope_inv_freq(ModelConfig.from_hf_dict(dict(d, rope_scaling=None))))
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="max_model_len=128 exceeds the model's context of 64 tokens; dynamic NTK"):
        LLM(str(tmp_path), load_format="dummy", max_model_len=128, num_kv_blocks=16)


def test_medusa_features_rotate_each_sequence_by_its_own_length(tmp_path):
    """train-medusa's forward_hidden runs several sequences in one forward: with LongRoPE each rotates
    by its own length (a 20-token sequence batched with a 40-token one stays short), so its hidden
    states equal HF's over it alone (they rotated the whole batch with the long factors)."""
    from transformers import AutoModelForCausalLM

    from hf_ref import make_random_hf_folder
    from pageflash.spec.train_medusa import forward_hidden
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS["phi3-longrope"])  # long past 32 tokens
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=64)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (20, 32, 40)]
    hidden = forward_hidden(llm.llm_engine, seqs)
    for s, h in zip(seqs, hidden):
        with torch.no_grad():
            ref = hf(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0]
        assert torch.allclose(h, ref, atol=1e-4), f"{len(s)} tokens"


def _step(sched, sampled=()):
    """One scheduler step as the engine applies it, without a model: every scheduled token computed,
    a token appended to each request that samples (its id from `sampled`, else 7)."""
    out = sched.schedule()
    toks = iter(sampled)
    for s in out.seqs:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if s.samples:
            r.token_ids.append(next(toks, 7))
        sched.kv.cache_full_blocks(r.request_id, r.token_ids, r.num_computed_tokens)
    return out


def test_longrope_restart_that_preempts_itself_counts_its_prefix_query_once():
    """A request that crosses the original context (8 tokens) starts over; when the pool cannot hold
    its recompute it preempts itself (the most recent request) and is recomputed when readmitted:
    the prefix-cache statistics count that one recompute once, like a preemption's (they counted
    the failed restart too), and nothing leaks."""
    from pageflash.engine.kv_cache import KVCacheManager
    from pageflash.engine.scheduler import Scheduler
    from pageflash.engine.sequence import Request
    from pageflash.sampling_params import SamplingParams

    kv = KVCacheManager(4, 4, locality_tokens=0)
    sched = Scheduler(kv, 8, 64, 64, long_rope_after=8)
    a = Request("a", None, list(range(100, 105)), SamplingParams(max_tokens=2), 0.0)  # 2 blocks
    b = Request("b", None, list(range(8)), SamplingParams(max_tokens=4), 0.0)  # 2 blocks, short
    sched.add(a)
    sched.add(b)
    _step(sched)  # both prefilled; b now has 9 tokens: long
    assert kv.prefix_queries == 13 and b.num_tokens == 9
    out = _step(sched)  # b's recompute needs 3 blocks: a holds 2 of the 4, so b preempts itself
    assert out.preempted == [b] and b in sched.waiting and [s.request for s in out.seqs] == [a]
    assert kv.prefix_queries == 13
    sched.finish(a)
    out = _step(sched)  # b readmitted: its 9 tokens recomputed with the long factors
    assert [(s.request, s.num_new_tokens) for s in out.seqs] == [(b, 9)] and kv.salt("b") == (None, True)
    assert kv.prefix_queries == 13 + 9 and kv.prefix_hits == 0
    sched.finish(b)
    assert kv.num_free_blocks == 4
