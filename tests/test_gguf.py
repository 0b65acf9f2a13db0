"""GGUF files of every architecture pageflash runs, written as llama.cpp's convert_hf_to_gguf.py writes
them (tests/gguf_ref.py), against HF transformers on the folder they were converted from: greedy
tokens equal (a text prompt through the tokenizer built from the file's metadata too), the writer's
conventions read back by transformers' own GGUF loader where it reads the architecture, Llama 3.1's
rope_freqs, LongRoPE / partial rotary / YaRN read back as the HF config's rope scaling, Granite's
multipliers, K-quants and Q8_0, tokenizers, and bad files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_ref import bpe_tokenizer, spm_tokenizer, write_gguf
from hf_ref import hf_greedy, make_random_hf_folder
from test_engine_hf import CONFIGS

from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig
from pageflash.layers.rotary import rope_attention_factor, rope_inv_freq
from pageflash.model.loader import iter_weights, load_config, load_tokenizer, resolve_model


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_CACHE_DIR", str(tmp_path / "cache"))  # (GGUF tokenizers are cached there)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(kind: str) -> dict:
    """Tokenizer metadata of the kind each model family's files carry."""
    if kind == "llama3":  # Llama 3: byte-level BPE with its pre-tokenizer
        return bpe_tokenizer("llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                             "<|begin_of_text|>", "<|eot_id|>")
    if kind == "qwen":  # Qwen2 / 2.5 / 3: byte-level BPE, no BOS, ChatML
        return bpe_tokenizer("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|im_end|>",
                             add_bos=False, chat_template=CHATML)
    return spm_tokenizer(kind)  # SentencePiece: "llama" (Mistral, Mixtral), "gemma", "phi3"


# the end-of-generation tokens llama.cpp stops at, by tokenizer kind
EOG = {"llama3": {"<|end_of_text|>", "<|eot_id|>"}, "qwen": {"<|endoftext|>", "<|im_end|>"}, "llama": {"</s>"},
       "gemma": {"<eos>", "<end_of_turn>"}, "phi3": {"</s>", "<|endoftext|>", "<|end|>"}}

# Llama 3.1's rope scaling, its original context shrunk to 64 so that these prompts' positions pass it
# (the converter reads that length from the config's top level)
LLAMA31 = dict(CONFIGS["llama-mha-rope-scaling"], num_key_value_heads=2, original_max_position_embeddings=64)
GEMMA3 = {k: v for k, v in CONFIGS["gemma3"].items() if k != "layer_types"}
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=16.0, beta_slow=2.0)
# name -> (HF config, tokenizer kind): test_engine_hf's configs as a converted file keeps them. llama.cpp
# scales Gemma 2/3 attention by head_dim (hidden / heads at 27B) as the real configs' query_pre_attn_scalar
# does, slides 5 of every 6 Gemma 3 layers, and has no dense layer in qwen3moe.
CASES = {
    "llama3.1": (LLAMA31, "llama3"),
    "mistral": (CONFIGS["mistral"], "llama"),
    "qwen2": (CONFIGS["qwen2-bias"], "qwen"),
    "qwen3": (CONFIGS["qwen3-qk-norm"], "qwen"),
    "mixtral": (CONFIGS["mixtral"], "llama"),
    "qwen2-moe": (CONFIGS["qwen2-moe"], "qwen"),
    "qwen3-moe": (dict(CONFIGS["qwen3-moe"], mlp_only_layers=[]), "qwen"),
    "gemma": (CONFIGS["gemma"], "gemma"),
    "gemma2": (dict(CONFIGS["gemma2"], query_pre_attn_scalar=32), "gemma"),
    "gemma3": (dict(GEMMA3, num_hidden_layers=6, query_pre_attn_scalar=32), "gemma"),
    "phi3": (CONFIGS["phi3"], "phi3"),
    # the rope types the converter writes: Phi-3.5's LongRoPE (rope_factors tensors, from a 32-token
    # original context: these prompts cross it), Phi-4-mini's with partial rotary, YaRN with the extras
    # the converter copies (attention_factor, beta_fast / beta_slow)
    "phi3-longrope": (CONFIGS["phi3-longrope"], "phi3"),
    "phi4-mini": (CONFIGS["phi4-mini-like"], "phi3"),
    "qwen2-yarn": (CONFIGS["qwen2-yarn"], "qwen"),
    "qwen3-yarn": (dict(CONFIGS["qwen3-qk-norm"], rope_scaling=YARN), "qwen"),
    "llama-yarn": (dict(CONFIGS["llama-gqa"], rope_scaling=dict(YARN, attention_factor=1.25)), "llama3"),
    # Granite's embedding / residual / attention multipliers and logits scaling (a byte-level BPE vocabulary)
    "granite": (CONFIGS["granite"], "llama3"),
}
ROPE_CASES = ("phi3-longrope", "phi4-mini", "qwen2-yarn", "qwen3-yarn", "llama-yarn")
# architectures whose every config key transformers' GGUF reader reads (not Gemma 1, Mixtral, nor the
# Qwen MoE's expert sizes or Qwen3's head_dim)
TRANSFORMERS_READS = ("llama3.1", "mistral", "qwen2", "gemma2", "gemma3", "phi3", "phi3-longrope", "phi4-mini",
                      "qwen2-yarn", "llama-yarn")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=24)


