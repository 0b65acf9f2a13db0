"""GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf.py writes them: a HF folder's
tensors renamed through gguf's own TensorNameMap (the converter's map_tensor_name), llama's and
Granite's Q/K rows permuted, Gemma's norms shifted by 1, experts stacked into [E, out, in], Llama 3.1's
rope scaling as a rope_freqs tensor, Phi-3's LongRoPE as rope_factors tensors, and the metadata keys
each converter class writes (YaRN's rope.scaling.* keys, Phi-3's rotary dims and attn_factor,
Granite's *_scale keys); tokenizer metadata (byte-level BPE as Llama 3 and Qwen files carry,
SentencePiece as Gemma, Phi-3 and Mistral files do); and K-quant blocks, which gguf.quants cannot
make (Q4_K / Q5_K / Q6_K encoders after ggml's block layouts)."""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Callable, Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# HF model_type -> GGUF general.architecture (the converter class registered for it)
ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "phi3": "phi3", "granite": "granite"}


def _folder_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head: the K rows' KV heads for attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rp: dict, hp: dict, head_dim: int) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: the factors each inverse frequency is divided by (the
    converter reads the original context length from the config's top level, default 8192)."""
    base = rp.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = hp.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _metadata(w: gguf.GGUFWriter, arch: str, hp: dict, rp: dict) -> None:
    """The keys of TextModel.set_gguf_parameters and of the arch's converter class."""
    heads, layers = hp["num_attention_heads"], hp["num_hidden_layers"]
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    w.add_block_count(layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if arch in ("gemma", "gemma2"):  # GemmaModel / Gemma2Model write no rope keys (llama.cpp: base 10000)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            w.add_sliding_window(hp["sliding_window"])
        return
    rope_type = rp.get("rope_type", rp.get("type"))
    if arch == "phi3":
        pass  # Phi3MiniModel writes no scaling type: its LongRoPE is the rope_factors tensors (_phi3_longrope)
    elif rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif rope_type == "yarn" and rp.get("factor") is not None:  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        if rp.get("extrapolation_factor") is not None:
            w.add_rope_scaling_yarn_ext_factor(rp["extrapolation_factor"])
        if rp.get("attention_factor", rp.get("attn_factor")) is not None:
            w.add_rope_scaling_yarn_attn_factor(rp.get("attention_factor", rp.get("attn_factor")))
        if rp.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        if rp.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    elif rope_type in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    w.add_rope_freq_base(rp["rope_theta"])
    if hp.get("num_local_experts"):
        w.add_expert_count(hp["num_local_experts"])
    if hp.get("num_experts_per_tok"):
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "granite"):  # LlamaModel
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)
        if arch == "granite":  # GraniteModel: HF's multipliers under llama.cpp's names (those set and nonzero)
            for hf, add in (("attention_multiplier", w.add_attention_scale),
                            ("embedding_multiplier", w.add_embedding_scale),
                            ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
                if hp.get(hf):
                    add(hp[hf])
    elif arch in ("qwen2moe", "qwen3moe"):
        if hp.get("num_experts"):  # (Qwen2MoeModel: the name transformers 4 saved)
            w.add_expert_count(hp["num_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if hp.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    elif arch == "gemma3":
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])
    elif arch == "phi3":  # Phi3MiniModel: the rotary dims from hidden / heads, not head_dim
        w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(hp.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // heads)
        w.add_sliding_window(hp.get("sliding_window") or 0)


def _phi3_longrope(w: gguf.GGUFWriter, hp: dict, rp: dict) -> dict[str, torch.Tensor]:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as tensors, and the cos / sin factor
    (rope.scaling.attn_factor) from max_position_embeddings / original_max_position_embeddings."""
    kind = rp.get("rope_type", rp.get("type", "")).lower()
    if kind not in ("su", "longrope", "yarn"):
        return {}
    scale, orig = hp["max_position_embeddings"] / hp["original_max_position_embeddings"], \
        hp["original_max_position_embeddings"]
    if kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    w.add_rope_scaling_attn_factors(attn)
    return {"rope_factors_long.weight": torch.tensor(rp["long_factor"], dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(rp["short_factor"], dtype=torch.float32)}


def write_gguf(folder: str, path: str, quant: Optional[Callable[[str], Optional[Q]]] = None,
               tokenizer: Optional[dict] = None,
               edit: Optional[Callable[[dict[str, torch.Tensor], gguf.GGUFWriter], None]] = None) -> str:
    """Convert the HF folder (float32 safetensors) into a GGUF file at path, as convert_hf_to_gguf.py
    would. quant(gguf tensor name) -> its type (None: F32); tokenizer: from bpe_tokenizer /
    spm_tokenizer; edit(tensors, writer): changes the tensors (by GGUF name) or the metadata (a key
    written again replaces the converter's) before the file is written, to make a bad file. Returns path."""
    with open(os.path.join(folder, "config.json")) as f:
        hp = json.load(f)
    arch = ARCH[hp["model_type"]]
    if arch == "granite":
        hp.pop("head_dim", None)  # GraniteModel ignores it (llama.cpp: hidden / heads)
    rp = hp.get("rope_parameters") or dict(hp.get("rope_scaling") or {}, rope_theta=hp.get("rope_theta", 10000.0))
    rp = rp.get("full_attention", rp)  # (per layer type: Gemma 3)
    heads, layers = hp["num_attention_heads"], hp["num_hidden_layers"]
    kv_heads = hp.get("num_key_value_heads") or heads
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    experts: dict[str, dict[int, torch.Tensor]] = {}  # stacked name -> expert -> tensor
    out: dict[str, torch.Tensor] = {}
    for name, t in _folder_tensors(folder).items():
        t = t.float()
        if arch in ("gemma", "gemma2", "gemma3") and name == "lm_head.weight":
            continue  # the Gemma converters skip it (tied)
        if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's norms scale by 1 + w; llama.cpp's by the stored weight
        if arch in ("llama", "granite") and name.endswith("q_proj.weight"):  # (GraniteModel is a LlamaModel)
            t = permute(t, heads)
        elif arch in ("llama", "granite") and name.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        parts = name.split(".")
        if ".experts." in name and parts[-2] in ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"):
            part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(parts[-2], parts[-2])
            experts.setdefault(f"model.layers.{parts[2]}.mlp.experts.{part}", {})[int(parts[-3])] = t
            continue
        key = name.removesuffix(".weight").removesuffix(".bias")
        out[names.get_name(key) + name[len(key):]] = t
    for key, by_expert in experts.items():
        out[names.get_name(key) + ".weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if arch == "llama" and rp.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_freqs(rp, hp, head_dim)

    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, hp, rp)
    if arch == "phi3":
        out.update(_phi3_longrope(w, hp, rp))
    if tokenizer is not None:
        add_tokenizer(w, tokenizer)
    if edit is not None:
        edit(out, w)
    for name, t in out.items():
        a = t.numpy().astype(np.float32)
        qtype = quant(name) if quant is not None else None
        if qtype is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- tokenizer metadata ------------------------------------------------------------------------

# a few merges, enough to make real words whole tokens
_MERGES = [("t", "h"), ("h", "e"), ("th", "e"), ("i", "n"), ("h", "a"), ("ha", "t"), ("in", "g"), ("a", "t"),
           ("o", "n"), ("e", "r"), ("s", "t")]


def bpe_tokenizer(pre: str, specials: list[str], bos: str, eos: str, add_bos: bool = True,
                  chat_template: Optional[str] = None) -> dict:
    """Byte-level BPE metadata ("gpt2" model, as Llama 3 / Qwen files): the 256 byte symbols, merges
    (each also with the space symbol "Ġ" in front), then the special tokens (control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)]
    merges = list(_MERGES) + [("Ġ", "t"), ("Ġt", "he"), ("Ġ", "ha"), ("Ġha", "t"), ("Ġ", "a")]
    tokens += [a + b for a, b in merges if a + b not in tokens]
    types = [1] * len(tokens) + [3] * len(specials)
    tokens += specials
    return dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=[f"{a} {b}" for a, b in merges],
                bos=tokens.index(bos), eos=tokens.index(eos), add_bos=add_bos, chat_template=chat_template)


def spm_tokenizer(flavor: str, chat_template: Optional[str] = None) -> dict:
    """SentencePiece metadata ("llama" model): specials in the model family's places (flavor "llama":
    <unk> <s> </s>, as Mistral / Phi-3; "gemma": <pad> <eos> <bos> <unk>), the 256 byte-fallback
    tokens, then pieces with scores (merged best first). Phi-3 ("phi3") adds its chat tokens at the end."""
    if flavor == "gemma":
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
        bos, eos, eot = "<bos>", "<eos>", "<end_of_turn>"
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
        bos, eos, eot = "<s>", "</s>", None
    chars = ["▁", "t", "h", "e", "a", "i", "n", "g", "s", "o", "r", "w", "d", "l", "c"]
    pieces = chars + [a + b for a, b in _MERGES] + ["▁t", "▁the", "▁ha", "▁hat", "▁a", "▁in", "▁th"]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [k for _, k in head] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces))]
    pad = None
    if flavor == "phi3":
        tail = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
        tokens += tail
        types += [3] * len(tail)
        scores += [0.0] * len(tail)
        pad = tokens.index("<|endoftext|>")
    return dict(model="llama", pre="default", tokens=tokens, types=types, scores=scores, bos=tokens.index(bos),
                eos=tokens.index(eos), eot=tokens.index(eot) if eot else None, pad=pad, chat_template=chat_template,
                add_space_prefix=flavor != "gemma")


def add_tokenizer(w: gguf.GGUFWriter, tok: dict) -> None:
    """Write tokenizer metadata as the converter's _set_vocab_* and SpecialVocab do."""
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    if tok.get("eot") is not None:
        w.add_eot_token_id(tok["eot"])
    if tok.get("pad") is not None:
        w.add_pad_token_id(tok["pad"])
    if "add_space_prefix" in tok:
        w.add_add_space_prefix(tok["add_space_prefix"])
    w.add_add_bos_token(tok.get("add_bos", True))
    if tok.get("chat_template"):
        w.add_chat_template(tok["chat_template"])


# ---- quantization ------------------------------------------------------------------------------

def quantize(a: np.ndarray, qtype: Q) -> np.ndarray:
    """a [..., K] float32 -> the uint8 blocks of qtype [..., bytes] (K-quants: our encoders, rows of a
    multiple of 256; the others: gguf.quants.quantize)."""
    enc = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}.get(qtype)
    if enc is None:
        return gguf.quants.quantize(a, qtype)
    rows = a.reshape(-1, 256)
    return enc(rows).reshape(*a.shape[:-1], -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _bytes(*arrays: np.ndarray) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(x).view(np.uint8).reshape(x.shape[0], -1) for x in arrays], axis=1)


