"""GGUF files (llama.cpp's format): the model config from their metadata, and their tensors under HF
checkpoint names, dequantized, with what llama.cpp's convert_hf_to_gguf.py changed undone.

general.architecture: llama (Llama 2/3/3.x, Mistral; with routed experts Mixtral), qwen2, qwen3,
qwen2moe, qwen3moe, gemma, gemma2, gemma3 (the text decoder), phi3 (LongRoPE and partial rotary
too), granite. What the converter changes: llama's and granite's Q/K rows are permuted (interleaved
rope), Gemma's norm weights hold 1 + w, experts are fused into [E, out, in] tensors, Llama 3.1's rope
scaling becomes a rope_freqs tensor, Phi-3's LongRoPE factors become rope_factors_long / _short
tensors, the rest of the rope_scaling dict becomes rope.scaling.* keys (read back into HF's dict),
Granite's multipliers become *_scale keys, and some constants (Gemma's attention scale, sliding
pattern, local rope base) are left to llama.cpp's per-architecture rules, which are followed here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Iterator, Optional

import torch

from pageflash.config import MOE_ARCHITECTURES, ModelConfig
from pageflash.layers.rotary import rope_attention_factor

# GGUF general.architecture -> ours ("llama" with routed experts: Mixtral)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}
# with routed experts: Mixtral
_LLAMAS = ("llama", "mistral")
# the converter's LlamaModel and its subclass GraniteModel: Q/K rows permuted (the others keep HF's)
_PERMUTED = ("llama", "mistral", "granite")
_GEMMAS = ("gemma", "gemma2", "gemma3")
# llama.cpp's end-of-generation tokens besides EOS / EOT / EOM: these texts (llama-vocab.cpp)
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "_<EOT>", "<|end_of_text|>"))

# tensor names: GGUF -> HF checkpoint (blocks: blk.N.<key>.weight|bias -> model.layers.N.<value>.weight|bias)
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        # "": read into the config
        "rope_freqs.weight": "", "rope_factors_long.weight": "", "rope_factors_short.weight": ""}
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router [E, H]
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_SANDWICH = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK_BY_ARCH = {
    "gemma2": _SANDWICH, "gemma3": _SANDWICH,
    # Phi-3 keeps its fused projections ([q; k; v] rows, [gate; up] rows): load_weights splits them
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # [E, out, in]
# early Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
_LEGACY_EXPERTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([A-Za-z0-9_]+?)(?:\.(\d+))?\.(weight|bias)")


def open_gguf(path: str):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ValueError("loading a GGUF file needs the 'gguf' package: pip install gguf") from e
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on a damaged file
        raise ValueError(f"GGUF file {path!r} is corrupt or unreadable: {type(e).__name__}: {e}") from e


def field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(name: str, arch: str) -> Optional[str]:
    """The HF checkpoint name of GGUF tensor `name`: "" for one read into the config (rope_freqs,
    rope_factors_*), a template with "{e}" for a fused expert tensor (one name per expert), None for a
    tensor we do not know."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None:
        return None
    layer, key, expert, kind = m.groups()
    if expert is not None:
        part = _LEGACY_EXPERTS.get(key)
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight" if part and kind == "weight" else None
    if key in _EXPERTS:
        return f"model.layers.{layer}.mlp.experts.{{e}}.{_EXPERTS[key]}.weight" if kind == "weight" else None
    module = _BLOCK_BY_ARCH.get(arch, {}).get(key) or _BLOCK.get(key)
    return f"model.layers.{layer}.{module}.{kind}" if module else None


# ---- config ------------------------------------------------------------------------------------