def _hf(folder: str, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_matches_hf(tmp_path, name):
    """The engine on the converted file == HF on the folder, token for token: prompts past the sliding
    windows (8 / 9 tokens), chunked prefill, and a text prompt encoded by the file's own tokenizer;
    the file's end-of-generation tokens as llama.cpp's."""
    cfg, kind = CASES[name]
    tok = _tokenizer(kind)
    folder = make_random_hf_folder(tmp_path / "hf", dict(cfg, vocab_size=len(tok["tokens"])))
    path = write_gguf(folder, str(tmp_path / f"{name}.gguf"), tokenizer=tok)
    hf = _hf(folder)
    if name in TRANSFORMERS_READS:  # the writer's conventions, read back by an independent GGUF loader
        ref, got = hf.state_dict(), _hf(str(tmp_path), gguf_file=f"{name}.gguf").state_dict()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6, msg=k)

    llm = LLM(path, **ENGINE)
    g = torch.Generator().manual_seed(1)
    prompts = ["the hat in a thing, héllo"] + [
        {"prompt_token_ids": torch.randint(0, len(tok["tokens"]), (n,), generator=g).tolist()} for n in (1, 17, 40)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(prompts[0])
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(hf, o.prompt_token_ids, 16)
    eos = llm.llm_engine.model_config.eos_token_ids
    assert {tok["tokens"][i] for i in eos} == EOG[kind]


def test_llama31_rope_freqs_are_its_rope_scaling(tmp_path):
    """A Llama 3.1 file's rope_freqs give the inverse frequencies of the HF config's llama3 rope
    scaling, and they matter here: HF with plain rope on the same weights decodes otherwise."""
    folder = make_random_hf_folder(tmp_path / "hf", dict(LLAMA31, vocab_size=211))
    path = write_gguf(folder, str(tmp_path / "llama31.gguf"))
    cfg = load_config(resolve_model(path))
    assert cfg.rope_scaling is None and cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0
    want = rope_inv_freq(ModelConfig.from_hf_dict(dict(LLAMA31, vocab_size=211)))
    torch.testing.assert_close(rope_inv_freq(cfg), want, rtol=1e-6, atol=0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (30, 50)]
    scaled = _hf(folder)
    plain = _hf(folder, rope_parameters={"rope_type": "default", "rope_theta": LLAMA31["rope_theta"]})
    outs = LLM(path, **ENGINE).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(scaled, p, 16) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(plain, p, 16) for p in prompts]


