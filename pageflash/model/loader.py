"""Where weights, config and tokenizer come from: a HF folder, a GGUF file, or a config alone (dummy).

resolve_model(name) -> ModelSource; load_config(source) -> ModelConfig; iter_weights(source) yields
(HF tensor name, float tensor) pairs for LlamaForCausalLM.load_weights; load_tokenizer(source).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from pageflash.config import ModelConfig
from pageflash.model.registry import EMBEDDED_MODELS, NAMED_CONFIGS


@dataclass(frozen=True)
class ModelSource:
    """kind: "gguf" (path = the .gguf file), "hf" (path = a folder), or "config" (named config, no weights)."""

    name: str
    kind: str
    path: Optional[str] = None
    tokenizer_source: Optional["ModelSource"] = None  # for "config": where a tokenizer can come from
    weights: str = "auto"  # "hf": which weight files to read ("safetensors", "pt", or "auto": either)


def _embedded_path(name: str) -> str:
    pkg, fname, how = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} is embedded in the Python package {pkg.replace('_', '-')!r}, which is not installed; "
            f"install it with: {how}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], fname)
    if not os.path.isfile(path):
        raise ValueError(f"model {name!r}: file {fname} is missing from package {pkg}; reinstall it with: {how}")
    return path


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    """Map a short name or a local path to a ModelSource. Raises ValueError naming what is wrong."""
    if load_format not in ("auto", "dummy", "gguf", "safetensors", "pt"):
        raise ValueError(f"load_format must be one of auto, dummy, gguf, safetensors, pt; got {load_format!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    key = model.lower()
    if key in NAMED_CONFIGS or key in EMBEDDED_MODELS:
        if load_format == "dummy":
            tok = None
            if key in EMBEDDED_MODELS:
                try:
                    tok = ModelSource(key, "gguf", _embedded_path(key))
                except ValueError:
                    tok = None
            return ModelSource(key, "config", None, tok)
        if key in EMBEDDED_MODELS:
            if load_format in ("safetensors", "pt"):
                raise ValueError(f"load_format={load_format!r}, but model {model!r} is an embedded GGUF file")
            return ModelSource(key, "gguf", _embedded_path(key))
        raise ValueError(
            f"model {model!r} is a named config without embedded weights: pass load_format='dummy' for random "
            f"weights of its shape, or the path of a local HF folder or GGUF file"
        )
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a GGUF file or a HF model folder")
        src = ModelSource(os.path.basename(path), "gguf", path)
    elif os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            src = ModelSource(os.path.basename(path.rstrip("/")), "hf", path)
        else:
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if len(ggufs) != 1:
                raise ValueError(f"model folder {path!r} has no config.json and {len(ggufs)} .gguf files; expected one")
            src = ModelSource(os.path.basename(ggufs[0]), "gguf", ggufs[0])
    else:
        known = ", ".join(sorted(set(NAMED_CONFIGS) | set(EMBEDDED_MODELS)))
        raise ValueError(f"unknown model {model!r}: not a known name ({known}) nor an existing file or folder")
    if load_format == "dummy":
        return ModelSource(src.name, "config", src.path, src)
    if load_format == "gguf" and src.kind != "gguf":
        raise ValueError(f"load_format='gguf', but {model!r} is a HF model folder, not a GGUF file")
    if load_format in ("safetensors", "pt"):
        if src.kind != "hf":
            raise ValueError(f"load_format={load_format!r}, but {model!r} is a GGUF file, not a HF model folder")
        return ModelSource(src.name, "hf", src.path, weights=load_format)
    return src


# ---- config ------------------------------------------------------------------------------------

def load_config(src: ModelSource) -> ModelConfig:
    if src.kind == "config":
        if src.path is None:
            return ModelConfig.from_hf_dict(NAMED_CONFIGS[src.name])
        return load_config(src.tokenizer_source)  # dummy weights in the shape of a local checkpoint
    if src.kind == "hf":
        try:
            with open(os.path.join(src.path, "config.json")) as f:
                d = json.load(f)
            if not isinstance(d, dict):
                raise ValueError(f"model folder {src.path!r}: config.json must hold a JSON object, got {type(d).__name__}")
            return ModelConfig.from_hf_dict(d)
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"model folder {src.path!r}: config.json is invalid ({e})") from e
    return _gguf_config(_gguf_reader(src.path))


# generation_config.json keys vLLM's generation_config="auto" takes as default sampling parameters
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_config(src: Optional[ModelSource]) -> dict[str, Any]:
    """The model folder's generation_config.json (HF folders, and dummy weights in a folder's shape):
    {"eos_token_ids": tuple of ints, "defaults": {sampling field: value}}, or {} without the file.
    A damaged file raises naming it."""
    while src is not None and src.kind == "config":
        src = src.tokenizer_source
    if src is None or src.kind != "hf":
        return {}
    path = os.path.join(src.path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model folder {src.path!r}: generation_config.json is invalid ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"model folder {src.path!r}: generation_config.json must hold a JSON object")
    eos = d.get("eos_token_id")
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int))
    return {"eos_token_ids": eos, "defaults": {k: d[k] for k in _GENERATION_DEFAULTS if d.get(k) is not None}}


def _gguf_reader(path: str):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ValueError("loading a GGUF file needs the 'gguf' package: pip install gguf") from e
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on a damaged file
        raise ValueError(f"GGUF file {path!r} is corrupt or unreadable: {type(e).__name__}: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


# GGUF general.architecture -> ours
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def _gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(_GGUF_ARCHS)})")
    a = arch
    if _field(reader, f"{a}.expert_count"):  # e.g. Mixtral GGUFs are "llama" with routed experts
        raise ValueError("GGUF files of mixture-of-experts models are not supported yet; load the HF folder")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported yet; load the HF folder")
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{a}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        architecture=_GGUF_ARCHS[arch],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


# ---- weights -----------------------------------------------------------------------------------

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved rope -> HF's rotate-halves).

    llama.cpp stores, per head, rows ordered (pair, half) -> we restore (half, pair).
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_gguf_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    import numpy as np

    reader = _gguf_reader(path)
    permute = _field(reader, "general.architecture") in ("llama", "mistral")
    for t in reader.tensors:
        shape = tuple(reversed([int(x) for x in t.shape]))
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name}: quantization type {t.tensor_type.name} is not supported") from e
        arr = np.asarray(arr).reshape(shape)
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # own, writable copy
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if permute and parts[2] == "attn_q":
                w = _unpermute_rope_rows(w, cfg.num_attention_heads)
            elif permute and parts[2] == "attn_k":
                w = _unpermute_rope_rows(w, cfg.num_key_value_heads)
        else:
            continue  # e.g. rope_freqs handled in config; unknown extras are ignored
        yield name, w


def iter_hf_weights(folder: str, weights: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """A HF folder's tensors: its *.safetensors files, else its pytorch_model*.bin files (weights
    "auto"); weights "safetensors" / "pt" reads only those (load_format)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if weights != "pt" else []
    if weights == "safetensors" and not files:
        raise ValueError(f"load_format='safetensors', but model folder {folder!r} has no *.safetensors files")
    if files:
        from safetensors import safe_open

        for fn in files:
            try:
                with safe_open(fn, framework="pt") as f:
                    for k in f.keys():
                        yield k, f.get_tensor(k)
            except Exception as e:
                if isinstance(e, ValueError) and "checkpoint tensor" in str(e):
                    raise
                raise ValueError(f"safetensors file {fn!r} is corrupt or unreadable: {e}") from e
        return
    bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not bins:
        what = "pytorch_model*.bin" if weights == "pt" else "*.safetensors or pytorch_model*.bin"
        raise ValueError(f"model folder {folder!r} has no {what} weights")
    for fn in bins:
        try:
            state = torch.load(fn, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: pickle, zip or torch errors
            raise ValueError(f"weights file {fn!r} is corrupt or unreadable: {type(e).__name__}: {e}") from e
        if not isinstance(state, dict):
            raise ValueError(f"weights file {fn!r} does not hold a state dict (got {type(state).__name__})")
        yield from state.items()


def iter_weights(src: ModelSource, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if src.kind == "gguf":
        return iter_gguf_weights(src.path, cfg)
    if src.kind == "hf":
        return iter_hf_weights(src.path, src.weights)
    raise ValueError("a named config has no weights; use load_format='dummy'")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shape (as vLLM's load_format='dummy'): small normal matrices, unit norms.
    Each parameter draws from its own seed (seed and its name), so that tensor-parallel ranks hold the
    same replicated parameters (embeddings, routers, LM head)."""
    g = torch.Generator(device=next(model.parameters()).device)
    for name, p in model.named_parameters():
        g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
        if p.dim() == 1 and name.endswith("norm.weight"):
            continue  # unit norms, as RMSNorm makes them (ones; Gemma's, which scale by 1 + w: zeros)
        p.data.normal_(0.0, 0.02, generator=g)


# ---- tokenizer ---------------------------------------------------------------------------------

def _cache_dir() -> str:
    return os.environ.get("PAGEFLASH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pageflash"))


def load_tokenizer(src: Optional[ModelSource]):
    """A HF tokenizer (with chat template) or None when the source has none (dummy named configs)."""
    if src is None:
        return None
    if src.kind == "config":
        return load_tokenizer(src.tokenizer_source)
    from transformers import AutoTokenizer

    if src.kind == "hf":
        tok_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
        if not any(os.path.isfile(os.path.join(src.path, f)) for f in tok_files):
            return None  # weights only: prompts must come as token ids
        return AutoTokenizer.from_pretrained(src.path)
    # Building a tokenizer from GGUF metadata takes seconds; keep a converted copy keyed by the file.
    st = os.stat(src.path)
    key = hashlib.sha256(f"{os.path.abspath(src.path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache entry: rebuild it below
    folder, fname = os.path.split(src.path)
    tok = AutoTokenizer.from_pretrained(folder or ".", gguf_file=fname)
    try:
        tok.save_pretrained(cached)
    except OSError:
        pass  # read-only home: fine, just slower next time
    return tok