def _scale_min_k4(x: np.ndarray, qmax: int):
    """Q4_K / Q5_K: 8 sub-blocks of 32 as d * sc * q - dmin * m, sc and m on 6 bits.
    Returns (d f16 [n], dmin f16 [n], packed scales [n, 12], q [n, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / qmax, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, offset = (df * sc)[..., None], (dminf * m)[..., None]
    q = np.clip(np.round(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0)), 0, qmax)
    # ggml's get_scale_min_k4: bytes 0-3 sc[0:4] (+ the top 2 bits of sc[4:8]), 4-7 m[0:4] (+ m[4:8]'s),
    # 8-11 the low 4 bits of sc[4:8] and of m[4:8]
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    return d, dmin, packed, q.astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin (f16), scales[12], qs[128]: each 64 values' 32 bytes hold sub-block 2j in
    the low nibbles and 2j + 1 in the high ones."""
    d, dmin, packed, q = _scale_min_k4(x, 15)
    qs = np.concatenate([q[:, 2 * j] | (q[:, 2 * j + 1] << 4) for j in range(4)], axis=1)
    return _bytes(d, dmin, packed, qs)


def _q5_k(x: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32] (bit j of byte l: the 5th bit of sub-block j's value
    l), qs[128] (the low 4 bits, laid out as Q4_K's)."""
    d, dmin, packed, q = _scale_min_k4(x, 31)
    low = q & 15
    qs = np.concatenate([low[:, 2 * j] | (low[:, 2 * j + 1] << 4) for j in range(4)], axis=1)
    qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)
    return _bytes(d, dmin, packed, qh, qs)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], scales[16] (int8, one per 16 values), d (f16); value = d * scale *
    (q - 32), q on 6 bits. Each 128-value half: ql bytes l / 32 + l hold values l / 32 + l (low
    nibble) and 64 + l / 96 + l (high); qh byte l holds the top 2 bits of values l, 32 + l, 64 + l, 96 + l."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(np.abs(scale).max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = (np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31) + 32)
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, quarter, l]
    ql = np.concatenate([(q[:, h, k] & 15) | ((q[:, h, k + 2] & 15) << 4) for h in range(2) for k in range(2)], axis=1)
    qh = np.concatenate([sum((q[:, h, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8) for h in range(2)],
                        axis=1)
    return _bytes(ql, qh, sc, d)