@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_scaling_read_as_the_hf_config(tmp_path, name):
    """A file's LongRoPE factors, partial rotary dims and YaRN keys give the rope_scaling of the HF
    config it was converted from (its fields the converter keeps), hence the same tables: inverse
    frequencies (short and long), the cos / sin factor, the context and LongRoPE's switch. And the
    scaling matters on these prompts: HF with the default rope on the same weights decodes otherwise."""
    cfg_dict, kind = CASES[name]
    hf_cfg = ModelConfig.from_hf_dict(dict(cfg_dict, vocab_size=211))
    folder = make_random_hf_folder(tmp_path / "hf", dict(cfg_dict, vocab_size=211))
    cfg = load_config(resolve_model(write_gguf(folder, str(tmp_path / f"{name}.gguf"))))
    keep = ("rope_type", "factor", "original_max_position_embeddings", "short_factor", "long_factor",
            "attention_factor", "beta_fast", "beta_slow")
    # (the file holds the factors as float32, the precision the tables are computed in)
    assert cfg.rope_scaling == {k: np.float32(v).tolist() if isinstance(v, list) else v
                                for k, v in hf_cfg.rope_scaling.items() if k in keep}
    assert (cfg.rotary_dim, cfg.max_context_len, cfg.rope_long_after) == \
        (hf_cfg.rotary_dim, hf_cfg.max_context_len, hf_cfg.rope_long_after)
    assert np.float32(rope_attention_factor(cfg)) == np.float32(rope_attention_factor(hf_cfg))
    for long in (False, True):
        assert torch.equal(rope_inv_freq(cfg, long=long), rope_inv_freq(hf_cfg, long=long))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (20, 40)]
    plain = _hf(folder, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    outs = LLM(str(tmp_path / f"{name}.gguf"), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(_hf(folder), p, 16) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(plain, p, 16) for p in prompts]


def test_granite_multipliers_and_weights_read_as_the_hf_folder(tmp_path):
    """A Granite file's *_scale keys are the HF config's multipliers, and its tensors (Q/K rows
    permuted as for llama) read back as the folder's (transformers' GGUF loader reads no granite)."""
    folder = make_random_hf_folder(tmp_path / "hf", dict(CONFIGS["granite"], vocab_size=211))
    src = resolve_model(write_gguf(folder, str(tmp_path / "granite.gguf")))
    cfg, want = load_config(src), ModelConfig.from_hf_dict(dict(CONFIGS["granite"], vocab_size=211))
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    # (the file holds float32 values: the multipliers as the float32 arithmetic applies them anyway)
    assert [np.float32(getattr(cfg, n)) for n in names] == [np.float32(getattr(want, n)) for n in names]
    assert (cfg.architecture, cfg.head_dim, cfg.rope_theta) == ("GraniteForCausalLM", want.head_dim, want.rope_theta)
    ref = _hf(folder).state_dict()
    weights = dict(iter_weights(src, cfg))
    assert weights.keys() == ref.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ref[name], rtol=0, atol=1e-6, msg=name)


def test_early_mixtral_files_with_one_tensor_per_expert(tmp_path):
    """Mixtral files from before llama.cpp stacked the experts (blk.N.ffn_gate.E.weight ...) load the
    same weights as the stacked layout."""
    folder = make_random_hf_folder(tmp_path / "hf", CONFIGS["mixtral"])

    def unstack(t, w):
        for name in [n for n in t if "_exps." in n]:
            stacked = t.pop(name)
            t.update({name.replace("_exps.", f".{e}.", 1): stacked[e] for e in range(stacked.shape[0])})

    weights = []
    for edit in (None, unstack):
        src = resolve_model(write_gguf(folder, str(tmp_path / f"{edit is None}.gguf"), edit=edit))
        weights.append(dict(iter_weights(src, load_config(src))))
    assert any(".experts.3." in n for n in weights[1]) and weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        assert torch.equal(weights[1][name], w), name


# a Q4_K_M-like mix (and F16 / BF16): GGUF tensor key -> (HF name part, type, bound on the relative error:
# 1.5x what our plain encoders reach on normal weights; a block layout read wrongly gives ~1)
QUANTS = {"token_embd": ("embed_tokens", Q.Q8_0, 0.01), "output": ("lm_head", Q.Q6_K, 0.03),
          "attn_q": ("q_proj", Q.Q4_K, 0.12), "attn_k": ("k_proj", Q.Q4_K, 0.12), "attn_v": ("v_proj", Q.Q6_K, 0.03),
          "attn_output": ("o_proj", Q.F16, 1e-3), "ffn_gate": ("gate_proj", Q.Q4_K, 0.12),
          "ffn_up": ("up_proj", Q.BF16, 0.004), "ffn_down": ("down_proj", Q.Q5_K, 0.06)}