def gguf_config(reader, path: str) -> ModelConfig:
    """The ModelConfig of a GGUF file. Raises ValueError naming an unsupported architecture or
    feature, a missing metadata key or tensor, or a tensor we do not know."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # numpy (row-major) order
    key = _keys(reader, arch, path)
    unknown = sorted(n for n in shapes if hf_name(n, arch) is None)
    if unknown:
        raise ValueError(f"GGUF file {path!r}: tensors of {arch} that pageflash does not know: {unknown[:5]}")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {path!r} lacks the tensor token_embd.weight")
    vocab, hidden = shapes["token_embd.weight"]  # (Gemma 3's files drop the HF config's unused vocabulary rows)
    heads, layers = int(key("attention.head_count")), int(key("block_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer (other architectures vary it)
        if len(set(kv_heads)) != 1:
            raise ValueError(f"GGUF file {path!r}: KV heads differ between layers ({arch}.attention.head_count_kv)")
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF file {path!r}: value heads of another size than key heads are not supported")
    hf_arch, moe = _moe(key, arch, layers, shapes, path)
    names = set(shapes)
    fields = dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", None) or moe.get("moe_intermediate_size") or 0),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=int(kv_heads), head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names, architecture=hf_arch,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"), eos_token_ids=_eog_ids(reader),
        **_rope(reader, key, arch, head_dim, path), **moe, **_window(reader, arch, layers),
        **_gemma(reader, arch, hidden, heads, head_dim, layers), **_granite(key, arch, path))
    try:
        cfg = ModelConfig(**fields)
    except ValueError as e:  # a value of the file the model config refuses
        raise ValueError(f"GGUF file {path!r}: {e}") from None
    attn = key("rope.scaling.attn_factor", None)
    if cfg.rope_type == "longrope" and attn is not None and \
            not math.isclose(float(attn), rope_attention_factor(cfg), rel_tol=1e-6):
        # the converter writes LongRoPE's factor from HF's formula; a file whose factor differs from
        # it (to float32 rounding) keeps its own, as llama.cpp multiplies cos / sin by the file's value
        cfg = dataclasses.replace(cfg, rope_scaling={**cfg.rope_scaling, "attention_factor": float(attn)})
    need = [n for n in _required_tensors(cfg, arch, names) if n not in names]
    if need:
        raise ValueError(f"GGUF file {path!r} lacks tensors the {arch} model needs: {need[:5]}")
    return cfg


def _keys(reader, arch: str, path: str) -> Callable[..., Any]:
    """key(name, default) -> the metadata value of "<arch>.<name>"; without a default a missing key
    raises naming it."""
    missing = object()

    def key(name: str, default: Any = missing) -> Any:
        v = field(reader, f"{arch}.{name}", default)
        if v is missing:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{name}")
        return v

    return key


def _rope(reader, key: Callable[..., Any], arch: str, head_dim: int, path: str) -> dict[str, Any]:
    """The rope base and scaling, as the HF config the file was converted from has them: linear, YaRN
    (its factor, pretraining context and the extras the converter copies: attention_factor,
    beta_fast, beta_slow), Phi-3's LongRoPE (the rope_factors_long / _short tensors, the context
    before them: rope.scaling.original_context_length), partial rotary (phi3.rope.dimension_count <
    head_dim: Phi-4-mini), and Llama 3.1's scaling as the rope_freqs factors."""
    rope_dims = int(key("rope.dimension_count", head_dim))
    prf = 1.0
    if rope_dims != head_dim:
        if arch != "phi3" or not 2 <= rope_dims < head_dim:
            raise ValueError(f"GGUF file {path!r}: partial rotary embeddings ({arch}.rope.dimension_count="
                             f"{rope_dims}, head_dim {head_dim}) are supported for phi3 only")
        prf = rope_dims / head_dim
        if int(head_dim * prf) != rope_dims:  # (ModelConfig.rotary_dim truncates head_dim x factor)
            prf = math.nextafter(prf, 1.0)
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}

    def factors(name: str) -> Optional[list[float]]:
        t = tensors.get(name)
        return None if t is None else [float(f) for f in _dequantize(t).reshape(-1)]

    kind = key("rope.scaling.type", None)
    # (llama.cpp's pretraining context where the key is missing: the context length)
    orig = int(key("rope.scaling.original_context_length", None) or key("context_length", 4096))
    long, short = factors("rope_factors_long.weight"), factors("rope_factors_short.weight")
    scaling = None
    if long is not None or short is not None or kind == "longrope":
        if arch != "phi3":
            raise ValueError(f"GGUF file {path!r}: LongRoPE (rope_factors_long / rope_factors_short) is "
                             f"supported for phi3 only, not {arch}")
        lacking = [n for n, f in (("rope_factors_long", long), ("rope_factors_short", short)) if f is None]
        if lacking:
            raise ValueError(f"GGUF file {path!r}: LongRoPE lacks the tensor(s) {lacking}")
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                   "original_max_position_embeddings": orig}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                   "original_max_position_embeddings": orig}
        # (llama.cpp's yarn_ext_factor and yarn_log_multiplier: no transformers field, not written
        # for these architectures)
        for name, hf in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                         ("yarn_beta_slow", "beta_slow")):
            v = key(f"rope.scaling.{name}", None)
            if v is not None:
                scaling[hf] = float(v)
    elif kind == "linear" or (kind is None and float(key("rope.scale_linear", 1.0)) != 1.0):  # (older files)
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", None) or key("rope.scale_linear"))}
    elif kind not in (None, "none"):
        raise ValueError(f"GGUF file {path!r}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
                         "(linear, yarn, longrope, and Llama 3.1's rope_freqs)")
    freqs = factors("rope_freqs.weight")
    # (llama.cpp's default base where the key is missing: Gemma 1 / 2 files have none)
    return dict(rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling, partial_rotary_factor=prf,
                rope_freq_factors=None if freqs is None else tuple(freqs))


