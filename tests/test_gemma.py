"""Gemma 1/2/3: softcapped attention (Gemma 2) in the reference against a brute-force loop and in every
Triton kernel (interpreter) against the reference; the configs as transformers reads them (hub-shaped
config.json files, defaults filled in); Gemma 3's image-text checkpoints run as their text decoder;
logprobs under the final logit softcap; speculative decoding and the Triton path over a Gemma 2 model.
(Greedy equality with HF for gemma / gemma2 / gemma3: tests/test_engine_hf.py's CONFIGS.)"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)
from test_kernels_paged import TOL, make_case, rel_err
from test_sliding_window import PAGED_CASES, STEPS, brute, rotated_and_stored, static_verify_steps, tree_positions

from pageflash.config import ModelConfig
from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import flash_attn_varlen_fwd, flash_attn_varlen_ref
from pageflash.kernels.flash_decoding import flash_decode, flash_decode_ref
from pageflash.kernels.paged_attention import paged_attention, paged_attention_ref
from pageflash.layers.attention import TorchBackend, store_kv_ref

CAP = 1.5  # small enough to bite: make_case's scores (D 32, scale 0.2) reach several units


# ---------------------------------------------------------------------------------------------
# softcapped attention: reference, kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_softcap_reference_and_triton_backend(step, window):
    """TorchBackend with softcap == a float64 loop; TritonBackend (interpreter) == TorchBackend for
    every kind of step (decode, fresh prefill, mixed, chain / tree verify), with and without a window;
    the cap changes the result (it is not a no-op here)."""
    tree = step == "tree_verify"
    q, k, v, kc, vc, meta = make_case(STEPS[step], 4, 2, 32, 16, torch.float32, tree=tree, seed=3)
    pos = tree_positions(meta)
    kc2, vc2 = kc.clone(), vc.clone()
    be_ref = TorchBackend()
    ref = be_ref.forward(q, k, v, kc, vc, be_ref.plan(meta), 0.2, window=window, positions=pos, softcap=CAP)
    want = brute(q, kc, vc, meta, 0.2, window or 10**6, pos, softcap=CAP).float()
    assert rel_err(ref, want) < 1e-5
    assert rel_err(want, brute(q, kc, vc, meta, 0.2, window or 10**6, pos).float()) > 1e-2
    be = TritonBackend(num_sms=4)
    be.mixed_decode_min = 0
    out = be.forward(q, k, v, kc2, vc2, be.plan(meta), 0.2, window=window, positions=pos, softcap=CAP)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_softcap_cpu_decode_path():
    """The CPU decode path (SDPA, which has no cap) falls back to the batched reference with a cap."""
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in (1, 15, 17, 40)], 4, 1, 16, 8, torch.float32)
    be = TorchBackend()
    out = be.forward(q, k, v, kc, vc, be.plan(meta), 0.6, softcap=CAP)
    pos = meta.seq_lens.long() - 1
    assert rel_err(out, brute(q, kc, vc, meta, 0.6, 10**6, pos, softcap=CAP).float()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits,strided,fused,window", [(1, True, False, None), (3, True, False, 17),
                                                         (3, False, False, None), (7, True, True, 5)])
def test_flash_decode_softcap(splits, strided, fused, window, dtype):
    specs = [(0, 1), (14, 1), (16, 1), (52, 1), (90, 1)]
    q, k, v, kc, vc, meta = make_case(specs, 8, 2, 64, 16, dtype, seed=splits)
    q = q * 3  # larger scores: the cap bites
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, window=window, softcap=CAP)
    counters = torch.zeros(len(specs) * 2, dtype=torch.int32) if fused else None
    cfg = dict(BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1, STRIDED=strided)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, num_splits=splits, config=cfg,
                       counters=counters, window=window, softcap=CAP)
    assert rel_err(out, ref) < TOL[dtype]
    no_cap = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, window=window)
    assert rel_err(ref, no_cap) > 1e-2


def test_flash_decode_softcap_with_rope_and_store():
    """The decode launch that rotates q / k and stores the new K/V, with a cap: its new key's score
    (taken from registers) is capped too."""
    specs = [(0, 1), (30, 1), (64, 1)]
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 32, 16, torch.float32, seed=4)
    q, k = q * 3, k * 3
    (pos, cos, sin), qr, kc_ref, vc_ref = rotated_and_stored(q, k, v, kc, vc, meta)
    ref = flash_decode_ref(qr, kc_ref, vc_ref, meta.block_tables, meta.seq_lens, 0.2, softcap=CAP)
    for splits in (1, 3):
        kc2, vc2 = kc.clone(), vc.clone()
        out = flash_decode(q, kc2, vc2, meta.block_tables, meta.seq_lens, 0.2, num_splits=splits,
                           rope=(pos, cos, sin), k_new=k, v_new=v, slot_mapping=meta.slot_mapping, softcap=CAP)
        assert torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref)
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case,tree,splits,window", [("chunked", False, 1, None), ("spec", False, 3, 9),
                                                     ("spec", True, 1, None), ("spec", True, 4, 16)])
def test_paged_attention_softcap(case, tree, splits, window, dtype):
    q, k, v, kc, vc, meta = make_case(PAGED_CASES[case], 8, 2, 64, 8, dtype, tree=tree, seed=5)
    q = q * 3
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    pos = tree_positions(meta)
    ref = paged_attention_ref(q, kc, vc, meta, 0.125, window=window, positions=pos, softcap=CAP)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, config=cfg,
                          num_splits=splits, window=window, positions=pos, softcap=CAP)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 7, 31])
def test_varlen_prefill_softcap(window, dtype):
    g = torch.Generator().manual_seed(9)
    lens = [1, 15, 17, 40, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 32, generator=g).to(dtype) for h in (6, 2, 2))
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens), True, 0.5, window=window, softcap=CAP)
    o_ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu, True, 0.5, window=window, softcap=CAP)
    assert rel_err(o, o_ref) < TOL[dtype]
    assert torch.allclose(lse, lse_ref, atol=1e-3)
    assert rel_err(o_ref, flash_attn_varlen_ref(q, k, v, cu, True, 0.5, window=window)[0]) > 1e-2
    with pytest.raises(ValueError, match="softcap must be positive"):
        flash_attn_varlen_fwd(q, k, v, cu, max(lens), True, 0.5, softcap=-1.0)


# ---------------------------------------------------------------------------------------------
# configs: hub-shaped config.json files against transformers' config objects
# ---------------------------------------------------------------------------------------------

GEMMA_7B = dict(architectures=["GemmaForCausalLM"], model_type="gemma", bos_token_id=2, eos_token_id=1, head_dim=256,
                hidden_act="gelu", hidden_size=3072, intermediate_size=24576, max_position_embeddings=8192,
                num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=16, rms_norm_eps=1e-6,
                rope_scaling=None, rope_theta=10000.0, vocab_size=256000)
GEMMA2_27B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, head_dim=128, hidden_act="gelu_pytorch_tanh",
                  hidden_activation="gelu_pytorch_tanh", hidden_size=4608, intermediate_size=36864,
                  num_attention_heads=32, num_hidden_layers=46, num_key_value_heads=16, query_pre_attn_scalar=144,
                  sliding_window=4096, eos_token_id=[1, 107], bos_token_id=2)
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attn_logit_softcapping=None,
                 eos_token_id=[1, 106], final_logit_softcapping=None, head_dim=256,
                 hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
                 max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
                 query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None,
                 rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, vocab_size=262144)
# the 4B image-text checkpoint: its text_config leaves most keys to Gemma3TextConfig's defaults
GEMMA3_4B = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", eos_token_id=[1, 106],
                 text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text",
                                  num_hidden_layers=34, rope_scaling=dict(factor=8.0, rope_type="linear"),
                                  sliding_window=1024),
                 vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, num_hidden_layers=27,
                                    num_attention_heads=16, intermediate_size=4304, image_size=896, patch_size=14))


@pytest.mark.parametrize("d", [GEMMA_7B, GEMMA2_27B, GEMMA3_1B, GEMMA3_4B,
                               dict(GEMMA2_27B, sliding_window=16, num_hidden_layers=5,
                                    layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"])],
                         ids=["gemma-7b", "gemma-2-27b", "gemma-3-1b", "gemma-3-4b", "gemma2-layer_types"])
def test_config_matches_transformers(d):
    from transformers import AutoConfig

    c = AutoConfig.for_model(**d)
    cfg = ModelConfig.from_hf_dict(d)
    t = c.text_config if d["model_type"] == "gemma3" else c
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(cfg, name) == getattr(t, name), name
    assert cfg.hidden_act == "gelu_pytorch_tanh" == (t.hidden_act if d["model_type"] == "gemma" else t.hidden_activation)
    assert cfg.norm_unit_offset and cfg.embed_scale and cfg.sandwich_norm == (d["model_type"] != "gemma")
    assert cfg.qk_norm == (t.model_type == "gemma3_text")
    n = t.num_hidden_layers
    rp = t.rope_parameters
    if t.model_type == "gemma":
        assert [cfg.layer_window(i) for i in range(n)] == [None] * n
        assert cfg.rope_theta == rp["rope_theta"] and cfg.attn_scale == t.head_dim ** -0.5
        return
    assert [cfg.layer_window(i) for i in range(n)] == [
        t.sliding_window if t.layer_types[i] == "sliding_attention" else None for i in range(n)]
    assert cfg.attn_scale == t.query_pre_attn_scalar ** -0.5
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (t.attn_logit_softcapping,
                                                                         t.final_logit_softcapping)
    if t.model_type == "gemma2":
        assert cfg.rope_theta == rp["rope_theta"] and cfg.rope_local_theta is None
    else:
        full, local = rp["full_attention"], rp["sliding_attention"]
        assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
        assert (cfg.rope_scaling or {}).get("factor") == full.get("factor")
        assert [cfg.layer_rope_local(i) for i in range(n)] == [x == "sliding_attention" for x in t.layer_types]
    if d is GEMMA3_4B:
        assert cfg.architecture == "Gemma3ForCausalLM" and cfg.eos_token_ids == (1, 106)
    # a config.json rewritten by transformers 5 (rope_parameters, layer_types) reads the same
    again = ModelConfig.from_hf_dict(t.to_dict() if d["model_type"] != "gemma3" else c.to_dict())
    assert [again.layer_window(i) for i in range(n)] == [cfg.layer_window(i) for i in range(n)]
    assert (again.rope_theta, again.rope_local_theta, again.rope_scaling and again.rope_scaling.get("factor")) == \
        (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling and cfg.rope_scaling.get("factor"))


def test_phi3_configs():
    """Phi-3: a mini-4k config (every layer over 2047 tokens, 3.82B parameters); partial rotary
    (Phi-4-mini) and LongRoPE (the 128k variants) are read (tests/test_rope.py checks their values)."""
    from pageflash.model.registry import NAMED_CONFIGS

    cfg = ModelConfig.from_hf_dict(NAMED_CONFIGS["phi-3-mini-4k"])
    assert cfg.kv_window == 2047 and abs(cfg.num_params() / 1e9 - 3.82) < 0.01
    assert (cfg.rope_type, cfg.rotary_dim) == ("default", 96)
    d = dict(NAMED_CONFIGS["phi-3-mini-4k"], sliding_window=None)
    assert ModelConfig.from_hf_dict(dict(d, partial_rotary_factor=0.75)).rotary_dim == 72
    long = ModelConfig.from_hf_dict(dict(d, rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                                              long_factor=[2.0] * 48)))
    assert long.rope_type == "longrope" and long.rope_original_max == 4096  # (Phi3Config's default)


@pytest.mark.parametrize("d", [dict(model_type="granite", architectures=["GraniteForCausalLM"]),
                               dict(model_type="phi3", architectures=["Phi3ForCausalLM"])], ids=["granite", "phi3"])
def test_minimal_configs_take_transformers_defaults(d):
    """Keys a config.json leaves out read as transformers' GraniteConfig / Phi3Config default them."""
    from transformers import AutoConfig

    d = dict(d, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    c, cfg = AutoConfig.for_model(**d), ModelConfig.from_hf_dict(d)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.bos_token_id) == (
        c.rms_norm_eps, c.max_position_embeddings, c.bos_token_id)
    assert cfg.eos_token_ids == (c.eos_token_id,) and cfg.tie_word_embeddings == c.tie_word_embeddings