def test_k_quants_load(tmp_path):
    """A file of K-quant (our encoders: ggml's block layouts), Q8_0, F16 and BF16 tensors: each
    dequantizes to the folder's weight within its type's error (the encoders and gguf's decoder agree
    on the layouts), and the engine's greedy tokens equal transformers' on the same file."""
    cfg = dict(CONFIGS["llama-gqa"], hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2)  # (K-quant rows: multiples of 256)
    tok = _tokenizer("llama3")
    folder = make_random_hf_folder(tmp_path / "hf", dict(cfg, vocab_size=len(tok["tokens"])), std=0.02)
    path = write_gguf(folder, str(tmp_path / "q.gguf"), tokenizer=tok,
                      quant=lambda n: QUANTS.get(n.split(".")[-2], (None, None))[1])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    for key, (_, qtype, _) in QUANTS.items():
        assert types[f"{key}.weight" if key in ("token_embd", "output") else f"blk.1.{key}.weight"] == qtype
    src = resolve_model(path)
    ref = _hf(folder).state_dict()
    checked = 0
    for name, w in iter_weights(src, load_config(src)):
        bound = next((b for part, _, b in QUANTS.values() if f".{part}." in f".{name}"), 1e-7)
        assert float((w - ref[name]).norm() / ref[name].norm()) < bound, name
        checked += bound > 1e-7
    assert checked == 2 + 7 * 2
    hf = _hf(str(tmp_path), gguf_file="q.gguf")
    prompts = [[5, 9, 2, 40, 11, 3, 77] * 3, [1, 2, 3]]
    outs = LLM(path, **ENGINE).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]


def _tokenizer_file(path: str, arch: str, tok: dict) -> str:
    from gguf_ref import add_tokenizer

    w = gguf.GGUFWriter(path, arch)
    add_tokenizer(w, tok)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,kind", [("llama", "llama3"), ("qwen2", "qwen"), ("llama", "llama"), ("gemma", "gemma"),
                                       ("gemma3", "gemma"), ("phi3", "phi3"), ("granite", "llama3")])