def _moe(key: Callable[..., Any], arch: str, layers: int, shapes: dict[str, tuple[int, ...]],
         path: str) -> tuple[str, dict[str, Any]]:
    """(our architecture, the mixture-of-experts fields): the sparse layers are those with a router,
    the experts' sizes those of their tensors."""
    hf_arch = ARCHITECTURES[arch]
    num_experts = int(key("expert_count", 0) or 0)
    if not num_experts:
        if hf_arch in MOE_ARCHITECTURES:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.expert_count")
        return hf_arch, {}
    hf_arch = "MixtralForCausalLM" if arch in _LLAMAS else hf_arch
    if hf_arch not in MOE_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r}: {arch} with routed experts is not supported")
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if not sparse:
        raise ValueError(f"GGUF file {path!r}: {arch}.expert_count is {num_experts}, but no layer has a router "
                         "(blk.N.ffn_gate_inp.weight)")
    first = f"blk.{sparse[0]}."
    gate = shapes.get(first + "ffn_gate_exps.weight")  # [E, I, H]; early Mixtral files: ffn_gate.0 [I, H]
    shared = shapes.get(first + "ffn_gate_shexp.weight")
    return hf_arch, dict(
        num_experts=num_experts, num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=gate[1] if gate else shapes.get(first + "ffn_gate.0.weight", (0,))[0],
        # llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's
        norm_topk_prob=arch != "qwen2moe",
        shared_expert_intermediate_size=shared[0] if shared else 0,
        mlp_only_layers=tuple(i for i in range(layers) if i not in sparse))