def test_config_rejections():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(GEMMA3_1B, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="hidden activation 'relu'"):
        ModelConfig.from_hf_dict(dict(GEMMA3_1B, hidden_activation="relu"))
    with pytest.raises(ValueError, match="attn_logit_softcapping must be a positive"):
        ModelConfig.from_hf_dict(dict(GEMMA2_27B, attn_logit_softcapping=-1.0))


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
GEMMA2_TINY = dict(TINY, model_type="gemma2", architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=20,
                   sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=4.0)


def test_gemma3_image_text_checkpoint_runs_its_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration folder (vision tower and projector in it, the decoder's names
    under language_model.): its text decoder's greedy tokens equal HF's on text-only prompts."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from hf_ref import hf_greedy
    from pageflash import LLM, SamplingParams

    torch.manual_seed(0)
    text = dict(TINY, vocab_size=300, model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.08)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                     image_token_index=299, boi_token_index=297,
                                                     eoi_token_index=298)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), block_size=4, max_model_len=64, num_kv_blocks=64, dtype="float32")
    assert llm.llm_engine.model_config.architecture == "Gemma3ForCausalLM"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 290, (n,), generator=g).tolist() for n in (3, 12, 21)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)


GRANITE_TINY = dict(TINY, model_type="granite", architectures=["GraniteForCausalLM"], embedding_multiplier=6.0,
                    residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=0.5)