def test_tokenizer_from_gguf_metadata(tmp_path, arch, kind):
    """Each family's tokenizer metadata builds a tokenizer that round-trips text (bytes outside the
    vocabulary too), uses the merges, keeps special tokens whole, adds BOS as the file says and
    carries the file's chat template."""
    tok = _tokenizer(kind)
    hf_tok = load_tokenizer(resolve_model(_tokenizer_file(str(tmp_path / "t.gguf"), arch, tok)))
    text = "the hat in a thing, héllo ✓"
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert hf_tok.decode(ids) == text
    pieces = hf_tok.convert_ids_to_tokens(ids)
    assert {"ha", "hat", "Ġhat", "▁hat", "▁ha"} & set(pieces), pieces  # merged, not byte by byte
    eos = tok["tokens"][tok["eos"]]
    assert hf_tok.encode(eos, add_special_tokens=False) == [tok["eos"]]
    assert (hf_tok.encode(text)[0] == tok["bos"]) == tok.get("add_bos", True)
    if tok.get("chat_template"):
        chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_absent_or_unsupported(tmp_path):
    """A file without tokenizer metadata has no tokenizer (prompts as token ids); a tokenizer model
    transformers cannot build is a ValueError naming it."""
    bare = str(tmp_path / "bare.gguf")
    w = gguf.GGUFWriter(bare, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_tokenizer(resolve_model(bare)) is None
    odd = dict(_tokenizer("llama"), model="rwkv")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'rwkv'"):
        load_tokenizer(resolve_model(_tokenizer_file(str(tmp_path / "odd.gguf"), "llama", odd)))


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_attention_scale(tmp_path, arch, layers):
    """As llama.cpp: a Gemma 2 / 3 of the 27B depth scales attention by (hidden / heads)^-1/2 (the HF
    configs' query_pre_attn_scalar), other depths by head_dim's."""
    hf = CONFIGS["gemma2"] if arch == "gemma2" else GEMMA3
    tiny = dict(hf, vocab_size=16, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=1,
                head_dim=16, num_hidden_layers=layers)
    folder = make_random_hf_folder(tmp_path / "hf", tiny)
    cfg = load_config(resolve_model(write_gguf(folder, str(tmp_path / "g.gguf"))))
    assert cfg.num_hidden_layers == layers and cfg.attn_scale == (32 / 4) ** -0.5


# ---- bad files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    return {n: make_random_hf_folder(base / n, dict(CONFIGS[n], vocab_size=64)) for n in ("llama-gqa", "phi3", "granite")}


def _drop(name):
    return lambda t, w: t.pop(name)


def _rope_factors(*which):
    def edit(t, w):
        t.update({f"rope_factors_{k}.weight": torch.ones(4) for k in which})
    return edit


BAD = {  # name -> (folder, edit, error)
    "missing tensor": ("llama-gqa", _drop("blk.1.attn_k.weight"), r"lacks tensors .*\['blk.1.attn_k.weight'\]"),
    "unknown tensor": ("llama-gqa", lambda t, w: t.update({"blk.0.attn_sinks.weight": torch.zeros(4)}),
                       r"does not know: \['blk.0.attn_sinks.weight'\]"),
    "missing key": ("llama-gqa", lambda t, w: w.kv_data[0].pop("llama.block_count"),
                    "lacks the metadata key llama.block_count"),
    "yarn without its factor": ("llama-gqa", lambda t, w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                "lacks the metadata key llama.rope.scaling.factor"),
    "unknown rope scaling": ("llama-gqa", lambda t, w: w.add_string("llama.rope.scaling.type", "ntk"),
                             r"rope scaling 'ntk' \(llama.rope.scaling.type\) is not supported"),
    "longrope half": ("phi3", _rope_factors("long"), r"LongRoPE lacks the tensor\(s\) \['rope_factors_short'\]"),
    "longrope on llama": ("llama-gqa", _rope_factors("long", "short"), "LongRoPE .* is supported for phi3 only"),
    "partial rotary on llama": ("llama-gqa", lambda t, w: w.add_rope_dimension_count(4),
                                r"partial rotary embeddings \(llama.rope.dimension_count=4, head_dim 8\) are "
                                "supported for phi3 only"),
    "granite without a multiplier": ("granite", lambda t, w: w.kv_data[0].pop("granite.logit_scale"),
                                     "lacks the metadata key granite.logit_scale"),
    "granite without rope": ("granite", lambda t, w: w.add_rope_scaling_finetuned(False),
                             r"granite without rotary embeddings \(granite.rope.scaling.finetuned false\)"),
    "rope_freqs with yarn": ("llama-gqa", lambda t, w: (t.update({"rope_freqs.weight": torch.ones(4)}),
                                                        w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                        w.add_rope_scaling_factor(2.0)),
                             "rope_freq_factors with rope_scaling type 'yarn' are not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gguf_is_refused_by_name(tmp_path, folders, case):
    folder, edit, error = BAD[case]
    path = write_gguf(folders[folder], str(tmp_path / "bad.gguf"), edit=edit)
    with pytest.raises(ValueError, match=error):
        load_config(resolve_model(path))


def test_longrope_attn_factor_of_the_file(tmp_path, folders):
    """A LongRoPE file whose rope.scaling.attn_factor is not the one the converter computes from HF's
    formula keeps its own (llama.cpp multiplies cos / sin by it); the converter's gives HF's dict."""
    from test_engine_hf import CONFIGS as HF

    folder = make_random_hf_folder(tmp_path / "hf", dict(HF["phi3-longrope"], vocab_size=64))
    cfg = load_config(resolve_model(write_gguf(folder, str(tmp_path / "a.gguf"))))
    assert "attention_factor" not in cfg.rope_scaling
    odd = write_gguf(folder, str(tmp_path / "b.gguf"), edit=lambda t, w: w.add_rope_scaling_attn_factors(1.5))
    cfg = load_config(resolve_model(odd))
    assert cfg.rope_scaling["attention_factor"] == 1.5 and rope_attention_factor(cfg) == 1.5


def test_partial_rotary_dims_of_the_file(tmp_path):
    """phi3.rope.dimension_count is the rotary dim exactly, also where rope_dims / head_dim x head_dim
    falls an ulp short of it (30 of 44 dims: a factor of 30 / 44 would truncate to 29)."""
    from test_engine_hf import CONFIGS as HF

    assert int(44 * (30 / 44)) == 29
    folder = make_random_hf_folder(tmp_path / "hf", dict(HF["phi3"], hidden_size=176, vocab_size=64))
    path = write_gguf(folder, str(tmp_path / "p.gguf"), edit=lambda t, w: w.add_rope_dimension_count(30))
    cfg = load_config(resolve_model(path))
    assert (cfg.head_dim, cfg.rotary_dim) == (44, 30)


def test_unknown_architecture_and_quant_type(tmp_path, folders):
    path = str(tmp_path / "rwkv.gguf")
    w = gguf.GGUFWriter(path, "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'rwkv6' is not supported"):
        load_config(resolve_model(path))

    def q8_k(t, w):  # (a type files never hold: llama.cpp's intermediate for dot products)
        t.pop("blk.0.attn_q.weight")
        w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 292), np.uint8), raw_dtype=Q.Q8_K)

    src = resolve_model(write_gguf(folders["llama-gqa"], str(tmp_path / "q8k.gguf"), edit=q8_k))
    with pytest.raises(ValueError, match="tensor blk.0.attn_q.weight has quantization type Q8_K"):
        next(iter_weights(src, load_config(src)))