def _window(reader, arch: str, layers: int) -> dict[str, Any]:
    """Sliding windows as llama.cpp applies them: Gemma 2 on the even layers, Gemma 3 on 5 of every 6
    (unless the file states the pattern), Phi-3 on every layer (its window 0: none, Phi-4); llama.cpp
    slides no llama / qwen layer, whatever the HF config said."""
    w = int(field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if arch not in ("gemma2", "gemma3", "phi3") or w <= 0:
        return {}
    pattern = 0 if arch == "phi3" else field(reader, f"{arch}.attention.sliding_window_pattern",
                                             2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # per layer: true where it slides
        slide = tuple(i for i, s in enumerate(pattern) if s)
    else:  # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1 (n 0: every layer)
        n = int(pattern)
        slide = tuple(i for i in range(layers) if n == 0 or i % n < n - 1)
    if not slide:
        return {}
    return dict(sliding_window=w, sliding_layers=None if len(slide) == layers else slide)


def _gemma(reader, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    """Gemma's flags. The attention scale follows llama.cpp: hidden / heads for the 27B models (46
    layers for Gemma 2, 62 for Gemma 3; their HF query_pre_attn_scalar), head_dim otherwise."""
    if arch not in _GEMMAS:
        return {}
    d: dict[str, Any] = dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, embed_scale=True)
    if arch == "gemma":
        return d
    big = layers == (46 if arch == "gemma2" else 62)
    d.update(sandwich_norm=True, query_pre_attn_scalar=float(hidden // heads if big else head_dim))
    final = field(reader, f"{arch}.final_logit_softcapping")
    if arch == "gemma2":  # (llama.cpp's defaults where the keys are missing: Gemma 2's 50 and 30)
        d.update(attn_logit_softcapping=float(field(reader, f"{arch}.attn_logit_softcapping", 50.0)),
                 final_logit_softcapping=float(30.0 if final is None else final))
    else:
        d.update(final_logit_softcapping=float(final) if final else None,
                 rope_local_theta=float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0)))
    return d


def _granite(key: Callable[..., Any], arch: str, path: str) -> dict[str, Any]:
    """Granite's multipliers from the keys GraniteModel writes (llama.cpp requires all four): the
    embeddings times embedding_scale, each block's output times residual_scale, attention.scale the
    softmax scale, the logits divided by logit_scale. llama.cpp rotates Granite only while
    rope.scaling.finetuned is true (its default; transformers always does)."""
    if arch != "granite":
        return {}
    if not key("rope.scaling.finetuned", True):
        raise ValueError(f"GGUF file {path!r}: granite without rotary embeddings (granite.rope.scaling.finetuned "
                         "false) is not supported")
    return dict(embedding_multiplier=float(key("embedding_scale")), residual_multiplier=float(key("residual_scale")),
                attention_multiplier=float(key("attention.scale")), logits_scaling=float(key("logit_scale")))


def _eog_ids(reader) -> tuple[int, ...]:
    """End-of-generation tokens as llama.cpp counts them: EOS, EOT (Gemma's <end_of_turn>), EOM and
    the tokens whose text says so (Llama 3's <|eot_id|>, Phi-3's <|end|>, Qwen's <|im_end|>...): a chat
    reply stops at the end of its turn, as it does with the HF folder's generation_config.json."""
    ids = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for i, idx in enumerate(tokens.data):
            part = tokens.parts[idx]
            if len(part) <= 16 and bytes(part).decode("utf-8", "replace") in _EOG_TEXTS:
                ids.append(i)
    return tuple(sorted({int(i) for i in ids if i is not None}))


def _required_tensors(cfg: ModelConfig, arch: str, names: set[str]) -> Iterator[str]:
    """The GGUF tensors cfg's model reads (a missing one would leave a parameter unset)."""
    yield from ("token_embd.weight", "output_norm.weight")
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        keys = ["attn_norm", "attn_output", "ffn_norm"]
        keys += ["attn_qkv"] if arch == "phi3" else ["attn_q", "attn_k", "attn_v"]
        keys += ["attn_q_norm", "attn_k_norm"] if cfg.qk_norm else []
        keys += ["post_attention_norm", "post_ffw_norm"] if cfg.sandwich_norm else []
        if cfg.is_moe_layer(i):
            keys.append("ffn_gate_inp")
            if f"{b}ffn_gate.0.weight" in names:  # early Mixtral files: one tensor per expert
                keys += [f"{k}.{e}" for k in _LEGACY_EXPERTS for e in range(cfg.num_experts)]
            else:
                keys += list(_EXPERTS)
            if cfg.shared_expert_intermediate_size:
                keys += ["ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        else:
            keys += ["ffn_up", "ffn_down"] + ([] if arch == "phi3" else ["ffn_gate"])
        yield from (f"{b}{k}.weight" for k in keys)
        if cfg.attention_bias:
            yield from (f"{b}{k}.bias" for k in ("attn_q", "attn_k", "attn_v"))


# ---- weights -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _dequantizable(qtype) -> bool:
    import gguf
    import numpy as np

    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


def _dequantize(t) -> "Any":
    """A tensor of the file (a ReaderTensor), dequantized: a float32 numpy array in numpy (row-major) order."""
    import gguf
    import numpy as np

    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.array(arr, dtype=np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))  # own, writable copy


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved rope -> HF's rotate-halves).

    llama.cpp stores, per head, rows ordered (pair, half) -> we restore (half, pair).
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_gguf_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, float32 tensor) for every weight of the file (cfg: its gguf_config).
    Every tensor's quantization type is checked before any is dequantized."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            raise ValueError(f"GGUF file {path!r}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                             "which the gguf package cannot dequantize")
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"GGUF file {path!r}: tensor {t.name} of {arch} is not known to pageflash")
        if not name:
            continue
        w = torch.from_numpy(_dequantize(t))
        if arch in _GEMMAS and t.name.endswith("norm.weight"):
            w = w - 1.0  # the converter stored the 1 + w that Gemma's norms scale by
        if arch in _PERMUTED and ".attn_q." in t.name:
            w = unpermute_rope_rows(w, cfg.num_attention_heads)
        elif arch in _PERMUTED and ".attn_k." in t.name:
            w = unpermute_rope_rows(w, cfg.num_key_value_heads)
        elif t.name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # HF's [1, H] (files may store it as [H])
        if "{e}" in name:  # [E, out, in]: one HF tensor per expert
            yield from ((name.format(e=e), w[e]) for e in range(w.shape[0]))
        else:
            yield name, w