@pytest.mark.parametrize("cfg", [dict(GEMMA2_TINY, tie_word_embeddings=True), GRANITE_TINY], ids=["gemma2", "granite"])
def test_logprobs_match_hf_under_the_final_logit_transform(tmp_path, cfg):
    """Sampled-token and prompt logprobs are those of the transformed logits (HF's log-softmax):
    Gemma 2's final softcap, Granite's logits_scaling."""
    from hf_ref import hf_reference, make_random_hf_folder
    from pageflash import LLM, SamplingParams

    folder = make_random_hf_folder(tmp_path, cfg)
    hf = hf_reference(folder)  # eager: Gemma 2's score softcap on every transformers version
    prompt = torch.randint(0, 211, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=64, dtype="float32")
    o = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                    logprobs=2, prompt_logprobs=1),
                     use_tqdm=False)[0]
    ids = prompt + o.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    if cfg is not GRANITE_TINY:
        assert hf.config.final_logit_softcapping == 4.0 and ref.max() - ref.min() < 8.5  # the cap shapes them
    for t in range(1, len(prompt)):
        assert abs(o.prompt_logprobs[t][prompt[t]].logprob - ref[t - 1, prompt[t]].item()) < 1e-4
    for j, tok in enumerate(o.outputs[0].token_ids):
        assert abs(o.outputs[0].logprobs[j][tok].logprob - ref[len(prompt) + j - 1, tok].item()) < 1e-4


@pytest.fixture(scope="module")
def gemma2_env(tmp_path_factory):
    from hf_ref import make_random_hf_folder
    from pageflash import LLM, SamplingParams

    folder = make_random_hf_folder(tmp_path_factory.mktemp("gemma2"), dict(GEMMA2_TINY, tie_word_embeddings=True))
    prompts = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2 + [3, 1], [11, 12, 13]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    eng = dict(block_size=4, max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=120, dtype="float32")
    plain = LLM(folder, attention_backend="torch", **eng)
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                           use_tqdm=False)]
    return dict(folder=folder, prompts=prompts, greedy=greedy, eng=eng, ref=ref)


@pytest.mark.parametrize("backend,spec", [
    ("triton", None),
    ("torch", dict(method="ngram", tree=[2], num_speculative_tokens=5)),
    ("triton", dict(method="ngram", tree=[2], num_speculative_tokens=5)),
    ("torch", dict(method="early_exit", num_layers=1, num_speculative_tokens=2)),
], ids=["triton-plain", "torch-ngram-tree", "triton-ngram-tree", "torch-early_exit"])
def test_gemma2_triton_and_speculation_equal_plain(gemma2_env, backend, spec):
    """Gemma 2 (softcaps, alternating windows, sandwich norms) through the Triton kernels (interpreter;
    verify steps along the static-buffer path their graphs replay) and with speculation: the reference
    backend's plain greedy tokens."""
    from pageflash import LLM

    llm = LLM(gemma2_env["folder"], attention_backend=backend, speculative_config=spec, **gemma2_env["eng"])
    eng = llm.llm_engine
    if spec is not None and backend == "triton":
        static_verify_steps(eng)
    outs = llm.generate([{"prompt_token_ids": p} for p in gemma2_env["prompts"]], gemma2_env["greedy"],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == gemma2_env["ref"]
    if spec is not None:
        assert eng.get_stats()["spec"][spec["method"]]["num_accepted_tokens"] > 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_parameter_counts():
    """The named configs' counts are the published ones; the model holds what num_params counts
    (four norms per layer, q/k norms, tied head)."""
    from pageflash.model.llama import LlamaForCausalLM
    from pageflash.model.registry import NAMED_CONFIGS

    counts = {"gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952}
    for name, n in counts.items():
        assert ModelConfig.from_hf_dict(NAMED_CONFIGS[name]).num_params() == n
    for d in (GEMMA2_TINY, dict(TINY, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=4),
              dict(TINY, model_type="gemma", architectures=["GemmaForCausalLM"])):
        cfg = ModelConfig.from_hf_dict(d)
        model = LlamaForCausalLM(cfg, max_positions=16)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("top_tie,text_tie", [(False, True), (True, False), (None, False)])
def test_gemma3_image_text_top_level_tie_and_eos(top_tie, text_tie):
    """transformers ties a Gemma 3 image-text model's head by the top-level tie_word_embeddings
    (default true) and reads its EOS there; the saved text_config carries its own defaults."""
    from transformers import AutoConfig

    d = dict(GEMMA3_4B, text_config=dict(GEMMA3_4B["text_config"], tie_word_embeddings=text_tie, eos_token_id=1))
    if top_tie is not None:
        d["tie_word_embeddings"] = top_tie
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.tie_word_embeddings == AutoConfig.for_model(**d).tie_word_embeddings == (top_tie is not False)
    assert cfg.eos_token_ids == (1, 106)


def test_gemma3_reads_no_attention_softcap():
    """transformers' Gemma 3 ignores attn_logit_softcapping (Gemma 2's); its final_logit_softcapping applies."""
    cfg = ModelConfig.from_hf_dict(dict(GEMMA3_1B, attn_logit_softcapping=1.5, final_logit_softcapping=30.0))
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping == 30.0
    g2 = ModelConfig.from_hf_dict(GEMMA2_27B)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert ModelConfig.from_hf_dict(dict(GEMMA_7B, final_logit_softcapping=5.0)).final_logit_softcapping is None
